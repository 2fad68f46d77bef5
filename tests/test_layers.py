"""runner's packages import only downward, with no cycle inside a group, and the narrower
rules (components/ and report/ never import distributed/; the worker and the trainer never
import a concrete strategy): the contracts in pyproject.toml, checked by import-linter (the
same check as `lint-imports`)."""

import logging
import tomllib
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def test_imports_point_one_way_between_packages(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    # import-linter's CLI configures logging with dictConfig, which switches off every logger
    # that exists: put back what it found, or later in-process runs log nothing.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    was = [lg.disabled for lg in loggers]
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        for logger, disabled in zip(loggers, was):
            logger.disabled = disabled
    out = capsys.readouterr().out
    assert code == 0, out
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(contracts) >= 5, contracts  # the layers, no cycles, and the forbidden imports
    assert f"{len(contracts)} kept, 0 broken" in out
