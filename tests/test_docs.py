"""The README keeps the mappings the code applies, and its commands exist."""

from pathlib import Path

from runner.accelerate_config import ACCELERATE_KEYS, RUN_CLM_FLAGS

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_lists_every_accelerate_key_and_run_clm_flag():
    for key, override in {**ACCELERATE_KEYS, **RUN_CLM_FLAGS}.items():
        assert f"| `{key}` | `{override}` |" in README, key


def test_readme_has_the_sections_users_look_for():
    for heading in ("## Fresh machine: two commands", "## Coming from accelerate launch", "## When a run hangs",
                    "## Checkpoints and resume", "## Precision and sweeps"):
        assert heading in README
