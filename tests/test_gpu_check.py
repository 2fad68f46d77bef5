"""The GPU check never rots: its CPU mode runs every case it can on this machine, through
the script a GPU machine runs (scripts/gpu-check.sh --cpu), and writes its table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What a CPU can and cannot do, as the table must say it.
EXPECTED = {
    "Trainer, bf16": "ok", "runner, bf16": "ok", "runner, bf16, plain loss": "ok",
    "runner, bf16, compile": "not run", "runner, bf16, chunked loss": "not run",
    "runner, fp16, overflow at step 5": "refused",  # fp16 needs a GPU, said in one line
    "~0.5B from config, full": "ok", "~0.5B from config, LoRA": "ok", "~0.5B from config, GRPO": "ok",
    "instruction data, padded": "ok", "instruction data, packed": "ok",
    "runner, bf16, zero2 on 1 device": "ok", "runner, bf16, fsdp on 1 device": "refused",  # FSDP shards over 2 or more
}


@pytest.mark.e2e
def test_the_gpu_check_runs_every_case_on_a_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--cpu", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads((out / "table.json").read_text())
    assert table["mode"] == "CPU" and "# GPU check (CPU" in (out / "table.md").read_text()
    statuses = {row["case"]: row["status"] for row in table["rows"]}
    assert statuses == EXPECTED, {row["case"]: (row["status"], row["note"]) for row in table["rows"]}
    rows = {row["case"]: row for row in table["rows"]}
    for name, status in EXPECTED.items():
        if status == "ok":
            assert rows[name]["tokens_per_s"] > 0 and rows[name]["peak_memory_mb"] > 0, rows[name]
    assert "precision=fp16 needs a GPU" in rows["runner, fp16, overflow at step 5"]["note"]
    measured = {t["what"]: t["ratio"] for t in table["targets"]}
    assert measured["runner, bf16 / Trainer, bf16, tokens_per_s"] > 0
    assert measured["~0.5B from config, LoRA / ~0.5B from config, full, peak_memory_mb"] > 0
    assert "(locked " in (out / "versions.txt").read_text()  # the image's versions beside the lock's
