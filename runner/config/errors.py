"""User-facing errors: one clear message naming the fix, exit code 2, no traceback."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from typing import NoReturn, Sequence

from runner.config.spec import RunSpec

USAGE_EXIT_CODE = 2


class UserError(Exception):
    """A problem the user can fix (config, data, run folder). Never a traceback."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def render(self) -> str:
        if len(self.problems) == 1:
            return f"runner: error: {self.problems[0]}"
        lines = [f"runner: {len(self.problems)} problems:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class RunFailed(Exception):
    """Training itself failed (a worker crashed); its traceback was already shown."""


class TrainingStopped(SystemExit):
    """Training stopped itself for a reason it has already logged (a non-finite loss):
    a SystemExit, so a single run exits with `code` and no traceback, carrying the
    reason for a sweep, which records the job as failed and goes on to the next."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code)
        self.reason = reason


def exit_with(error: UserError) -> NoReturn:
    sys.stderr.write(error.render() + "\n")
    sys.stderr.flush()
    raise SystemExit(USAGE_EXIT_CODE)


def _schema_keys(full_key: str) -> list[str]:
    """Field names of the schema node that holds `full_key` (for 'did you mean')."""
    node: type = RunSpec
    for part in full_key.split(".")[:-1]:
        hints = typing.get_type_hints(node)  # annotations are strings here
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return []
        node = hints[part]
    return [f.name for f in dataclasses.fields(node)]


def compose_error(exc: BaseException) -> UserError:
    """Turn Hydra/OmegaConf composition failures into one line that names the fix."""
    cause = exc.__cause__ or exc
    text = str(cause)
    full_key_match = re.search(r"full_key: (\S+)", text)
    # as an override names it: OmegaConf writes a list's item as data.mixture[0].weight
    full_key = re.sub(r"\[(\d+)\]", r".\1", full_key_match.group(1)) if full_key_match else ""
    first_line = text.splitlines()[0] if text else type(cause).__name__

    unknown = re.match(r"Key '([^']+)' not in '(\w+)'", first_line)
    if unknown:
        key = full_key or unknown.group(1)
        siblings = _schema_keys(key)
        close = difflib.get_close_matches(key.split(".")[-1], siblings, n=1)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        hint = f" Did you mean '{parent + '.' if parent else ''}{close[0]}'?" if close else ""
        valid = f" Valid keys{' in ' + parent if parent else ''}: {', '.join(siblings)}." if siblings else ""
        return UserError(f"unknown key '{key}'.{hint}{valid} (`runner --cfg job` prints every key.)")
    if type(cause).__name__ == "MissingMandatoryValue" and full_key:
        return UserError(f"'{full_key}' must be set: add {full_key}=... to the command line.")
    if type(cause).__name__ == "ValidationError" and full_key:
        return UserError(f"bad value for '{full_key}': {first_line}. Fix the override {full_key}=...")
    if type(exc).__name__ == "MissingConfigException":
        body = " ".join(line.strip() for line in text.splitlines() if line.strip() and "provider=" not in line and "Config search path" not in line)
        return UserError(f"{body}. Pick one of the available options.")
    if type(exc).__name__ == "OverrideParseException":
        return UserError(f"cannot parse the command line: {first_line}. Overrides look like key=value or group=option.")
    message = str(exc).splitlines()[0] if str(exc) else first_line
    detail = f" ({first_line})" if cause is not exc else ""
    return UserError(f"{message}{detail}")
