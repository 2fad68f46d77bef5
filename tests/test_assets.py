"""The vendored GPT-2 tokenizer and corpus."""

import gzip
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from runner.config.paths import PACKAGE_DIR, asset_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))


@pytest.mark.parametrize(
    "text, ids",
    [("Hello world", [15496, 995]), (" the", [262]), ("<|endoftext|>", [50256]), (" gazed", [50255])],
)
def test_tokenizer_golden_ids(tokenizer, text, ids):
    assert tokenizer(text)["input_ids"] == ids


def test_tokenizer_specials(tokenizer):
    assert len(tokenizer) == 50257
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer("It is a truth universally acknowledged")["input_ids"]) == (
        "It is a truth universally acknowledged"
    )


def test_corpus_is_the_six_novels():
    text = gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8").read()
    assert 3_900_000 < len(text) < 4_100_000
    upper = text.upper()
    for title in ("SENSE AND SENSIBILITY", "PRIDE AND PREJUDICE", "MANSFIELD PARK", "EMMA", "NORTHANGER ABBEY", "PERSUASION"):
        assert title in upper


@pytest.mark.e2e
def test_vendored_files_match_their_checksums():
    script = PACKAGE_DIR.parent / "scripts" / "build_assets.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_arithmetic_tokenizer_cuts_gpt2s_pieces_and_keeps_them(tokenizer):
    """runner/assets/arith_tokenizer/ (scripts/subset_bpe.py): each arithmetic record, prompt
    and prompt + completion as SFT tokenizes them, is GPT-2's pieces, from 470 tokens."""
    arith = AutoTokenizer.from_pretrained(str(asset_path("arith_tokenizer")))
    assert len(arith) == 470 and arith.eos_token == "<|endoftext|>" and arith.eos_token_id == 469
    with gzip.open(asset_path("arith.jsonl.gz"), "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    texts = [text for r in records for text in (r["prompt"], r["prompt"] + r["completion"])]
    pieces = [arith.convert_ids_to_tokens(ids) for ids in arith(texts)["input_ids"]]
    assert pieces == [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(texts)["input_ids"]]
    assert pieces[1] == ["What", "Ġis", "Ġ71", "Ġ+", "Ġ98", "?", "ĠAnswer", ":", "Ġ169"]


def test_the_arithmetic_tokenizer_still_encodes_any_text():
    """Other text falls to smaller pieces, down to the 256 byte symbols, and decodes back."""
    arith = AutoTokenizer.from_pretrained(str(asset_path("arith_tokenizer")))
    for text in ("It is a truth universally acknowledged", "café — 12,345 ✓", "  two  spaces\n"):
        ids = arith(text)["input_ids"]
        assert arith.unk_token_id not in ids  # byte-level: no text needs the unknown token
        assert arith.decode(ids) == text
