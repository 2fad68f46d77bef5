"""The private library code runner changes, each change fenced by the versions it was verified on.

A patch of a library's private code is a debt: the next release may rename what it
touches, or fix what it works around. Each patch below names the library and the exact
versions it was checked against (its tests in tests/distributed/ pass there); on any
other installed version it is not engaged, the library's own behaviour runs, and the
banner and run_spec.yaml say so (`fence_notes`). To verify a new version, run the
tests named in the patch's note against it and add the version here.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # the distribution's name, as pip knows it
    verified: tuple[str, ...]  # versions it was verified on
    does: str  # what it changes
    without: str  # what happens where it is not engaged


ZERO3_RELEASE_GRADIENT_PARTITION = Patch(
    "zero3_release_gradient_partition", "deepspeed", ("0.19.8",),
    "ZeRO-3's fp32 gradient partition freed between steps (wraps DeepSpeedZeroOptimizer_Stage3.partition_grads "
    "and its name-mangled views)",
    "the partition stays allocated for the whole run",
)
ZERO3_SHARE_FP32_MASTER = Patch(
    "zero3_share_fp32_master", "deepspeed", ("0.19.8",),
    "ZeRO-3 in fp32 keeps one copy of each partition, not two (aliases fp32_partitioned_groups_flat's .data)",
    "DeepSpeed keeps both",
)
DEEPSPEED_FORGET_WORLD_GROUP = Patch(
    "deepspeed_forget_world_group", "deepspeed", ("0.19.8",),
    "a finished in-process ZeRO run clears deepspeed.utils.groups._WORLD_GROUP, so a one-process sweep's next "
    "ZeRO job can initialise",
    "that job fails with 'Group ... is not registered'",
)
FSDP2_ON_CPU = Patch(
    "fsdp2_on_cpu", "accelerate", ("1.15.0",),
    "Accelerate's state set to FSDP on a CPU (AcceleratorState.distributed_type, PartialState._shared_state), as "
    "its GPU branch does",
    "strategy=fsdp is refused on a CPU by the engagement check",
)
SKIP_OUTPUT_UPCAST = Patch(
    "skip_output_upcast", "accelerate", ("1.15.0",),
    "under bf16/fp16 the model's outputs are not copied to fp32 (unwraps Accelerate's ConvertOutputsToFp32)",
    "every step copies the logits to fp32",
)
ZERO2_LINK_READ_ACROSS_STATE = Patch(
    "zero2_link_read_across_state", "deepspeed", ("0.19.8",),
    "a checkpoint read across into zero2 links each parameter's fragment to the AdamW state made for it before "
    "the first step (calls DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state, "
    "runner/distributed/zero_checkpoint.py)",
    "resuming under zero2 from another layout or strategy is refused",
)

PATCHES = (ZERO3_RELEASE_GRADIENT_PARTITION, ZERO3_SHARE_FP32_MASTER, DEEPSPEED_FORGET_WORLD_GROUP, FSDP2_ON_CPU,
           SKIP_OUTPUT_UPCAST, ZERO2_LINK_READ_ACROSS_STATE)


@lru_cache(maxsize=None)
def installed_version(library: str) -> Optional[str]:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


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
                     f"({', '.join(patch.verified)}); {patch.without}")
    return notes
