"""The Accelerator we build: precision really in effect, strategy engaged as asked."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from transformers import GPT2Config, GPT2LMHeadModel

from runner.distributed.accelerator import build_accelerator, reset_accelerate_state, skip_output_upcast
from runner.distributed.engagement import EngagementError, check_engaged, check_in_sync
from runner.distributed.strategies import build_strategy
from runner.config.spec import ModelSpec, OffloadDevice, OptimSpec, PrecisionKind, PrecisionSpec, RunSpec, StrategyKind, StrategySpec

SUPPORTED_HERE = [PrecisionKind.fp32, PrecisionKind.bf16] + ([PrecisionKind.fp16] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


@pytest.fixture
def tf32_flags():
    """torch's TF32 switches are process-wide: put them back after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_a_fake_gpu() -> None:
    """Make Accelerate's state see a CUDA device: AcceleratorState copies PartialState's
    `device`, and its TF32 branch asks only that device's type."""
    PartialState(cpu=True)
    PartialState._shared_state["device"] = torch.device("cuda")


def test_compile_in_fp32_keeps_tf32_off(tf32_flags):
    """model.compile=true in fp32: Accelerate turns TF32 matmuls on when a dynamo backend is
    set on a GPU (reproduced first with a bare Accelerator). runner compiles the layers
    itself and gives Accelerate no backend, and its build keeps both TF32 switches off
    whatever Accelerate did, so fp32 stays fp32."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
    on_a_fake_gpu()
    Accelerator(cpu=True, dynamo_backend="inductor")
    assert torch.backends.cuda.matmul.allow_tf32 is True  # what Accelerate does by itself
    reset_accelerate_state()
    torch.backends.cuda.matmul.allow_tf32 = False
    on_a_fake_gpu()
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
    assert accelerator.device.type == "cuda" and accelerator.state.dynamo_plugin.backend.value == "NO"
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False


@pytest.mark.parametrize("precision", SUPPORTED_HERE, ids=lambda p: p.value)
def test_requested_dtype_is_in_effect_inside_forward(precision):
    """A matmul inside the forward runs in the dtype the spec asked for."""
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec(kind=precision)), grad_accum_steps=1, max_grad_norm=1.0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=100))
    seen = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    model = accelerator.prepare(model)
    model(input_ids=torch.randint(0, 100, (2, 8), device=accelerator.device))
    expected = {PrecisionKind.fp32: torch.float32, PrecisionKind.bf16: torch.bfloat16, PrecisionKind.fp16: torch.float16}
    assert seen == [expected[precision]]
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), fused=True))
    spec = RunSpec(precision=PrecisionSpec(kind=precision))
    assert check_engaged(accelerator, model, optimizer, spec, planned_world_size=1) == "AdamW (fused)"


def test_bf16_keeps_autocast_but_not_the_fp32_copy_of_the_logits():
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec(kind=PrecisionKind.bf16)), grad_accum_steps=1, max_grad_norm=1.0)
    model = accelerator.prepare(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=100)))
    ids = torch.randint(0, 100, (2, 8))
    model.eval()  # no dropout: the two losses must match
    before = model(input_ids=ids, labels=ids)
    assert before.logits.dtype == torch.float32  # Accelerate's wrapper upcasts every output
    assert skip_output_upcast(accelerator, model) is True
    after = model(input_ids=ids, labels=ids)
    assert after.logits.dtype == torch.bfloat16  # still under autocast, no copy
    assert after.loss.dtype == torch.float32 and after.loss.item() == pytest.approx(before.loss.item(), rel=1e-6)
    after.loss.backward()
    assert skip_output_upcast(accelerator, model) is False  # already gone: a no-op


def test_output_upcast_is_left_alone_in_fp32():
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
    model = accelerator.prepare(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=100)))
    assert skip_output_upcast(accelerator, model) is False


def prepared_linear(accelerator, fused=True):
    model = torch.nn.Linear(2, 2)
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), fused=fused))


def test_engagement_check_compares_with_the_launchers_plan():
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
    model, optimizer = prepared_linear(accelerator)
    spec = RunSpec()
    assert check_engaged(accelerator, model, optimizer, spec, planned_world_size=1) == "AdamW (fused)"
    with pytest.raises(EngagementError, match="world size is 1, the launcher planned 2"):
        check_engaged(accelerator, model, optimizer, spec, planned_world_size=2)
    with pytest.raises(EngagementError, match="DeepSpeed ZeRO-3"):
        check_engaged(accelerator, model, optimizer, RunSpec(strategy=StrategySpec(kind=StrategyKind.zero3)), 1)
    with pytest.raises(EngagementError, match="mixed precision is no, expected bf16"):
        check_engaged(accelerator, model, optimizer, RunSpec(precision=PrecisionSpec(kind=PrecisionKind.bf16)), 1)
    with pytest.raises(EngagementError, match="optimizer in use is AdamW \\(fused\\), expected AdamW \\(foreach\\)"):
        check_engaged(accelerator, model, optimizer, RunSpec(optim=OptimSpec(fused=False)), 1)
    with pytest.raises(EngagementError, match="model.compile=true but no layer of the model is compiled"):
        check_engaged(accelerator, model, optimizer, RunSpec(model=ModelSpec(compile=True)), 1)


def test_an_outer_accelerate_launch_overriding_accumulation_is_caught(monkeypatch):
    """Accelerate lets ACCELERATE_GRADIENT_ACCUMULATION_STEPS win over the value runner passes."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
    assert accelerator.gradient_accumulation_steps == 4  # the library behaviour the check guards against
    model, optimizer = prepared_linear(accelerator)
    with pytest.raises(EngagementError, match="gradient accumulation is 4 steps, expected 1"):
        check_engaged(accelerator, model, optimizer, RunSpec(), planned_world_size=1)


