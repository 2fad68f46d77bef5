"""A sweep summary's evaluation columns come from the jobs' objectives (made-up job folders, no training)."""

import csv
import json

import yaml

from runner.components.objectives import OBJECTIVES
from runner.config.spec import DataFormat, DataSpec, ObjectiveKind, RunSpec, TrainSpec, save_spec
from runner.sweep.job import run_sweep_job
from runner.sweep.status import write_job_status
from runner.sweep.summary import summarize

# What a text sweep's summary.csv and table held before objectives chose the columns.
TEXT_CSV = ["job", "overrides", "status", "run", "train_loss", "eval_loss", "perplexity", "tokens_per_s",
            "peak_memory_mb", "wall_s", "goodput", "reason", "max_abs_dloss", "max_grad_norm_rel_diff", "parity",
            "parity_detail"]
TEXT_HEADER = ("| job | overrides | status | run | train loss | eval loss | perplexity | tokens/s | peak MB | wall s | "
               "goodput | max abs Δloss | max grad-norm rel diff | parity |")
DPO_FIGURES = ["eval_loss", "rewards/accuracies", "rewards/margins"]


def make_job(sweep_dir, num, overrides, objective=None, results=None, status="ok", spec=True):
    """A job folder as a sweep leaves it (runner/sweep/job.py): job_status.json with the
    objective as composed, and, for a job that got past validation, run_spec.yaml and
    .hydra/; all_results.json for one that finished. objective None: an older sweep's
    folder, whose job_status.json has no objective."""
    job = sweep_dir / f"{num}_abc{num}"
    write_job_status(job, status, 5.0, overrides, None if status == "ok" else "refused", objective)
    if objective is not None and spec:
        kind = ObjectiveKind(objective)
        data = DataSpec(format=DataFormat.preference if kind is ObjectiveKind.dpo else DataFormat.text)
        save_spec(RunSpec(train=TrainSpec(objective=kind), data=data), job / "run_spec.yaml")
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if results is not None:
        (job / "all_results.json").write_text(json.dumps({"train_loss": 0.69, "peak_memory_mb": 900.0,
                                                          "train_tokens_per_second": 1234.0, **results}))
    return job


def dpo_results(loss, accuracy, margin):
    """A DPO run's all_results.json figures (its evaluation's, runner/components/objectives/dpo.py)."""
    return {"eval_loss": loss, "rewards/chosen": margin / 2, "rewards/rejected": -margin / 2,
            "rewards/accuracies": accuracy, "rewards/margins": margin, "logps/chosen": -40.0, "logps/rejected": -44.0}


def read_csv(sweep_dir):
    with (sweep_dir / "summary.csv").open() as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, {row["job"]: row for row in reader}


def cells(line):
    return [cell.strip() for cell in line.strip("|").split("|")]


def table_lines(text):
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_a_preference_sweep_shows_each_jobs_rewards_and_no_perplexity(tmp_path, capsys):
    """`runner -m recipe=gpt2_dpo_tiny preference.loss_type=sigmoid,ipo`, and a third job refused."""
    make_job(tmp_path, 0, ["recipe=gpt2_dpo_tiny", "preference.loss_type=sigmoid"], "dpo", dpo_results(0.6124, 0.75, 0.4211))
    make_job(tmp_path, 1, ["recipe=gpt2_dpo_tiny", "preference.loss_type=ipo"], "dpo", dpo_results(23.5, 0.625, 1.875))
    make_job(tmp_path, 2, ["recipe=gpt2_dpo_tiny", "preference.loss_type=hinge", "preference.gamma=2"], "dpo",
             status="failed", spec=False)
    summarize(tmp_path)
    columns, rows = read_csv(tmp_path)
    assert columns == [*TEXT_CSV[:5], *DPO_FIGURES, *TEXT_CSV[7:]]
    assert [float(rows["0_abc0"][name]) for name in DPO_FIGURES] == [0.6124, 0.75, 0.4211]
    assert [float(rows["1_abc1"][name]) for name in DPO_FIGURES] == [23.5, 0.625, 1.875]
    assert [rows["2_abc2"][name] for name in DPO_FIGURES] == ["", "", ""]
    header, *body = table_lines((tmp_path / "summary.md").read_text())
    assert header == TEXT_HEADER.replace("eval loss | perplexity", "eval loss | rewards/accuracies | rewards/margins")
    names, shown = cells(header), {cells(line)[0]: dict(zip(cells(header), cells(line))) for line in body}
    assert names[5:8] == ["eval loss", "rewards/accuracies", "rewards/margins"]
    assert [shown["0_abc0"][name] for name in names[5:8]] == ["0.6124", "0.75", "0.4211"]
    assert [shown["1_abc1"][name] for name in names[5:8]] == ["23.5", "0.625", "1.875"]
    assert "perplexity" not in (tmp_path / "summary.md").read_text()
    assert table_lines(capsys.readouterr().out)[0] == header  # the printed table: the same columns


def test_a_text_sweep_summary_is_as_before(tmp_path, capsys):
    """Causal-LM jobs (one with its spec, one folder without: an older sweep's) keep the columns of before."""
    make_job(tmp_path, 0, ["train.per_device_batch_size=2"], "causal_lm",
             {"eval_loss": 5.5, "perplexity": 244.7, "eval_accuracy": 0.12})
    make_job(tmp_path, 1, ["train.per_device_batch_size=4"], None, {"eval_loss": 5.25, "perplexity": 190.6})
    summarize(tmp_path)
    columns, rows = read_csv(tmp_path)
    assert columns == TEXT_CSV
    assert [(rows[job]["eval_loss"], rows[job]["perplexity"]) for job in ("0_abc0", "1_abc1")] == [
        ("5.5", "244.7"), ("5.25", "190.6")]
    header = table_lines((tmp_path / "summary.md").read_text())[0]
    assert header == TEXT_HEADER
    assert table_lines(capsys.readouterr().out)[0] == TEXT_HEADER


