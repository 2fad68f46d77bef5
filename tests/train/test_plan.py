"""Batch arithmetic, the dry-run plan and its memory estimate."""

import math
import re

import pytest

from runner.report.memory_estimate import estimate_memory
from runner.train.plan import batches_per_rank, steps_per_epoch, total_steps

P = 124_439_808  # GPT-2 small


def test_batches_and_steps():
    assert batches_per_rank(100, 8, 1) == 13
    assert batches_per_rank(100, 8, 2) == 7  # 13 batches round-robin over 2 ranks, the last round padded
    assert steps_per_epoch(13, 2) == 7  # the short last accumulation still steps
    assert total_steps(None, 3, 7) == 21 and total_steps(5, 3, 7) == 5 and total_steps(None, 0.5, 7) == 4


def test_ddp_keeps_16_bytes_per_parameter_on_every_rank_and_a_second_copy_of_the_gradients():
    est = estimate_memory(P, "ddp", "fp32", 8)
    assert (est.params, est.grads, est.optimizer) == (4 * P, 4 * P, 8 * P)
    assert est.buffers == 4 * P  # DDP's gradient buckets (gradient_as_bucket_view off)
    assert estimate_memory(P, "ddp", "bf16", 8).device_total == 20 * P  # autocast keeps fp32 weights


def test_zero2_partitions_gradients_and_optimizer():
    est = estimate_memory(P, "zero2", "bf16", 8)
    assert est.params == 2 * P and est.grads == pytest.approx(2 * P / 8) and est.optimizer == pytest.approx(12 * P / 8)


def test_zero3_partitions_everything():
    est = estimate_memory(P, "zero3", "bf16", 8)
    assert est.device_total == pytest.approx(16 * P / 8)  # no width given: no buffers counted
    fp32 = estimate_memory(P, "zero3", "fp32", 4)
    assert fp32.device_total == pytest.approx(16 * P / 4)


def test_zero_buffers_follow_the_model_sized_buckets():
    h = 768  # GPT-2 small
    layers, bucket = 12, int(0.9 * h * h)
    z3 = estimate_memory(P, "zero3", "fp32", 2, hidden_size=h, layers=layers)
    # the reduce bucket (h² gradients) + a prefetch bucket of gathered parameters + the
    # largest parameter (everything outside the 12 h² layers: the embeddings)
    embeddings = P - layers * 12 * h * h
    assert z3.buffers == 4 * h * h + 4 * (embeddings + bucket)
    # without the depth, the whole model is taken as one gathered parameter
    assert estimate_memory(P, "zero3", "fp32", 2, hidden_size=h).buffers == 4 * h * h + 4 * (P + bucket)
    assert estimate_memory(P, "zero2", "bf16", 2, hidden_size=h).buffers == 2 * h * h
    ddp = estimate_memory(P, "ddp", "fp32", 2, hidden_size=h)
    assert z3.device_total / ddp.device_total == pytest.approx((8 * P + 4 * (h * h + embeddings + bucket)) / (20 * P))


def test_fsdp_shards_fp32_states_and_gathers_the_root_and_two_layers():
    h, layers = 768, 12  # GPT-2 small
    layer = 12 * h * h
    fp32 = estimate_memory(P, "fsdp", "fp32", 2, hidden_size=h, layers=layers)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * P / 2, 4 * P / 2, 8 * P / 2)
    assert fp32.buffers == (P - layers * layer + 2 * layer) * 4 + layer * 4
    bf16 = estimate_memory(P, "fsdp", "bf16", 2, hidden_size=h, layers=layers)
    assert bf16.params == fp32.params  # fp32 shards; only the gathered copy is bf16
    assert bf16.buffers == (P - layers * layer + 2 * layer) * 2 + layer * 4
    offloaded = estimate_memory(P, "fsdp", "fp32", 2, offload_params=True)
    assert offloaded.params == offloaded.grads == offloaded.optimizer == 0 and offloaded.offloaded == 16 * P / 2


