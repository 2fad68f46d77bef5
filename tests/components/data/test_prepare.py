"""run_clm's pipeline: exact grouping, splits, and the processed-data cache."""

import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from runner.components.data.prepare import cache_key, collate, group_texts, load_raw, prepare, resolve_block_size
from runner.config.paths import asset_path
from runner.config.spec import DataSpec


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


def test_group_texts_concatenates_and_drops_the_remainder():
    out = group_texts({"input_ids": [[1, 2, 3], [4], [], [5, 6, 7, 8, 9]]}, block_size=4)
    assert out == {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]]}  # 9 is the dropped remainder


def test_group_texts_shorter_than_a_block_gives_nothing():
    assert group_texts({"input_ids": [[1, 2]]}, block_size=4) == {"input_ids": []}


def test_collate_sets_labels_to_inputs():
    import torch

    batch = collate([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4])}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 4]]
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_block_size_defaults_like_run_clm():
    assert resolve_block_size(DataSpec(), model_positions=1024, tokenizer_max=1024) == 1024
    assert resolve_block_size(DataSpec(), model_positions=128, tokenizer_max=1024) == 128
    assert resolve_block_size(DataSpec(block_size=64), model_positions=128, tokenizer_max=1024) == 64


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_validation_split_percentage_holds_out_the_first_rows(tmp_path):
    train = _write(tmp_path / "t.txt", [f"line {i}" for i in range(100)])
    raw = load_raw(DataSpec(train_file=train, validation_split_percentage=10))
    assert len(raw["validation"]) == 10 and len(raw["train"]) == 90
    assert raw["validation"][0]["text"] == "line 0\n"  # keep_linebreaks
    assert raw["train"][0]["text"] == "line 10\n"


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt.gz", ".jsonl.gz"])
def test_local_file_types(tmp_path, suffix, tokenizer):
    rows = [f"The {i}th sentence of a small corpus, with words enough." for i in range(40)]
    path = tmp_path / f"data{suffix}"
    if ".json" in suffix:
        body = "\n".join(json.dumps({"id": i, "content": r}) for i, r in enumerate(rows)) + "\n"
    elif ".csv" in suffix:
        body = "content,id\n" + "\n".join(f'"{r}",{i}' for i, r in enumerate(rows)) + "\n"
    else:
        body = "\n".join(rows) + "\n"
    if suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(body.encode()))
    else:
        path.write_text(body)
    spec = DataSpec(train_file=str(path), text_column=None if suffix == ".txt.gz" else "content",
                    block_size=16, cache_dir=str(tmp_path / "cache"))
    data = prepare(spec, tokenizer, 16)
    expected_tokens = sum(len(tokenizer(r + ("\n" if "txt" in suffix else ""))["input_ids"]) for r in rows[2:])
    assert len(data.train) == expected_tokens // 16
    assert data.train[0]["input_ids"].shape == (16,)


def test_cache_hit_on_same_inputs_and_rebuild_on_any_change(tmp_path, tokenizer):
    train = _write(tmp_path / "t.txt", [f"It was the {i}th day of the season in the country." for i in range(200)])
    spec = DataSpec(train_file=train, cache_dir=str(tmp_path / "cache"))
    first = prepare(spec, tokenizer, 32)
    second = prepare(spec, tokenizer, 32)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.cache_path == first.cache_path
    assert [r["input_ids"].tolist() for r in second.train] == [r["input_ids"].tolist() for r in first.train]

    assert prepare(spec, tokenizer, 16).cache_hit is False  # block size
    spec_text = DataSpec(train_file=train, cache_dir=spec.cache_dir, keep_linebreaks=False)
    assert prepare(spec_text, tokenizer, 32).cache_hit is False  # processing option
    _write(tmp_path / "t.txt", [f"It was the {i}th night of the season in town." for i in range(200)])
    assert prepare(spec, tokenizer, 32).cache_hit is False  # file contents


def test_the_worker_count_is_part_of_the_cache_key(tmp_path, tokenizer):
    train = _write(tmp_path / "t.txt", ["a b c"])
    keys = {w: cache_key(DataSpec(train_file=train, preprocessing_num_workers=w), tokenizer, 8) for w in (None, 1, 2)}
    assert keys[None] == keys[1] != keys[2]  # null means one worker


def test_grouping_with_two_workers_can_give_other_blocks():
    """Why the worker count is in the key: datasets gives each worker a contiguous shard,
    and each batch drops its remainder inside its shard."""
    from datasets import Dataset

    rows = Dataset.from_dict({"input_ids": [[i] * 7 for i in range(2500)]})
    one = rows.map(group_texts, batched=True, fn_kwargs={"block_size": 64})["input_ids"]
    two = rows.map(group_texts, batched=True, num_proc=2, fn_kwargs={"block_size": 64})["input_ids"]
    assert len(one) == len(two) and one != two


