"""The certify rows' small vocabulary: GPT-2's tokenizer cut to its first tokens is a BPE
tokenizer of its own that agrees with the whole one wherever the whole one's tokens are
kept, and every row's config stays inside it."""

from __future__ import annotations

import gzip
import itertools

import pytest
from transformers import AutoTokenizer

from runner.certify import architectures
from runner.certify.architectures import EOS, ROWS, VOCAB, save_small_tokenizer, small_vocabulary
from runner.components.model import build_config
from runner.config.paths import asset_path
from runner.config.spec import ModelSpec

pytestmark = pytest.mark.unit


def test_the_cut_tokenizer_agrees_with_gpt2s_wherever_its_tokens_are_kept(tmp_path):
    save_small_tokenizer(tmp_path)
    small, whole = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(asset_path("gpt2_tokenizer"))
    assert len(small) == VOCAB and small.eos_token_id == EOS and small.convert_ids_to_tokens(EOS) == "<|endoftext|>"
    with gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8") as handle:
        text = " ".join(itertools.islice((line.strip() for line in handle if line.strip()), 400))
    words = sorted({" " + w for w in text.split()})
    agreed = differed = 0
    for word in words:
        ours, theirs = small(word)["input_ids"], whole(word)["input_ids"]
        assert max(ours) < EOS and small.decode(ours) == word, word
        if max(theirs) < EOS:  # BPE applied the same merges: none of them was cut
            assert ours == theirs, word
            agreed += 1
        else:
            differed += 1
    assert agreed > 400 and differed > 400, (agreed, differed)  # 461 and 988 on these lines


@pytest.mark.parametrize("row", ROWS)
def test_every_rows_config_keeps_its_ids_inside_the_small_vocabulary(row):
    config = small_vocabulary(build_config(ModelSpec(model_type=architectures.model_type(row),
                                                     config_overrides=architectures.tiny_config(row))))
    assert config.vocab_size == VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        assert value is None or 0 <= value < VOCAB, (key, value)