def test_a_refused_job_records_its_composed_objective(tmp_path):
    """A job refused before its run_spec.yaml was written (runner/sweep/job.py) says in
    job_status.json which objective it was composed with."""
    from omegaconf import OmegaConf

    from runner.config.errors import UserError

    def refused():
        raise UserError("preference.beta=0 must be > 0.")

    composed = OmegaConf.structured(RunSpec(train=TrainSpec(objective=ObjectiveKind.dpo)))
    run_sweep_job(refused, tmp_path / "0_abc0", tmp_path, 0, ["preference.beta=0"], composed, True)
    status = json.loads((tmp_path / "0_abc0" / "job_status.json").read_text())
    assert (status["status"], status["objective"]) == ("failed", "dpo")
    assert not (tmp_path / "0_abc0" / "run_spec.yaml").exists()


def test_jobs_refused_before_their_spec_still_say_their_objective(tmp_path):
    """No job wrote run_spec.yaml: their job_status.json says dpo, so no perplexity column."""
    make_job(tmp_path, 0, ["recipe=gpt2_dpo_tiny", "preference.beta=0"], "dpo", status="failed", spec=False)
    make_job(tmp_path, 1, ["recipe=gpt2_dpo_tiny", "preference.beta=-1"], "dpo", status="failed", spec=False)
    summarize(tmp_path)
    columns, _ = read_csv(tmp_path)
    assert columns[5:8] == DPO_FIGURES and "perplexity" not in columns


def test_a_sweep_over_objectives_shows_each_jobs_own_figures(tmp_path):
    make_job(tmp_path, 0, ["objective=causal_lm"], "causal_lm", {"eval_loss": 5.5, "perplexity": 244.7})
    make_job(tmp_path, 1, ["objective=dpo"], "dpo", dpo_results(0.5, 1.0, 0.25))
    summarize(tmp_path)
    columns, rows = read_csv(tmp_path)
    assert columns[5:9] == ["eval_loss", "perplexity", "rewards/accuracies", "rewards/margins"]
    assert [rows["0_abc0"][name] for name in columns[5:9]] == ["5.5", "244.7", "", ""]
    assert [rows["1_abc1"][name] for name in columns[5:9]] == ["0.5", "", "1.0", "0.25"]


def test_each_objective_summarises_figures_it_reports():
    for kind, objective in OBJECTIVES.items():
        assert objective.summarised and set(objective.summarised) <= set(objective.figures), kind


def test_a_mixture_sweep_shows_each_sources_own_loss(tmp_path):
    """Jobs over data.mixture: a column per source's validation loss (all_results.json's
    eval_loss/<source>), beside the total; a job without that source shows none."""
    make_job(tmp_path, 0, ["data.mixture.0.weight=0.7"], "causal_lm",
             {"eval_loss": 5.5, "perplexity": 244.7, "eval_loss/novels": 5.4, "eval_loss/instructions": 5.9})
    make_job(tmp_path, 1, ["data.mixture.0.weight=0.5"], "causal_lm",
             {"eval_loss": 5.6, "perplexity": 270.4, "eval_loss/novels": 5.45, "eval_loss/instructions": 5.75})
    make_job(tmp_path, 2, ["data.train_file=x.txt"], "causal_lm", {"eval_loss": 5.2, "perplexity": 181.3})
    summarize(tmp_path)
    columns, rows = read_csv(tmp_path)
    assert columns[columns.index("perplexity") + 1:][:2] == ["eval_loss/novels", "eval_loss/instructions"]
    assert [rows[job]["eval_loss/instructions"] for job in ("0_abc0", "1_abc1", "2_abc2")] == ["5.9", "5.75", ""]
    header = cells(table_lines((tmp_path / "summary.md").read_text())[0])
    assert "eval loss/novels" in header or "eval_loss/novels" in header, header


def test_a_sweep_with_benchmarks_shows_a_column_per_task_metric(tmp_path):
    """eval.tasks: each task metric of all_results.json (benchmark/<task>/<metric>) is a
    column after the evaluation's; their standard errors are not; a job without the
    benchmark (it failed before it) shows none."""
    make_job(tmp_path, 0, ["precision=fp32"], "causal_lm",
             {"eval_loss": 5.5, "perplexity": 244.7, "benchmark/austen_next/acc": 0.31,
              "benchmark/austen_next/acc_stderr": 0.03, "benchmark/austen_next/acc_norm": 0.27})
    make_job(tmp_path, 1, ["precision=bf16"], "causal_lm", {"eval_loss": 5.6, "perplexity": 270.4})
    summarize(tmp_path)
    columns, rows = read_csv(tmp_path)
    assert columns[columns.index("perplexity") + 1:][:2] == ["benchmark/austen_next/acc", "benchmark/austen_next/acc_norm"]
    assert not any(c.endswith("_stderr") for c in columns), columns
    assert [rows[job]["benchmark/austen_next/acc"] for job in ("0_abc0", "1_abc1")] == ["0.31", ""]
    header = cells(table_lines((tmp_path / "summary.md").read_text())[0])
    assert any("austen" in h and h.endswith("acc") for h in header), header
