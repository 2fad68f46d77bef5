"""One micro-batch's forward and backward traced on fake tensors: the bytes of activations
and gradients alive at every allocation, for the memory plan (`dry_run=true`, the fit
check, `train.per_device_batch_size=auto`).

PyTorch's own tools do the work: the model is built and run under `FakeTensorMode`
(shapes, dtypes and devices, no data and no memory, so a 7B config traces on a laptop),
and `torch.distributed._tools.mem_tracker.MemTracker` classifies every live storage as a
parameter, a gradient, an activation or a temporary. What the trace cannot see is a
strategy's sharding and its buffers; runner.launch.memory_estimate adds those to it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator, Optional

from runner.components.adapters import add_adapters, uses_adapters
from runner.components.chunked_loss import install as install_chunked_loss
from runner.components.model import apply_model_settings, disable_dropout
from runner.config.spec import ModelSpec, PeftSpec


class Numerics(str, Enum):
    """How a strategy computes under a precision, which decides the activations' dtypes."""

    fp32 = "fp32"
    autocast = "autocast"  # fp32 weights under autocast (ddp): autocast also caches a low-precision copy of each weight
    half_autocast = "half_autocast"  # low-precision weights under autocast (fsdp's MixedPrecisionPolicy gathers them so)
    half = "half"  # low-precision weights, no autocast (DeepSpeed ZeRO with bf16/fp16)


@dataclass(frozen=True)
class StepTrace:
    """Bytes alive during one traced micro-batch (forward, loss, backward), by kind.

    `samples`: (activations and temporaries, parameter gradients) after every operator,
    in order. Gradients are what backward has written into `.grad` so far, at the trace's
    gradient dtype (`grad_bytes` a parameter)."""

    parameters: int
    grad_bytes: int
    samples: tuple[tuple[int, int], ...]
    seconds: float
    largest_parameter: int = 0  # elements of the model's largest parameter (an embedding or output head)
    chunked: bool = False  # the loss through the chunked head (model.chunked_loss, not refused by the model)

    @property
    def activation_peak(self) -> int:
        return max((a for a, _ in self.samples), default=0)

    def peak_with_gradients(self, gradient_share: float, unreduced: float = 0.0) -> float:
        """The most ever alive of activations, plus `gradient_share` of the gradients written
        by then (1: every gradient stays, as under DDP; 1/world: the fp32 shards FSDP keeps),
        plus up to `unreduced` bytes of them still at full size, waiting for their
        reduction (a sharded strategy's output head, written first in backward and reduced
        with the root or its bucket)."""
        return max((a + gradient_share * g + min(g, unreduced) for a, g in self.samples), default=0.0)


def _low_precision(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


@contextlib.contextmanager
def gpu_attention_kernels() -> Iterator[None]:
    """Attention as a GPU computes it, in memory: fake tensors live on the CPU, whose SDPA
    falls back to the math kernel under dropout or an explicit mask and keeps every
    head's T x T probabilities (and the dropout mask) for backward. A GPU's flash and
    memory-efficient kernels keep O(T) per head (the output and its log-sum-exp; dropout
    regenerated from its seed), whatever the mask and dropout; the CPU's flash kernel,
    causal and without dropout, keeps the same. Only the sizes matter here: fake tensors
    compute nothing."""
    import torch

    plain = torch.nn.functional.scaled_dot_product_attention

    def fused(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, **kwargs: Any) -> Any:
        return plain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = plain


@contextlib.contextmanager
def grouped_experts_traceable() -> Iterator[None]:
    """A mixture of experts traced as it runs: transformers' grouped expert matmul (the
    default; one (tokens x top-k) x width activation per projection), through its own
    fallback operator, whose fake kernel takes any dtype, rather than torch's grouped_mm,
    whose fake kernel takes bf16 only. (The eager experts' routing asks which tokens chose
    an expert, data fake tensors do not have; batched_mm copies each chosen expert's
    weights per token, hundreds of MB a token for a real model.)"""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without grouped experts
        yield
        return
    plain = getattr(moe, "_can_use_grouped_mm", None)
    if plain is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = plain


@contextlib.contextmanager
def quiet_fake_tensor_errors() -> Iterator[None]:
    """No traceback from FakeTensorMode's own logger: an operator whose fake kernel fails
    is logged there at error level before the error is raised, and the caller (the fit
    check) reports the error in one line."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _pairs_loss(model: Any, chunked: Any, ids: Any) -> Any:
    """A DPO-shaped loss of the pairs in `ids` (chosen rows, then rejected), computed as a
    preference run computes it: what it holds is what the trace measures."""
    import torch.nn.functional as F

    from runner.components.chunked_pairs import forward_pairs
    from runner.components.objectives.preference_loss import sequence_logps

    def pair_loss(chosen: Any, rejected: Any, *_: Any) -> Any:
        return -F.logsigmoid(chosen - rejected).sum()

    inputs = {"input_ids": ids, "use_cache": False}
    if chunked is not None:
        return forward_pairs(chunked, model, inputs, ids, pair_loss)[0]
    logps, _ = sequence_logps(model(**inputs).logits, ids)
    half = ids.shape[0] // 2
    return pair_loss(logps[:half], logps[half:])


def _sampling_tracker(samples: list[tuple[int, int]]) -> Any:
    """PyTorch's MemTracker, recording into `samples` (activations and temporaries,
    parameter gradients) after every operator, and tracking a model whose base is
    frozen (adapters)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:  # called after every operator
            # MemTracker's own per-module peaks are not used: they cost a pass over every
            # module per operator (most of a 7B trace's time).
            snap = self._curr_mem_snap.get(torch.device("cpu"), {})
            total = snap.get("Total", 0)
            grads = snap.get(_MemRefType.GRAD, 0)
            samples.append((total - snap.get(_MemRefType.PARAM, 0) - grads - snap.get(_MemRefType.BUFFER, 0), grads))

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            # A frozen parameter (a base under adapters) takes no gradient hook (torch
            # refuses one); marked as hooked with handles that remove nothing. MemTracker's
            # private method, as on torch 2.13: where it is renamed, a plan with adapters
            # fails and the run starts unchecked, saying so (runner/launch/fit.py check_fit).
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker()