def test_offload_moves_state_to_the_host():
    est = estimate_memory(P, "zero3", "bf16", 4, offload_optimizer=True, offload_params=True)
    assert est.optimizer == 0 and est.params == 0
    assert est.offloaded == pytest.approx(12 * P / 4 + 2 * P / 4)
    assert est.grads == pytest.approx(2 * P / 4)
    # Offloading parameters means nothing under ZeRO-2: weights stay on the device.
    assert estimate_memory(P, "zero2", "bf16", 4, offload_params=True).params == 2 * P


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    from runner.cli import main

    run_dir = tmp_path / "run"
    main(["recipe=gpt2_clm_tiny", "dry_run=true", "launch.nproc_per_node=2", "train.grad_accum_steps=2",
          "strategy=zero3", f"hydra.run.dir={run_dir}"])
    out = capsys.readouterr().out
    blocks = 7364  # the vendored corpus at block 128, 95% for training
    per_epoch = math.ceil(batches_per_rank(blocks, 8, 2) / 2)
    assert "global batch    32 = 8 per device x 2 process(es) x 2 accumulation" in out
    assert "tokens/step     4,096 = 32 x 128" in out
    assert f"data            {blocks:,} train / " in out
    assert f"epochs of {per_epoch:,} steps)" in out
    assert "parameters      3,324,736" in out
    assert "buffers       " in out and "activations   " in out
    # each strategy's verdict on this machine's host memory, at the same global batch
    assert re.search(r"fits on this machine's host memory \([\d.]+ GiB available, 2 rank\(s\)\)\? per rank, "
                     r"global batch 32 kept:", out)
    for strategy in ("ddp", "zero2", "zero3", "fsdp"):
        assert re.search(rf"\n    {strategy} +peak +[\d.,]+ MiB  fits, [\d.,]+ GiB headroom; largest micro-batch 16 x 1 "
                         "accumulation", out), out
    assert not run_dir.exists()


# Hand counts of two tiny models of runner/certify/architectures.py (h 64, 4 query heads of
# 16 over 2 key-value heads, MLP 128, 2 layers, the GPT-2 tokenizer's 50,257 tokens, an
# untied output head): attention q, o 64x64 each and k, v 64x32 each = 12,288; two norms
# of 64 = 128; a gated MLP (gate, up, down) 3 x 64 x 128 = 24,576.
GQA_LAYER = 12_288 + 128 + 24_576
# A mixture of 4 such MLPs with a 64 x 4 router: every expert sits in memory.
MOE_LAYER = 12_288 + 128 + 4 * 24_576 + 64 * 4
OUTSIDE = 2 * 50_257 * 64 + 64  # embedding, untied head, final norm


@pytest.mark.parametrize("model_type, layer", [("llama", GQA_LAYER), ("mixtral", MOE_LAYER)])
def test_the_memory_plan_counts_the_models_own_layers(compose_spec, model_type, layer):
    """Grouped-query attention, a gated MLP, a mixture of experts, an untied head: the plan
    counts them from the model (on the meta device), not as GPT-2's 12 h² a layer."""
    from runner.certify.architectures import TINY
    from runner.launch.fit import estimate_for, model_shape

    spec = compose_spec("recipe=gpt2_clm_tiny", f"model.model_type={model_type}",
                        f"model.config_overrides='{TINY[model_type]}'")
    shape = model_shape(spec)
    assert (shape.parameters, shape.layer_parameters, shape.layers) == (2 * layer + OUTSIDE, layer, 2)
    fsdp = estimate_for(shape, "fsdp", "fp32", 2)
    assert fsdp.buffers == (OUTSIDE + 2 * layer) * 4 + layer * 4  # the root gathered, two layers, one layer's grads
    zero3 = estimate_for(shape, "zero3", "fp32", 2)
    assert zero3.buffers == 4 * 64 * 64 + 4 * (OUTSIDE + int(0.9 * 64 * 64))  # CPU: the head gathered alone + a bucket