def test_deepspeed_swaps_the_optimizer_under_offload():
    zero2 = StrategySpec(kind=StrategyKind.zero2)
    assert build_strategy(zero2, PrecisionSpec()).expected_optimizer(fused=True) == "AdamW (fused)"
    zero2.offload_optimizer = OffloadDevice.cpu
    assert build_strategy(zero2, PrecisionSpec()).expected_optimizer(fused=True) == "DeepSpeedCPUAdam"


def test_rank_sync_check():
    check_in_sync([1.0, 1.0])
    with pytest.raises(EngagementError, match="different parameters"):
        check_in_sync([1.0, 1.5])


def test_rank_fingerprint_sums_what_a_rank_holds_whole_and_the_shards_of_the_rest():
    """rank_fingerprints gathers nothing: a parameter held whole adds its own sum (a
    drifted replica shows), a sharded one the sum of its shards (all-reduced over the
    ranks; one rank here). Summed in float64, without a float64 copy."""
    from types import SimpleNamespace

    from runner.distributed.engagement import rank_fingerprints

    whole = torch.tensor([1.0, 2.0])
    shard = torch.tensor([0.25, 0.5])
    both = (torch.tensor([100.0]), torch.tensor([3.0]))  # held whole too: the whole copy counts, not the shard
    strategy = SimpleNamespace(parameter_pieces=lambda model: iter([(None, whole), (shard, None), both]))
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)
    assert rank_fingerprints(accelerator, None, strategy) == [3.0 + 0.75 + 3.0]


