"""MFU's peak FLOP/s on GPUs: the table, TF32, and unknown GPUs (CUDA queries monkeypatched)."""

import pytest
import torch

from runner.report import flops
from runner.report.flops import gpu_peak_tflops, peak_flops

# Device names as torch.cuda.get_device_name() reports them on these GPUs.
NAMES = {
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "fp32": 66.9},  # SXM5
    "NVIDIA H100 PCIe": {"bf16": 756.5, "fp32": 51.2},
    "NVIDIA H100 NVL": {"bf16": 835.5, "fp32": 60.0},
    "NVIDIA H200": {"bf16": 989.4, "fp32": 66.9},
    "NVIDIA B200": {"bf16": 2250.0, "fp32": 75.0},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp32": 19.5},
    "NVIDIA A40": {"bf16": 149.7, "fp32": 37.4},
    "NVIDIA RTX A6000": {"bf16": 154.8, "fp32": 38.7},
    "NVIDIA RTX 6000 Ada Generation": {"bf16": 364.2, "fp32": 91.1},
    "NVIDIA L40": {"bf16": 181.0, "fp32": 90.5},
    "NVIDIA L40S": {"bf16": 362.1, "fp32": 91.6},
    "NVIDIA L4": {"bf16": 121.0, "fp32": 30.3},
    "Tesla V100-SXM2-32GB": {"fp16": 125.0, "fp32": 15.7},
    "Tesla T4": {"fp16": 65.0, "fp32": 8.1},
}


@pytest.mark.parametrize("name", NAMES)
def test_each_gpu_gets_its_own_row(name):
    for dtype, tflops in NAMES[name].items():
        assert gpu_peak_tflops(name, dtype, tf32=False) == tflops


def test_similar_names_do_not_borrow_each_others_figures():
    assert gpu_peak_tflops("NVIDIA L40", "bf16", False) != gpu_peak_tflops("NVIDIA L4", "bf16", False)
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16", False) < gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16", False)


def test_fp32_counts_tf32_peak_only_when_tf32_is_on():
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32=False) == 19.5
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156.0


@pytest.mark.parametrize("name,dtype", [("Quadro RTX 8000", "bf16"), ("NVIDIA GH200 480GB", "bf16"), ("NVIDIA GB200", "bf16"), ("Tesla T4", "bf16")])
def test_unknown_gpu_or_dtype_has_no_peak(name, dtype):
    assert gpu_peak_tflops(name, dtype, tf32=False) is None


def test_peak_flops_on_a_monkeypatched_gpu_never_probes(monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("a GPU must not fall back to the matmul probe")

    monkeypatch.setattr(flops, "_probe", no_probe)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    # Set and put back by hand: pytest >= 9.2's monkeypatch undoes an attribute that is
    # not in the object's __dict__ by deleting it, which torch's cuBLAS settings refuse.
    matmul = torch.backends.cuda.matmul
    tf32 = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        device = torch.device("cuda", 0)
        assert peak_flops(device, "bf16") == pytest.approx(989.4e12)
        assert peak_flops(device, "fp32") == pytest.approx(66.9e12)  # torch's default: TF32 off
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
        assert peak_flops(device, "bf16") is None
    finally:
        matmul.allow_tf32 = tf32


def test_a_cpu_peak_is_the_highest_probe_seen_so_a_busy_moment_never_lowers_it(monkeypatch, tmp_path):
    """A probe that shared the cores with other work reads low; cached as the peak it would
    inflate every later MFU. Each process's first run probes again and the cache keeps the
    highest; its later runs (in turn, a sweep's) read the cache."""
    readings = iter([20e9, 5e9, 80e9, 40e9, 30e9])
    monkeypatch.setattr(flops, "_probe", lambda *args, **kwargs: next(readings))
    monkeypatch.setattr(flops, "default_cache_dir", lambda: tmp_path)
    peaks = []
    for _ in range(4):
        monkeypatch.setattr(flops, "_PROBED", set())  # a new process
        peaks.append(peak_flops(torch.device("cpu"), "fp32"))
    assert peaks == [20e9, 20e9, 80e9, 80e9]
    assert peak_flops(torch.device("cpu"), "fp32") == 80e9  # the same process again: no reading left to take
    assert peak_flops(torch.device("cpu"), "bf16") == 30e9 and next(readings, "none left") == "none left"


def test_the_cpu_probe_leaves_the_global_random_streams_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert flops._probe("fp32", seconds=0.01) > 0
    assert torch.equal(torch.rand(3), expected)


def test_a_mixture_of_experts_counts_the_experts_a_token_uses():
    """Mixtral-style, 4 experts, top 2: a token's FLOPs use half the expert weights."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from runner.report.flops import expert_parameters, model_flops_per_token

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000)
    model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = expert_parameters(model)
    assert 0 < experts < total
    dense_part = total - experts
    expected = 6 * (dense_part + experts / 2) + 12 * 2 * 64 * 32
    assert model_flops_per_token(config, total, 32, experts) == pytest.approx(expected)


def test_attention_flops_use_heads_times_head_dim_not_the_hidden_size():
    from transformers import Qwen3Config

    from runner.report.flops import model_flops_per_token

    config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, num_hidden_layers=2)
    assert model_flops_per_token(config, 1000, 16) == 6 * 1000 + 12 * 2 * (4 * 32) * 16
    assert model_flops_per_token(type("GPT2Like", (), {"n_layer": 2, "n_embd": 64})(), 1000, 16) == 6 * 1000 + 12 * 2 * 64 * 16


def test_a_frozen_base_costs_four_flops_a_parameter_and_the_adapters_six():
    """Adapters on a frozen base: no weight gradient for the base (2 FLOPs a token less
    per frozen parameter); attention's term is unchanged (it has no weights)."""
    from transformers import GPT2Config

    from runner.report.flops import model_flops_per_token

    config = GPT2Config(n_embd=64, n_layer=2, n_head=2)
    full = model_flops_per_token(config, 1_000_000, 128)
    assert model_flops_per_token(config, 1_000_000, 128, n_trainable=1_000_000) == full
    assert model_flops_per_token(config, 1_000_000, 128, n_trainable=10_000) == full - 2.0 * 990_000
    assert full == 6.0 * 1_000_000 + 12.0 * 2 * 64 * 128
