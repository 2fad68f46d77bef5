"""bench/preference.py --tiny runs runner's DPO and TRL's DPOTrainer side by side and prints
the table: pairs/s and peak of live tensors for every variant (runner's frozen reference
included), every ratio beside its target."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]  # one process at a time: runner and TRL runs, 2-layer GPT-2, 3 steps each

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ("runner, reference=precomputed", "runner, reference=frozen", "runner, precomputed, packed",
            "runner, precomputed, act. ckpt", "TRL, reference model", "TRL, precompute_ref_log_probs")
NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def test_tiny_bench_prints_every_row_with_numbers(tmp_path):
    done = subprocess.run([sys.executable, "bench/preference.py", "--tiny", "--keep", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for variant in MEASURED:
        row = re.search(rf"^{re.escape(variant)} +\| +{NUMBER} \| +{NUMBER}$", out, re.M)
        assert row, (variant, out)
        pairs_per_s, peak_mb = (float(value.replace(",", "")) for value in row.groups())
        assert pairs_per_s > 0 and math.isfinite(pairs_per_s), (variant, pairs_per_s)
        assert peak_mb > 0, (variant, peak_mb)
    ratios = re.findall(rf"^ *(.+?): {NUMBER}x   target ([<>]=) {NUMBER}x: (met|NOT met)$", out, re.M)
    # pairs/s and peak against both TRL variants; precomputed / frozen peak; checkpointed
    # runner against TRL (which checkpoints by default), pairs/s and peak
    assert len(ratios) == 7, out
    assert re.search(r"^the states \(weights, gradients, AdamW's moments: 16 B x 3\.4M\) = 54 MB; above them", out, re.M), out
    for what, value, sign, target, verdict in ratios:
        met = float(value) >= float(target) if sign == ">=" else float(value) <= float(target)
        assert verdict == ("met" if met else "NOT met"), (what, value, target, verdict)
