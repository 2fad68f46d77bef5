"""Streaming data: the cached path's blocks, every format, per-rank shares, seeded
windows, an exact position at any block, and a bad record named by file and line."""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from runner.components.data.prepare import prepare
from runner.components.data.stream import BadRecord, BlockStream, check_stream_files, open_stream
from runner.config.paths import asset_path
from runner.config.spec import DataSpec

BLOCK = 32


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """3,000 non-blank lines of the vendored corpus: three of datasets' 1,000-row batches."""
    with gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in itertools.islice((ln for ln in handle if ln.strip()), 3000)]


def stream_spec(train: str, **extra) -> DataSpec:
    return DataSpec(**{"train_file": train, "streaming": True, "shuffle_buffer": 0, "validation_blocks": 4, **extra})


def blocks(stream: BlockStream, n: int | None = None) -> list[list[int]]:
    return [row["input_ids"].tolist() for row in itertools.islice(iter(stream), n)]


def ids(dataset) -> list[list[int]]:
    return [list(row) for row in dataset.with_format(None)["input_ids"]]


def write_jsonl(path: Path, rows: list[str], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows))
    return path


def split_files(tmp_path: Path, lines: list[str], files: int) -> tuple[str, str]:
    """The lines in `files` jsonl files under p/, and a validation file: (glob, validation path)."""
    (tmp_path / "p").mkdir()
    per = len(lines) // files
    for i in range(files):
        write_jsonl(tmp_path / "p" / f"{i}.jsonl", lines[i * per:(i + 1) * per])
    validation = tmp_path / "val.txt"
    validation.write_text("Validation text, separate from training. " * 30)
    return str(tmp_path / "p" / "*.jsonl"), str(validation)


def test_unshuffled_stream_yields_the_cached_paths_blocks_in_order(tokenizer, tmp_path):
    corpus = str(asset_path("austen.txt.gz"))
    validation = tmp_path / "val.txt"
    validation.write_text("A short validation text that is long enough for a block or two. " * 20)
    cached = prepare(DataSpec(train_file=corpus, validation_file=str(validation), cache_dir=str(tmp_path / "c")), tokenizer, 128)
    streamed = open_stream(DataSpec(train_file=corpus, validation_file=str(validation), streaming=True, shuffle_buffer=0),
                           tokenizer, 128, seed=0)
    first = blocks(streamed.train, 400)
    assert len(first) == 400
    assert first == cached.train["input_ids"][:400].tolist()
    assert ids(streamed.validation) == ids(cached.validation)


def test_every_format_compressed_or_globbed_gives_the_same_blocks(tokenizer, lines, tmp_path):
    """jsonl over three gzipped files by glob, csv, parquet, bz2 text: the blocks of one jsonl file."""
    import pandas as pd

    reference = blocks(open_stream(stream_spec(str(write_jsonl(tmp_path / "all.jsonl", lines))), tokenizer, BLOCK, 0).train)
    assert len(reference) > 500
    (tmp_path / "parts").mkdir()
    for i in range(3):  # 1,000 rows per file: datasets' batches fall on the same rows
        write_jsonl(tmp_path / "parts" / f"part-{i}.jsonl.gz", lines[i * 1000:(i + 1) * 1000], opener=gzip.open)
    pd.DataFrame({"text": lines}).to_csv(tmp_path / "all.csv", index=False)
    pd.DataFrame({"id": range(len(lines)), "text": lines}).to_parquet(tmp_path / "all.parquet")
    for train in (str(tmp_path / "parts" / "*.jsonl.gz"), str(tmp_path / "all.csv"), str(tmp_path / "all.parquet")):
        assert blocks(open_stream(stream_spec(train), tokenizer, BLOCK, 0).train) == reference, train
    with bz2.open(tmp_path / "all.txt.bz2", "wt", encoding="utf-8") as handle:
        handle.writelines(line + "\n" for line in lines)
    text = blocks(open_stream(stream_spec(str(tmp_path / "all.txt.bz2")), tokenizer, BLOCK, 0).train)
    plain = tmp_path / "all.txt"
    plain.write_text("".join(line + "\n" for line in lines))
    cached = prepare(DataSpec(train_file=str(plain), validation_file=str(plain), cache_dir=str(tmp_path / "c")), tokenizer, BLOCK)
    assert text == cached.train["input_ids"][4:].tolist()  # the first 4 are held out for evaluation


