"""End to end on CPU: the real entry point trains a micro GPT-2 on the embedded corpus."""

import json
import math
from pathlib import Path

import pytest
import torch

from runner.cli import main

GOLDEN = Path(__file__).parent / "golden" / "micro_losses.json"


def train_run(run_dir: Path, overrides: list[str]) -> list[dict]:
    main([*overrides, f"hydra.run.dir={run_dir}"])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    from conftest import MICRO

    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    return run_dir, train_run(run_dir, MICRO)


@pytest.mark.e2e
def test_loss_falls_and_outputs_exist(micro_run):
    run_dir, metrics = micro_run
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.05
    for name in ("run_spec.yaml", ".hydra/config.yaml", "metrics.jsonl", "train_results.json",
                 "eval_results.json", "all_results.json", "loss_curves.png", "run.log", "model/config.json"):
        assert (run_dir / name).exists(), name
    first = metrics[0]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(first)
    evals = [m for m in metrics if "eval_loss" in m]
    assert [e["step"] for e in evals] == [4, 8]
    assert all({"eval_loss", "perplexity"} <= set(e) for e in evals)


@pytest.mark.e2e
def test_results_use_run_clm_keys(micro_run):
    run_dir, _ = micro_run
    results = json.loads((run_dir / "all_results.json").read_text())
    for key in ("train_loss", "eval_loss", "perplexity", "train_samples_per_second", "train_runtime", "epoch", "eval_samples"):
        assert key in results, key
    assert math.isclose(results["perplexity"], math.exp(results["eval_loss"]), rel_tol=1e-6)
    assert results["train_steps"] == 8 and results["eval_samples"] == 16


@pytest.mark.e2e
def test_saved_model_reloads_and_generates(micro_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = micro_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    assert model.config.n_embd == 32 and model.config.n_layer == 1
    ids = tokenizer("It is a truth", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 5)


@pytest.mark.e2e
def test_saved_model_matches_the_final_eval(micro_run):
    """The weights in model/ are the trained ones: their eval loss equals the reported one."""
    from transformers import AutoModelForCausalLM

    from runner.components.data.prepare import prepare
    from runner.config.spec import load_spec

    run_dir, _ = micro_run
    spec = load_spec(run_dir / "run_spec.yaml")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    from transformers import AutoTokenizer

    data = prepare(spec.data, AutoTokenizer.from_pretrained(run_dir / "model"), 32)
    ids = torch.stack([row["input_ids"] for row in data.validation])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    reported = json.loads((run_dir / "eval_results.json").read_text())["eval_loss"]
    assert loss == pytest.approx(reported, abs=1e-4)


@pytest.mark.e2e
def test_golden_losses(micro_run):
    """Numerics guard: a fixed seed gives these per-step losses (regenerate only on purpose)."""
    _, metrics = micro_run
    losses = [m["loss"] for m in metrics if "loss" in m]
    golden = json.loads(GOLDEN.read_text())
    assert losses == pytest.approx(golden["losses"], abs=1e-4)


@pytest.mark.e2e
def test_rerun_from_frozen_spec_is_bit_identical(micro_run, tmp_path):
    run_dir, metrics = micro_run
    again = tmp_path / "again"
    main(["--spec", str(run_dir / "run_spec.yaml"), "--run-dir", str(again)])
    rerun = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("loss") for m in rerun] == [m.get("loss") for m in metrics]


@pytest.mark.e2e
def test_overwrite_true_replaces_results(micro_run, tmp_path):
    run_dir = tmp_path / "run"
    from conftest import MICRO

    short = [o for o in MICRO if not o.startswith("train.max_steps")] + ["train.max_steps=2", "train.eval_every=0"]
    train_run(run_dir, short)
    metrics = train_run(run_dir, [*short, "overwrite=true"])
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]  # replaced, not appended


@pytest.mark.e2e
def test_accumulation_matches_a_bigger_batch(tmp_path):
    """batch 4 x 2 accumulation == batch 8 x 1, step by step."""
    from conftest import MICRO

    base = [o for o in MICRO if not o.startswith(("train.per_device_batch_size", "train.max_steps", "train.eval_every"))]
    base += ["train.max_steps=4", "train.eval_every=0"]
    big = train_run(tmp_path / "b8", [*base, "train.per_device_batch_size=8"])
    acc = train_run(tmp_path / "b4x2", [*base, "train.per_device_batch_size=4", "train.grad_accum_steps=2"])
    assert [m["loss"] for m in acc if "loss" in m] == pytest.approx([m["loss"] for m in big if "loss" in m], abs=1e-4)