def test_unwrap_leaves_torch_compile_over_ddp_intact():
    """Accelerate's unwrap_model re-points a compiled wrapper at the bare model, which drops
    DDP from the model being trained (seen as 'expected DistributedDataParallel, got
    OptimizedModule' and ranks drifting apart). runner's unwrap leaves it whole."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from runner.distributed.accelerator import unwrap

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        accelerator = build_accelerator(build_strategy(StrategySpec(), PrecisionSpec()), grad_accum_steps=1, max_grad_norm=1.0)
        bare = torch.nn.Linear(2, 2)
        compiled = torch.compile(DistributedDataParallel(bare))  # what Accelerate's dynamo_backend builds under DDP
        assert unwrap(accelerator, compiled) is bare
        assert isinstance(compiled._orig_mod, DistributedDataParallel)
        accelerator.unwrap_model(compiled)  # the library's default
        assert compiled._orig_mod is bare  # DDP is gone from the live model: why runner never calls it so
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- DeepSpeed config (a GPU spec, built on CPU)
def _values(node):
    for value in node.values():
        yield from _values(value) if isinstance(value, dict) else [value]


def _engine_config(strategy, precision, max_grad_norm, monkeypatch, world_size=8, per_device=4, accum=2, hidden_size=None):
    """What a DeepSpeed engine on `world_size` GPUs would read: our config through
    Accelerate's plugin, its mixed-precision step, its prepare()-time filling of
    "auto" values (the same keyword arguments Accelerate 1.15 passes), then
    DeepSpeed's own parser with the world size monkeypatched."""
    import deepspeed.runtime.config as ds_config

    from runner.distributed.deepspeed import deepspeed_config, deepspeed_plugin
    from runner.distributed.strategy import MIXED_PRECISION

    plugin = deepspeed_plugin(deepspeed_config(strategy, precision, accum, max_grad_norm, per_device, world_size, hidden_size))
    plugin.set_mixed_precision(MIXED_PRECISION[precision.kind])
    plugin.deepspeed_config_process(
        must_match=False,
        gradient_clipping=1.0,  # Accelerate's fill-in for an "auto" clipping value
        train_micro_batch_size_per_gpu=per_device,
        train_batch_size=per_device * accum * world_size,
        **{"zero_optimization.stage3_gather_16bit_weights_on_model_save": False},
    )
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world_size)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    return plugin.deepspeed_config, ds_config.DeepSpeedConfig(plugin.deepspeed_config)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
@pytest.mark.parametrize("kind", [StrategyKind.zero2, StrategyKind.zero3], ids=lambda k: k.value)
def test_zero_clips_exactly_as_asked_and_leaves_nothing_auto(kind, max_grad_norm, monkeypatch):
    raw, parsed = _engine_config(StrategySpec(kind=kind), PrecisionSpec(kind=PrecisionKind.bf16), max_grad_norm, monkeypatch)
    assert "auto" not in list(_values(raw))
    assert parsed.gradient_clipping == max_grad_norm  # 0 means no clipping, as under ddp
    assert parsed.zero_optimization_stage == {StrategyKind.zero2: 2, StrategyKind.zero3: 3}[kind]
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps, parsed.train_batch_size) == (4, 2, 64)


@pytest.mark.parametrize("precision", list(PrecisionKind), ids=lambda p: p.value)
def test_zero_precision_sections(precision, monkeypatch):
    raw, parsed = _engine_config(StrategySpec(kind=StrategyKind.zero2), PrecisionSpec(kind=precision), 1.0, monkeypatch)
    assert parsed.float16_config.enabled is (precision is PrecisionKind.fp16)
    assert parsed.bfloat16_config.enabled is (precision is PrecisionKind.bf16)
    if precision is PrecisionKind.fp16:
        # Dynamic scaling like torch's GradScaler under ddp: 2**16, halve per overflow, grow after 2000.
        fp16 = parsed.float16_config
        assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis) == (0.0, 16, 2000, 1)


def test_zero3_offload_and_16bit_gather_reach_deepspeed(monkeypatch):
    from runner.config.spec import OffloadDevice

    strategy = StrategySpec(kind=StrategyKind.zero3, offload_optimizer=OffloadDevice.cpu, offload_params=OffloadDevice.cpu)
    _, parsed = _engine_config(strategy, PrecisionSpec(kind=PrecisionKind.fp16), 1.0, monkeypatch)
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert parsed.zero_config.offload_param.device == "cpu"
    assert parsed.zero_config.gather_16bit_weights_on_model_save is True  # Accelerate's False fill-in did not win
    _, plain = _engine_config(StrategySpec(kind=StrategyKind.zero2), PrecisionSpec(), 1.0, monkeypatch)
    assert plain.zero_config.offload_optimizer is None or plain.zero_config.offload_optimizer.device == "none"
    assert plain.zero_config.offload_param is None


