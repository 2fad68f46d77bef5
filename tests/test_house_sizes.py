"""The house's sizes (issue 47): no module in runner/ over 500 lines, the trainer at most
450, no function or method over 80. A module or function that outgrows its limit fails
here, named with its size: split it along a seam (docs/architecture.md lists the rooms)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "runner"
MODULE_LINES = 500
MODULE_LIMITS = {"train/trainer.py": 450}  # the loop stays readable in one sitting
FUNCTION_LINES = 80


def oversized_modules(package: Path) -> list[str]:
    """Each module over its limit, as `path: N lines (at most M)`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        lines, limit = len(path.read_text().splitlines()), MODULE_LIMITS.get(name, MODULE_LINES)
        if lines > limit:
            found.append(f"{package.name}/{name}: {lines} lines (at most {limit})")
    return found


def _functions(node: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method under `node`, nested ones too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def oversized_functions(package: Path) -> list[str]:
    """Each function or method longer than FUNCTION_LINES, from its `def` line to its last
    (the docstring counts, decorators do not), as `path:line name: N lines (at most M)`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for name, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            lines = node.end_lineno - node.lineno + 1
            if lines > FUNCTION_LINES:
                where = f"{package.name}/{path.relative_to(package).as_posix()}:{node.lineno}"
                found.append(f"{where} {name}: {lines} lines (at most {FUNCTION_LINES})")
    return found


def test_no_module_is_over_its_size():
    assert len(list(PACKAGE.rglob("*.py"))) > 100, "the package's modules were not found"
    found = oversized_modules(PACKAGE)
    assert not found, "modules over their size (split each along a seam):\n" + "\n".join(found)


def test_no_function_is_over_80_lines():
    found = oversized_functions(PACKAGE)
    assert not found, "functions over 80 lines (give a part with its own job a name):\n" + "\n".join(found)


def test_the_checks_name_what_is_too_long_and_its_size(tmp_path):
    """The measures themselves, on a package made to break them (so the two checks above
    cannot pass by measuring nothing)."""
    package = tmp_path / "runner"
    (package / "train").mkdir(parents=True)
    (package / "big.py").write_text("x = 1\n" * 501)
    (package / "ok.py").write_text("x = 1\n" * 500)
    (package / "train" / "trainer.py").write_text("x = 1\n" * 451)
    body = "".join(f"        x{i} = {i}\n" for i in range(79))  # with its def line: 80 lines, allowed
    (package / "code.py").write_text(f"class Loop:\n    def fit(self):\n{body}        return 0\n\n"
                                     f"    def step(self):\n{body}\n")
    assert oversized_modules(package) == ["runner/big.py: 501 lines (at most 500)",
                                          "runner/train/trainer.py: 451 lines (at most 450)"]
    assert oversized_functions(package) == ["runner/code.py:2 Loop.fit: 81 lines (at most 80)"]
