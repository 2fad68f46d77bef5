"""The README and docs/ keep the mappings the code applies, the sections users look for, and links that resolve."""

import re
from pathlib import Path

from runner.launch.accelerate_config import ACCELERATE_KEYS, RUN_CLM_FLAGS

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Where each section users look for lives: page -> headings it must hold (any level).
SECTIONS = {
    "README.md": ("Fresh machine: two commands", "Examples", "Documentation", "Tests"),
    "docs/strategies.md": ("Processes, strategies and machines", "Coming from accelerate launch"),
    "docs/precision-and-sweeps.md": ("Precision and sweeps",),
    "docs/resume-and-faults.md": ("Checkpoints and resume", "When a run hangs"),
    "docs/clusters-and-slurm.md": ("Two machines", "Slurm", "Preemption and requeue on Slurm"),
    "docs/gpus.md": ("On GPUs",),
    "docs/architectures.md": ("Architectures: any causal LM, certified", "Certifying an architecture", "The matrix"),
    "docs/run-folder.md": ("Seeing the run", "The run folder"),
    "docs/config-groups.md": ("Configuration groups", "Your own recipes"),
    "docs/benchmarks.md": ("Benchmarks",),
}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _headings(text: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ +(.+)$", text, re.M)}


def test_strategies_page_lists_every_accelerate_key_and_run_clm_flag():
    page = (DOCS / "strategies.md").read_text()
    for key, override in {**ACCELERATE_KEYS, **RUN_CLM_FLAGS}.items():
        assert f"| `{key}` | `{override}` |" in page, key


def test_the_sections_users_look_for_are_where_the_readme_says():
    for name, headings in SECTIONS.items():
        path = ROOT / name
        assert path.is_file(), name
        found = _headings(path.read_text())
        for heading in headings:
            assert heading in found, f"{name}: no heading {heading!r}"


def test_on_gpus_page_names_the_variables_and_settings():
    section = (DOCS / "gpus.md").read_text()
    for text in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "--cpus-per-task", "compute capability 8.0",
                 "launch.timeout_minutes", "launch.rdzv_endpoint", "NCCL_DEBUG=INFO", "SIGABRT"):
        assert text in section, text


def test_readme_links_every_docs_page():
    linked = {(README.parent / target.split("#", 1)[0]).resolve()
              for target in LINK.findall(README.read_text()) if not target.startswith("#")}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


def test_every_relative_link_points_at_an_existing_file():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s)://, mailto:, or an anchor in the same page
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_readme_stays_a_doorway():
    """The README says what runner is and where to read on; the manual lives in docs/ (issue 47)."""
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines (at most 250): move the detail into its docs/ page"


def _layer_rows(page: str) -> list[tuple[list[str], str]]:
    """docs/architecture.md's layer table: each row's package groups (its first cell's
    `group/` names, or runner/ itself for `cli.py`) and the rest of the row."""
    section = page.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        groups = re.findall(r"`([a-z_]+)/`", cells[1]) or [""]
        rows.append((groups, "|".join(cells[2:])))
    return rows


def test_every_module_the_architecture_page_names_exists():
    """docs/architecture.md draws the package as it is: each module its flow names
    (`group/module.py`) exists at that path, and each one a layer row names exists in
    one of that row's groups (a module moved or renamed without the page fails here)."""
    package = ROOT / "runner"
    page = (DOCS / "architecture.md").read_text()
    flow = page.split("## The flow", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.py)\b", flow)
    assert len(named) >= 6, "the flow names the modules a run passes through"
    missing = [name for name in named if not (package / name).is_file()]
    rows = _layer_rows(page)
    assert len(rows) >= 6, "the layer table has a row per group"
    for groups, rest in rows:
        for name in re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", rest):
            places = [package / group / name for group in groups] + ([package / name] if "/" in name else [])
            if not any(place.is_file() for place in places):
                missing.append(f"{'|'.join(groups) or 'runner'}: {name}")
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
