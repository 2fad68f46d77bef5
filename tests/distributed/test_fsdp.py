"""strategy=fsdp in one process: FSDP2 as Accelerate builds it, and the engagement check.

A one-rank gloo group is enough for fully_shard to wrap the model (the mesh has one
shard), so what Accelerate builds and what runner checks run here in seconds; the
2-process math is tests/test_multiprocess.py's. (`one_rank_group`: tests/conftest.py.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.distributed.accelerator import build_accelerator
from runner.distributed.engagement import EngagementError, check_engaged
from runner.distributed.strategies import build_strategy
from runner.config.spec import ModelSpec, OffloadDevice, PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec


def fsdp_run(precision=PrecisionKind.fp32, reshard=True) -> RunSpec:
    return RunSpec(strategy=StrategySpec(kind=StrategyKind.fsdp, reshard_after_forward=reshard),
                   precision=PrecisionSpec(kind=precision))


def prepared(spec: RunSpec):
    torch.manual_seed(0)
    accelerator = build_accelerator(build_strategy(spec.strategy, spec.precision), grad_accum_steps=1, max_grad_norm=1.0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


@pytest.mark.parametrize("precision, reshard", [(PrecisionKind.fp32, True), (PrecisionKind.bf16, False)])
def test_fsdp2_is_engaged_as_the_spec_says(one_rank_group, precision, reshard):
    from torch.distributed.fsdp import FSDPModule

    spec = fsdp_run(precision, reshard)
    accelerator, model, optimizer = prepared(spec)
    assert accelerator.is_fsdp2
    assert isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for block in model.transformer.h)
    assert check_engaged(accelerator, model, optimizer, spec, planned_world_size=1) == "AdamW (fused)"
    # Each check names what differs: the other reshard setting, the other precision.
    with pytest.raises(EngagementError, match=f"reshard_after_forward is {reshard}, expected {not reshard}"):
        check_engaged(accelerator, model, optimizer, fsdp_run(precision, not reshard), 1)
    other = PrecisionKind.bf16 if precision is PrecisionKind.fp32 else PrecisionKind.fp32
    with pytest.raises(EngagementError, match="mixed precision"):
        check_engaged(accelerator, model, optimizer, fsdp_run(other, reshard), 1)
    offload = fsdp_run(precision, reshard)
    offload.strategy.offload_params = OffloadDevice.cpu
    with pytest.raises(EngagementError, match="CPU offload is False"):
        check_engaged(accelerator, model, optimizer, offload, 1)


def test_ddp_model_is_not_taken_for_fsdp(one_rank_group):
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(EngagementError, match="expected FSDP2"):
        check_engaged(accelerator, model, optimizer, fsdp_run(), 1)


def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights(one_rank_group):
    """FSDP2's policy, not autocast: the block's matmul runs in bf16, the sharded
    parameters the optimizer steps stay fp32, the gradients reach them in fp32."""
    accelerator, model, optimizer = prepared(fsdp_run(PrecisionKind.bf16))
    seen = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    ids = torch.randint(0, 100, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_grad_norm_over_sharded_gradients_is_a_plain_global_norm(one_rank_group, max_grad_norm):
    """FSDP2's gradients are DTensors: the norm comes back as a plain tensor (the trainer's
    finite check concatenates it with the loss), equal to the norm of the full gradients,
    and clipping scales them to max_grad_norm."""
    from torch.distributed.tensor import DTensor

    accelerator, model, optimizer = prepared(fsdp_run())
    ids = torch.randint(0, 100, (2, 8))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) for g in grads)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.full_tensor()) for g in grads]))
    spec = fsdp_run()
    norm = build_strategy(spec.strategy, spec.precision).grad_norm(accelerator, model, max_grad_norm)
    assert type(norm) is torch.Tensor
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]))
    assert float(after) == pytest.approx(max_grad_norm if max_grad_norm else float(expected), rel=1e-3)


def test_saved_state_dict_is_the_full_fp32_model(one_rank_group):
    accelerator, model, _ = prepared(fsdp_run(PrecisionKind.bf16))
    state = accelerator.get_state_dict(model)
    reference = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100)).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in reference.items() if k in state}
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


def test_compile_under_fsdp_is_refused_at_validation(compose_spec):
    from runner.launch.preflight import check_fsdp

    [problem] = check_fsdp(compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "model.compile=true"))
    assert "model.compile=true with strategy=fsdp" in problem
    assert check_fsdp(compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "model.gradient_checkpointing=true")) == []
    assert ModelSpec().compile is False