def test_zero3_buckets_and_residency_are_sized_from_the_model(monkeypatch):
    """GPT-2 small (hidden 768) on a CPU: Accelerate's "auto" rule, not DeepSpeed's
    billion-scale defaults, and no more than a prefetch bucket of gathered parameters
    kept live."""
    h = 768
    _, parsed = _engine_config(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec(), 1.0, monkeypatch, hidden_size=h)
    zero = parsed.zero_config
    assert zero.reduce_bucket_size == h * h == 589_824
    assert zero.prefetch_bucket_size == int(0.9 * h * h) == 530_841
    assert zero.param_persistence_threshold == 10 * h
    assert zero.max_live_parameters == 530_841  # DeepSpeed's default: 1e9, the whole model
    assert zero.max_reuse_distance == 530_841  # DeepSpeed's default: 1e9, the whole model gathered after forward


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
def test_zero3_prefetches_the_next_layer_on_a_gpu_only(cuda, monkeypatch):
    """The device decides ZeRO-3's residency (build_accelerator reads torch.cuda, mocked
    here; Accelerator() is replaced by a recorder of its arguments, and DeepSpeed's own
    parser reads the config). On a CPU the small sizes stay: 0.9 h², less than a layer.
    On a GPU the prefetch bucket holds the next transformer layer, counted on the model
    (GPT-2 small's: 12 h² + 13 h), and the live parameters the current one plus it."""
    import deepspeed.runtime.config as ds_config

    import runner.distributed.accelerator as accelerator_module
    from runner.components.model import layer_parameters

    h = 768
    with torch.device("meta"):
        gpt2_small = GPT2LMHeadModel(GPT2Config(n_embd=h, n_layer=2, n_head=12))
    layer = layer_parameters(gpt2_small)
    assert layer == 12 * h * h + 13 * h == 7_087_872  # weights 12 h², biases and norms 13 h
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    recorded = {}
    monkeypatch.setattr(accelerator_module, "Accelerator", lambda **kwargs: recorded.update(kwargs))
    strategy = build_strategy(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec(kind=PrecisionKind.bf16))
    build_accelerator(strategy, grad_accum_steps=1, max_grad_norm=1.0, per_device_batch_size=4, hidden_size=h,
                      layer_parameters=layer)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    zero = ds_config.DeepSpeedConfig(recorded["deepspeed_plugin"].deepspeed_config).zero_config
    assert zero.reduce_bucket_size == h * h and zero.param_persistence_threshold == 10 * h  # either device
    if not cuda:
        assert zero.prefetch_bucket_size == zero.max_live_parameters == zero.max_reuse_distance == 530_841
        assert zero.prefetch_bucket_size < layer  # no room for a layer: nothing to overlap on gloo anyway
        return
    assert zero.prefetch_bucket_size == layer >= 12 * h * h  # the next layer, prefetched whole
    assert zero.max_live_parameters == 2 * layer == 14_175_744  # the layer computing + the one prefetched
    assert zero.max_live_parameters >= zero.prefetch_bucket_size + layer
    assert zero.max_reuse_distance == layer


def test_zero3_gpu_prefetch_without_a_layer_count_is_gpt2s_layer():
    from runner.distributed.deepspeed import zero_sizes

    sizes = zero_sizes(3, 1024, cuda=True)
    assert sizes["stage3_prefetch_bucket_size"] == 12 * 1024 * 1024  # GPT-2's layer weights, 12 h²
    assert sizes["stage3_max_live_parameters"] == 2 * 12 * 1024 * 1024
    assert zero_sizes(2, 1024, cuda=True) == zero_sizes(2, 1024) == {"reduce_bucket_size": 1024 * 1024}


def test_zero2_gets_the_model_sized_reduce_bucket_and_no_zero3_keys(monkeypatch):
    raw, parsed = _engine_config(StrategySpec(kind=StrategyKind.zero2), PrecisionSpec(), 1.0, monkeypatch, hidden_size=64)
    assert parsed.zero_config.reduce_bucket_size == 4096
    assert not any(key.startswith("stage3_") for key in raw["zero_optimization"])
    _, unsized = _engine_config(StrategySpec(kind=StrategyKind.zero2), PrecisionSpec(), 1.0, monkeypatch)
    assert unsized.zero_config.reduce_bucket_size == 500_000_000  # no width known: DeepSpeed's own default


