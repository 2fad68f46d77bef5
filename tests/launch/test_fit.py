"""Will it fit: the budget a rank has, the peak each strategy needs, the largest micro-batch
that keeps the global batch, and the one-line refusal."""

import pytest
from transformers import GPT2Config

from runner.config.errors import UserError
from runner.launch import fit
from runner.launch.memory_estimate import MemoryEstimate, with_activations

TINY = ["recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=64,n_layer=2,n_head=4,n_positions=128'"]


def test_device_memory_names_a_gpu_or_a_size():
    assert fit.parse_device_memory("A40") == (44.4 * 2**30, True)
    assert fit.parse_device_memory("h100") == (79.2 * 2**30, True)
    assert fit.parse_device_memory("A100-40GB") == (39.4 * 2**30, True)
    assert fit.parse_device_memory("80GB") == (80e9, False)
    assert fit.parse_device_memory("48GiB") == (48 * 2**30, False)
    assert fit.parse_device_memory("24") == (24 * 2**30, False)  # no unit: GiB
    with pytest.raises(UserError, match="neither a GPU .* nor a size such as 80GB"):
        fit.parse_device_memory("A4O")


def test_the_budget_is_the_named_gpu_less_its_reserve(compose_spec):
    spec = compose_spec(*TINY, "launch.device_memory=A40", "launch.nproc_per_node=8")
    room = fit.budget(spec, 8)
    assert room.gpu and room.bytes_per_rank == 44.4 * 2**30 - fit.GPU_RESERVE_BYTES
    assert room.described.startswith("8 x A40 (44.4 GiB each")


