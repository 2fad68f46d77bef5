"""What each strategy's checkpoint holds, by world size: bytes on disk, files, save time.

Not a test: for each strategy and number of processes, trains a GPT-2 config (n_embd
256, 4 layers, 16.1M parameters, fp32) for 2 steps with a checkpoint at step 2, and
prints the checkpoint folder's size, its number of files, the largest file, and the
save time: from the first file written in it to its COMPLETE.json, written last (the
save's own time, without the barriers before it). Sizes are exact; times are one run's
on a shared 2-core CPU, to read for their trend.

    python bench/checkpoint_size.py                          # ~4 minutes on 2 CPU cores
    python bench/checkpoint_size.py --strategies zero3,fsdp --worlds 2,4
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "model.config_overrides='n_embd=256,n_layer=4,n_head=4,n_positions=128'"
RUN = ["recipe=gpt2_clm_tiny", MODEL, "data.block_size=128", "train.max_steps=2", "train.save_every=2",
       "train.eval_every=0", "train.global_batch_size=8", "data.max_train_samples=64", "tracking=none"]


def measure(run_dir: Path, strategy: str, world: int) -> dict[str, float]:
    per_device = 8 // world
    done = subprocess.run([sys.executable, "-m", "runner", *RUN, f"strategy={strategy}",
                           f"launch.nproc_per_node={world}", f"train.per_device_batch_size={per_device}",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} x{world} failed:\n{done.stderr[-3000:]}")
    folder = run_dir / "checkpoints" / "step_2"
    files = [p for p in folder.rglob("*") if p.is_file()]
    marker = folder / "COMPLETE.json"
    written = [p.stat().st_mtime for p in files if p != marker]
    return {"mb": sum(p.stat().st_size for p in files) / 2**20, "files": len(files),
            "largest_mb": max(p.stat().st_size for p in files) / 2**20,
            "save_s": marker.stat().st_mtime - min(written)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero2,zero3,fsdp")
    parser.add_argument("--worlds", default="1,2,4")
    args = parser.parse_args()
    print("| strategy | processes | checkpoint MB | files | largest file MB | save s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for strategy in args.strategies.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                if strategy == "fsdp" and world < 2:
                    continue  # FSDP2 shards over 2 processes or more
                f = measure(Path(root) / f"{strategy}-{world}", strategy, world)
                print(f"| {strategy} | {world} | {f['mb']:.1f} | {f['files']} | {f['largest_mb']:.1f} | "
                      f"{f['save_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
