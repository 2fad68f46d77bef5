"""The lock (runner/constraints.txt): what it pins, how it is read, and how a difference is named."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from runner.config import versions

REPO = Path(__file__).resolve().parents[2]


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in [*project["dependencies"], *extras]]


def test_the_lock_pins_every_dependency_and_extra_within_pyprojects_range():
    lock = versions.read_lock(versions.LOCK_FILE)
    for requirement in project_requirements():
        name = versions.canonical(requirement.name)
        assert name in lock, f"{name} is a dependency of runner but not in the lock"
        assert requirement.specifier.contains(lock[name], prereleases=True), (name, lock[name], requirement.specifier)
    for name in versions.KEY_LIBRARIES:
        assert versions.canonical(name) in lock, name


def test_torch_is_recorded_not_constrained():
    text = versions.LOCK_FILE.read_text()
    pins = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not [line for line in pins if line.startswith("torch==")]  # a GPU build installed first is kept
    assert versions.read_lock(versions.LOCK_FILE)["torch"]  # but its verified version is on record
    assert "pip install -c runner/constraints.txt ." in text and "pip install ." in text


def test_read_lock_takes_pins_markers_and_recorded_lines(tmp_path):
    lock = tmp_path / "constraints.txt"
    lock.write_text("# a comment with pip install torch==9.9 in it\n# torch==2.13.0\nAccelerate==1.16.0\n"
                    'numpy==2.4.6 ; python_version >= "3.11"\nlm_eval==0.4.13\n\n')
    assert versions.read_lock(lock) == {"torch": "2.13.0", "accelerate": "1.16.0", "numpy": "2.4.6",
                                        "lm-eval": "0.4.13"}


def test_differences_name_each_library_off_the_lock(monkeypatch):
    real = versions.installed
    monkeypatch.setattr(versions, "installed",
                        lambda name: {"accelerate": "1.99.0", "torch": versions.locked_versions()["torch"] + "+cu130"}
                        .get(name) or real(name))
    found = versions.differences()
    assert found == [("accelerate", "1.99.0", versions.locked_versions()["accelerate"])]  # torch's local build agrees
    assert versions.install_hint("accelerate") == f"pip install -c {versions.LOCK_FILE} accelerate"