def test_without_a_name_the_budget_is_this_machines_gpu(compose_spec, monkeypatch):
    """Contract for a GPU node: the smallest visible GPU, queried through torch.cuda."""
    import torch

    class Props:
        def __init__(self, total):
            self.total_memory = total

    sizes = [80 * 2**30, 40 * 2**30]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(sizes[i]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    room = fit.budget(compose_spec(*TINY), 2)
    assert room.gpu and room.bytes_per_rank == 40 * 2**30 - fit.GPU_RESERVE_BYTES
    assert "NVIDIA A100" in room.described


def test_on_a_cpu_the_ranks_share_the_host_memory_available(compose_spec, monkeypatch):
    monkeypatch.setattr(fit, "_host_available", lambda: 12 * 2**30)
    room = fit.budget(compose_spec(*TINY, "launch.nproc_per_node=2"), 2)
    assert not room.gpu and room.bytes_per_rank == 6 * 2**30


class Trace:
    """A traced micro-batch by hand: activations rise to 100 then fall as gradients (of 4-byte
    parameters) arrive, up to 40."""

    grad_bytes = 4
    largest_parameter = 5  # 20 bytes of gradient
    samples = ((50, 0), (100, 0), (80, 10), (40, 30), (0, 40))

    def peak_with_gradients(self, share, unreduced=0.0):
        return max(a + share * g + min(g, unreduced) for a, g in self.samples)


STATES = MemoryEstimate(params=400.0, grads=40.0, optimizer=800.0, offloaded=0.0, buffers=40.0)


def test_each_strategy_holds_its_own_gradients_beside_the_activations():
    ddp = with_activations(STATES, Trace(), "ddp", 2)
    assert ddp.activations == 100 and ddp.device_total == 400 + 800 + 40 + 100  # 80 + 10 < 100
    # an fp32 gradient shard per rank as backward leaves each layer
    fsdp = with_activations(STATES, Trace(), "fsdp", 2)
    assert fsdp.activations == 100 and fsdp.grads_at_rest == 0
    zero2 = with_activations(STATES, Trace(), "zero2", 2)
    assert zero2.device_total == 400 + 800 + 40 + 40 + 100  # its gradient partition stays
    zero3 = with_activations(STATES, Trace(), "zero3", 2)
    # runner's deferred partition is allocated after backward
    assert zero3.device_total == 400 + 800 + 40 + 100
    # accumulation: the window's first micro-batch left every gradient in place
    accumulating = with_activations(STATES, Trace(), "ddp", 2, grad_accum_steps=4)
    assert accumulating.device_total == 400 + 800 + 40 + 40 + 100
    # the optimizer step (every gradient, no activation) is the peak when activations are small
    small = with_activations(MemoryEstimate(400.0, 500.0, 800.0, 0.0, 40.0), Trace(), "fsdp", 2)
    assert small.device_total == 400 + 800 + 40 + 500


def test_ddps_gradients_count_when_they_outlast_the_activations():
    class Late(Trace):
        samples = ((100, 0), (90, 40))

    assert with_activations(STATES, Late(), "ddp", 2).activations == 130
    # sharded: the largest parameter's gradient (20 bytes) waits at full size for its reduction
    assert with_activations(STATES, Late(), "zero3", 2).activations == 90 + 20
    assert with_activations(STATES, Late(), "fsdp", 2).activations == 90 + 40 / 2 + 20


@pytest.fixture
def planner(compose_spec):
    spec = compose_spec(*TINY, "train.per_device_batch_size=8", "train.grad_accum_steps=6")
    return fit.Planner(spec, 128, 1)


def test_the_largest_micro_batch_is_the_largest_divisor_that_fits(planner):
    peaks = {b: planner.estimate("ddp", b, 48 // b).device_total for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)}
    assert list(peaks.values()) == sorted(peaks.values())  # a bigger micro-batch never needs less
    limit = (peaks[6] + peaks[8]) / 2
    assert planner.largest_micro_batch("ddp", 48, limit) == 6
    assert planner.largest_micro_batch("ddp", 48, peaks[48]) == 48
    assert planner.largest_micro_batch("ddp", 48, peaks[1] - 1) is None


def test_a_run_that_does_not_fit_is_refused_in_one_line_naming_what_fits(planner):
    room = fit.Budget(planner.estimate("ddp", 4, 12).device_total, "1 x test", True)
    with pytest.raises(UserError) as refused:
        fit.check_fit(planner.spec, planner, room)
    message = refused.value.render()
    assert "predicted not to fit" in message and "\n" not in message.strip()
    assert "train.per_device_batch_size=4 train.grad_accum_steps=12 keeps the global batch 48" in message
    assert "launch.check_fit=false" in message
    planner.spec.launch.check_fit = False
    fit.check_fit(planner.spec, planner, room)  # the override starts it


def test_a_run_that_fits_passes(planner):
    fit.check_fit(planner.spec, planner, fit.Budget(planner.estimate("ddp").device_total, "1 x test", True))


def test_nothing_fits_names_the_other_ways_out(planner):
    with pytest.raises(UserError, match="no micro-batch fits: choose a sharding strategy"):
        fit.check_fit(planner.spec, planner, fit.Budget(1.0, "1 x test", True))


def test_the_verdict_names_each_strategy_its_headroom_and_largest_micro_batch(compose_spec):
    """GPT-2 small (124M) at block 1024, global batch 64, on 8 x A40 in bf16."""
    spec = compose_spec("recipe=gpt2_clm_tiny", "model.config_overrides=null", "launch.device_memory=A40",
                        "launch.nproc_per_node=8", "precision=bf16", "train.per_device_batch_size=8")
    room = fit.budget(spec, 8)
    planner = fit.Planner(spec, 1024, 8, gpu=room.gpu)
    lines = fit.verdict_lines(planner, ("ddp", "zero2", "zero3", "fsdp"), room)
    assert lines[0] == "  fits on 8 x A40 (44.4 GiB each, 42.9 GiB usable)? per rank, global batch 64 kept:"
    assert [line.split()[0] for line in lines[1:]] == ["ddp", "zero2", "zero3", "fsdp"]
    assert all("fits, " in line and "GiB headroom" in line and "largest micro-batch 8 x 1 accumulation" in line
               for line in lines[1:])
    ddp, zero3 = planner.estimate("ddp"), planner.estimate("zero3")
    assert zero3.device_total < ddp.device_total
    assert ddp.activations > 4 * 2**30  # 8 x 1024 tokens of fp32 logits over 50,257 words alone are 1.6 GB


def test_a_model_the_trace_cannot_run_still_starts_with_a_note(planner, monkeypatch, capsys):
    def cannot(*args, **kwargs):
        raise RuntimeError("an operator fake tensors do not support\nsecond line")

    monkeypatch.setattr(fit, "trace_step", cannot)
    fit.check_fit(planner.spec, planner, fit.Budget(1.0, "1 x test", True))
    assert ("runner: note: no memory plan for this model (RuntimeError: an operator fake tensors do not support); "
            "the run starts unchecked") in capsys.readouterr().err


@pytest.mark.e2e
def test_the_cli_refuses_a_run_that_does_not_fit_before_claiming_its_folder(tmp_path):
    import subprocess
    import sys

    from conftest import MICRO

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "runner", *MICRO, "launch.device_memory=10MiB",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = next(line for line in done.stderr.splitlines() if "predicted not to fit" in line)
    assert line.startswith("runner: error: this run is predicted not to fit: ")
    assert "under ddp at micro-batch 4, 10.0 MiB available on 1 x 10MiB" in line
    assert not run_dir.exists() or not any(run_dir.iterdir())
    started = subprocess.run([sys.executable, "-m", "runner", *MICRO, "launch.device_memory=10MiB",
                              "launch.check_fit=false", "train.max_steps=1", f"hydra.run.dir={run_dir}"],
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr[-2000:]


def test_a_frozen_base_has_no_gradients_or_adam_state_in_the_plan(compose_spec, tmp_path):
    """peft=lora: the base's weights are counted, its gradients and AdamW moments are not
    (nor DDP's bucket copy of them); only the adapters' are."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from runner.launch.fit import Planner

    AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64)).save_pretrained(tmp_path)
    plans = {}
    for peft in ("none", "lora"):
        spec = compose_spec("recipe=gpt2_clm_tiny", f"peft={peft}", f"model.name_or_path={tmp_path}",
                            "train.per_device_batch_size=2", "data.block_size=32")
        plans[peft] = {s: Planner(spec, 32, 2).estimate(s) for s in ("ddp", "zero2", "zero3", "fsdp")}
    # rank 8, A (8 x in) and B (out x 8), on c_attn 64->192, attn.c_proj 64->64, c_fc 64->256, mlp.c_proj 256->64
    adapters = 2 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    for strategy, full in plans["none"].items():
        lora = plans["lora"][strategy]
        shards = 1 if strategy == "ddp" else 2
        assert lora.params - full.params == pytest.approx(4.0 * adapters / (1 if strategy in ("ddp", "zero2") else 2))
        assert lora.optimizer == pytest.approx(8.0 * adapters / shards)
        assert lora.grads == pytest.approx(4.0 * adapters / shards)
        assert lora.device_total < full.device_total
    assert plans["lora"]["ddp"].buffers == pytest.approx(4.0 * adapters)


def moe_planner(compose_spec) -> "fit.Planner":
    """A tiny Mixtral with its router loss on, the chunked loss on (the default)."""
    from runner.certify.architectures import TINY as ARCHITECTURES

    spec = compose_spec("recipe=gpt2_clm_tiny", "model.model_type=mixtral",
                        f"model.config_overrides='{ARCHITECTURES['mixtral']},output_router_logits=True'",
                        "data.block_size=32", "train.per_device_batch_size=4")
    assert spec.model.chunked_loss
    return fit.Planner(spec, 32, 1)


def test_a_mixture_of_experts_with_the_chunked_loss_is_planned(compose_spec, capfd):
    """The chunked loss's probe forward runs through the traceable experts as the step's
    does: the fit check (so dry_run=true and per_device_batch_size=auto) gets a plan."""
    planner = moe_planner(compose_spec)
    fit.check_fit(planner.spec, planner, fit.Budget(2.0**40, "1 x test", True))
    assert capfd.readouterr().err == ""
    assert planner.estimate("ddp").activations > 4 * 32 * 4 * 64  # the micro-batch's hidden states, at least
    assert planner.largest_micro_batch("ddp", 4, 2.0**40) == 4


def test_a_trace_that_fails_is_one_note_without_torchs_traceback(compose_spec, capfd, monkeypatch):
    """Fake tensors log a failing operator's traceback before raising it: the fit check's
    one-line note is all the user sees."""
    import torch

    from runner.components import step_trace

    settings = step_trace.apply_model_settings

    def with_a_failing_operator(spec, model):  # an operator whose fake kernel fails, on any torch
        settings(spec, model)
        model.register_forward_pre_hook(lambda module, args: torch.mm(torch.empty(2, 3), torch.empty(4, 5)))

    monkeypatch.setattr(step_trace, "apply_model_settings", with_a_failing_operator)
    monkeypatch.setattr(fit, "_TRACED", {})  # an earlier test's trace of this model would be kept (_traced)
    planner = moe_planner(compose_spec)
    fit.check_fit(planner.spec, planner, fit.Budget(2.0**40, "1 x test", True))
    err = capfd.readouterr().err
    assert err.startswith("runner: note: no memory plan for this model (RuntimeError: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_preference_run_is_planned_on_its_pairs_two_sequences_each(compose_spec, monkeypatch):
    """The plan, the fit check and the automatic micro-batch trace a preference run's
    micro-batch of pairs as the run scores it (runner/components/step_trace.py)."""
    traced = []
    monkeypatch.setattr(fit, "trace_step", lambda *args, **kwargs: traced.append(kwargs["pairs"]))
    for recipe, pairs in (("gpt2_dpo_tiny", True), ("gpt2_clm_tiny", False)):
        planner = fit.Planner(compose_spec(f"recipe={recipe}"), 32, 1)
        assert planner.pairs is pairs
        planner.trace(4, fit.Numerics.fp32)
    assert traced == [True, False]


def test_a_model_is_traced_once_a_process_whoever_plans_it_again(compose_spec, monkeypatch, tmp_path):
    """A second plan of the same model and micro-batch (a sweep's next job, certify's resume
    leg, another strategy in fp32) reuses the first's trace; another micro-batch, block size
    or width traces anew."""
    traced = []

    def counted(*args, **kwargs):
        traced.append(args[2:4])
        return f"trace {len(traced)}"

    monkeypatch.setattr(fit, "trace_step", counted)
    first = compose_spec("recipe=gpt2_clm_tiny")
    plans = [fit.Planner(first, 32, 1).trace(4, fit.Numerics.fp32), fit.Planner(first, 32, 2).trace(4, fit.Numerics.fp32),
             fit.Planner(compose_spec("recipe=gpt2_clm_tiny", "strategy=zero2"), 32, 2).trace(4, fit.Numerics.fp32),
             fit.Planner(first, 32, 1).trace(2, fit.Numerics.fp32), fit.Planner(first, 64, 1).trace(4, fit.Numerics.fp32),
             fit.Planner(compose_spec("recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=32,n_layer=1,n_head=2'"),
                         32, 1).trace(4, fit.Numerics.fp32)]
    assert plans == ["trace 1", "trace 1", "trace 1", "trace 2", "trace 3", "trace 4"]
    assert traced == [(4, 32), (2, 32), (4, 64), (4, 32)]
    # A model folder written again between two plans (a certify work dir reused): its config is read anew.
    folder = tmp_path / "model"
    for width in (32, 48, 48):
        GPT2Config(n_embd=width, n_layer=1, n_head=2, n_positions=64).save_pretrained(folder)
        spec = compose_spec("recipe=gpt2_clm_tiny", f"model.name_or_path={folder}", "model.config_overrides=null")
        plans.append(fit.Planner(spec, 32, 1).trace(4, fit.Numerics.fp32))
    assert plans[-3:] == ["trace 5", "trace 6", "trace 6"]


@pytest.mark.parametrize("strategy, share", [("ddp", 1.0), ("zero2", 1.0), ("zero3", 0.5), ("fsdp", 0.5)])
def test_a_frozen_reference_adds_its_weights_sharded_as_the_policys(compose_spec, strategy, share):
    """preference.reference=frozen holds a second copy of the starting weights: the plan
    grows by its bytes on every rank under ddp and zero2, by 1/world of them under zero3
    and fsdp, and by nothing else (no gradients, optimizer state or buffers of its own)."""
    world = 2
    plans = {}
    for mode in ("precomputed", "frozen"):
        planner = fit.Planner(compose_spec("recipe=gpt2_dpo_tiny", f"preference.reference={mode}"), 32, world)
        plans[mode] = fit.estimate_for(planner.shape, strategy, "fp32", world, frozen_reference=planner.frozen)
    weights = planner.shape.parameters * 4.0  # fp32
    grown = plans["frozen"].device_total - plans["precomputed"].device_total
    assert grown == pytest.approx(weights * share, rel=1e-9), (strategy, grown, weights)
    assert plans["frozen"].states_total - plans["precomputed"].states_total == pytest.approx(grown)
    assert plans["frozen"].params == plans["precomputed"].params and plans["frozen"].buffers == plans["precomputed"].buffers


# Evaluation in the plan: GPT-2's vocabulary at block 256, as issue 46 measured it (920 MB RSS
# at evaluation batch 1, 3,933 MB at 32, for a plan of the training step alone).
EVALUATING = ["recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=64,n_layer=2,n_head=4,n_positions=256'",
              "data.block_size=256", "train.per_device_batch_size=1"]
PLAIN = "model.chunked_loss=false"


def measured_evaluation_peak(spec) -> float:
    """What a trained model holds while it evaluates one batch of
    train.per_device_eval_batch_size x 256 tokens as the run does
    (causal_lm.evaluation_scores, under no gradient): its weights, AdamW's state (a step
    taken, its gradients freed as the trainer's step ends), counted tensor by tensor, and
    the evaluation's live tensor bytes at their most, by the allocator's running total in
    torch profiler's allocation events: bench/tensor_peak's instrument (the CPU's
    torch.cuda.max_memory_allocated)."""
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from runner.components.model import build_config
    from runner.components.objectives.causal_lm import evaluation_scores

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench" / "tensor_peak"))
    import step_peak

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(spec.model))
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 50257, (1, 256))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as the trainer's step ends, before an evaluation
    held = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values())]
    resident = sum(t.nbytes for t in {t.untyped_storage().data_ptr(): t for t in held}.values())
    model.eval()
    ids = torch.randint(0, 50257, (spec.train.per_device_eval_batch_size, 256))
    profile = step_peak.start_profile()  # counts what is allocated from here on
    with torch.profiler.record_function(step_peak.MARKER), torch.no_grad():
        evaluation_scores(model, {"input_ids": ids, "use_cache": False}, ids, None)
    return float(resident + step_peak.peak_in_marker(profile))


def test_an_evaluation_holding_the_whole_logits_is_the_planned_peak(compose_spec):
    """model.chunked_loss=false, evaluation batch 8: the plan's peak is the evaluation's
    (the whole fp32 logits and logsumexp's temporary of their size, 2 x 8 x 256 x 50,257 x 4
    bytes), and within 15% of the measured one: 834.6 MiB planned for 821.9 MiB measured
    (before: 208.3 MiB planned, the training step's alone)."""
    spec = compose_spec(*EVALUATING, PLAIN, "train.per_device_eval_batch_size=8")
    estimate = fit.Planner(spec, 256, 1).estimate("ddp")
    measured = measured_evaluation_peak(spec)
    logits = 8 * 256 * 50257 * 4
    assert measured > 2 * logits  # what the old plan, the training step's alone, left out
    assert estimate.decided_by == "evaluation" and estimate.evaluation_total > 2 * estimate.training_total
    assert estimate.device_total == estimate.evaluation_total
    assert 0.85 < estimate.device_total / measured < 1.15, (estimate.device_total, measured)


def test_a_run_whose_evaluation_does_not_fit_is_refused_naming_the_evaluation_batch(compose_spec):
    """The training step fits, its evaluation does not: refused in one line (exit 2) naming
    evaluation, the evaluation batch that fits and the chunked head; that batch fits."""
    planner = fit.Planner(compose_spec(*EVALUATING, PLAIN, "train.per_device_eval_batch_size=8"), 256, 1)
    estimate = planner.estimate("ddp")
    room = fit.Budget((estimate.training_total + estimate.evaluation_total) / 2, "1 x test", True)
    with pytest.raises(UserError) as refused:
        fit.check_fit(planner.spec, planner, room)
    message = refused.value.render()
    assert "\n" not in message.strip() and "per rank (evaluation) under ddp at micro-batch 1" in message
    largest = int(message.split("train.per_device_eval_batch_size=")[1].split()[0])
    assert 1 <= largest < 8
    assert "or model.chunked_loss=true" in message and "train.per_device_batch_size=" not in message
    assert planner.estimate("ddp", eval_batch=largest).device_total <= room.bytes_per_rank
    assert planner.estimate("ddp", eval_batch=largest + 1).device_total > room.bytes_per_rank


def test_auto_keeps_a_given_evaluation_batch_and_refuses_when_only_it_does_not_fit(compose_spec):
    """train.per_device_batch_size=auto with a given evaluation batch that does not fit at
    any micro-batch (what evaluation holds does not depend on it): refused before any
    probe runs, naming the evaluation batch that fits. Left unset, the evaluation batch
    follows the micro-batch, so the micro-batch chosen is one whose evaluation fits too."""
    from runner.launch import auto_batch

    spec = compose_spec(*EVALUATING, PLAIN, "train.per_device_eval_batch_size=32", "train.per_device_batch_size=auto",
                        "train.global_batch_size=8")
    planner = fit.Planner(spec, 256, 1)
    training = planner.estimate("ddp", 8, 1)
    room = fit.Budget((training.training_total + training.evaluation_total) / 2, "1 x test", True)
    assert planner.largest_micro_batch("ddp", 8, room.bytes_per_rank, evaluation=False) == 8  # the old choice
    assert planner.largest_micro_batch("ddp", 8, room.bytes_per_rank) is None
    probes = []
    with pytest.raises(UserError) as refused:
        auto_batch.choose(spec, planner, room, 1, lambda *args: probes.append(args))
    assert probes == []
    assert "evaluation at batch 32 needs" in refused.value.render()
    assert "train.per_device_eval_batch_size=" in refused.value.render()
    follows = fit.Planner(compose_spec(*EVALUATING, PLAIN), 256, 1)  # the evaluation batch unset
    assert follows.eval_batch(4) == 4
    assert follows.estimate("ddp", 4, 2).evaluation == follows.evaluation(4, fit.Numerics.fp32).peak


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_with_the_chunked_head_evaluating_the_plan_is_unchanged(compose_spec, strategy):
    """The default (model.chunked_loss=true), evaluating at the micro-batch: the plan's
    peak is the training step's, as before evaluation was planned. Its evaluation is not
    traced there, and traced it holds less than the step (a chunk's logits: 1,024 of the
    micro-batch's 4,096 tokens)."""
    from runner.launch.memory_estimate import with_evaluation

    planner = fit.Planner(compose_spec(*EVALUATING, "train.per_device_batch_size=16"), 256, 2)
    estimate = planner.estimate(strategy)
    how = fit.numerics(strategy, "fp32")
    before = with_activations(fit.estimate_for(planner.shape, strategy, "fp32", 2), planner.trace(16, how), strategy, 2)
    assert estimate.device_total == before.device_total and estimate.decided_by == "training step"
    assert estimate.evaluation is None  # not traced
    traced = planner.evaluation(16, how)
    assert traced.chunked and traced.peak < 16 * 256 * 50257 * 4  # less than the whole logits once: a chunk's, twice
    assert with_evaluation(before, traced.peak, strategy).evaluation_total < before.training_total
