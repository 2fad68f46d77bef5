"""strategy=fsdp in one process: FSDP2 as Accelerate builds it, and the engagement check.

A one-rank gloo group is enough for fully_shard to wrap the model (the mesh has one
shard), so what Accelerate builds and what runner checks run here in seconds; the
2-process math is tests/test_multiprocess.py's. (`one_rank_group`: tests/conftest.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
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
    accelerator = build_accelerator(build_strategy(spec.strategy, spec.precision), grad_accum_steps=1, max_grad_norm=1.0,
                                    layer_classes=["GPT2Block"])
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


def _grad_norm_rank(rank: int, world: int, init_file: str, results: dict) -> None:
    """One rank of a gloo group: FSDP2 over `world` ranks, each with its own batch."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batches = [torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
        # The reference: the same seeded model, unsharded, with the gradient FSDP2 averages over the ranks.
        torch.manual_seed(0)
        reference = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100))
        reference.eval()  # no dropout: the two models must see the same function
        for ids in batches:
            (reference(input_ids=ids, labels=ids).loss / world).backward()
        expected = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in reference.parameters()]))

        spec = fsdp_run()
        accelerator, model, optimizer = prepared(spec)
        model.eval()
        ids = batches[rank]
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        grads = [p.grad for p in model.parameters()]
        local = torch.linalg.vector_norm(torch.stack([g.to_local().double().norm() for g in grads]))
        strategy = build_strategy(spec.strategy, spec.precision)
        unclipped = strategy.grad_norm(accelerator, model, 0.0)
        clipping = strategy.grad_norm(accelerator, model, 1e-3)  # the norm before clipping, then clips
        after = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().double().norm() for p in model.parameters()]))
        results[rank] = {
            "dtensors": all(isinstance(g, DTensor) for g in grads), "plain": type(unclipped) is torch.Tensor,
            "shard_rows": grads[0].to_local().shape[0], "rows": grads[0].shape[0],
            "local": float(local), "expected": float(expected), "unclipped": float(unclipped),
            "clipping": float(clipping), "after": float(after),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_grad_norm_over_sharded_gradients_is_a_plain_global_norm(tmp_path):
    """Two ranks (gloo), a batch each: FSDP2's gradients are DTensor shards that really
    differ (each rank holds half the rows of every gradient). The norm comes back as a
    plain tensor (the trainer's finite check concatenates it with the loss), on every
    rank the norm of the full averaged gradient (an unsharded model's, to float32
    rounding), not of the rank's shard; clipping then scales the full gradient to
    max_grad_norm."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_grad_norm_rank, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
        ranks = [dict(results[r]) for r in (0, 1)]
    for r in ranks:
        assert r["dtensors"] and r["plain"]
        assert r["shard_rows"] == r["rows"] // 2  # the embedding's gradient: 50 of 100 rows here
        assert r["unclipped"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["clipping"] == pytest.approx(r["unclipped"], rel=1e-12)
        assert r["after"] == pytest.approx(1e-3, rel=1e-3)
    # Each rank's own shard has a norm of its own, smaller than the global one: summing
    # the squares over the ranks is what makes the global norm.
    assert ranks[0]["local"] != pytest.approx(ranks[1]["local"], rel=1e-3)
    assert max(r["local"] for r in ranks) < ranks[0]["unclipped"] * (1 - 1e-3)
    assert ranks[0]["local"] ** 2 + ranks[1]["local"] ** 2 == pytest.approx(ranks[0]["unclipped"] ** 2, rel=1e-5)


def test_saved_state_dict_is_the_full_fp32_model(one_rank_group):
    """What model/ is written from (the strategy's full_state_dict): every key a plain
    GPT-2 has, the tied lm_head included, each the full fp32 tensor with the same values
    (the same seeded weights, nothing trained), although bf16 computes in bf16."""
    spec = fsdp_run(PrecisionKind.bf16)
    accelerator, model, _ = prepared(spec)
    state = build_strategy(spec.strategy, spec.precision).full_state_dict(accelerator, model)
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100)).state_dict()
    assert sorted(state) == sorted(reference)
    for key, value in reference.items():
        assert state[key].dtype == value.dtype and state[key].device.type == "cpu", key
        assert torch.equal(state[key], value), key


def test_compile_under_fsdp_is_accepted_at_validation(compose_spec):
    """Each layer compiled in place before fully_shard (runner/components/compile.py):
    tests/test_compile.py trains it."""
    from runner.launch.preflight import check_fsdp

    assert check_fsdp(compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "model.compile=true")) == []
    assert check_fsdp(compose_spec("recipe=gpt2_clm_tiny", "strategy=fsdp", "model.gradient_checkpointing=true")) == []
    assert ModelSpec().compile is False
