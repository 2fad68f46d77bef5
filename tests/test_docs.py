"""The README keeps the mappings the code applies, and its commands exist."""

from pathlib import Path

from runner.launch.accelerate_config import ACCELERATE_KEYS, RUN_CLM_FLAGS

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_lists_every_accelerate_key_and_run_clm_flag():
    for key, override in {**ACCELERATE_KEYS, **RUN_CLM_FLAGS}.items():
        assert f"| `{key}` | `{override}` |" in README, key


def test_readme_has_the_sections_users_look_for():
    for heading in ("## Fresh machine: two commands", "## Coming from accelerate launch", "## When a run hangs",
                    "## Checkpoints and resume", "## Precision and sweeps"):
        assert heading in README


def test_readme_on_gpus_names_the_variables_and_settings():
    section = README.split("## On GPUs", 1)[1].split("\n## ", 1)[0]
    for text in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "--cpus-per-task", "compute capability 8.0",
                 "launch.timeout_minutes", "launch.rdzv_endpoint", "NCCL_DEBUG=INFO", "SIGABRT"):
        assert text in section, text
