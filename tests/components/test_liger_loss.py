"""Liger's fused linear cross-entropy as the chunked loss's kernel on a GPU
(runner/components/liger_loss.py), a contract test: its Triton kernels need a GPU
driver, so the GPU is monkeypatched in and the installed Liger module's kernel (its
autograd Function's `apply`) is replaced by the same computation in torch, taking
every argument where Liger's module passes it. What is checked is runner's side: that
on a GPU the chunked loss goes through Liger's public module, with the arguments that
make it runner's loss, and that the result is the plain loss, with every gradient."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

from runner.components import liger_loss

# liger-kernel is a dev dependency: its contract is checked against the installed module.
from liger_kernel.transformers import fused_linear_cross_entropy as fused_module
from runner.components.chunked_loss import install
from tests.components.test_chunked_loss import batch, tiny


class LigerOnTorch:
    """LigerFusedLinearCrossEntropyFunction.apply's positional arguments as its module
    passes them (liger-kernel 0.6.2 to 0.8.5): (_input, weight, target, bias, ce_weight,
    ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
    accum_dtype, ...), computed by torch: returns (loss, z_loss, accuracy, predictions)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, _input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                 label_smoothing, reduction, softcap, return_z_loss, accum_dtype, *rest):
        self.calls.append(dict(shape=tuple(_input.shape), target=tuple(target.shape), ignore_index=ignore_index,
                               reduction=reduction, accum_dtype=accum_dtype, softcap=softcap,
                               lse_square_scale=lse_square_scale, label_smoothing=label_smoothing,
                               ce_weight=ce_weight, return_z_loss=return_z_loss))
        logits = F.linear(_input, weight, bias).float()
        loss = F.cross_entropy(logits, target, weight=ce_weight, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
        return loss, None, None, None


@pytest.fixture
def on_a_gpu(monkeypatch):
    """A GPU, as far as runner's choice of kernel can tell, and Liger's kernel in torch."""
    kernel = LigerOnTorch()
    monkeypatch.setattr(liger_loss, "gpu_present", lambda: True)
    monkeypatch.setattr(liger_loss, "runs_on", lambda hidden: True)
    monkeypatch.setattr(fused_module.LigerFusedLinearCrossEntropyFunction, "apply", kernel)
    return kernel


def test_the_installed_liger_module_takes_the_arguments_runner_passes():
    init = inspect.signature(fused_module.LigerFusedLinearCrossEntropyLoss.__init__).parameters
    assert {"ignore_index", "reduction", "accum_dtype"} <= init.keys()
    forward = list(inspect.signature(fused_module.LigerFusedLinearCrossEntropyLoss.forward).parameters)
    assert forward[1:5] == ["lin_weight", "_input", "target", "bias"]


@pytest.mark.parametrize("model_type,extra", [("gpt2", ""), ("llama", ",tie_word_embeddings=False")],
                         ids=["gpt2-tied", "llama-untied"])
def test_on_a_gpu_liger_computes_the_plain_loss_and_every_gradient(on_a_gpu, model_type, extra):
    plain = tiny(model_type, extra)
    model = copy.deepcopy(plain)
    chunked, reason = install(model, gpu_kernel=True)
    assert reason is None, reason
    assert chunked.kernel.startswith("Liger's fused linear cross-entropy (liger-kernel ")
    ids, labels = batch(masked=True)
    loss = plain(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    on_a_gpu.calls.clear()  # the probe's call at install
    with chunked.labels(labels):
        fused_loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    fused_loss.backward()

    (call,) = on_a_gpu.calls
    width = plain.config.hidden_size
    assert call == dict(shape=(2 * 23, width), target=(2 * 23,), ignore_index=-100, reduction="sum",
                        accum_dtype=torch.float32, softcap=None, lse_square_scale=0.0, label_smoothing=0.0,
                        ce_weight=None, return_z_loss=False)
    assert fused_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == fused_grads.keys() and grads
    for name, g in grads.items():
        assert (fused_grads[name] - g).abs().max().item() <= 1e-4 * max(g.abs().max().item(), 1e-6), name


def test_hidden_states_off_the_gpu_take_runners_chunks(on_a_gpu, monkeypatch):
    """Liger loaded (a GPU machine) but the tensors on the CPU: runner's own chunks."""
    monkeypatch.setattr(liger_loss, "runs_on", lambda hidden: hidden.device.type == "cuda")
    model = tiny("gpt2")
    chunked, _ = install(model, gpu_kernel=True)
    ids, labels = batch(masked=False)
    with chunked.labels(labels):
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    assert on_a_gpu.calls == []


def test_liger_is_used_only_where_it_can_run(monkeypatch):
    monkeypatch.setattr(liger_loss, "gpu_present", lambda: False)
    assert liger_loss.liger_head_loss() == (None, f"liger-kernel {liger_loss.installed_version('liger-kernel')} installed, but no GPU")
    model = tiny("gpt2")
    chunked, _ = install(model, gpu_kernel=True)
    assert chunked.state.fused is None and chunked.kernel == "runner's chunks of 1,024 tokens"
    chunked.remove()
    monkeypatch.setattr(liger_loss, "gpu_present", lambda: True)
    chunked, _ = install(model)  # the memory plan's trace: runner's chunks even on a GPU with Liger
    assert chunked.state.fused is None
    chunked.remove()
    monkeypatch.setattr(liger_loss, "installed_version", lambda library: None)
    assert liger_loss.liger_head_loss() == (None, "liger-kernel is not installed")