@pytest.mark.parametrize("cuda", [True, False])
def test_batches_reach_a_gpu_without_blocking_the_host(cuda):
    """The prepared loader copies with non_blocking=True on a GPU (Accelerate's
    DataLoaderShard passes its flag to send_to_device); on a CPU there is nothing to overlap."""
    from accelerate import Accelerator

    from runner.distributed.accelerator import dataloader_config

    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config(cuda))
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=4))
    assert loader._non_blocking is cuda


def _zero3_engine(precision=PrecisionKind.fp32):
    """A real one-rank ZeRO-3 engine over the micro GPT-2, prepared as the worker does
    (runner's optimizer with its two groups, the strategy's after_prepare)."""
    from runner.components.optim import build_optimizer

    strategy = build_strategy(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec(kind=precision))
    accelerator = build_accelerator(strategy, grad_accum_steps=1, max_grad_norm=0.0, per_device_batch_size=2,
                                    hidden_size=32)
    model = _micro_gpt2()
    optimizer = build_optimizer(OptimSpec(fused=False), model, 1e-2)
    strategy.before_prepare(model, accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    strategy.after_prepare(accelerator, model)
    return strategy, accelerator, model, optimizer


def _zero3_step(strategy, accelerator, model, optimizer, seed):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed))
    with accelerator.accumulate(model):
        strategy.backward(accelerator, model(input_ids=ids, labels=ids).loss)
        strategy.optimizer_step(accelerator, optimizer)


def test_zero3_fp32_master_shares_the_working_partition_through_training_save_and_load(one_rank_group, tmp_path):
    """A real ZeRO-3 engine in fp32 (one rank, gloo): DeepSpeed keeps a second fp32 copy
    of each partition (its `tensor.device == "cpu"` check is never true); runner points
    the optimizer's master at the working partition. They must stay one storage through
    optimizer steps, Accelerate's save_state and load_state, and after the load hold the
    saved values, with training continuing exactly as from the saved state."""
    from runner.distributed.zero_patches import share_zero3_fp32_master

    strategy, accelerator, model, optimizer = _zero3_engine()
    zero = model.optimizer
    assert share_zero3_fp32_master(model) == 0  # after_prepare shared them already: nothing left to share

    def shared() -> list[bool]:  # per parameter group: master and working partition are one storage
        return [m.data_ptr() == w.data_ptr() for m, w in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat)]

    assert len(zero.fp32_partitioned_groups_flat) == 2  # runner's decay and no-decay groups
    assert shared() == [True, True]
    _zero3_step(strategy, accelerator, model, optimizer, seed=1)
    assert shared() == [True, True]
    saved = [t.clone() for t in zero.fp32_partitioned_groups_flat]
    accelerator.save_state(str(tmp_path / "ckpt"))
    _zero3_step(strategy, accelerator, model, optimizer, seed=2)
    after_save = [t.clone() for t in zero.fp32_partitioned_groups_flat]
    assert not all(torch.equal(a, b) for a, b in zip(saved, after_save))  # the step moved the weights
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert shared() == [True, True]
    for master, working, value in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, saved):
        assert torch.equal(master, value) and torch.equal(working, value)  # the loaded values, in both
    _zero3_step(strategy, accelerator, model, optimizer, seed=2)  # the same step again, from the loaded state
    assert shared() == [True, True]
    for got, expected in zip(zero.fp32_partitioned_groups_flat, after_save):
        assert torch.equal(got, expected)


def test_zero3_master_is_not_shared_unless_it_is_a_true_copy(one_rank_group):
    """On real engines: a bf16 engine's fp32 master is no copy of its bf16 partition, and
    an fp32 master whose values differ from the working partition is never shared."""
    from runner.distributed.zero_patches import share_zero3_fp32_master

    _, _, bf16, _ = _zero3_engine(PrecisionKind.bf16)
    zero = bf16.optimizer
    assert {t.dtype for t in zero.fp16_partitioned_groups_flat} == {torch.bfloat16}
    assert share_zero3_fp32_master(bf16) == 0
    assert all(m.data_ptr() != w.data_ptr() for m, w in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat))
    reset_accelerate_state()

    from deepspeed.runtime.zero import stage3

    # An fp32 engine as DeepSpeed leaves it (after_prepare not run), its master moved off the working values.
    strategy = build_strategy(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec())
    accelerator = build_accelerator(strategy, grad_accum_steps=1, max_grad_norm=0.0, per_device_batch_size=2, hidden_size=32)
    model = _micro_gpt2()
    engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    zero = engine.optimizer
    assert isinstance(zero, stage3.DeepSpeedZeroOptimizer_Stage3)
    master, working = zero.fp32_partitioned_groups_flat[0], zero.fp16_partitioned_groups_flat[0]
    assert master.data_ptr() != working.data_ptr() and torch.equal(master, working)  # DeepSpeed's second copy
    original = master.detach().clone()
    master.data[0] += 1
    assert share_zero3_fp32_master(engine) == 0 and master.data_ptr() != working.data_ptr()
    master.data.copy_(original)
    assert share_zero3_fp32_master(engine) == master.numel() * 4 and master.data_ptr() == working.data_ptr()


