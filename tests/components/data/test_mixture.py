"""data.mixture on the cached path (runner/components/data/mixture.py): a mixture of one
source is that source bit for bit; several are sampled as datasets.interleave_datasets
samples them, each row whole and in its source's order; text blocks among instruction
examples train on every token; the realised shares follow the schedule in closed form,
in every layout."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from runner.components.data.epoch_batches import EpochBatches, EpochSampler
from runner.components.data.mixture import SOURCE
from runner.components.data.prepare import collate_for, prepare
from runner.config.data_spec import DataFormat, DataSpec, MixtureSource, MixtureStop
from runner.config.paths import asset_path

NOVELS, INSTRUCTIONS = str(asset_path("austen.txt.gz")), str(asset_path("austen_sft.jsonl.gz"))


def column(rows, name: str) -> list:
    """A column as plain Python values (datasets 5 hands out a lazy Column)."""
    return rows.with_format(None)[:][name]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


def two_sources(stopping: MixtureStop = MixtureStop.first_exhausted, packing: bool = True) -> DataSpec:
    return DataSpec(block_size=128, packing=packing, mixture_stopping=stopping, mixture=[
        MixtureSource(name="novels", train_file=NOVELS, format=DataFormat.text, weight=0.7),
        MixtureSource(name="instructions", train_file=INSTRUCTIONS, format=DataFormat.prompt_completion, weight=0.3)])


@pytest.mark.parametrize("source", [
    {"train_file": NOVELS, "format": DataFormat.text},
    {"train_file": INSTRUCTIONS, "format": DataFormat.prompt_completion},
])
def test_a_mixture_of_one_source_is_that_source_bit_for_bit(tokenizer, source):
    alone = prepare(DataSpec(block_size=128, packing=source["format"] is not DataFormat.text, **source), tokenizer, 128)
    mixed = prepare(DataSpec(block_size=128, packing=source["format"] is not DataFormat.text,
                             mixture=[MixtureSource(weight=3.0, **source)]), tokenizer, 128)
    for ours, theirs in ((mixed.train, alone.train), (mixed.validation, alone.validation)):
        assert len(ours) == len(theirs)
        columns = [c for c in theirs.column_names]
        assert sorted(c for c in ours.column_names if c != SOURCE) == sorted(columns)
        for name in columns:
            assert column(ours, name) == column(theirs, name), name
    spec = DataSpec(block_size=128, **source)
    rows = [mixed.train[i] for i in range(4)]
    batch, again = collate_for(spec, mixed.pad_id)(rows), collate_for(spec, alone.pad_id)([alone.train[i] for i in range(4)])
    assert batch.keys() == again.keys() and all(torch.equal(batch[k], again[k]) for k in batch)


def test_two_sources_are_interleaved_whole_in_their_order(tokenizer):
    data = two_sources()
    mixed = prepare(data, tokenizer, 128)
    novels = prepare(DataSpec(block_size=128, train_file=NOVELS), tokenizer, 128).train
    instructions = prepare(DataSpec(block_size=128, train_file=INSTRUCTIONS, format=DataFormat.prompt_completion,
                                    packing=True), tokenizer, 128).train
    sources = column(mixed.train, SOURCE)
    seen = [0, 0]
    for index, source in enumerate(sources):  # each source's rows in its own order, whole
        row, origin = mixed.train[index], (novels, instructions)[source][seen[source]]
        assert torch.equal(row["input_ids"], origin["input_ids"]), index
        if source == 0:  # a block trains every token: labels are its ids, one sequence
            assert torch.equal(row["labels"], row["input_ids"]) and row["real_tokens"] == 128
            assert torch.equal(row["position_ids"], torch.arange(128))
        else:
            assert torch.equal(row["labels"], origin["labels"]) and torch.equal(row["position_ids"], origin["position_ids"])
        seen[source] += 1
    # first_exhausted: sampling stops as the instructions run out, the novels part-read
    assert seen[1] == len(instructions) and seen[0] < len(novels) and sources[-1] == 1
    share = seen[0] / len(sources)
    assert abs(share - 0.7) < 0.03, share  # 0.7 asked; a binomial's sd here is 0.006
    figures = {f.name: f for f in mixed.mixture.figures}
    assert figures["novels"].mixed_examples == seen[0] and figures["instructions"].examples == len(instructions)
    assert figures["novels"].mixed_tokens == 128 * seen[0]
    assert sum(mixed.mixture.tokens) == sum(f.mixed_tokens for f in figures.values())
    assert len(mixed.validation) == figures["novels"].validation_examples + figures["instructions"].validation_examples


def test_max_eval_samples_is_shared_among_the_sources_so_each_is_evaluated(tokenizer):
    """data.max_eval_samples=9: 5 of the novels' validation rows and 4 of the
    instructions', each its own first rows; every source keeps a loss of its own."""
    whole = prepare(two_sources(), tokenizer, 128).validation
    cut = prepare(replace(two_sources(), max_eval_samples=9), tokenizer, 128).validation
    sources, everything = column(cut, SOURCE), column(whole, SOURCE)
    assert sources == [0] * 5 + [1] * 4
    first_instruction = everything.index(1)
    kept = list(range(5)) + list(range(first_instruction, first_instruction + 4))
    assert column(cut, "input_ids") == [column(whole, "input_ids")[i] for i in kept]


