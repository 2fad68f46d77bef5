"""A pairwise covering array: cells in which every pair of factor values that can meet,
meets at least once, in a few dozen cells instead of every combination.

Factors are named, each with its values; a value may apply only under others (DPO's
reference mode only to DPO, `adapter_off` only with adapters): a cell gives such a factor
the value None where it does not apply, and `applies` says which full cells can run at
all. A pair is required when some cell that applies holds it. The cells are chosen
greedily (each the candidate covering most pairs not yet covered, ties to the first in the
factors' order: deterministic), the way AETG and allpairspy build theirs; with 8 factors
of 2-4 values it needs some 20 cells, against 1,700 combinations. A new value of any
factor (the next objective) joins every pair without a line listed by hand.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping, Optional, Sequence

Cell = dict[str, Optional[str]]
Pair = tuple[tuple[str, Optional[str]], tuple[str, Optional[str]]]


def candidates(factors: Mapping[str, Sequence[str]], applies: Callable[[Cell], bool]) -> list[Cell]:
    """Every cell that can run: each factor a value of its own or None (not applying)."""
    names = list(factors)
    cells = []
    for values in itertools.product(*[[*factors[name], None] for name in names]):
        cell = dict(zip(names, values))
        if applies(cell):
            cells.append(cell)
    return cells


def pairs_of(cell: Cell) -> set[Pair]:
    """The pairs of values a cell holds (a factor that does not apply is no value)."""
    held = [(name, value) for name, value in cell.items() if value is not None]
    return {(a, b) for a, b in itertools.combinations(held, 2)}


def covering_array(factors: Mapping[str, Sequence[str]], applies: Callable[[Cell], bool]) -> list[Cell]:
    """Cells in which every pair some applicable cell holds is held at least once."""
    pool = candidates(factors, applies)
    held = [pairs_of(cell) for cell in pool]
    uncovered = set().union(*held) if held else set()
    chosen: list[Cell] = []
    while uncovered:
        best = max(range(len(pool)), key=lambda i: (len(held[i] & uncovered), -i))
        chosen.append(pool[best])
        uncovered -= held[best]
    return chosen


def required_pairs(factors: Mapping[str, Sequence[str]], applies: Callable[[Cell], bool]) -> set[Pair]:
    """Every pair some applicable cell holds: what a covering array must cover."""
    return set().union(*(pairs_of(cell) for cell in candidates(factors, applies)))


def uncovered_pairs(cells: Sequence[Cell], factors: Mapping[str, Sequence[str]],
                    applies: Callable[[Cell], bool]) -> set[Pair]:
    """The required pairs `cells` leave out (a refused cell covers nothing)."""
    return required_pairs(factors, applies) - set().union(*(pairs_of(cell) for cell in cells))
