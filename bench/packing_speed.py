"""Packed against padded instruction data: examples and real tokens a second, same examples and model.

Not a test: runs the offline SFT example (`recipe=gpt2_sft_tiny`: 2,000 prompt/completion
pairs from the embedded novels, a 2-layer GPT-2, block 256, 8 rows a step, one process)
with `data.packing=true`, then `false`, in turn, `--repeats` times each, and prints the
faster run of each and their ratio (packed / padded), from the same invocation:

- `rows/s`: rows a second over the run (packed rows hold several examples; padded rows one);
- `examples/s`: rows/s x the split's examples per row (its `instruction_data` counts);
- `real tok/s`: runner's own `train_tokens_per_second`, which counts tokens that are not
  padding (a packed row's own count; a padded batch's attention mask);
- `efficiency`: the split's non-padding tokens over its packed rows' capacity (padded
  rows are padded to the longest of each batch, at collate time).

    python bench/packing_speed.py                     # ~1.5 minutes on 2 CPU cores
    python bench/packing_speed.py --steps 80 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(run_dir: Path, packing: bool, steps: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "runner", "recipe=gpt2_sft_tiny", f"data.packing={str(packing).lower()}",
                           f"train.max_steps={steps}", "train.eval_every=0", "train.log_every=10",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-3000:]}")
    results = json.loads((run_dir / "all_results.json").read_text())
    train = results["instruction_data"]["train"]
    rows_per_s = results["train_samples_per_second"]
    return {"rows/s": rows_per_s, "examples/s": rows_per_s * train["examples"] / train["rows"],
            "real tok/s": results["train_tokens_per_second"], "efficiency": train["packing_efficiency"],
            "rows": train["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    best: dict[bool, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for packing in (True, False):  # in turn, so a machine's drift falls on both
                figures = one_run(Path(root) / f"{packing}-{repeat}", packing, args.steps)
                if packing not in best or figures["real tok/s"] > best[packing]["real tok/s"]:
                    best[packing] = figures
    print("| packing | rows | efficiency | rows/s | examples/s | real tok/s |")
    print("|---|---|---|---|---|---|")
    for packing in (True, False):
        f = best[packing]
        efficiency = f"{100 * f['efficiency']:.1f}%" if packing else "per batch"  # padded to each batch's longest
        print(f"| {str(packing).lower()} | {f['rows']:,} | {efficiency} | {f['rows/s']:.1f} | "
              f"{f['examples/s']:.1f} | {f['real tok/s']:,.0f} |")
    print(f"packed / padded: examples/s {best[True]['examples/s'] / best[False]['examples/s']:.2f}x, "
          f"real tok/s {best[True]['real tok/s'] / best[False]['real tok/s']:.2f}x")


if __name__ == "__main__":
    main()
