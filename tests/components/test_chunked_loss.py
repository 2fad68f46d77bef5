"""The head and loss over chunks of tokens (runner/components/chunked_loss.py) against the
plain loss: per-token losses, the loss and every gradient, on each certified
architecture, tied and untied heads, with and without masked labels; and its memory,
traced."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from runner.certify.architectures import TINY
from runner.components.chunked_loss import (
    MIN_CHUNK_TOKENS,
    ChunkedHeadLoss,
    chunk_tokens,
    chunked_token_losses,
    install,
    why_not,
)
from runner.components.model import build_config
from runner.components.step_trace import Numerics, trace_step
from runner.config.spec import ModelSpec

VOCAB = 50257


def tiny(model_type: str, extra: str = "") -> torch.nn.Module:
    config = build_config(ModelSpec(model_type=model_type, config_overrides=TINY[model_type] + extra))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()  # eval: no dropout, so both see the same forward


def batch(masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 23), generator=g)
    labels = ids.clone()
    if masked:  # a prompt not trained on, and an example that ends early
        labels[0, :9] = -100
        labels[1, 15:] = -100
    return ids, labels


def plain_and_chunked(model_type: str, masked: bool, chunk: int = 7, extra: str = ""):
    plain = tiny(model_type, extra)
    chunked_model = copy.deepcopy(plain)
    chunked, reason = install(chunked_model)
    assert reason is None, reason
    chunked.state.chunk = chunk  # 46 tokens: six whole chunks and a partial one
    ids, labels = batch(masked)
    loss = plain(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    with chunked.labels(labels):
        chunked_loss = chunked_model(input_ids=ids, labels=labels, use_cache=False).loss
    chunked_loss.backward()
    return plain, chunked_model, loss, chunked_loss


ARCHITECTURES = [t for t in TINY if t != "gemma2"]  # gemma2 soft-caps its logits: refused, below


@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "masked-100"])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_loss_and_every_gradient_equal_the_plain_loss(model_type, masked):
    plain, chunked, loss, chunked_loss = plain_and_chunked(model_type, masked)
    assert chunked_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    chunked_grads = {n: p.grad for n, p in chunked.named_parameters() if p.grad is not None}
    assert grads.keys() == chunked_grads.keys() and grads
    for name, g in grads.items():
        scale = g.abs().max().item()
        # + 1e-9: a gradient that is zero in exact math (a key projection's bias: softmax
        # ignores a shift) is float noise of 1e-11 to 1e-10 in both (OPT's read 1.02e-10 apart)
        assert (chunked_grads[name] - g).abs().max().item() <= 1e-4 * scale + 1e-9, name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_and_untied_heads(tied):
    """Llama either way: the tied head's gradient reaches the embedding through both uses."""
    plain, chunked, loss, chunked_loss = plain_and_chunked("llama", True, extra=f",tie_word_embeddings={tied}")
    head, embedding = chunked.get_output_embeddings().weight, chunked.get_input_embeddings().weight
    assert (head is embedding) == tied
    assert chunked_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    expected = plain.get_output_embeddings().weight.grad
    assert (head.grad - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "masked-100"])
