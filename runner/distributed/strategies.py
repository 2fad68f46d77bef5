"""The strategy object for a spec (runner/distributed/strategy.py is the interface)."""

from __future__ import annotations

from runner.config.spec import PrecisionSpec, StrategyKind, StrategySpec
from runner.distributed.deepspeed import ZeroStrategy
from runner.distributed.fsdp import FSDPStrategy
from runner.distributed.strategy import DDPStrategy, Strategy

STRATEGIES: dict[StrategyKind, type[Strategy]] = {
    StrategyKind.ddp: DDPStrategy,
    StrategyKind.zero2: ZeroStrategy,
    StrategyKind.zero3: ZeroStrategy,
    StrategyKind.fsdp: FSDPStrategy,
}


def build_strategy(spec: StrategySpec, precision: PrecisionSpec) -> Strategy:
    """strategy=accelerate_config is turned into one of the others by the launcher
    (runner/launch/accelerate_config.py) before any worker builds its strategy."""
    if spec.kind not in STRATEGIES:
        raise ValueError(f"strategy={spec.kind.value} has no strategy object; the launcher resolves it first")
    return STRATEGIES[spec.kind](spec, precision)


def strategy_of_kind(kind: str) -> Strategy:
    """The strategy object for a kind alone, as a checkpoint's run_spec.yaml records the
    strategy that wrote it: the format it reads, and how a state is set into it, depend on
    the kind alone. ValueError for a kind with no object."""
    return build_strategy(StrategySpec(kind=StrategyKind(kind)), PrecisionSpec())