@pytest.mark.e2e
def test_gradient_checkpointing_and_eager_attention_keep_the_numbers(tmp_path):
    """Recomputing activations and another attention kernel change speed/memory, not the math."""
    from conftest import MICRO

    # The first 3 steps do not depend on the schedule's length (2 warmup steps), so a
    # 3-step run must reproduce the golden 8-step run's first 3 losses.
    golden = json.loads(GOLDEN.read_text())["losses"][:3]
    short = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))] + ["train.max_steps=3", "train.eval_every=0"]
    metrics = train_run(tmp_path / "run", [*short, "model.gradient_checkpointing=true", "model.attn_implementation=eager"])
    assert [m["loss"] for m in metrics if "loss" in m] == pytest.approx(golden, abs=1e-4)


@pytest.mark.e2e
def test_torch_compile_trains_and_saves(tmp_path):
    from conftest import MICRO

    short = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))] + ["train.max_steps=3", "train.eval_every=0"]
    metrics = train_run(tmp_path / "run", [*short, "model.compile=true"])
    golden = json.loads(GOLDEN.read_text())["losses"][:3]
    assert [m["loss"] for m in metrics if "loss" in m] == pytest.approx(golden, abs=1e-3)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")  # no torch.compile prefixes in the saved keys


@pytest.mark.e2e
def test_bf16_trains_close_to_fp32_and_saves_fp32_weights(tmp_path):
    """bf16 autocast (with the fp32 copy of the logits dropped, runner/distributed/accelerator.py) follows
    the fp32 losses to bf16's precision, evaluates, and saves full-precision weights."""
    from conftest import MICRO
    from transformers import AutoModelForCausalLM

    short = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))] + ["train.max_steps=3", "train.eval_every=0"]
    metrics = train_run(tmp_path / "run", [*short, "precision=bf16"])
    golden = json.loads(GOLDEN.read_text())["losses"][:3]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses == pytest.approx(golden, abs=0.05) and losses != pytest.approx(golden, abs=1e-6)
    final = [m for m in metrics if "eval_loss" in m][-1]
    assert math.isfinite(final["eval_loss"]) and 0 < final["eval_accuracy"] < 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.e2e
def test_resume_auto_never_overwrites_a_finished_run_without_checkpoints(micro_run, capsys):
    """The micro run saved no checkpoint (train.save_every=0): resume=auto must not start
    fresh over its results."""
    import hashlib

    from conftest import MICRO

    run_dir, _ = micro_run

    def digests() -> dict[str, str]:
        return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = digests()
    assert "all_results.json" in before and not any(name.startswith("checkpoints") for name in before)
    with pytest.raises(SystemExit) as info:
        main([*MICRO, "resume=auto", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "resume=auto found no checkpoint" in err and "overwrite=true" in err and "hydra.run.dir=" in err
    assert "starting fresh" not in err
    assert digests() == before  # every file byte-identical


@pytest.mark.e2e
def test_zero_optimizer_offload_engages_deepspeed_cpu_adam_and_says_so(tmp_path):
    """strategy.offload_optimizer=cpu: DeepSpeed steps its own CPU Adam. The run must engage
    it (the engagement check reads the offload device DeepSpeed built), say so in the banner
    and in run_spec.yaml, and keep the numbers of torch's AdamW."""
    from conftest import MICRO

    from runner.config.spec import spec_from_yaml

    golden = json.loads(GOLDEN.read_text())["losses"][:3]
    short = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))] + ["train.max_steps=3", "train.eval_every=0"]
    run_dir = tmp_path / "run"
    metrics = train_run(run_dir, [*short, "strategy=zero2", "strategy.offload_optimizer=cpu"])
    assert [m["loss"] for m in metrics if "loss" in m] == pytest.approx(golden, abs=1e-4)
    log = (run_dir / "run.log").read_text()
    assert "optimizer      DeepSpeedCPUAdam" in log and "optim.fused does not apply" in log
    frozen = (run_dir / "run_spec.yaml").read_text()
    assert frozen.startswith("# optimizer: DeepSpeedCPUAdam") and "optim.fused does not apply" in frozen
    assert spec_from_yaml(frozen).strategy.offload_optimizer.value == "cpu"  # the note is a comment, not a key