def test_cache_key_ignores_sample_limits(tmp_path, tokenizer):
    train = _write(tmp_path / "t.txt", ["a b c"])
    base = DataSpec(train_file=train)
    limited = DataSpec(train_file=train, max_train_samples=3, max_eval_samples=2)
    assert cache_key(base, tokenizer, 8) == cache_key(limited, tokenizer, 8)


def test_incomplete_cache_entry_is_rebuilt(tmp_path, tokenizer):
    train = _write(tmp_path / "t.txt", [f"Sentence number {i} is here." for i in range(100)])
    spec = DataSpec(train_file=train, cache_dir=str(tmp_path / "cache"))
    first = prepare(spec, tokenizer, 8)
    (first.cache_path / "COMPLETE").unlink()  # as if a crash happened mid-write
    assert prepare(spec, tokenizer, 8).cache_hit is False


def test_max_samples_limit_blocks(tmp_path, tokenizer):
    train = _write(tmp_path / "t.txt", [f"Sentence number {i} is here." for i in range(300)])
    spec = DataSpec(train_file=train, cache_dir=str(tmp_path / "cache"), max_train_samples=5, max_eval_samples=2)
    data = prepare(spec, tokenizer, 8)
    assert (len(data.train), len(data.validation)) == (5, 2)


def _prepare_in_process(train: str, cache: str, results: dict, name: str) -> None:
    """One 'node': its own process (as on another machine), the same shared cache folder."""
    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))
    data = prepare(DataSpec(train_file=train, cache_dir=cache), tokenizer, 8)
    results[name] = (data.cache_hit, [r["input_ids"].tolist() for r in data.train])


@pytest.mark.multiprocess
def test_two_nodes_tokenizing_into_one_shared_cache_build_it_once(tmp_path):
    import multiprocessing

    train = _write(tmp_path / "t.txt", [f"Line {i} of a corpus read by two nodes at once." for i in range(3000)])
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        nodes = [context.Process(target=_prepare_in_process, args=(train, str(cache), results, n)) for n in ("a", "b")]
        for node in nodes:
            node.start()
        for node in nodes:
            node.join(300)
        got = dict(results)
    assert [node.exitcode for node in nodes] == [0, 0]
    assert sorted(hit for hit, _ in got.values()) == [False, True]  # one built, the other waited and read it
    assert got["a"][1] == got["b"][1]
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name or ".stale-" in p.name] == []


def _entry(folder: Path, content: str, complete: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "data.arrow").write_text(content)
    if complete:
        (folder / "COMPLETE").write_text("{}")
    return folder


def test_a_complete_entry_that_appears_meanwhile_is_never_replaced(tmp_path):
    """Two builders without a working file lock (some shared filesystems) both finish:
    the second one's copy is discarded, and the first one's files, which another node
    may already be reading, are left untouched."""
    from runner.components.data.prepare import _publish

    path = _entry(tmp_path / "key", "winner", complete=True)
    inode = (path / "data.arrow").stat().st_ino
    loser = _entry(tmp_path / "key.tmp-other-1", "loser", complete=True)
    _publish(loser, path)
    assert (path / "data.arrow").read_text() == "winner" and (path / "data.arrow").stat().st_ino == inode
    assert not loser.exists()