@contextlib.contextmanager
def _fake_model(spec: ModelSpec, config: Any, precision: str, numerics: Numerics,
                peft: Optional[PeftSpec], dropout: bool = True) -> Iterator[tuple[Any, Any]]:
    """Within: (the model the run would build, on fake tensors, with its adapters; its
    chunked loss, or None where the run computes the plain loss). Its config, attention
    implementation, activations, dropout and gradient checkpointing are the run's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    low = _low_precision(precision)
    kwargs: dict[str, Any] = {}
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation.value
    if numerics in (Numerics.half, Numerics.half_autocast) and low is not None:
        kwargs["dtype"] = low

    def build() -> Any:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
        # The run's activations and gradient checkpointing, as build_model applies them:
        # both change what backward keeps (the fused GELU three MLP-width tensors fewer a layer).
        apply_model_settings(spec, model)
        if not dropout:  # a preference run's (preference.disable_dropout), as the worker does
            disable_dropout(model)
        return model

    adapters = peft is not None and uses_adapters(peft)
    if adapters:
        # peft moves each new adapter to its base layer's device and dtype, which swaps
        # tensors, and a fake tensor (weakly referenced by its mode) cannot be swapped:
        # so the model and its adapters are built on the meta device, then given fake storage.
        with torch.device("meta"):
            meta_model = add_adapters(peft, build(), spec.gradient_checkpointing)
            if not dropout:
                disable_dropout(meta_model)  # the adapters' too
    # Experts traceable for every forward here: the chunked loss's probe runs one too.
    with FakeTensorMode(allow_non_fake_inputs=True), grouped_experts_traceable(), quiet_fake_tensor_errors():
        model = meta_model.to_empty(device="cpu") if adapters else build()  # a frozen base: gradients only for the adapters
        # The loss as the run computes it: chunked, unless the run would fall back (its probe runs on fake tensors too).
        chunked = install_chunked_loss(model)[0] if spec.chunked_loss else None
        yield model, chunked


def _autocast(precision: str, numerics: Numerics) -> Any:
    """The strategy's autocast for a traced forward (none in fp32 or over low-precision weights)."""
    import torch

    low = _low_precision(precision)
    if low is not None and numerics in (Numerics.autocast, Numerics.half_autocast):
        return torch.autocast("cpu", dtype=low)
    return contextlib.nullcontext()


def _attention(model: Any, gpu_kernels: bool) -> Any:
    """A GPU's fused attention kernels when asked for and the model runs SDPA (gpu_attention_kernels)."""
    if gpu_kernels and getattr(model.config, "_attn_implementation", None) == "sdpa":
        return gpu_attention_kernels()
    return contextlib.nullcontext()


