"""A streamed mixture (data.mixture with data.streaming=true): the sources' blocks sampled
as `datasets.interleave_datasets` samples them, every rank its world-th block, each
source's evaluation blocks, an exact position past a shuffle window and past a source's
end on a rank other than 0, and the blocks handed out per source."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from datasets import Dataset, interleave_datasets
from test_stream import BLOCK, blocks, lines, loader, tokenizer, write_jsonl  # noqa: F401 - fixtures

from runner.components.data.labels import SOURCE
from runner.components.data.stream import BlockStream, blocks_handed_out, open_stream
from runner.config.data_spec import MixtureSource, MixtureStop
from runner.config.spec import DataSpec

SEED = 3


def mixture_spec(tmp_path, lines, stopping: str = "first_exhausted", weights=(0.7, 0.3), **extra) -> DataSpec:  # noqa: F811
    """A large source (2,400 lines: 1,076 training blocks) and a small one (30 lines: 9
    after its 4 held-out ones; under all_exhausted its 10th comes at mixed block 44),
    unshuffled unless `extra` says otherwise."""
    big = write_jsonl(tmp_path / "big.jsonl", lines[:2400])
    small = write_jsonl(tmp_path / "small.jsonl", lines[2400:2430])
    sources = [MixtureSource(name="big", train_file=str(big), weight=weights[0]),
               MixtureSource(name="small", train_file=str(small), weight=weights[1])]
    return DataSpec(**{"train_file": None, "mixture": sources, "mixture_stopping": MixtureStop(stopping),
                       "mixture_seed": 11, "streaming": True, "shuffle_buffer": 0, "validation_blocks": 4, **extra})


def alone(spec: DataSpec, index: int, tokenizer) -> list[list[int]]:  # noqa: F811
    """A source's training blocks as a stream of it alone yields them, unshuffled."""
    source = spec.mixture[index]
    single = DataSpec(train_file=source.train_file, streaming=True, shuffle_buffer=0, validation_blocks=spec.validation_blocks)
    return blocks(open_stream(single, tokenizer, BLOCK, SEED).train)


def oracle(spec: DataSpec, tokenizer) -> tuple[list[list[int]], list[int], list[int]]:  # noqa: F811
    """interleave_datasets itself, over each source's blocks as a stream of it alone gives
    them: the mixed blocks, their sources, and each source's block count alone."""
    each = [alone(spec, i, tokenizer) for i in range(len(spec.mixture))]
    parts = [Dataset.from_dict({"input_ids": b, SOURCE: [i] * len(b)}).to_iterable_dataset() for i, b in enumerate(each)]
    mixed = list(interleave_datasets(parts, probabilities=[0.7, 0.3], seed=spec.mixture_seed,
                                     stopping_strategy=spec.mixture_stopping.value))
    return [row["input_ids"] for row in mixed], [row[SOURCE] for row in mixed], [len(b) for b in each]


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_an_unshuffled_mixture_is_interleave_datasets_over_its_sources(tmp_path, lines, tokenizer, stopping):  # noqa: F811
    spec = mixture_spec(tmp_path, lines, stopping)
    streamed = open_stream(spec, tokenizer, BLOCK, SEED)
    expected, sources, sizes = oracle(spec, tokenizer)
    got = blocks(streamed.train)
    assert got == expected and len(got) > 20
    counted = Counter(sources)
    assert streamed.train.counts == [counted[0], counted[1]]
    if stopping == "all_exhausted":  # the small source ran out and started again
        assert counted[1] > sizes[1]
    # each source's evaluation blocks, in the sources' order, with their index
    assert streamed.sources == ("big", "small")
    assert [int(v) for v in streamed.validation[SOURCE]] == [0] * 4 + [1] * 4


def test_every_rank_keeps_its_world_th_block_of_the_mixture(tmp_path, lines, tokenizer):  # noqa: F811
    spec = mixture_spec(tmp_path, lines)
    whole = blocks(open_stream(spec, tokenizer, BLOCK, SEED).train)
    ranks = [blocks(open_stream(spec, tokenizer, BLOCK, SEED, rank=r, world_size=2).train) for r in range(2)]
    assert ranks[0] == whole[0::2] and ranks[1] == whole[1::2][:len(ranks[1])]


def test_a_source_of_weight_0_is_evaluated_and_never_trained(tmp_path, lines, tokenizer):  # noqa: F811
    spec = mixture_spec(tmp_path, lines, weights=(1.0, 0.0))
    streamed = open_stream(spec, tokenizer, BLOCK, SEED)
    assert blocks(streamed.train) == alone(spec, 0, tokenizer) and streamed.train.counts[1] == 0
    assert [int(v) for v in streamed.validation[SOURCE]].count(1) == 4


def test_max_eval_samples_is_shared_among_the_streamed_sources(tmp_path, lines, tokenizer):  # noqa: F811
    spec = mixture_spec(tmp_path, lines, max_eval_samples=5)
    whole = open_stream(mixture_spec(tmp_path, lines), tokenizer, BLOCK, SEED).validation
    cut = open_stream(spec, tokenizer, BLOCK, SEED).validation
    assert [int(v) for v in cut[SOURCE]] == [0, 0, 0, 1, 1]
    assert [list(map(int, r)) for r in cut["input_ids"]] == [list(map(int, whole["input_ids"][i])) for i in (0, 1, 2, 4, 5)]


# rank 1's blocks 9 and 27 (mixed blocks 18 and 54): in its 3rd window, and past the small source's restart at 44
@pytest.mark.parametrize("cut", [3, 9])
def test_rank_1_restored_past_a_window_and_a_sources_end_continues_exactly(tmp_path, lines, tokenizer, cut):  # noqa: F811
    spec = mixture_spec(tmp_path, lines, "all_exhausted", shuffle_buffer=4)

    def share() -> BlockStream:
        stream = open_stream(spec, tokenizer, BLOCK, SEED, rank=1, world_size=2).train
        stream.set_epoch(1)
        return stream

    whole = [b["input_ids"].tolist() for b in loader(share(), 0)]
    first = loader(share(), 0)
    head = [b["input_ids"].tolist() for b in itertools.islice(first, cut)]
    state = first.state_dict()
    handed = blocks_handed_out(state)
    again = loader(share(), 0)
    again.load_state_dict(state)
    tail = [b["input_ids"].tolist() for b in again]
    assert head + tail == whole and len(whole) > cut + 3
    # the counts went on from the state: the whole pass's, as the uninterrupted one counted
    assert sum(handed) == cut * 3  # 3 blocks a batch (test_stream's loader)
    full = share()
    list(loader(full, 0))
    assert blocks_handed_out(again.state_dict()) == full.counts


def test_blocks_handed_out_sums_loader_workers_states():
    one = {"epoch": 0, "start": None, "sources": [3, 1]}
    two = {"epoch": 0, "start": None, "sources": [2, 2]}
    assert blocks_handed_out({"_snapshot": {"_worker_snapshots": {"w0": {"dataset_state": one},
                                                                  "w1": {"dataset_state": two}}}}) == [5, 3]
    assert blocks_handed_out({"nothing": 1}) == []
