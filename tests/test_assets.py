"""The vendored GPT-2 tokenizer and corpus."""

import gzip
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