def test_an_incomplete_leftover_is_replaced(tmp_path):
    from runner.components.data.prepare import _publish

    path = _entry(tmp_path / "key", "half-written", complete=False)
    fresh = _entry(tmp_path / "key.tmp-here-2", "fresh", complete=True)
    _publish(fresh, path)
    assert (path / "data.arrow").read_text() == "fresh" and (path / "COMPLETE").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_seeds_give_unrelated_data_orders_in_every_epoch():
    """A seed sweep's runs must not share orders: with seed + epoch, seed 2's epoch 0 was
    seed 1's epoch 1."""
    from runner.components.data.epoch_batches import EpochSampler

    def order(seed: int, epoch: int) -> list[int]:
        sampler = EpochSampler(64, seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    orders = {(seed, epoch): order(seed, epoch) for seed in (1, 2, 3) for epoch in range(4)}
    assert len({tuple(o) for o in orders.values()}) == len(orders)  # twelve different orders
    assert order(2, 1) == orders[(2, 1)]  # and each one reproducible, as a resume needs
    # Epoch 0 is torch's RandomSampler order under the same seed.
    expected = list(torch.utils.data.RandomSampler(range(64), generator=torch.Generator().manual_seed(1)))
    assert orders[(1, 0)] == expected


def _tokenizers_differing_only_in_eos(tmp_path: Path) -> tuple:
    """A base and an instruct tokenizer of one family: the same tokenizer.json (both EOS
    candidates are special tokens in it), another EOS in tokenizer_config.json (as
    Qwen2.5's <|endoftext|> and <|im_end|>, Llama 3.1's <|end_of_text|> and <|eot_id|>)."""
    import shutil

    family = AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))
    family.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    base, instruct = tmp_path / "base", tmp_path / "instruct"
    family.save_pretrained(base)
    shutil.copytree(base, instruct)
    config = json.loads((instruct / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_end|>"
    (instruct / "tokenizer_config.json").write_text(json.dumps(config))
    assert (base / "tokenizer.json").read_bytes() == (instruct / "tokenizer.json").read_bytes()
    return AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(instruct)


def test_instruction_rows_are_keyed_on_the_tokenizers_eos(tmp_path):
    """Two tokenizers differing only in EOS get their own rows, each closed by its own EOS;
    text, whose blocks no EOS enters, keeps one key."""
    from runner.config.spec import DataFormat

    base, instruct = _tokenizers_differing_only_in_eos(tmp_path)
    assert (base.eos_token_id, instruct.eos_token_id) == (50256, 50257)
    train = tmp_path / "sft.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Question {i}?", "completion": f" Answer {i}."}) + "\n"
                             for i in range(40)))
    spec = DataSpec(train_file=str(train), format=DataFormat.prompt_completion, packing=False,
                    cache_dir=str(tmp_path / "cache"))
    assert cache_key(spec, base, 64) != cache_key(spec, instruct, 64)
    for tokenizer in (base, instruct):
        rows = prepare(spec, tokenizer, 64)
        assert rows.cache_hit is False
        assert {int(row["input_ids"][-1]) for row in rows.train} == {tokenizer.eos_token_id}
    text = DataSpec(train_file=str(train))
    assert cache_key(text, base, 64) == cache_key(text, instruct, 64)


def test_the_padding_token_is_in_the_instruction_key(tmp_path):
    from runner.config.spec import DataFormat

    base, _ = _tokenizers_differing_only_in_eos(tmp_path)
    train = tmp_path / "sft.jsonl"
    train.write_text(json.dumps({"prompt": "Q?", "completion": " A."}) + "\n")
    spec = DataSpec(train_file=str(train), format=DataFormat.prompt_completion)
    padded = AutoTokenizer.from_pretrained(tmp_path / "base", pad_token="<|im_end|>")
    assert cache_key(spec, base, 64) != cache_key(spec, padded, 64)


def test_a_hub_datasets_splits_are_in_the_cache_key_only_when_named(tokenizer):
    """data.train_split / validation_split pick other rows, so another cache entry; the
    defaults keep the key a hub dataset had before they existed."""
    import hashlib

    from runner.components.data.prepare import PIPELINE_VERSION, tokenizer_fingerprint

    hub = DataSpec(dataset_name="HuggingFaceH4/ultrafeedback_binarized")
    keys = {splits: cache_key(DataSpec(dataset_name=hub.dataset_name, train_split=splits[0], validation_split=splits[1]),
                              tokenizer, 8)
            for splits in (("train", None), ("train_prefs", "test_prefs"), ("train_prefs", None), ("train", "test"))}
    assert len(set(keys.values())) == 4 and keys[("train", None)] == cache_key(hub, tokenizer, 8)
    parts = {"pipeline": PIPELINE_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer), "block_size": 8,
             "text_column": None, "keep_linebreaks": True, "validation_split_percentage": 5,
             "preprocessing_num_workers": 1, "dataset": [hub.dataset_name, None]}
    assert keys[("train", None)] == hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def test_a_stream_reads_the_named_splits(monkeypatch):
    import datasets

    from runner.components.data.stream import sources
    from runner.config.errors import UserError

    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name, config: ["train_prefs", "test_prefs", "test"])
    named = DataSpec(dataset_name="uf", train_split="train_prefs", validation_split="test_prefs", streaming=True)
    train, held = sources(named)
    assert (train.dataset, held.dataset) == (("uf", None, "train_prefs"), ("uf", None, "test_prefs"))
    assert sources(DataSpec(dataset_name="uf", train_split="train_prefs"))[1].dataset == ("uf", None, "test")
    with pytest.raises(UserError, match=r"uf has no split 'train' \(data.train_split\); its splits: train_prefs"):
        sources(DataSpec(dataset_name="uf"))
