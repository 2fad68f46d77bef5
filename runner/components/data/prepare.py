"""run_clm's data pipeline: load text, tokenize, concatenate, cut into blocks; cached.

The processed blocks are saved under a key made of everything that changes them
(file contents or dataset name, tokenizer, block size, text column, split ...),
so a second run with the same inputs skips tokenization and any change rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from datasets import Dataset, DatasetDict, Features, Sequence, Value, load_dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from runner.components.data.checks import builder_for
from runner.components.data.labels import IGNORE_INDEX
from runner.config.errors import UserError
from runner.config.mixture import row_format
from runner.config.paths import default_cache_dir
from runner.config.spec import DataFormat, DataSpec

log = logging.getLogger(__name__)

# Bump when the processing below changes, so old cache entries are not reused.
PIPELINE_VERSION = 1
COMPLETE_MARKER = "COMPLETE"


@dataclass
class PreparedData:
    train: "Dataset"
    validation: "Dataset"
    block_size: int
    cache_path: Path
    cache_hit: bool
    seconds: float
    # Instruction formats: per split, what building the examples did (instruct.Counts)
    counts: Optional[dict[str, dict[str, Any]]] = None
    pad_id: int = 0  # what unpacked instruction batches are padded with
    mixture: Optional[Any] = None  # data.mixture: its rows' sources and each source's figures (mixture.Mixture)


def resolve_block_size(data: DataSpec, model_positions: Optional[int], tokenizer_max: int) -> int:
    """run_clm: block_size defaults to min(1024, tokenizer.model_max_length), and
    never exceeds the model's positions."""
    if data.block_size is not None:
        return data.block_size
    candidates = [1024, tokenizer_max]
    if model_positions:
        candidates.append(model_positions)
    return min(candidates)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: "PreTrainedTokenizerBase") -> str:
    """The tokenizer's tokenization: its backend's tokenizer.json (vocabulary, merges,
    normalizer, the post-processor that adds BOS/EOS); a Python tokenizer without one,
    its vocabulary and special tokens (it adds them in Python)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (backend.to_str() if backend is not None else
            json.dumps([tokenizer.get_vocab(), special_tokens(tokenizer)], sort_keys=True))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()


def special_tokens(tokenizer: "PreTrainedTokenizerBase") -> dict[str, Any]:
    """What of a tokenizer lies outside its tokenizer.json and still changes instruction
    rows: which tokens are BOS, EOS, padding and unknown, by text and id (the EOS closes
    every example, padding fills rows, a chat template renders bos_token and eos_token;
    base and instruct tokenizers of one family often share tokenizer.json and differ
    here), and the ids it puts around a text (add_bos / add_eos, set in Python by some)."""
    named = {name: [getattr(tokenizer, f"{name}_token", None), getattr(tokenizer, f"{name}_token_id", None)]
             for name in ("bos", "eos", "pad", "unk")}
    around = [list(tokenizer("a", add_special_tokens=flag)["input_ids"]) for flag in (True, False)]
    return {**named, "padded_with": pad_token_id(tokenizer), "around_a_text": around}


def cache_key(data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int,
              template: Optional[str] = None) -> str:
    parts: dict[str, Any] = {
        "pipeline": PIPELINE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "block_size": block_size,
        "text_column": data.text_column,
        "keep_linebreaks": data.keep_linebreaks,
        "validation_split_percentage": None if data.validation_file else data.validation_split_percentage,
        # datasets shards the rows contiguously over the workers, and each batch drops its
        # remainder inside a shard, so the blocks depend on the worker count (null = 1).
        "preprocessing_num_workers": data.preprocessing_num_workers or 1,
    }
    if data.format is not DataFormat.text:  # text keeps its old keys, and its users' caches
        fields = [data.prompt_field, data.completion_field, data.messages_field]
        if data.format is DataFormat.preference:
            fields += [data.chosen_field, data.rejected_field]
        parts["instruct"] = {"format": data.format.value, "fields": fields, "template": template, "train_on_prompt": data.train_on_prompt,
                             "too_long": data.too_long.value, "packing": data.packing,
                             "rows": 4,  # 2: packed rows carry real_tokens; 3: the text tokenized once; 4: a chat
                             # template closing its last answer with the EOS gets no second one
                             "special_tokens": special_tokens(tokenizer)}
        if data.format is DataFormat.preference:
            # Pairs are packed at collate time (preference_batch.py): a packed run reads the
            # padded run's rows, and its precomputed reference (keyed by this key).
            del parts["instruct"]["packing"]
    if data.train_file:
        parts["train_file"] = _file_sha256(os.path.expanduser(data.train_file))
        parts["train_type"] = builder_for(data.train_file)
        if data.validation_file:
            parts["validation_file"] = _file_sha256(os.path.expanduser(data.validation_file))
    else:
        parts["dataset"] = [data.dataset_name, data.dataset_config_name]
        if (data.train_split, data.validation_split) != (DataSpec.train_split, DataSpec.validation_split):
            parts["splits"] = [data.train_split, data.validation_split]  # the defaults keep their old keys
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def check_splits(data: DataSpec, splits: list[str]) -> None:
    """data.train_split and data.validation_split are among a hub dataset's `splits`, else
    refused, naming those it has."""
    missing = {key: name for key, name in (("train_split", data.train_split), ("validation_split", data.validation_split))
               if name is not None and name not in splits}
    if missing:
        named = " or ".join(f"'{name}' (data.{key})" for key, name in missing.items())
        raise UserError(f"{data.dataset_name} has no split {named}; its splits: {', '.join(splits)}. Set "
                        f"{' and '.join(f'data.{key}' for key in missing)} to one of them.")


def hub_splits(raw: "DatasetDict", data: DataSpec) -> "DatasetDict":
    """A hub dataset's data.train_split and data.validation_split as `train` and
    `validation` (no validation_split: its `validation` split if it has one, else none,
    for the caller to hold out)."""
    check_splits(data, list(raw))
    validation = data.validation_split or ("validation" if "validation" in raw else None)
    return DatasetDict({"train": raw[data.train_split], **({"validation": raw[validation]} if validation else {})})


def load_raw(data: DataSpec) -> "DatasetDict":
    """Raw text rows with `train` and `validation` splits, as run_clm builds them."""
    if data.dataset_name:
        raw = hub_splits(load_dataset(data.dataset_name, data.dataset_config_name), data)
    else:
        files = {"train": os.path.expanduser(str(data.train_file))}
        if data.validation_file:
            files["validation"] = os.path.expanduser(data.validation_file)
        builder = builder_for(files["train"])
        kwargs = {"keep_linebreaks": data.keep_linebreaks} if builder == "text" else {}
        raw = load_dataset(builder, data_files=files, **kwargs)
    if "validation" not in raw:
        # run_clm: validation = train[:p%], train = train[p%:]
        train = raw["train"]
        n_val = len(train) * data.validation_split_percentage // 100
        raw = DatasetDict(validation=train.select(range(n_val)), train=train.select(range(n_val, len(train))))

    if len(raw["validation"]) == 0:
        raise UserError(
            "the validation data leaves no eval rows. Raise data.validation_split_percentage "
            "or give data.validation_file."
        )
    if len(raw["train"]) == 0:
        raise UserError("the training split has no rows. Give more data or lower data.validation_split_percentage.")
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def text_column_of(data: DataSpec, columns: list[str]) -> str:
    if data.text_column:
        if data.text_column not in columns:
            raise UserError(f"data.text_column='{data.text_column}' is not a column (have: {', '.join(columns)}).")
        return data.text_column
    return "text" if "text" in columns else columns[0]


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """Concatenate all token lists and cut them into block_size chunks, dropping the
    remainder (run_clm's group_texts; labels are the inputs, set at collate time)."""
    ids = list(chain.from_iterable(examples["input_ids"]))
    total = (len(ids) // block_size) * block_size
    return {"input_ids": [ids[i : i + block_size] for i in range(0, total, block_size)]}


def tokenize_and_group(
    raw: "DatasetDict", data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int
) -> "DatasetDict":
    column = text_column_of(data, raw["train"].column_names)
    eos_warning = logging.getLogger("transformers.tokenization_utils_base")
    eos_warning.setLevel(logging.ERROR)  # long rows are expected: they are split into blocks next

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        return {"input_ids": tokenizer(batch[column], return_attention_mask=False)["input_ids"]}

    workers = data.preprocessing_num_workers
    tokenized = raw.map(
        tokenize,
        batched=True,
        num_proc=workers,
        remove_columns=raw["train"].column_names,
        desc="Tokenizing",
        load_from_cache_file=False,  # our own cache decides; don't double-store
    )
    return tokenized.map(
        group_texts,
        batched=True,
        num_proc=workers,
        fn_kwargs={"block_size": block_size},
        desc=f"Grouping into blocks of {block_size}",
        load_from_cache_file=False,
    )


def instruction_rows(raw: "DatasetDict", data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int,
                     template: Optional[str]) -> tuple["DatasetDict", dict[str, dict[str, Any]]]:
    """Instruction records as training rows (runner/components/data/instruct.py): examples with
    loss on the answer, fitted to the block, packed or one a row; and the counts. The
    records are tokenized by datasets' map on data.preprocessing_num_workers processes,
    as run_clm tokenizes text; each record is its own example, so the rows do not depend
    on the number."""
    from runner.components.data.instruct import build, examples_of, record_example

    names = {"prompt_field": data.prompt_field, "completion_field": data.completion_field,
             "messages_field": data.messages_field}
    pad_id = pad_token_id(tokenizer)
    splits, counts = {}, {}
    for split in ("train", "validation"):
        where = (data.train_file if split == "train" else data.validation_file or data.train_file) or data.dataset_name
        tokenized = raw[split].map(
            record_example, with_indices=True, num_proc=data.preprocessing_num_workers,
            fn_kwargs={"fmt": data.format.value, "names": names, "tokenizer": tokenizer, "template": template,
                       "train_on_prompt": data.train_on_prompt, "where": f"{split} data ({where})"},
            remove_columns=raw[split].column_names, desc=f"Tokenizing {split} records", load_from_cache_file=False,
            features=Features(input_ids=Sequence(Value("int64")), labels=Sequence(Value("int64")),
                              answered=Value("bool"), turns_cut=Value("bool")))
        examples, read = examples_of(tokenized)
        rows, split_counts = build(examples, block_size, data.too_long.value, data.packing, pad_id, read)
        if not rows:
            dropped = f"; {split_counts.dropped} dropped as longer than data.block_size={block_size}" \
                if split_counts.dropped else ""
            dropped += f"; {split_counts.no_answer} chats with no assistant turn left out" \
                if split_counts.no_answer else ""
            raise UserError(f"the {split} data ({where}) leaves no examples{dropped}. Give more records, raise "
                            "data.block_size, or set data.too_long=truncate.")
        splits[split] = Dataset.from_list(rows)
        counts[split] = {**vars(split_counts), "trained_share": round(split_counts.trained_share, 4),
                         "packing_efficiency": round(split_counts.packing_efficiency, 4)}
    return DatasetDict(splits), counts


def preference_rows(raw: "DatasetDict", data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int,
                    template: Optional[str]) -> tuple["DatasetDict", dict[str, dict[str, Any]]]:
    """Preference records as pair rows (runner/components/data/preference.py): the chosen
    and the rejected answer after the prompt, each with loss on the answer; a pair whose
    answers are equal is dropped (it trains nothing under any loss here), a pair longer
    than the block fitted or dropped (data.too_long); counted per split. `pair_index`: the
    row's place in its split, which the precomputed reference's log-probs are keyed by."""
    from runner.components.data.preference import fit_pair_to_block, preference_record_row

    names = {"prompt_field": data.prompt_field, "chosen_field": data.chosen_field,
             "rejected_field": data.rejected_field}
    sequence = Sequence(Value("int64"))
    splits, counts = {}, {}
    for split in ("train", "validation"):
        where = (data.train_file if split == "train" else data.validation_file or data.train_file) or data.dataset_name
        tokenized = raw[split].map(
            preference_record_row, with_indices=True, num_proc=data.preprocessing_num_workers,
            fn_kwargs={"names": names, "tokenizer": tokenizer, "template": template,
                       "where": f"{split} data ({where})"},
            remove_columns=raw[split].column_names, desc=f"Tokenizing {split} pairs", load_from_cache_file=False,
            features=Features(chosen_input_ids=sequence, chosen_labels=sequence, rejected_input_ids=sequence,
                              rejected_labels=sequence, same=Value("bool")))
        rows: list[dict[str, Any]] = []
        split_counts = {"pairs": 0, "same_answers_dropped": 0, "truncated": 0, "dropped": 0, "tokens": 0,
                        "trained_tokens": 0}
        for row in tokenized:
            if row["same"]:
                split_counts["same_answers_dropped"] += 1
                continue
            pair = {key: list(row[key]) for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                      "rejected_labels")}
            fitted = fit_pair_to_block(pair, block_size, data.too_long.value)
            if fitted is None:
                split_counts["dropped"] += 1
                continue
            split_counts["truncated"] += fitted != pair
            for side in ("chosen", "rejected"):
                split_counts["tokens"] += len(fitted[f"{side}_input_ids"])
                split_counts["trained_tokens"] += sum(label != IGNORE_INDEX for label in fitted[f"{side}_labels"][1:])
            rows.append({**fitted, "pair_index": len(rows)})
        split_counts["pairs"] = len(rows)
        if not rows:
            raise UserError(f"the {split} data ({where}) leaves no pairs ({split_counts['dropped']} longer than "
                            f"data.block_size={block_size} dropped, {split_counts['same_answers_dropped']} with equal "
                            "answers dropped). Give more records, raise data.block_size, or set data.too_long=truncate.")
        splits[split] = Dataset.from_list(rows)
        counts[split] = split_counts
    return DatasetDict(splits), counts


def pad_token_id(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The id padding is written with (never trained: its labels are -100): the
    tokenizer's pad token, else its EOS (GPT-2 has no pad token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def _refuse_empty(blocks: "DatasetDict", data: DataSpec, block_size: int) -> None:
    """A split too short for one block cannot train or evaluate; say which and why."""
    source = data.train_file or data.dataset_name
    problems = []
    if len(blocks["train"]) == 0:
        problems.append(
            f"the training data ({source}) is shorter than one block of {block_size} tokens. "
            "Give more text or lower data.block_size."
        )
    if len(blocks["validation"]) == 0:
        where = data.validation_file or f"{data.validation_split_percentage}% of {source}"
        problems.append(
            f"the validation data ({where}) is shorter than one block of {block_size} tokens. Raise "
            "data.validation_split_percentage, give a longer data.validation_file, or lower data.block_size."
        )
    if problems:
        raise UserError(problems)


@contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on one cache entry, held while it is built: two nodes sharing a
    cache folder (NFS and Lustre support flock) tokenize once, not at the same time.
    Where the filesystem has no locks, building stays safe without one (see _publish)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            log.warning(f"no file locks on {path.parent}; concurrent runs may tokenize twice")
        try:
            yield
        finally:
            try:
                fcntl.flock(handle, fcntl.LOCK_UN)
            except OSError:
                pass


def _unique_name(path: Path, what: str) -> Path:
    # Host name too: two nodes on one shared folder can have processes with equal pids.
    return path.with_name(f"{path.name}.{what}-{socket.gethostname()}-{os.getpid()}")


def _publish(tmp: Path, path: Path) -> None:
    """Move a finished entry into place without touching one another process may read.

    A complete entry (with its marker) is never removed: if one appeared meanwhile, ours
    is discarded. An incomplete leftover (a crash before this scheme) is renamed aside
    first, so removing it never races a reader (readers only open complete entries)."""
    if (path / COMPLETE_MARKER).exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if path.exists():
        aside = _unique_name(path, "stale")
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(path)  # atomic; fails, never overwrites, if another builder won the race
    except OSError:
        if not (path / COMPLETE_MARKER).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int) -> PreparedData:
    """Cached blocks for train and validation; builds them if absent. A mixture: each
    source's, sampled into one (prepare_mixture)."""
    if data.mixture:
        return prepare_mixture(data, tokenizer, block_size)
    started = time.perf_counter()
    root = Path(os.path.expanduser(data.cache_dir)) if data.cache_dir else default_cache_dir() / "data"
    instruct = data.format is not DataFormat.text
    template = None
    if data.format is DataFormat.chat or (data.format is DataFormat.preference and data.chat_template):
        from runner.components.data.instruct import chat_template_text

        template = chat_template_text(data.chat_template, tokenizer)
    # Preference records that are chat messages are rendered by the tokenizer's own template
    # when data.chat_template is unset: it joins the key (whether the records are messages
    # is known only once they are read, so a templated tokenizer keys string pairs with it too).
    keyed_template = template
    if data.format is DataFormat.preference and template is None and getattr(tokenizer, "chat_template", None):
        keyed_template = str(tokenizer.chat_template)
    path = root / cache_key(data, tokenizer, block_size, keyed_template)
    hit = (path / COMPLETE_MARKER).exists()
    if not hit:
        with _cache_lock(path):
            hit = (path / COMPLETE_MARKER).exists()  # built by whoever held the lock before us
            if not hit:
                marker: dict[str, Any] = {"block_size": block_size}
                if data.format is DataFormat.preference:
                    blocks, marker["counts"] = preference_rows(load_raw(data), data, tokenizer, block_size, template)
                elif instruct:
                    blocks, marker["counts"] = instruction_rows(load_raw(data), data, tokenizer, block_size, template)
                else:
                    blocks = tokenize_and_group(load_raw(data), data, tokenizer, block_size)
                _refuse_empty(blocks, data, block_size)
                # Build beside the final folder under a name no other process uses, then
                # publish: a crash never leaves a half-written entry a later run would trust.
                tmp = _unique_name(path, "tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                blocks.save_to_disk(str(tmp))
                (tmp / COMPLETE_MARKER).write_text(json.dumps(marker))
                _publish(tmp, path)
    blocks = load_from_disk(str(path))
    train, validation = blocks["train"], blocks["validation"]
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        validation = validation.select(range(min(data.max_eval_samples, len(validation))))
    return PreparedData(
        train=train.with_format("torch"),
        validation=validation.with_format("torch"),
        block_size=block_size,
        cache_path=path,
        cache_hit=hit,
        seconds=time.perf_counter() - started,
        counts=json.loads((path / COMPLETE_MARKER).read_text()).get("counts") if instruct else None,
        pad_id=pad_token_id(tokenizer),
    )


def prepare_mixture(data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int) -> PreparedData:
    """data.mixture: each source prepared and cached as a run of it alone would, then
    sampled into one (runner/components/data/mixture.py). Its cache_path names the mixture
    (beside the sources' entries); nothing is written there."""
    from runner.components.data.mixture import mix

    started, hits = time.perf_counter(), []

    def prepare_source(source: DataSpec) -> PreparedData:
        ready = prepare(source, tokenizer, block_size)
        hits.append(ready.cache_hit)
        return ready

    mixed = mix(data, prepare_source)
    root = Path(os.path.expanduser(data.cache_dir)) if data.cache_dir else default_cache_dir() / "data"
    return PreparedData(train=mixed.train.with_format("torch"), validation=mixed.validation.with_format("torch"),
                        block_size=block_size, cache_path=root / mixed.key, cache_hit=all(hits),
                        seconds=time.perf_counter() - started, pad_id=pad_token_id(tokenizer), mixture=mixed.mixture)


def collate(batch: list[dict[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
    input_ids = torch.stack([row["input_ids"] for row in batch])
    # Causal LM: labels are the inputs; the model shifts them by one internally.
    return {"input_ids": input_ids, "labels": input_ids}


def collate_for(data: DataSpec, pad_id: int) -> Callable[[list[dict[str, "torch.Tensor"]]], dict[str, "torch.Tensor"]]:
    """The batch builder of the data's format: run_clm's blocks; packed instruction rows
    with their position ids; or instruction examples padded to the longest in the batch;
    preference pairs padded, or packed per micro-batch (preference_batch.py)."""
    layout = row_format(data)
    if layout is DataFormat.text:
        return collate
    if layout is DataFormat.preference:
        from runner.components.data.preference_batch import pack_pairs, pad_pairs

        return partial(pack_pairs if data.packing else pad_pairs, pad_id=pad_id)
    from runner.components.data.instruct import pad_batch, stack_packed

    return stack_packed if data.packing else partial(pad_batch, pad_id=pad_id)
