"""Hydra multirun: every job in its own folder, failures recorded, a summary at the end."""

import csv
import json
import subprocess
import sys

import pytest

from conftest import MICRO

SHORT = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every"))] + ["train.max_steps=3", "train.eval_every=0"]


def sweep(sweep_dir, *overrides, timeout=600):
    """timeout: a guard against a hung sweep, not a speed check."""
    return subprocess.run(
        [sys.executable, "-m", "runner", "-m", *SHORT, *overrides, f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def mixed_sweep(tmp_path_factory):
    """Two valid jobs (batch 2 and 4) and one refused one (fp16 on a CPU)."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    done = sweep(sweep_dir, "precision=fp32,fp16", "train.per_device_batch_size=2,4")
    return sweep_dir, done


@pytest.mark.e2e
def test_every_combination_has_its_own_folder(mixed_sweep):
    sweep_dir, _ = mixed_sweep
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / "job_status.json").exists())
    assert len(jobs) == 4
    ok = [p for p in jobs if json.loads((p / "job_status.json").read_text())["status"] == "ok"]
    assert len(ok) == 2 and all((p / "all_results.json").exists() for p in ok)


@pytest.mark.e2e
def test_failed_jobs_are_recorded_and_the_sweep_goes_on(mixed_sweep):
    sweep_dir, done = mixed_sweep
    assert done.returncode == 1  # the sweep finished, and says some jobs failed
    with (sweep_dir / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 2
    assert all("precision=fp16" in r["overrides"] and "precision=bf16" in r["reason"] for r in failed)
    for r in rows:
        if r["status"] == "ok":
            assert float(r["train_loss"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["peak_memory_mb"]) > 0
            assert float(r["eval_loss"]) > 0 and float(r["perplexity"]) > 1 and float(r["wall_s"]) > 0
            assert 0 < float(r["goodput"]) < 1  # the job's steps over its wall time
        else:
            assert r["goodput"] == ""  # a failed job has no ledger


@pytest.mark.e2e
def test_summary_files_and_printed_table(mixed_sweep):
    sweep_dir, done = mixed_sweep
    assert (sweep_dir / "loss_curves.png").stat().st_size > 10_000
    assert "| job | overrides | status |" in (sweep_dir / "summary.md").read_text()
    assert "runner: sweep summary" in done.stdout and "train.per_device_batch_size=4" in done.stdout


@pytest.mark.e2e
def test_runner_report_rebuilds_the_summary(mixed_sweep):
    sweep_dir, _ = mixed_sweep
    (sweep_dir / "summary.csv").unlink()
    done = subprocess.run([sys.executable, "-c", "from runner.sweep.summary import report_main; report_main()", str(sweep_dir)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(list(csv.DictReader((sweep_dir / "summary.csv").open()))) == 4


def test_slurm_launcher_config_composes():
    """hydra/launcher=submitit_slurm (the `slurm` extra) composes; Slurm itself is not here."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.config.store import register
    from runner.config.paths import conf_dir

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["recipe=gpt2_clm_tiny", "hydra/launcher=submitit_slurm",
                                           "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=8"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.nodes == 2


@pytest.mark.multiprocess
def test_a_strategy_sweep_certifies_parity(tmp_path):
    """ddp vs zero2 at 2 processes, dropout off (MICRO): the summary's parity columns say ok."""
    sweep_dir = tmp_path / "sweep"
    done = sweep(sweep_dir, "strategy=ddp,zero2", "launch.nproc_per_node=2", timeout=1800)  # 4 processes: slow on a loaded CI box
    assert done.returncode == 0, done.stderr[-3000:]
    with (sweep_dir / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert ["strategy=ddp" in rows[0]["overrides"], "strategy=zero2" in rows[1]["overrides"]] == [True, True]
    assert [r["parity"] for r in rows] == ["baseline", "ok"], rows[1]["parity_detail"]
    assert 0 <= float(rows[1]["max_abs_dloss"]) <= 1e-4
    assert 0 <= float(rows[1]["max_grad_norm_rel_diff"]) <= 1e-3
    assert float(rows[1]["tokens_per_s"]) > 0 and float(rows[1]["peak_memory_mb"]) > 0
    summary = (sweep_dir / "summary.md").read_text()
    assert "| parity |" in summary and "Dropout was on" not in summary
    assert "max abs Δloss" in done.stdout
