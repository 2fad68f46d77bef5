"""scripts/newest.sh's table and scripts/lock.py's lock, on fixtures: no registry is asked."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from runner.config import versions
from runner.distributed import patches

REPO = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name.removesuffix('_script')}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


newest = load("newest_script")
lock = load("lock_script")

PIP_INDEX = """accelerate (1.17.0)
Available versions: 1.17.0, 1.16.0, 1.15.0
"""


def test_the_patch_tests_are_every_patchs_once():
    tests = newest.patch_tests()
    assert len(tests) == len(set(tests))
    assert set(tests) == {t for p in patches.PATCHES for t in p.tests}


def test_pip_index_answer_gives_the_newest_version():
    assert newest.parse_pip_index(PIP_INDEX) == "1.17.0"
    assert newest.parse_pip_index("ERROR: No matching distribution found for nothing\n") is None


def fixture_lock(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "constraints.txt"
    path.write_text("# torch==2.13.0\naccelerate==1.16.0\ntransformers==5.25.0\ndeepspeed==0.19.8\n"
                    'omegaconf==2.3.1 ; python_version >= "3.11"\n')
    return versions.read_lock(path)


def verdicts(table) -> dict[str, str]:
    return {row.library: row.verdict for row in table}


def test_a_newer_release_that_passes_every_check_is_verified_and_its_fences_named(tmp_path):
    have = {"torch": "2.13.0+cpu", "accelerate": "1.17.0", "transformers": "5.25.0", "deepspeed": "0.19.8",
            "omegaconf": "2.3.1"}.get
    registry = {"accelerate": "1.17.0", "transformers": "5.25.0", "omegaconf": "2.4.0", "torch": "2.15.0"}
    table = newest.rows(fixture_lock(tmp_path), {"patches": 0, "certify": 0, "unit": 0}, registry, have=have)
    got = verdicts(table)
    assert got["accelerate"].startswith("NEWER, every check passed: verified")
    assert "fence to extend: fsdp2_on_cpu, skip_output_upcast" in got["accelerate"]
    assert got["transformers"] == "as locked"
    assert got["omegaconf"] == "as locked; registry's 2.4.0 not tried (pyproject.toml's range, or the machine's cap)"
    assert got["torch"].startswith("as locked; registry's 2.15.0 not tried")  # a local build's suffix is the same release
    assert got["peft"] == "not installed"
    rendered = newest.render(table, {"patches": 0, "certify": 0, "unit": 0})
    assert "| accelerate | 1.16.0 | 1.17.0 | 1.17.0 | NEWER, every check passed" in rendered
    assert rendered.endswith("checks: patches passed, certify passed, unit passed")


def test_a_failed_check_leaves_every_newer_release_unverified(tmp_path):
    have = {"accelerate": "1.17.0", "transformers": "5.26.0"}.get
    checks = {"patches": 1, "certify": 0, "unit": 2}
    table = newest.rows(fixture_lock(tmp_path), checks, {}, have=have)
    got = verdicts(table)
    assert got["accelerate"].startswith("NEWER, checks failed (patches, unit): not verified")
    assert got["transformers"] == "NEWER, checks failed (patches, unit): not verified"
    assert "certify passed, unit FAILED (exit 2)" in newest.render(table, checks)


def test_table_command_reads_its_inputs_from_files(tmp_path, capsys):
    fixture_lock(tmp_path)
    (tmp_path / "checks.json").write_text(json.dumps({"patches": 0, "certify": 0, "unit": 0}))
    (tmp_path / "registry.json").write_text(json.dumps({"accelerate": "1.16.0"}))
    assert newest.main(["table", "--checks", str(tmp_path / "checks.json"), "--registry",
                        str(tmp_path / "registry.json"), "--lock", str(tmp_path / "constraints.txt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| library | locked |")
    assert len([line for line in out if line.startswith("|")]) == 2 + len(versions.KEY_LIBRARIES)


@pytest.mark.parametrize("requires, marker", [
    (None, ""), (">=3.9", ""), (">=3.10", ""), (">=3.11", ' ; python_version >= "3.11"'),
    (">=3.10,<3.13", ' ; python_version < "3.13"'), (">=3.12,<3.14", ' ; python_version >= "3.12" and python_version < "3.14"'),
])
def test_a_pin_that_leaves_out_a_python_gets_a_marker(requires, marker):
    assert lock.python_marker(requires) == marker


def test_the_lock_written_here_pins_what_is_installed_but_torch_and_runner(tmp_path):
    text = lock.lock_text(lock.installed_distributions())
    (tmp_path / "constraints.txt").write_text(text)
    pins = versions.read_lock(tmp_path / "constraints.txt")
    assert "\n# torch==" in text and not [line for line in text.splitlines() if line.startswith("torch==")]
    assert "runner" not in pins and "pip" not in pins
    assert pins["accelerate"] == versions.installed("accelerate")


def test_newest_sh_runs_the_patches_certify_and_unit_checks():
    script = (REPO / "scripts" / "newest.sh").read_text()
    assert 'check patches "$PY" -m pytest' in script and "newest.py patch-tests" in script
    assert 'check certify "$OUT/venv/bin/runner" certify gpt2' in script
    assert 'check unit "$PY" -m pytest -p no:cacheprovider -m unit' in script


def test_the_deepspeed_extra_is_read_from_pyproject():
    from packaging.requirements import Requirement

    requirement = Requirement(lock.extra_requirement("deepspeed"))
    assert requirement.name == "deepspeed" and requirement.specifier.contains(versions.locked_versions()["deepspeed"])
