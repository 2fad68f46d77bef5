"""A causal LM's training loss without its whole logits: the output head and the
cross-entropy over chunks of tokens, forward and backward.

The plain loss holds (tokens x vocabulary) logits, their log-softmax and, in backward,
their gradient: 3 x 8 x 1024 x 50,257 x 4 bytes ~ 5 GB for GPT-2 at run_clm's batch.
Here each chunk's logits live only while that chunk's loss and gradients are computed
(in forward, by autograd itself, so the numerics are the plain loss's: autocast's casts,
the fp32 cross-entropy); backward only scales the gradients kept, in place. No matmul is redone.

How it reaches every model and strategy without patching a model class: the output
head (a plain nn.Linear, found by get_output_embeddings) gets a forward that, when the
trainer has handed it the micro-batch's labels, returns the summed token loss instead of
logits, and the model's `loss_function` (transformers' per-instance setter) divides it
by the trained tokens as transformers' ForCausalLMLoss does. Computing inside the head's
own call is what keeps the weight available under every strategy: ZeRO-3 gathers it in
the head's pre-forward hook and again for its backward, FSDP2 holds it with the root's
unsharded parameters, DDP and ZeRO-2 never shard it. Without labels (evaluation,
generation), the head is the plain linear layer.

A model whose forward changes the logits between its head and its loss (Gemma-2's
soft-capping, a logit scale) cannot use it: `install` probes the model's own forward
and leaves the plain loss in place, saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from runner.components import liger_loss
from runner.components.data.labels import IGNORE_INDEX
from runner.components.liger_loss import HeadLoss

# Tokens a chunk holds: at least MIN_CHUNK_TOKENS, more where their fp32 logits stay
# within CHUNK_LOGIT_BYTES (a small vocabulary). Every chunk reads the head's weight twice
# and reads and writes the fp32 weight-gradient buffer: traffic of vocabulary x width,
# whatever the chunk's tokens, against matmuls that grow with them. So the share a chunk
# adds depends on its tokens alone, not on the vocabulary. GPT-2 124M's head and loss,
# forward and backward, fp32 on 2 CPU cores (bench/head_chunks.py), per 1,024 tokens:
# whole logits 1,436 ms, chunks of 333 tokens 1,617 (64 MiB of logits, the budget
# before), 512 1,469, 1,024 1,418; per 4,096 tokens: whole 9.6 s, 333 7.3 s, 1,024 6.0 s,
# 2,048 5.7 s (bf16: 5.2, 3.3, 3.0, 3.4 s). A chunk of 1,024 GPT-2 tokens holds 206 MB
# of fp32 logits (and the log-softmax and gradient as much each), against 1.6 GB each
# for run_clm's whole 8 x 1024 batch.
MIN_CHUNK_TOKENS = 1024
CHUNK_LOGIT_BYTES = 64 << 20


def chunk_tokens(vocab_size: int, budget: int = CHUNK_LOGIT_BYTES) -> int:
    return max(MIN_CHUNK_TOKENS, budget // (4 * max(vocab_size, 1)))


class ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of cross-entropy(hidden @ weight.T + bias, labels), labels already
    aligned with hidden (IGNORE_INDEX: not trained). Returns (that sum, the per-token
    losses, not differentiable). The gradients are computed chunk by chunk in forward
    and scaled in backward: per chunk, the logits' gradient comes from autograd (the
    fp32 cross-entropy over the logits in their compute dtype, as transformers' loss
    does), and the two matmuls of the head's backward are written out, the weight's
    accumulated in place (a chunk adds into one fp32 buffer instead of allocating a
    vocabulary x width gradient of its own)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        grads = HeadGradients(hidden, weight, bias, ctx.needs_input_grad)
        for start in range(0, labels.shape[0], chunk):
            rows = slice(start, start + chunk)
            # No test for a chunk without trained tokens: reading it on the host would
            # wait for the device at every chunk (and a fake tensor has no values).
            target, h = labels[rows], hidden[rows]
            logits = F.linear(h, weight, bias)  # under autocast: in its compute dtype, as the plain head
            with torch.enable_grad():
                logits.requires_grad_(grads.wanted)
                losses = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="none")
                (g,) = torch.autograd.grad(losses.sum(), logits) if grads.wanted else (None,)
            per_token[rows] = losses.detach()
            del logits, losses
            if g is not None:
                grads.add(rows, g, h, weight)
        grads.save(ctx, weight, bias)
        ctx.mark_non_differentiable(per_token)
        return per_token.sum(), per_token

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_per_token: Any) -> tuple[Any, ...]:
        return (*HeadGradients.scaled(ctx, grad_total), None, None)


class HeadGradients:
    """The output head's gradients a chunked loss computes in forward, chunk by chunk,
    and scales in backward: the hidden states' (row by row), the weight's (one fp32
    buffer every chunk adds into in place, instead of a vocabulary x width gradient of its
    own) and the bias'. Only what autograd wants of them (`wants`: needs_input_grad)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 wants: tuple[bool, ...]) -> None:
        self.hidden = torch.zeros_like(hidden) if wants[0] else None
        # The weight's buffer is the first chunk's product (fp32), not zeros added into:
        # with one chunk (a micro-batch of up to MIN_CHUNK_TOKENS) no vocabulary x width
        # buffer is zeroed, read and written again beside what the plain head computes.
        self.wants_weight = wants[1]
        self.weight: Optional[torch.Tensor] = None
        self.bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and wants[2] else None
        self.wanted = self.hidden is not None or self.wants_weight or self.bias is not None
        self._cast: Optional[torch.Tensor] = None

    def add(self, rows: Any, g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> None:
        """One chunk's: `g` the gradient of its logits (rows x ... x vocabulary), `h` its hidden states.

        Both matmuls run in the logits' compute dtype, as the plain head's backward does
        (under bf16 autocast, bf16 x bf16: on GPT-2 124M's CPU step an fp32 weight-gradient
        matmul here cost 0.5 s of a 3.3 s step, behind the Trainer's); the weight's product
        is then summed into the fp32 buffer, so each chunk rounds once, as the plain head's
        product does."""
        flat_g, flat_h = g.reshape(-1, g.shape[-1]), h.reshape(-1, h.shape[-1])
        if self.hidden is not None:
            # In the buffer's (the hidden states') dtype: a norm may hand the head fp32 hidden
            # states under bf16 autocast (Llama's), and an indexed put does not cast.
            self.hidden[rows] = self._times_weight(g, weight).to(self.hidden.dtype)
        if self.wants_weight:
            inputs = flat_h.to(flat_g.dtype)
            if self.weight is None:  # the first chunk: its product is the buffer
                self.weight = (flat_g.t() @ inputs).to(torch.float32)
            elif flat_g.dtype == self.weight.dtype:
                self.weight.addmm_(flat_g.t(), inputs)
            else:
                self.weight.add_(flat_g.t() @ inputs)
        if self.bias is not None:
            self.bias += flat_g.sum(0, dtype=torch.float32)

    def _times_weight(self, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """g @ weight in g's dtype. Under autocast in that dtype, autocast's own cast of the
        weight, which the chunk's F.linear made and autocast keeps (the plain head's
        backward reuses it too): not a second copy of the weight (GPT-2: 77 MB in bf16)."""
        if weight.dtype == g.dtype:
            return g @ weight
        device = g.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == g.dtype:
            return torch.matmul(g, weight)
        return g @ self._weight_in(g.dtype, weight)

    def _weight_in(self, dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor:
        """The weight in the logits' dtype, cast once for all chunks (not once a chunk)."""
        if self._cast is None or self._cast.dtype != dtype:
            self._cast = weight.to(dtype)
        return self._cast

    def save(self, ctx: Any, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        ctx.save_for_backward(
            self.hidden if self.hidden is not None else torch.empty(0),
            self._weight_gradient(weight).to(weight.dtype) if self.wants_weight else torch.empty(0),
            self.bias.to(bias.dtype) if self.bias is not None and bias is not None else torch.empty(0),
        )

    def _weight_gradient(self, weight: torch.Tensor) -> torch.Tensor:
        """The summed weight gradient (fp32); zeros when no chunk ran (no tokens)."""
        return self.weight if self.weight is not None else torch.zeros_like(weight, dtype=torch.float32)

    @staticmethod
    def scaled(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """backward's gradients of (hidden, weight, bias): the saved ones times the loss's,
        scaled in place. A product would allocate a vocabulary x width gradient and pass
        over it once more than the plain head's backward does (GPT-2: 154 MB, a step's
        only such pass beyond the Trainer's); in place, what autograd receives is the
        saved buffer itself, which it keeps as the parameter's gradient (an untied head) or
        sums with the tied embedding's, as it does the plain head's product. So one forward has one
        backward: a second through a retained graph is refused (the saved gradients are
        scaled already), and so is a differentiable one (create_graph)."""
        if getattr(ctx, "scaled_already", False) or torch.is_grad_enabled():
            raise RuntimeError("chunked loss: its gradients are computed once a forward, so a second backward through "
                               "a retained graph, or a differentiable one (create_graph), cannot reuse them; set "
                               "model.chunked_loss=false")
        ctx.scaled_already = True
        wants = ctx.needs_input_grad

        def scaled(g: torch.Tensor, wanted: bool) -> Optional[torch.Tensor]:
            return g.mul_(grad_total.to(g.dtype)) if wanted and g.numel() else None

        return tuple(scaled(g, wanted) for g, wanted in zip(ctx.saved_tensors, wants[:3]))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t's target is token t + 1 (the last has none), flattened: transformers'
    ForCausalLMLoss's alignment."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, chunk: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, per-token losses) of the head over `hidden` (batch x tokens x width)
    against unshifted `labels` (batch x tokens), chunk tokens at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return ChunkedHeadLoss.apply(flat, weight, bias, shifted_labels(labels), chunk or chunk_tokens(weight.shape[0]))


@torch.no_grad()
def chunked_token_scores(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, chunk: int) -> "TokenScores":
    """Evaluation's figures of the head over `hidden` against unshifted `labels`, chunk
    tokens at a time: each token's loss (fp32, as training's), whether it was trained and
    whether the head's top word is its target. No chunk's logits outlive it."""
    flat, target = hidden.reshape(-1, hidden.shape[-1]), shifted_labels(labels)
    losses = torch.zeros(target.shape, dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(target.shape, dtype=torch.bool, device=hidden.device)
    for start in range(0, target.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = F.linear(flat[rows], weight, bias)
        losses[rows] = F.cross_entropy(logits.float(), target[rows], ignore_index=IGNORE_INDEX, reduction="none")
        correct[rows] = logits.argmax(-1) == target[rows]
        del logits
    shape = labels.shape
    trained = target.reshape(shape) != IGNORE_INDEX
    # aligned with labels[:, 1:], as labels.token_losses: the last position predicts nothing
    return TokenScores(losses.reshape(shape)[:, :-1], trained[:, :-1], (correct.reshape(shape) & trained)[:, :-1])


@dataclass
class TokenScores:
    """Per-token figures of one evaluation forward, aligned with labels[:, 1:]: the loss
    (zero where untrained), the trained mask, and the correct next-token predictions."""

    losses: torch.Tensor
    trained: torch.Tensor
    correct: torch.Tensor


@dataclass
class _HeadState:
    labels: Optional[torch.Tensor] = None
    total: Optional[torch.Tensor] = None  # what the head returned for the forward in flight
    chunk: int = 1
    fused: Optional[HeadLoss] = None  # Liger's kernel, for hidden states on a GPU (runner/components/liger_loss.py)
    scoring: bool = False  # evaluation: the head keeps per-token scores (`scores`) instead of a loss
    scores: Optional[TokenScores] = None
    # What the head returns instead, for the forward in flight: another objective's loss of
    # (hidden states, weight, bias) (`computing`: runner/components/chunked_pairs.py's).
    compute: Optional[Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None


class ChunkedLoss:
    """The chunked loss installed on one model (see the module's docstring)."""

    def __init__(self, model: Any, head: torch.nn.Linear, chunk: int, fused: Optional[HeadLoss] = None,
                 kernel: str = "runner's chunks") -> None:
        self.model, self.head, self.kernel = model, head, kernel
        self.state = _HeadState(chunk=chunk, fused=fused)
        self._plain_forward = head.forward
        state = self.state

        def head_forward(module: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
            if state.compute is not None:
                compute, state.compute = state.compute, None
                return compute(hidden, module.weight, module.bias)
            labels, state.labels = state.labels, None
            if labels is None:
                return F.linear(hidden, module.weight, module.bias)
            check_positions(hidden, labels)
            if state.scoring:  # no loss for the model to compute: it was called without labels
                state.scores = chunked_token_scores(hidden, module.weight, module.bias, labels, state.chunk)
                return hidden.new_zeros(())
            if state.fused is not None and liger_loss.runs_on(hidden):
                total = state.fused(hidden.reshape(-1, hidden.shape[-1]), module.weight, module.bias,
                                    shifted_labels(labels))
            else:
                total, _ = chunked_token_losses(hidden, module.weight, module.bias, labels, state.chunk)
            state.total = total
            return total

        def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                          num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> torch.Tensor:
            total, state.total = state.total, None
            if total is None or not _same_values(logits, total):
                raise RuntimeError("chunked loss: the model changed the head's output before its loss (soft-capping or "
                                   "a logit scale); set model.chunked_loss=false")
            if num_items_in_batch is None:  # the mean over trained tokens, ForCausalLMLoss's
                num_items_in_batch = (shifted_labels(labels) != ignore_index).sum()
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            # `logits`, not `total`: what a strategy's hooks handed on carries their backward (ZeRO-3's gather).
            return logits / num_items_in_batch

        head.forward = MethodType(head_forward, head)
        self._had_loss_function = "_loss_function" in vars(model)
        self._old_loss_function = vars(model).get("_loss_function")
        model.loss_function = loss_function

    @contextlib.contextmanager
    def labels(self, labels: torch.Tensor) -> Iterator[None]:
        """Within: the model's next forward with these labels computes its loss chunked."""
        self.state.labels = labels
        try:
            yield
        finally:
            self.state.labels = self.state.total = None

    def computing(self, model: Any, inputs: dict[str, Any],
                  compute: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
                  extras: Optional[dict[str, Any]] = None) -> Any:
        """One forward of `model` (the prepared one, so every strategy's hooks run) on
        `inputs` (no labels) whose output head returns `compute(hidden, weight, bias)`
        instead of logits; returns what the model returned for it, which carries the
        strategies' backward (ZeRO-3 hands a module's outputs on through its hook).
        `extras` gets the forward's `aux_loss` (a mixture of experts' router loss, or None)."""
        returned: list[torch.Tensor] = []

        def noting(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            returned.append(compute(hidden, weight, bias))
            return returned[-1]

        self.state.compute = noting
        try:
            outputs = model(**inputs)
            output = outputs.logits
        finally:
            self.state.compute = None
        if extras is not None:
            extras["aux_loss"] = getattr(outputs, "aux_loss", None)
        if not returned:
            raise RuntimeError("chunked loss: the model's forward never called its output head; set model.chunked_loss=false")
        if not _same_values(output, returned[0]):
            raise RuntimeError("chunked loss: the model changed the head's output (soft-capping or a logit scale); "
                               "set model.chunked_loss=false")
        return output

    def scores(self, model: Any, inputs: dict[str, Any], labels: torch.Tensor) -> TokenScores:
        """Evaluation's per-token figures of one forward of `model` (the prepared one, so
        every strategy's hooks run) on `inputs` (no labels), through the chunked head: the
        whole logits (batch x tokens x vocabulary, in fp32 for the loss) are never held."""
        self.state.labels, self.state.scoring = labels, True
        try:
            model(**inputs)
            scores, self.state.scores = self.state.scores, None
        finally:
            self.state.labels, self.state.scoring = None, False
        if scores is None:
            raise RuntimeError("chunked loss: the model's forward never called its output head; set model.chunked_loss=false")
        return scores

    def remove(self) -> None:
        self.head.forward = self._plain_forward
        if self._had_loss_function:
            self.model.loss_function = self._old_loss_function
        else:
            vars(self.model).pop("_loss_function", None)


def check_positions(hidden: torch.Tensor, labels: torch.Tensor) -> None:
    """The head sees a hidden state for every labelled position (a model that slices its
    hidden states before the head, to keep the last few, cannot use the chunked head)."""
    if hidden.shape[:-1] != labels.shape:
        raise RuntimeError(f"chunked loss: the head saw {tuple(hidden.shape[:-1])} positions for labels "
                           f"{tuple(labels.shape)} (the model sliced its hidden states); set model.chunked_loss=false")


def _same_values(received: torch.Tensor, returned: torch.Tensor) -> bool:
    """`received` is the head's output or a view of it: DeepSpeed ZeRO-3 hands a module's
    outputs on detached, through its backward hook. Soft-capping or scaling makes a new
    tensor. (A fake tensor, in the memory plan's trace, has no data pointer: there is
    no wrapper there.)"""
    if received is returned:
        return True
    try:
        return received.data_ptr() == returned.data_ptr() and received.shape == returned.shape
    except RuntimeError:
        return False


def transformers_model(model: Any) -> Any:
    """The transformers model under peft's wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def why_not(model: Any) -> Optional[str]:
    """Why the chunked loss cannot be installed on `model` (None: it can)."""
    base = transformers_model(model)
    if not hasattr(type(base), "loss_function"):
        return f"{type(base).__name__} has no transformers loss_function to replace"
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return f"{type(base).__name__} names no output head (get_output_embeddings)"
    if type(head) is not torch.nn.Linear:
        return f"its output head is a {type(head).__name__}, not a plain Linear (adapters or a custom head)"
    return None


def install(model: Any, probe: bool = True, gpu_kernel: bool = False) -> tuple[Optional[ChunkedLoss], Optional[str]]:
    """Install the chunked loss on `model` (bare or under peft). Returns (it, None), or
    (None, the reason it is not used). `probe`: run the model's forward once on two
    tokens to see that its loss comes from the head's output unchanged. `gpu_kernel`:
    on a GPU, Liger's fused kernel computes the sum when liger-kernel is installed
    (`kernel` names what runs; the memory plan's trace keeps runner's chunks)."""
    reason = why_not(model)
    if reason is not None:
        return None, reason
    base = transformers_model(model)
    head = base.get_output_embeddings()
    fused, what = liger_loss.liger_head_loss() if gpu_kernel else (None, "")
    chunk = chunk_tokens(head.weight.shape[0])
    kernel = f"{what} on the GPU" if fused is not None else f"runner's chunks of {chunk:,} tokens"
    chunked = ChunkedLoss(base, head, chunk, fused, kernel)
    if probe:
        reason = _probe(model, chunked)
        if reason is not None:
            chunked.remove()
            return None, reason
    return chunked, None


def _probe(model: Any, chunked: ChunkedLoss) -> Optional[str]:
    ids = torch.zeros(1, 2, dtype=torch.long, device=chunked.head.weight.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), chunked.labels(ids):
            model(input_ids=ids, labels=ids, use_cache=False)
    except RuntimeError as err:
        if "chunked loss:" in str(err):
            return str(err).split("chunked loss: ", 1)[1].split(";")[0]
        raise
    finally:
        model.train(was_training)
    return None