def test_all_exhausted_repeats_the_smaller_source(tokenizer):
    mixed = prepare(two_sources(MixtureStop.all_exhausted), tokenizer, 128)
    figures = {f.name: f for f in mixed.mixture.figures}
    assert figures["novels"].mixed_examples == figures["novels"].examples  # every block, once
    assert figures["instructions"].mixed_examples > figures["instructions"].examples  # oversampled


def test_unpacked_examples_and_blocks_share_the_padded_batch(tokenizer):
    mixed = prepare(two_sources(packing=False), tokenizer, 128)
    sources = column(mixed.train, SOURCE)
    rows = [mixed.train[sources.index(0)], mixed.train[sources.index(1)]]
    batch = collate_for(two_sources(packing=False), mixed.pad_id)(rows)
    assert torch.equal(batch["labels"][0], rows[0]["input_ids"]) and batch["attention_mask"][0].all()
    assert "source" not in batch and "position_ids" not in batch


@pytest.mark.parametrize("world, per_device, accumulation", [(1, 8, 1), (2, 2, 2), (2, 3, 1)])
def test_the_trained_shares_are_the_schedules_rows_in_every_layout(world, per_device, accumulation):
    """Mixture.shares_trained counts rows [k x global batch, (k + 1) x global batch) of
    each epoch's order for step k; here against the rows EpochBatches hands every rank, in
    Accelerate's round-robin, for 1.5 epochs of a 40-row mixture whose last step is short."""
    from runner.components.data.mixture import Mixture, SourceFigures
    from runner.train.finish import mixture_results

    rows, seed = 43, 7
    sources = [int(i % 3 == 0) for i in range(rows)]
    tokens = [10 + i for i in range(rows)]
    global_batch = world * per_device * accumulation
    steps_per_epoch = -(-rows // global_batch)
    steps = steps_per_epoch + steps_per_epoch // 2 + 1
    trained = [0, 0]
    trained_tokens = [0, 0]
    done = 0
    for epoch in range(2):
        sampler = EpochSampler(rows, seed)
        sampler.set_epoch(epoch)
        batches = list(EpochBatches(sampler, per_device, world))
        rounds = [batches[i:i + world] for i in range(0, len(batches), world)]  # one batch a rank a round
        steps_here = -(-len(rounds) // accumulation)
        for step in range(steps_here):
            if done == steps:
                break
            for round_ in rounds[step * accumulation:(step + 1) * accumulation]:
                for batch in round_:
                    for index in batch:
                        if index < rows:  # a filler trains nothing
                            trained[sources[index]] += 1
                            trained_tokens[sources[index]] += tokens[index]
            done += 1
    assert done == steps

    plan = SimpleNamespace(global_batch_size=global_batch, steps_per_epoch=steps_per_epoch)
    data = SimpleNamespace(train=range(rows), mixture=Mixture(sources, tokens, [SourceFigures(n, 0.5, 0, 0, 0)
                                                                                for n in ("a", "b")]))
    spec = SimpleNamespace(train=SimpleNamespace(seed=seed))
    results = mixture_results(spec, data, plan, steps)
    assert [r["trained_examples_share"] for r in results] == [round(t / sum(trained), 6) for t in trained]
    assert [r["trained_tokens_share"] for r in results] == [round(t / sum(trained_tokens), 6) for t in trained_tokens]


def test_a_mixture_of_preference_sources_numbers_each_pair_by_its_place_in_the_mixture(tokenizer, tmp_path):
    """The precomputed reference's table is indexed by `pair_index`: each source numbers its
    pairs from 0, so the mixture renumbers them, or source A's pair 0 and source B's pair 0
    would read one row (issue 61, 1)."""
    import gzip
    import json

    records = [json.loads(line) for line in gzip.open(asset_path("austen_pref.jsonl.gz"), "rt")][:300]
    second = tmp_path / "second.jsonl"
    second.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))
    data = DataSpec(block_size=128, format=DataFormat.preference, mixture=[
        MixtureSource(name="a", train_file=str(asset_path("austen_pref.jsonl.gz")), weight=0.5),
        MixtureSource(name="b", train_file=str(second), weight=0.5)])
    mixed = prepare(data, tokenizer, 128)
    for split in (mixed.train, mixed.validation):
        sources = column(split, SOURCE)
        assert set(sources) == {0, 1}  # both sources in each split
        assert column(split, "pair_index") == list(range(len(split)))
    chosen = column(mixed.train, "chosen_input_ids")
    rows = collate_for(data, mixed.pad_id)([mixed.train[i] for i in range(6)])
    assert rows["pair_index"].tolist() == list(range(6)) and len(chosen) == len(mixed.train)
