"""The private library code runner changes, each change fenced by the versions it was verified on.

A patch of a library's private code is a debt: the next release may rename what it
touches, or fix what it works around. Each patch below names the library and the exact
versions it was checked against (its tests in tests/distributed/ pass there); on any
other installed version it is not engaged, the library's own behaviour runs, and the
banner and run_spec.yaml say so (`fence_notes`), with the command that installs the
verified version (runner/constraints.txt). To verify a new version, read the release's
diff of the code the patch touches, run the patch's `tests` against it (scripts/newest.sh
runs every patch's), and add the version here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from runner.config.versions import install_hint, installed


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # the distribution's name, as pip knows it
    verified: tuple[str, ...]  # versions it was verified on
    does: str  # what it changes
    without: str  # what happens where it is not engaged
    tests: tuple[str, ...]  # the pytest node ids that exercise it, run on a version before it is added


ACCELERATOR_TESTS = "tests/distributed/test_accelerator.py::"

ZERO3_RELEASE_GRADIENT_PARTITION = Patch(
    "zero3_release_gradient_partition", "deepspeed", ("0.19.8",),
    "ZeRO-3's fp32 gradient partition freed between steps (wraps DeepSpeedZeroOptimizer_Stage3.partition_grads "
    "and its name-mangled views)",
    "the partition stays allocated for the whole run",
    (ACCELERATOR_TESTS + "test_zero3_frees_its_gradient_partition_between_steps_and_still_accumulates_exactly",),
)
ZERO3_SHARE_FP32_MASTER = Patch(
    "zero3_share_fp32_master", "deepspeed", ("0.19.8",),
    "ZeRO-3 in fp32 keeps one copy of each partition, not two (aliases fp32_partitioned_groups_flat's .data)",
    "DeepSpeed keeps both",
    (ACCELERATOR_TESTS + "test_zero3_fp32_master_shares_the_working_partition_through_training_save_and_load",
     ACCELERATOR_TESTS + "test_zero3_master_is_not_shared_unless_it_is_a_true_copy"),
)
DEEPSPEED_FORGET_WORLD_GROUP = Patch(
    "deepspeed_forget_world_group", "deepspeed", ("0.19.8",),
    "a finished in-process ZeRO run clears deepspeed.utils.groups._WORLD_GROUP, so a one-process sweep's next "
    "ZeRO job can initialise",
    "that job fails with 'Group ... is not registered'",
    (ACCELERATOR_TESTS + "test_reset_forgets_deepspeeds_cached_world_group",),
)
FSDP2_ON_CPU = Patch(
    "fsdp2_on_cpu", "accelerate", ("1.15.0", "1.16.0"),
    "Accelerate's state set to FSDP on a CPU (AcceleratorState.distributed_type, PartialState._shared_state), as "
    "its GPU branch does",
    "strategy=fsdp is refused on a CPU by the engagement check",
    ("tests/distributed/test_fsdp.py",),
)
SKIP_OUTPUT_UPCAST = Patch(
    "skip_output_upcast", "accelerate", ("1.15.0", "1.16.0"),
    "under bf16/fp16 the model's outputs are not copied to fp32 (unwraps Accelerate's ConvertOutputsToFp32)",
    "every step copies the logits to fp32",
    (ACCELERATOR_TESTS + "test_bf16_keeps_autocast_but_not_the_fp32_copy_of_the_logits",
     ACCELERATOR_TESTS + "test_output_upcast_is_left_alone_in_fp32"),
)
ZERO2_LINK_READ_ACROSS_STATE = Patch(
    "zero2_link_read_across_state", "deepspeed", ("0.19.8",),
    "a checkpoint read across into zero2 links each parameter's fragment to the AdamW state made for it before "
    "the first step (calls DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state, "
    "runner/distributed/zero_checkpoint.py)",
    "resuming under zero2 from another layout or strategy is refused",
    ("tests/train/test_reshard_multiprocess.py",),
)

PATCHES = (ZERO3_RELEASE_GRADIENT_PARTITION, ZERO3_SHARE_FP32_MASTER, DEEPSPEED_FORGET_WORLD_GROUP, FSDP2_ON_CPU,
           SKIP_OUTPUT_UPCAST, ZERO2_LINK_READ_ACROSS_STATE)


@lru_cache(maxsize=None)
def installed_version(library: str) -> Optional[str]:
    return installed(library)


def engaged(patch: Patch) -> bool:
    """True when the installed library is one the patch was verified on."""
    return installed_version(patch.library) in patch.verified


def fence_notes(libraries: Optional[set[str]] = None) -> list[str]:
    """One line per patch left out on this machine (its library installed, at a version it
    was not verified on), for the banner and run_spec.yaml; `libraries` limits the list to
    the libraries a run uses."""
    notes = []
    for patch in PATCHES:
        version = installed_version(patch.library)
        if version is None or version in patch.verified or (libraries is not None and patch.library not in libraries):
            continue
        notes.append(f"patch {patch.name} not engaged: {patch.library} {version} is not a version it was verified on "
                     f"({', '.join(patch.verified)}); {patch.without}; the verified set: {install_hint(patch.library)}")
    return notes
