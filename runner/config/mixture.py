"""data.mixture as the run's other code reads it: each source as a DataSpec of its own
(the run's data settings with the source's on top), its label, its share asked, and the
row layout the sources share. Config only: no data is read here."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Optional

from runner.config.data_spec import DataFormat, DataSpec, MixtureSource

# The settings a source may set; every other data.* setting is the run's.
SOURCE_SETTINGS = tuple(f.name for f in fields(MixtureSource) if f.name not in ("weight", "name"))
# The run's own data source, which a mixture replaces (refused beside it).
SINGLE_SOURCE = ("dataset_name", "dataset_config_name", "train_file", "validation_file")


def source_specs(data: DataSpec) -> list[DataSpec]:
    """Each source as a DataSpec (the run's, without a mixture, the source's settings on
    top); [data] itself when the run has no mixture. Every source reads its whole split:
    data.max_train_samples cuts the mixture, and max_eval_samples is shared out among the
    sources (evaluation_quota), not applied to each."""
    if not data.mixture:
        return [data]
    base = replace(data, mixture=None, max_train_samples=None, max_eval_samples=None)
    return [replace(base, **{k: getattr(source, k) for k in SOURCE_SETTINGS if getattr(source, k) is not None})
            for source in data.mixture]


def source_names(data: DataSpec) -> list[str]:
    """Each source's label: its `name`, else its dataset's name or train file's name; a
    repeated label gets its position."""
    if not data.mixture:
        return []
    names = [s.name or s.dataset_name or (Path(s.train_file).name if s.train_file else f"source {i}")
             for i, s in enumerate(data.mixture)]
    return [name if names.count(name) == 1 else f"{name} #{i}" for i, name in enumerate(names)]


def shares_asked(data: DataSpec) -> list[float]:
    """Each source's probability: its weight over their sum (validate refuses a sum of 0)."""
    weights = [float(s.weight) for s in data.mixture or []]
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else weights


def row_format(data: DataSpec) -> DataFormat:
    """The format the run's rows have: data.format; for a mixture, its sources' one format,
    or (text blocks among instruction examples) an instruction format's, the text blocks
    becoming examples trained on every token. Preference pairs and online RL's prompts mix
    with nothing else (validate refuses it)."""
    formats = {s.format for s in source_specs(data)}
    if len(formats) == 1:
        return formats.pop()
    for alone in (DataFormat.preference, DataFormat.prompts):  # they mix with nothing else (validate refuses it)
        if alone in formats:
            return alone
    return DataFormat.prompt_completion  # chat, prompt_completion and text rows share its layout


def evaluation_quota(sizes: list[int], cap: Optional[int]) -> list[int]:
    """How many of each source's validation rows data.max_eval_samples keeps: an even
    share each (the remainder to the first sources), a source with fewer rows giving
    what it leaves to the others. A cut taken from the front of the sources in turn
    would evaluate the first source alone, and report no loss for the others."""
    if cap is None:
        return list(sizes)
    quota, left = [0] * len(sizes), cap
    open_ = [i for i, size in enumerate(sizes) if size > 0]
    while left > 0 and open_:
        share, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            quota[i] += min(share + (rank < extra), sizes[i] - quota[i])
        left = cap - sum(quota)
        open_ = [i for i in open_ if quota[i] < sizes[i]]
    return quota
