"""The per-rank memory of model states and strategy buffers (runner/launch/memory_estimate.py),
by the ZeRO paper's arithmetic, for each strategy, precision and offload."""

import pytest

from runner.launch.memory_estimate import estimate_memory

P = 124_439_808  # GPT-2 small


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
