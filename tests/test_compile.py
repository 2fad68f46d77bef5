"""model.compile=true (each layer compiled in place) and the chunked loss, in one process
(with gradient accumulation) and under two processes and every strategy: each is exact against the same run without it (the loss
within 1e-4 and the gradient norm within 0.1% at each of 8 steps, past the epoch boundary
at step 6; the evaluation too), and compiling is reported apart from the steps.

Dropout off (equal math only). One launch of two workers runs the twelve runs of the
strategies in turn (tests/in_turn.py), one launch of one worker the three of one process:
3 runs a layout, the plain loss, the chunked loss, and the chunked loss compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MICRO
from in_turn import run_in_turn
from test_multiprocess import losses

pytestmark = pytest.mark.multiprocess

STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
# One process accumulates two micro-batches: the same global batch of 8.
ONE_PROCESS = ["strategy=ddp", "launch.nproc_per_node=1", "train.grad_accum_steps=2"]
LAYOUTS = ("one", *STRATEGIES)
# Two layers (per-layer compilation shares one graph between them); 48 samples at a
# global batch of 8: 6 steps an epoch.
COMMON = [o for o in MICRO if not o.startswith(("model.config_overrides", "data.max_train_samples", "train.eval_every"))] + [
    "model.config_overrides='n_embd=32,n_layer=2,n_head=2,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0'",
    "data.max_train_samples=48", "train.eval_every=0", "launch.nproc_per_node=2"]
VARIANTS = {
    "plain": ["model.chunked_loss=false", "model.compile=false"],
    "chunked": ["model.chunked_loss=true", "model.compile=false"],
    "compiled": ["model.chunked_loss=true", "model.compile=true"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compile")
    wanted = {f"{s}-{v}": [*COMMON, f"strategy={s}", *extra] for s in STRATEGIES for v, extra in VARIANTS.items()}
    single = [o for o in COMMON if not o.startswith("launch.nproc_per_node")] + ONE_PROCESS
    one = {f"one-{v}": [*single, *extra] for v, extra in VARIANTS.items()}
    return {**run_in_turn(root / "one", one, timeout=900), **run_in_turn(root / "two", wanted, timeout=1800)}


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "all_results.json").read_text())


@pytest.mark.parametrize("strategy", LAYOUTS)
@pytest.mark.parametrize("variant, baseline", [("chunked", "plain"), ("compiled", "chunked")],
                         ids=["chunked-loss", "compile"])
def test_exact_against_the_same_run_without_it(runs, strategy, variant, baseline):
    run, base = runs[f"{strategy}-{variant}"], runs[f"{strategy}-{baseline}"]
    assert len(losses(run)) == 8
    assert losses(run) == pytest.approx(losses(base), abs=1e-4)
    assert losses(run, "grad_norm") == pytest.approx(losses(base, "grad_norm"), rel=1e-3)
    assert results(run)["eval_loss"] == pytest.approx(results(base)["eval_loss"], abs=1e-4)
    fingerprints = results(run)["rank_param_fingerprints"]
    assert len(fingerprints) == (1 if strategy == "one" else 2) and fingerprints[0] == pytest.approx(fingerprints[-1], rel=1e-9)


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_compiling_is_reported_apart_from_the_steps(runs, strategy):
    compiled, eager = results(runs[f"{strategy}-compiled"]), results(runs[f"{strategy}-chunked"])
    assert compiled["compile_seconds"] > 0 and compiled["compile_frames"] >= 1
    assert compiled["recompilations"] >= 0 and compiled["graph_breaks"] >= 0
    parts = compiled["goodput"]["parts_seconds"]
    assert parts["compile"] == pytest.approx(compiled["compile_seconds"], rel=0.05)
    assert compiled["goodput"]["parts_sum_seconds"] == pytest.approx(compiled["goodput"]["wall_seconds"], rel=0.02)
    assert "compile_seconds" not in eager and eager["goodput"]["parts_seconds"]["compile"] == 0
    summary = (runs[f"{strategy}-compiled"] / "run.log").read_text()
    assert "compile (s)" in summary and "recompilations" in summary
