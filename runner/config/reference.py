"""docs/configuration.md, generated from the schema: every field of the run spec with
its type, schema default, allowed values and the docstring written under it in
runner/config/spec.py (or the section module it nests: data_spec.py, preference_spec.py). A test fails when the page is out of date; rewrite it with

    python -m runner.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import typing
from typing import Any, Iterator

from runner.config.spec import RunSpec

HEADER = """# Configuration reference

Generated from the schema (`runner/config/spec.py`, its `data` and `preference` sections in
`data_spec.py` and `preference_spec.py` beside it) by `python -m runner.config.reference`;
`tests/config/test_reference.py` fails when this page is out of date. Defaults here are
the schema's: a recipe and the groups under `conf/` set their own on top (`runner
recipe=NAME --cfg job` prints what a run composes). Set any field on the command line
as `section.field=value`. How the groups and recipes fit together:
[config-groups.md](config-groups.md).
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (a string literal right after it)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _enum_of(hint: Any) -> type[enum.Enum] | None:
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return candidate
    return None


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
        return "null" if value is None else f"{value.value}" if isinstance(value, enum.Enum) else repr(value)
    return "-"


def rows(cls: type = RunSpec, prefix: str = "") -> Iterator[tuple[str, list[tuple[str, str, str, str]]]]:
    """(section, [(key, type, default, description)]) for `cls` and each nested section."""
    hints = typing.get_type_hints(cls)  # each section's annotations, read in the module defining it
    docs = field_docs(cls)
    own, nested = [], []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            nested.append((field.name, hint))
            continue
        kind = _enum_of(hint)
        allowed = f" One of: {', '.join(f'`{m.value}`' for m in kind)}." if kind else ""
        type_name = ("str or null" if type(None) in typing.get_args(hint) else "str") if kind else _type_name(hint)
        text = " ".join(docs.get(field.name, "").split()) + allowed
        own.append((f"{prefix}{field.name}", type_name, _default(field), text.strip()))
    yield (prefix.rstrip(".") or "top level", own)
    for name, sub in nested:
        yield from rows(sub, f"{prefix}{name}.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    parts = [HEADER]
    for section, fields in rows():
        parts.append(f"\n## `{section}`\n" if section != "top level" else "\n## Top level\n")
        parts.append("| key | type | default | what it sets |\n|---|---|---|---|")
        parts += [f"| `{key}` | {_cell(kind)} | `{_cell(default)}` | {_cell(text)} |" for key, kind, default, text in fields]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
