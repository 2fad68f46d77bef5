"""Every `runner` command the README, docs/ and the recipes' headers show is one that runs
(issue 61, 9: `runner recipe=gpt2_dpo_tiny peft=lora`, shown in two places, exited 2).

Each command is read from where it is shown (a fenced shell block, or a recipe header's
Launch: lines) and checked as far as this machine can without training: a run's overrides
compose and validate to a run spec, as the launcher does before any worker starts (each
combination of a sweep); `runner certify` and `runner eval` parse; a hub model or dataset
is the connected run's own business (the pre-flight names the way out offline), and a path
a reader fills in (PATH, RUN_DIR, an earlier run's folder) is not checked for existence.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from runner.config.validate import spec_problems
from runner.launch.elastic import elastic_problems

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*.yaml"))]
FENCE = re.compile(r"^```(\w*)\s*$")


def _commands_in_markdown(text: str) -> list[str]:
    """Commands in shell blocks (```bash) and in indented code blocks (four spaces);
    commands inline in prose hold placeholders a reader replaces, and are left out."""
    found, block, language = [], False, ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line.strip())
        indented = not block and line.startswith("    ") and line.strip().startswith("runner ")
        if fence:
            block, language = (not block), fence.group(1)
        elif indented or (block and language in ("bash", "sh", "shell", "console")
                          and line.strip().startswith("runner ")):
            command = line.strip()
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            found.append(command)
        i += 1
    return found


def _commands_in_recipe(text: str) -> list[str]:
    """A recipe header's Launch: lines (`#           runner recipe=...`)."""
    header = text.split("\ndefaults:")[0]
    return [line.lstrip("#").strip().removeprefix("Launch:").strip() for line in header.splitlines()
            if re.match(r"^#\s*(Launch:)?\s*runner ", line)]


def shown_commands() -> list[tuple[str, str]]:
    """(where, command) of every runner command shown, once each per source."""
    shown = []
    for path in SOURCES:
        text = path.read_text()
        commands = _commands_in_recipe(text) if path.suffix == ".yaml" else _commands_in_markdown(text)
        for command in dict.fromkeys(commands):
            shown.append((str(path.relative_to(ROOT)), command))
    return shown


def arguments(command: str) -> list[str]:
    """The command's arguments after `runner`, its trailing comment dropped."""
    return shlex.split(command, comments=True)[1:]


def sweep_combinations(overrides: list[str]) -> list[list[str]]:
    """A multirun's overrides as each job composes them (Hydra's basic sweeper: a comma list
    in a value is one job per item)."""
    choices = []
    for override in overrides:
        key, _, value = override.partition("=")
        quoted = value.startswith(("'", '"', "[")) or "[" in value
        items = value.split(",") if ("," in value and not quoted) else [value]
        choices.append([f"{key}={item}" for item in items])
    return [list(combination) for combination in itertools.product(*choices)]


def run_overrides(args: list[str]) -> list[str]:
    """The overrides that make the run spec (Hydra's own settings and flags left out)."""
    return [a for a in args if not a.startswith(("hydra.", "hydra/", "-")) and "=" in a]


SHOWN = shown_commands()


def test_commands_are_found_where_they_are_shown():
    where = {source for source, _ in SHOWN}
    assert len(SHOWN) >= 60 and "README.md" in where and "recipes/gpt2_dpo_tiny.yaml" in where
    assert ("docs/preference.md" in where) and any("peft=lora" in c for s, c in SHOWN if "dpo" in c)


@pytest.mark.parametrize("where, command", SHOWN, ids=[f"{w}: {c[:70]}" for w, c in SHOWN])
def test_a_shown_command_runs(compose_spec, where, command):
    args = arguments(command)
    if args[:1] == ["certify"]:
        from runner.certify.command import parser

        parser().parse_args(args[1:])
        return
    if args[:1] == ["eval"]:
        assert len(args) >= 2, "runner eval RUN_DIR [overrides]"
        return
    if not [a for a in args if "=" in a and not a.startswith("-")]:
        return  # --help, --spec FILE --run-dir DIR: nothing to compose
    if "--config-dir" in args:
        return  # the reader's own config folder (docs/config-groups.md shows one)
    multirun = "-m" in args or "--multirun" in args
    for overrides in sweep_combinations(run_overrides(args)) if multirun else [run_overrides(args)]:
        spec = compose_spec(*overrides)
        if spec.train.per_device_batch_size == "auto":  # the launcher settles it first, from the memory plan
            from dataclasses import replace

            spec = replace(spec, train=replace(spec.train, per_device_batch_size=1))
        nproc = str(spec.launch.nproc_per_node)
        world = int(nproc) * spec.launch.nnodes if nproc.isdigit() else 1
        problems = spec_problems(spec, world_size=world) + elastic_problems(spec, world)
        assert problems == [], f"{where}: {command}\n  {' '.join(overrides)}\n  -> {problems}"