def test_held_out_blocks_are_the_streams_head_and_never_trained_on(tokenizer, lines, tmp_path):
    path = str(write_jsonl(tmp_path / "a.jsonl", lines))
    one = open_stream(stream_spec(path, validation_blocks=1), tokenizer, BLOCK, 0)
    everything = ids(one.validation) + blocks(one.train)
    streamed = open_stream(stream_spec(path, validation_blocks=7), tokenizer, BLOCK, 0)
    assert ids(streamed.validation) == everything[:7]
    assert blocks(streamed.train) == everything[7:]


@pytest.mark.parametrize("files,held_out", [(4, False), (3, False), (4, True)])
def test_each_rank_reads_its_own_share_and_every_block_once(tokenizer, lines, tmp_path, files, held_out):
    """By whole files when they divide by the world size, else every world-th block; with
    blocks held out of the training stream, every rank skips them (no leak into training)."""
    pattern, validation = split_files(tmp_path, lines, files)
    spec = DataSpec(train_file=pattern, streaming=True, shuffle_buffer=0, validation_blocks=5,
                    validation_file=None if held_out else validation)
    one = open_stream(spec, tokenizer, BLOCK, 0)
    everything = blocks(one.train)
    shares = [blocks(open_stream(spec, tokenizer, BLOCK, 0, rank=r, world_size=2).train) for r in range(2)]
    assert all(len(s) > 100 for s in shares)
    together = Counter(map(tuple, shares[0] + shares[1]))
    if files == 3 or held_out:  # every world-th block of the one stream: exactly its blocks
        assert together == Counter(map(tuple, everything))
    else:  # whole files per rank: each file's blocks, grouped within the rank's own stream
        assert sum(together.values()) >= len(everything) - 2 * files
        assert not set(map(tuple, shares[0])) & set(map(tuple, shares[1]))
    held = set(map(tuple, ids(one.validation)))
    assert not held & set(together) if held_out else True


def test_shuffle_windows_are_seeded_per_epoch_and_permute_only_within_a_window(tokenizer, lines, tmp_path):
    spec = stream_spec(str(write_jsonl(tmp_path / "a.jsonl", lines)), shuffle_buffer=50)
    stream = open_stream(spec, tokenizer, BLOCK, seed=7).train
    ordered = blocks(open_stream(stream_spec(spec.train_file), tokenizer, BLOCK, 7).train)
    epoch0 = blocks(stream)
    assert epoch0 != ordered
    for start in range(0, len(ordered), 50):  # each window holds the same blocks, in another order
        assert sorted(epoch0[start:start + 50]) == sorted(ordered[start:start + 50])
    assert blocks(stream) == epoch0  # the same seed and epoch: the same order
    stream.set_epoch(1)
    assert blocks(stream) != epoch0
    other_seed = open_stream(spec, tokenizer, BLOCK, seed=8).train
    assert blocks(other_seed) != epoch0