def test_reset_forgets_deepspeeds_cached_world_group(monkeypatch):
    """A one-process ZeRO sweep runs its jobs in one process: the clone of the world group
    DeepSpeed caches must not outlive the job whose process group it cloned (the second
    job failed with "Group ... is not registered")."""
    groups = pytest.importorskip("deepspeed.utils.groups")
    monkeypatch.setattr(groups, "_WORLD_GROUP", object())
    reset_accelerate_state()
    assert groups._WORLD_GROUP is None


def test_grad_norm_never_copies_a_whole_gradient_to_float64():
    """The exact norm must not cost a float64 copy of the largest gradient at the step's
    memory peak (295 MB for GPT-2's embedding): at most one chunk is cast at a time."""
    from torch.profiler import ProfilerActivity, profile

    from runner.distributed.grad_norm import NORM_CHUNK_ELEMENTS, grad_norm

    g = torch.randn(3 * NORM_CHUNK_ELEMENTS + 5, generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        norm = grad_norm([g])
    largest = max(e.cpu_memory_usage for e in prof.events())  # bytes one op allocated and kept
    assert largest <= 8 * NORM_CHUNK_ELEMENTS  # one float64 chunk; the whole would be 3x that
    assert float(norm) == pytest.approx(float(g.double().norm()), rel=1e-13)


def test_grad_norm_squares_each_chunk_in_its_buffer_and_allocates_no_other_chunk():
    """Each chunk is cast into the one float64 buffer, squared there and summed: a
    product per chunk would be a second chunk-sized tensor to write and read back on
    every chunk of every step. The gradients themselves are never squared. (Why the
    square and sum rather than vector_norm is speed, measured by bench/grad_norm.py and
    bench/step_phases.py, not asserted here.)"""
    from torch.profiler import ProfilerActivity, profile

    from runner.distributed.grad_norm import NORM_CHUNK_ELEMENTS, grad_norm

    g = torch.randn(3 * NORM_CHUNK_ELEMENTS + 5, generator=torch.Generator().manual_seed(1))
    before = g.clone()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        norm = grad_norm([g, g[:7]])
    chunk_sized = [e.name for e in prof.events() if e.cpu_memory_usage >= 4 * NORM_CHUNK_ELEMENTS]
    assert chunk_sized == ["aten::empty"]  # the buffer, once
    assert torch.equal(g, before)
    assert float(norm) == pytest.approx(float(torch.cat([g, g[:7]]).double().norm()), rel=1e-13)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_grad_norm_is_exact_on_a_large_cpu_gradient(max_grad_norm):
    """torch's float32 L2 norm on a CPU drops small squares on a large tensor (GPT-2's
    embedding gradient read 3.6e-5 low, which made fsdp's norm over two half shards
    disagree with one process's). The logged norm, and the one clipping divides by, is
    the norm of the gradient held: float64 accumulation, to 1e-12."""
    strategy = build_strategy(StrategySpec(kind=StrategyKind.ddp), PrecisionSpec(kind=PrecisionKind.fp32))
    accelerator = build_accelerator(strategy, grad_accum_steps=1, max_grad_norm=max_grad_norm)
    model = torch.nn.Linear(1000, 4000)  # 4M weights, as big as a small model's embedding
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) / 1000
    grads = [p.grad.clone() for p in model.parameters()]
    exact = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    assert abs(float(torch.nn.utils.get_total_norm(grads)) / float(exact) - 1) > 1e-5  # the library's error, here
    norm = strategy.grad_norm(accelerator, model, max_grad_norm)
    assert float(norm) == pytest.approx(float(exact), rel=1e-12)
    scale = min(1.0, max_grad_norm / (float(exact) + 1e-6)) if max_grad_norm else 1.0
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, g * scale, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- ZeRO-3's gradient partition between steps
def _micro_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def test_zero3_frees_its_gradient_partition_between_steps_and_still_accumulates_exactly(one_rank_group):
    """DeepSpeed keeps ZeRO-3's fp32 gradient partition for the whole run; runner frees it
    after each optimizer step, the next backward writes its reduced gradients to tensors
    of their own, and its epilogue reallocates the partition and moves them in. Two
    windows of two micro-batches give the gradient norm plain torch computes for each
    window, so nothing stale, unmoved or half-zeroed survives the release."""
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    reference = _micro_gpt2()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_norms = []
    for window in (batches[:2], batches[2:]):
        for ids in window:
            (reference(input_ids=ids, labels=ids).loss / 2).backward()
        ref_norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters())).item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    strategy = build_strategy(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec())
    accelerator = build_accelerator(strategy, grad_accum_steps=2,
                                    max_grad_norm=0.0, per_device_batch_size=2, hidden_size=32)
    model = _micro_gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    flat = model.optimizer.grad_partitions_flat_buffer
    write = model.optimizer.partition_grads
    writes: list[list[int]] = []  # the partition's bytes at each write of reduced gradients, per micro-batch

    def recording(*args, **kwargs):
        writes[-1].append(flat.untyped_storage().nbytes())
        return write(*args, **kwargs)

    model.optimizer.partition_grads = recording
    norms, held, outside = [], [], []
    for ids in batches:
        writes.append([])
        with accelerator.accumulate(model):
            strategy.backward(accelerator, model(input_ids=ids, labels=ids).loss)
            held.append(flat.untyped_storage().nbytes())
            # what DeepSpeed's step reads: views of the partition, no staged tensor kept alive
            outside.append(sum(g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
                               for grads in model.optimizer.averaged_gradients.values() for g in grads))
            if accelerator.sync_gradients:
                norms.append(float(strategy.grad_norm(accelerator, model, 0.0)))
                strategy.optimizer_step(accelerator, optimizer)
                held.append(flat.untyped_storage().nbytes())
    size = flat.numel() * flat.element_size()
    # allocated through each window, freed after each step
    assert held == [size, size, 0, size, size, 0]
    assert outside == [0, 0, 0, 0]
    # DeepSpeed's partition until the first step; after it, the window's first backward
    # writes with the partition still free (reallocated by its epilogue), the second adds into it
    assert [set(w) for w in writes] == [{size}, {size}, {0}, {size}] and len(writes[2]) > 1
    assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_zero3_work_on_one_rank_alone_starts_no_collective(one_rank_group):
    """Accelerate registers the ZeRO-3 config process-wide for transformers and peft: a
    model built then (peft.save_merged's base, read again on rank 0 alone) would be
    partitioned by deepspeed.zero.Init, a broadcast per parameter that the other ranks
    never join (the run hung). Inside strategy.alone it is an ordinary model; after it
    the engine's config is registered again."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    def build():  # as runner builds a model (runner/components/model.py build_model)
        config = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=100)
        return AutoModelForCausalLM.from_config(config)

    strategy = build_strategy(StrategySpec(kind=StrategyKind.zero3), PrecisionSpec())
    accelerator = build_accelerator(strategy, grad_accum_steps=1, max_grad_norm=0.0, per_device_batch_size=2, hidden_size=32)
    assert is_deepspeed_zero3_enabled()
    partitioned = build()
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in partitioned.parameters())  # what rank 0 built before
    with strategy.alone(accelerator):
        assert not is_deepspeed_zero3_enabled()
        alone = build()
    assert not any(hasattr(p, "ds_id") for p in alone.parameters()) and all(p.numel() > 0 for p in alone.parameters())
    assert is_deepspeed_zero3_enabled()  # the engine's config back