def test_per_token_losses_and_a_biased_head(masked):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)
    bias = torch.randn(1000, requires_grad=True)
    labels = torch.randint(0, 1000, (3, 11))
    if masked:
        labels[0, :4] = -100
        labels[2, 7:] = -100
    logits = F.linear(hidden, weight, bias)[:, :-1].reshape(-1, 1000)
    target = labels[:, 1:].reshape(-1)
    expected = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    expected.sum().backward()
    plain_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    total, per_token = chunked_token_losses(hidden, weight, bias, labels, chunk=5)
    total.backward()
    per_token = per_token.view(3, 11)[:, :-1].reshape(-1)  # the last position predicts nothing
    assert torch.allclose(per_token, expected, atol=1e-5, rtol=0)
    assert (per_token[target == -100] == 0).all()
    for got, want in zip((hidden.grad, weight.grad, bias.grad), plain_grads):
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_bf16_autocast_follows_the_plain_loss():
    """Under autocast the chunks' logits are bf16 as the plain head's are, and the loss is
    taken in fp32 from them: the same rounding, up to the order of sums."""
    plain = tiny("llama")
    chunked_model = copy.deepcopy(plain)
    chunked, _ = install(chunked_model)
    ids, labels = batch(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = plain(input_ids=ids, labels=labels, use_cache=False).loss
        with chunked.labels(labels):
            chunked_loss = chunked_model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    chunked_loss.backward()
    assert chunked_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    g, cg = plain.lm_head.weight.grad, chunked_model.lm_head.weight.grad
    assert (cg - g).abs().max().item() <= 1e-2 * g.abs().max().item()  # bf16's own rounding of the matmuls


@pytest.mark.parametrize("chunk", [64, 5])
def test_under_bf16_autocast_the_heads_matmuls_run_in_bf16_as_the_plain_heads(chunk):
    """The head's two backward matmuls run in the logits' dtype (bf16 under autocast), as
    autograd runs the plain head's, not in fp32 (twice the time on a CPU with bf16
    matmuls: GPT-2 124M's bf16 step fell behind the Trainer's). One chunk holding every
    token gives the plain head's gradients bit for bit; several sum their bf16 products
    in fp32, within bf16's rounding of them."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(300, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 300, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    F.cross_entropy(logits.float(), labels, reduction="sum").backward()
    plain = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = ChunkedHeadLoss.apply(hidden, weight, None, labels, chunk)  # labels aligned with hidden
    total.backward()
    for got, want in zip((hidden.grad, weight.grad), plain):
        if chunk >= 40:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


def test_accumulation_divides_by_the_windows_trained_tokens():
    """num_items_in_batch (the trainer's count over the window and the ranks) divides the
    summed loss, as in transformers' loss."""
    plain = tiny("gpt2")
    chunked_model = copy.deepcopy(plain)
    chunked, _ = install(chunked_model)
    ids, labels = batch(True)
    items = torch.tensor(97)
    loss = plain(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
    with chunked.labels(labels):
        chunked_loss = chunked_model(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
    assert chunked_loss.item() == pytest.approx(loss.item(), abs=1e-6)


def test_without_labels_the_head_gives_logits_as_before():
    plain = tiny("gpt2")
    chunked_model = copy.deepcopy(plain)
    install(chunked_model)
    ids, _ = batch(False)
    with torch.no_grad():
        assert torch.equal(chunked_model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_model_that_soft_caps_its_logits_keeps_the_plain_loss():
    """Gemma 2 soft-caps the head's output before its loss: the probe sees it, and the
    model is left as it was."""
    model = tiny("gemma2")
    chunked, reason = install(model)
    assert chunked is None and "changed the head's output" in reason
    ids, labels = batch(False)
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)  # the plain loss, restored
    assert "_loss_function" not in vars(model)


def test_a_head_with_adapters_keeps_the_plain_loss():
    from runner.components.adapters import add_adapters
    from runner.config.spec import PeftKind, PeftSpec

    model = add_adapters(PeftSpec(kind=PeftKind.lora, modules_to_save=["lm_head"]), tiny("llama"), False)
    assert "not a plain Linear" in why_not(model)
    plain = add_adapters(PeftSpec(kind=PeftKind.lora), tiny("llama"), False)
    assert why_not(plain) is None  # adapters elsewhere: the head is the base's own Linear


def test_a_chunk_holds_at_least_1024_tokens_whatever_the_vocabulary():
    """Each chunk's fixed cost is traffic over vocabulary x width (the weight, the fp32
    weight gradient), its matmuls grow with its tokens: a chunk too short costs more
    than it saves, at any vocabulary (bench/head_chunks.py: GPT-2's head over 1,024
    tokens, 333-token chunks 1.13x the whole logits' time, one chunk 0.99x)."""
    assert MIN_CHUNK_TOKENS == 1024
    assert chunk_tokens(VOCAB) == 1024  # GPT-2: 206 MB of fp32 logits (64 MiB alone: 333 tokens)
    assert chunk_tokens(151_936) == 1024  # Qwen2's vocabulary (64 MiB alone: 110 tokens)
    assert chunk_tokens(8_000) == (64 << 20) // (4 * 8_000)  # a small vocabulary: the logit budget's, larger


def test_traced_peak_no_longer_grows_with_tokens_times_vocabulary():
    """The memory plan traces the loss the run computes: doubling the tokens adds
    3 x tokens x vocabulary x 4 bytes (logits, log-softmax, gradient) to the plain loss's
    peak, and only the activations' growth to the chunked loss's."""
    config = build_config(ModelSpec(config_overrides="n_embd=64,n_layer=2,n_head=4,n_positions=1024"))
    peaks = {}
    for chunked in (False, True):
        for block in (256, 512):  # 8,192 and 16,384 tokens: 8 and 16 chunks
            trace = trace_step(ModelSpec(chunked_loss=chunked), config, 32, block, "fp32", Numerics.fp32)
            peaks[chunked, block] = trace.activation_peak
    added_logits = 3 * 32 * 256 * VOCAB * 4
    plain_growth = peaks[False, 512] - peaks[False, 256]
    chunked_growth = peaks[True, 512] - peaks[True, 256]
    assert plain_growth >= 0.9 * added_logits
    assert chunked_growth <= 0.2 * plain_growth
    assert peaks[True, 512] <= 0.3 * peaks[False, 512]


def test_the_chunked_loss_reads_nothing_on_the_host():
    """No bool/item/tolist of a tensor in forward or backward: on a GPU each would wait for
    the device (the trainer's step reads nothing: tests/train/test_trainer.py)."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        names = frozenset({"__bool__", "item", "cpu", "tolist", "__float__", "__int__", "__index__", "numpy"})

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in self.names:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model = tiny("llama").train()
    chunked, _ = install(model)
    ids, labels = batch(True)
    with Reads() as reads:
        with chunked.labels(labels):
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(30)).loss
        loss.backward()
    assert reads.seen == []


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_backward_allocates_no_weight_sized_gradient_beyond_the_plain_heads(tied):
    """Backward hands autograd the saved weight gradient, scaled in place: no product of
    the head's size (GPT-2's 154 MB), and no copy of it when autograd keeps it as the
    parameter's gradient. With a tied embedding autograd sums the two as it sums the
    plain head's product with the embedding's. Llama, both ways, under accumulation's scaling (1/97)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightSized(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.made = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(out, torch.Tensor) and out.numel() == self.numel and not name.endswith("_"):
                self.made.append(name)
            return out

    def backward_makes(model, loss_of):
        loss = loss_of(model)
        weight = model.get_output_embeddings().weight
        with WeightSized(weight.numel()) as seen:
            loss.backward()
        return seen.made, weight.grad

    ids, labels = batch(True)
    items = torch.tensor(97)
    plain = tiny("llama", f",tie_word_embeddings={tied}")
    chunked_model = copy.deepcopy(plain)
    chunked, _ = install(chunked_model)

    def chunked_loss(model):
        with chunked.labels(labels):
            return model(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss

    plain_made, want = backward_makes(plain, lambda m: m(input_ids=ids, labels=labels, num_items_in_batch=items,
                                                          use_cache=False).loss)
    made, got = backward_makes(chunked_model, chunked_loss)
    assert made == [name for name in plain_made if name not in ("mm", "t")]  # the plain head's product is forward's here
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_a_second_backward_through_a_retained_graph_is_refused():
    """The gradients are computed once a forward and scaled in place by its backward: a
    second backward would scale them again, so it is refused, naming the fix."""
    model = tiny("gpt2").train()
    chunked, _ = install(model)
    ids, labels = batch(False)
    with chunked.labels(labels):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*model.chunked_loss=false"):
        loss.backward()


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "qwen3"])
def test_evaluation_scores_equal_the_plain_logits(model_type):
    """Evaluation through the chunked head gives each token's loss, the trained mask and
    the correct predictions of the plain logits (the losses within float rounding, 1e-5,
    as training's per-token losses above)."""
    from runner.components.data.labels import token_losses

    plain = tiny(model_type)
    chunked_model = copy.deepcopy(plain)
    chunked, reason = install(chunked_model)
    assert reason is None, reason
    chunked.state.chunk = 7
    ids, labels = batch(masked=True)
    with torch.no_grad():
        logits = plain(input_ids=ids, use_cache=False).logits
        scores = chunked.scores(chunked_model, {"input_ids": ids, "use_cache": False}, labels)
    losses, trained = token_losses(logits, labels)
    assert torch.equal(scores.trained, trained)
    assert torch.allclose(scores.losses, losses, atol=1e-5, rtol=0)  # another matmul shape: float rounding
    assert torch.equal(scores.correct, (logits[:, :-1].argmax(-1) == labels[:, 1:]) & trained)
    # and the head is its plain self again for the next forward
    with torch.no_grad():
        assert torch.allclose(chunked_model(input_ids=ids, use_cache=False).logits, logits, atol=1e-6)


def test_evaluation_never_holds_the_whole_logits():
    """The largest tensor an evaluation forward makes is a chunk's logits, not the batch's
    tokens x vocabulary (measured before: 920 MB RSS at evaluation batch 1 and 3,933 MB
    at 32 for a plan of 291.5 MiB, GPT-2's vocabulary at block 256)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny("gpt2")
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Largest(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                # a weight's transpose is the weight's memory, nothing new
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in parameters:
                    self.elements = max(self.elements, t.numel())
            return out

    chunked, _ = install(model)
    chunked.state.chunk = 7
    ids, labels = batch(masked=False)  # 46 tokens
    with torch.no_grad(), Largest() as seen:
        chunked.scores(model, {"input_ids": ids, "use_cache": False}, labels)
    assert seen.elements == 7 * VOCAB  # one chunk's logits (the embedding table is a parameter, not made)