def trace_step(spec: ModelSpec, config: Any, micro_batch: int, block_size: int, precision: str,
               numerics: Numerics, gpu_kernels: bool = False, peft: Optional[PeftSpec] = None,
               pairs: bool = False, dropout: bool = True) -> StepTrace:
    """Trace one micro-batch of `micro_batch` x `block_size` tokens through the model the
    run would build (its config, attention implementation, activations, dropout and
    gradient checkpointing), in train mode, under `numerics`. `gpu_kernels`: SDPA attention
    counted as a GPU's fused kernels keep it (gpu_attention_kernels), not as the CPU's.
    `pairs`: a preference objective's micro-batch of `micro_batch` pairs, 2 x micro_batch
    sequences, scored as its loss scores them (the chunked head a chunk of pairs at a
    time: runner/components/chunked_pairs.py; else from the whole logits)."""
    import torch

    start = time.perf_counter()
    samples: list[tuple[int, int]] = []
    with _fake_model(spec, config, precision, numerics, peft, dropout) as (model, chunked):
        model.train()
        parameters = sum(p.numel() for p in model.parameters())
        trained = [p for p in model.parameters() if p.requires_grad]
        largest = max(p.numel() for p in trained)  # the largest gradient
        grad_bytes = trained[0].element_size()
        ids = torch.zeros(micro_batch * (2 if pairs else 1), block_size, dtype=torch.long)
        tracker = _sampling_tracker(samples)
        tracker.track_external(model)
        with tracker, _attention(model, gpu_kernels):
            if pairs:
                with _autocast(precision, numerics):
                    loss = _pairs_loss(model, chunked, ids)
            else:
                with _autocast(precision, numerics), (chunked.labels(ids) if chunked is not None
                                                      else contextlib.nullcontext()):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
    return StepTrace(parameters, grad_bytes, tuple(samples), time.perf_counter() - start, largest, chunked is not None)


@dataclass(frozen=True)
class EvaluationTrace:
    """Bytes alive during one traced evaluation batch (forward and scores, no gradient)."""

    peak: int  # activations and temporaries at their most (the model's weights not counted)
    chunked: bool  # scored through the chunked head: the whole logits never held
    seconds: float


def _evaluation_scores(model: Any, chunked: Any, ids: Any, pairs: bool) -> None:
    """What evaluation computes of a batch, by the objectives' own functions: a causal LM's
    per-token scores (causal_lm.evaluation_scores), or each preference sequence's log-probs
    (through the chunked head a chunk of pairs at a time, else from the whole logits)."""
    from runner.components.chunked_pairs import forward_pairs
    from runner.components.objectives.causal_lm import evaluation_scores
    from runner.components.objectives.preference_loss import sequence_logps

    inputs = {"input_ids": ids, "use_cache": False}
    if not pairs:
        evaluation_scores(model, inputs, ids, chunked)
    elif chunked is not None:
        forward_pairs(chunked, model, inputs, ids)
    else:
        sequence_logps(model(**inputs).logits, ids)


def _hidden_temporaries(samples: list[tuple[int, int]]) -> Any:
    """A dispatch mode adding to `samples` what an operator's kernel holds that its fake
    kernel does not show: torch.logsumexp computes exp(x - max) at its input's size
    before reducing it (ATen's logsumexp_out_impl, on a CPU and a GPU alike), and
    evaluation's plain scores (labels.token_losses) reduce the whole logits so: measured
    on a CPU, 2.0 x the fp32 logits at their peak where the trace alone shows 1.0."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = {torch.ops.aten.logsumexp.default: 1}

    class Hidden(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))  # the tracker below samples what is alive after it
            if func in copies and samples:
                activations, grads = samples[-1]
                samples.append((activations + copies[func] * args[0].nbytes, grads))
            return out

    return Hidden()


def trace_evaluation(spec: ModelSpec, config: Any, batch: int, block_size: int, precision: str,
                     numerics: Numerics, gpu_kernels: bool = False, peft: Optional[PeftSpec] = None,
                     pairs: bool = False) -> EvaluationTrace:
    """Trace one evaluation batch of `batch` x `block_size` tokens (`pairs`: of `batch`
    pairs, two sequences each) as the run evaluates it: in eval mode, under no gradient,
    scored as its objective scores it. Where the chunked head does not evaluate
    (model.chunked_loss=false, or a model it refuses), the whole logits and the loss's
    fp32 temporaries are held: more than the training step's peak at a large evaluation
    batch."""
    import torch

    start = time.perf_counter()
    samples: list[tuple[int, int]] = []
    with _fake_model(spec, config, precision, numerics, peft) as (model, chunked):
        model.eval()
        ids = torch.zeros(batch * (2 if pairs else 1), block_size, dtype=torch.long)
        tracker = _sampling_tracker(samples)
        tracker.track_external(model)
        with tracker, _hidden_temporaries(samples), _attention(model, gpu_kernels), _autocast(precision, numerics), \
                torch.no_grad():
            _evaluation_scores(model, chunked, ids, pairs)
    return EvaluationTrace(max((a for a, _ in samples), default=0), chunked is not None, time.perf_counter() - start)