def loader(stream: BlockStream, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from runner.components.data.prepare import collate

    return StatefulDataLoader(stream, batch_size=3, collate_fn=collate, num_workers=workers, drop_last=True)


def resumed_batches(spec: DataSpec, tokenizer, workers: int, cut: int, epoch: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[list, list]:
    """(uninterrupted, resumed) batches of one pass of one rank's share, the resumed pass
    cut after `cut` batches and continued by a new loader from the old one's state_dict."""
    def share() -> BlockStream:
        return open_stream(spec, tokenizer, BLOCK, seed=3, rank=rank, world_size=world_size).train

    full = share()
    full.set_epoch(epoch)
    whole = [b["input_ids"].tolist() for b in loader(full, workers)]
    first = share()
    first.set_epoch(epoch)
    cut_loader = loader(first, workers)
    head = [b["input_ids"].tolist() for b in itertools.islice(cut_loader, cut)]
    state = cut_loader.state_dict()
    again = share()
    again_loader = loader(again, workers)
    again_loader.load_state_dict(state)
    return whole, head + [b["input_ids"].tolist() for b in again_loader]


@pytest.mark.parametrize("cut", [1, 16, 17, 33])  # inside the first window, at and past a window's end (50 blocks)
def test_a_restored_position_continues_at_the_exact_next_block(tokenizer, lines, tmp_path, cut):
    spec = stream_spec(str(write_jsonl(tmp_path / "a.jsonl", lines)), shuffle_buffer=50)
    whole, resumed = resumed_batches(spec, tokenizer, workers=0, cut=cut, epoch=2)
    assert len(whole) > 40
    assert resumed == whole


@pytest.mark.parametrize("files,validation_file", [(2, False), (2, True), (3, False), (3, True)])
def test_every_ranks_restored_position_is_exact_in_a_later_window(tokenizer, lines, tmp_path, files, validation_file):
    """Each of two ranks, cut in its third shuffle window, continues with exactly its own
    blocks: whole files per rank or every other block, held-out head or validation file."""
    pattern, validation = split_files(tmp_path, lines, files)
    spec = stream_spec(pattern, shuffle_buffer=4, validation_blocks=8, validation_file=validation if validation_file else None)
    for rank in range(2):
        for cut in (3, 5):  # 9 and 15 blocks: inside the third and at the fourth window's end (3 a batch)
            whole, resumed = resumed_batches(spec, tokenizer, workers=0, cut=cut, epoch=1, rank=rank, world_size=2)
            assert len(whole) > 20
            assert resumed == whole, (rank, cut)


@pytest.mark.multiprocess  # loader workers are child processes
def test_a_restored_position_is_exact_with_loader_workers(tokenizer, lines, tmp_path):
    (tmp_path / "p").mkdir()
    for i in range(3):  # three files: each worker reads its own
        write_jsonl(tmp_path / "p" / f"{i}.jsonl", lines[i * 1000:(i + 1) * 1000])
    spec = stream_spec(str(tmp_path / "p" / "*.jsonl"), shuffle_buffer=20)
    whole, resumed = resumed_batches(spec, tokenizer, workers=2, cut=23)
    assert resumed == whole


def test_a_bad_json_record_mid_stream_is_named_by_file_and_line(tokenizer, lines, tmp_path):
    (tmp_path / "p").mkdir()
    write_jsonl(tmp_path / "p" / "0.jsonl", lines[:1000])
    bad = write_jsonl(tmp_path / "p" / "1.jsonl", lines[1000:2000])
    text = bad.read_text().splitlines(keepends=True)
    text.insert(600, '{"text": "a record cut off by a crash\n')
    bad.write_text("".join(text))
    stream = open_stream(stream_spec(str(tmp_path / "p" / "*.jsonl")), tokenizer, BLOCK, 0).train
    with pytest.raises(BadRecord) as caught:
        blocks(stream)
    assert caught.value.line.startswith(f"bad record in the training stream: {bad}:601: malformed JSON"), caught.value.line
    assert "\n" not in caught.value.line


def test_undecodable_text_mid_stream_is_named_by_file_and_line(tokenizer, lines, tmp_path):
    path = tmp_path / "a.txt"
    body = "".join(line + "\n" for line in lines).encode()
    cut = body.index(b"\n", len(body) // 2) + 1
    path.write_bytes(body[:cut] + b"caf\xe9 au lait\n" + body[cut:])
    line = body[:cut].count(b"\n") + 1
    with pytest.raises(BadRecord) as caught:  # the text reader decodes 10 MB at a time: here, on opening
        blocks(open_stream(stream_spec(str(path)), tokenizer, BLOCK, 0).train)
    assert f"{path}:{line}" in caught.value.line and "UTF-8" in caught.value.line, caught.value.line


def test_a_bad_record_survives_a_loader_workers_traceback():
    """A DataLoader worker re-raises BadRecord(its traceback text): the one line is recovered."""
    wrapped = BadRecord("Caught BadRecord in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                        '  File "x.py", line 1\nrunner.components.data.stream.BadRecord: bad record in the training stream: a:3: x')
    assert wrapped.line == "bad record in the training stream: a:3: x"


def test_stream_files_are_checked_without_reading_them(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.txt").write_text("x\n")
    (tmp_path / "c.docx").write_text("x")
    assert check_stream_files(str(tmp_path / "a.jsonl"), "data.train_file") == []
    assert "no such file matches the pattern" in check_stream_files(str(tmp_path / "*.parquet"), "data.train_file")[0]
    assert "mix types" in check_stream_files(str(tmp_path / "[ab].*"), "data.train_file")[0]
    assert "type streaming cannot read" in check_stream_files(str(tmp_path / "c.docx"), "data.train_file")[0]


def test_streaming_needs_max_steps_and_refuses_cached_only_settings(compose_spec):
    from runner.config.validate import spec_problems

    problems = spec_problems(compose_spec("recipe=gpt2_clm_tiny", "data.streaming=true", "train.max_steps=null",
                                          "data.preprocessing_num_workers=2"))
    assert any("train.max_steps=N" in p for p in problems)
    assert any("data.preprocessing_num_workers=null" in p for p in problems)
    problems = spec_problems(compose_spec("recipe=gpt2_clm_tiny", "data.validation_blocks=10"))
    assert any("data.validation_blocks" in p and "data.streaming=true" in p for p in problems)
    assert spec_problems(compose_spec("recipe=gpt2_clm_tiny", "data.streaming=true")) == []


def test_stream_batches_are_long_tensors(tokenizer, lines, tmp_path):
    stream = open_stream(stream_spec(str(write_jsonl(tmp_path / "a.jsonl", lines))), tokenizer, BLOCK, 0).train
    row = next(iter(stream))
    assert row["input_ids"].dtype == torch.long and row["input_ids"].shape == (BLOCK,)


def test_a_position_at_a_windows_end_keeps_the_pass_length(tokenizer, lines, tmp_path):
    """data.max_train_samples caps a pass: a cut right after a window's last block must not
    count that window twice (the pass would end a window early)."""
    spec = stream_spec(str(write_jsonl(tmp_path / "a.jsonl", lines)), shuffle_buffer=6, max_train_samples=30)
    whole, resumed = resumed_batches(spec, tokenizer, workers=0, cut=2)  # 2 batches of 3 = the first window
    assert len(whole) == 10
    assert resumed == whole


def test_a_file_list_change_is_breaking_and_a_size_change_is_named():
    from runner.components.data.stream import training_files_changes

    saved = [["/d/1.jsonl", 10], ["/d/2.jsonl", 20]]
    assert training_files_changes(saved, saved) == ([], [])
    breaking, _ = training_files_changes(saved, [["/d/0.jsonl", 5], *saved])
    assert len(breaking) == 1 and "added /d/0.jsonl" in breaking[0]
    breaking, _ = training_files_changes(saved, saved[:1])
    assert "removed /d/2.jsonl" in breaking[0]
    breaking, _ = training_files_changes(saved, saved[::-1])
    assert "the same files in another order" in breaking[0]
    breaking, harmless = training_files_changes(saved, [saved[0], ["/d/2.jsonl", 25]])
    assert breaking == [] and "/d/2.jsonl (20 -> 25 bytes) changed size" in harmless[0]
