"""`runner`: compose once with Hydra, validate, freeze the spec, launch the workers.

Only this process runs Hydra; workers read run_spec.yaml.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from runner.errors import UserError, compose_error, exit_with


def _offline_defaults() -> None:
    # datasets/transformers otherwise probe the network on every load; a machine
    # that cannot reach the hub should not wait on it (validation says what to do).
    from runner.model import hub_reachable

    if "HF_HUB_OFFLINE" not in os.environ and not hub_reachable(timeout_s=2.0):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def start(spec: Any, run_dir: Path, overwrite: bool, composed: Any = None, overrides: tuple[str, ...] = ()) -> None:
    """Validate, claim the run folder, freeze the spec, launch. Shared by both entries."""
    from runner.launch import launch
    from runner.rundir import freeze, prepare_run_dir
    from runner.validate import validate

    spec.run_dir = str(run_dir.resolve())
    validate(spec)
    prepare_run_dir(run_dir, overwrite)
    spec_path = freeze(spec, run_dir, composed, overrides)
    launch(spec, spec_path)


def _hydra_task(cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    from runner.spec import to_spec

    hydra_cfg = HydraConfig.get()
    try:
        spec = to_spec(cfg)
        start(spec, Path(hydra_cfg.runtime.output_dir), spec.overwrite, cfg, tuple(hydra_cfg.overrides.task))
    except UserError as err:
        # Exit here: an exception would make Hydra print "Error executing job" first.
        exit_with(err)


def _run_spec_file(argv: list[str]) -> None:
    """`runner --spec RUN_DIR/run_spec.yaml`: re-run a frozen spec, no Hydra."""
    import datetime

    from runner.config_store import short_hash
    from runner.spec import load_spec

    parser = argparse.ArgumentParser(prog="runner --spec", description="Re-run a frozen run_spec.yaml.")
    parser.add_argument("--spec", required=True, type=Path, help="path to a run_spec.yaml")
    parser.add_argument("--run-dir", type=Path, default=None, help="output folder (default: a new one under outputs/)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --run-dir")
    args = parser.parse_args(argv)
    if not args.spec.is_file():
        raise UserError(f"--spec {args.spec}: no such file. Give the run_spec.yaml of an earlier run.")
    try:
        spec = load_spec(args.spec)
    except Exception as err:  # schema violations in a hand-edited file
        raise compose_error(err) from None
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dir = args.run_dir or Path("outputs") / spec.name / f"{stamp}_{short_hash(args.spec.read_text())}"
    start(spec, run_dir, args.overwrite or spec.overwrite)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _offline_defaults()
    try:
        if any(a == "--spec" or a.startswith("--spec=") for a in argv):
            _run_spec_file(argv)
            return
        _run_hydra(argv)
    except UserError as err:
        exit_with(err)


def _run_hydra(argv: list[str]) -> None:
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.config_store import register
    from runner.paths import conf_dir

    # Let composition errors reach us as exceptions so we print one clear line
    # (and exit 2) instead of Hydra's report; training crashes keep their traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    register()
    task = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_hydra_task)
    sys.argv = [sys.argv[0], *argv]
    try:
        task()
    except UserError:
        raise
    except (HydraException, OmegaConfBaseException) as err:
        raise compose_error(err) from None


if __name__ == "__main__":
    main()
