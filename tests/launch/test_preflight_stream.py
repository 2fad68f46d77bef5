"""A stream too short for one optimizer step on any rank is refused before launch, in
one line naming the setting that made it short."""

from __future__ import annotations

import json

import pytest

from conftest import MICRO
from runner.config.errors import UserError
from runner.launch.preflight import prepare_data

STREAM = [*MICRO, "data.streaming=true", "data.validation_blocks=4", "data.shuffle_buffer=4"]


def test_a_stream_capped_below_one_step_is_refused_with_the_cap_named(compose_spec):
    spec = compose_spec(*STREAM, "data.max_train_samples=4", "train.per_device_batch_size=8")
    with pytest.raises(UserError) as caught:
        prepare_data(spec)
    line = caught.value.render()
    assert "data.max_train_samples=4 leaves the stream 4 block(s) a pass" in line
    assert "fewer than one optimizer step of 8" in line and "at least 8" in line and "\n" not in line.strip()


def test_every_ranks_share_must_hold_a_step_counting_accumulation(compose_spec):
    # 12 blocks over two ranks: 6 each, one step a rank is 4 x 2
    spec = compose_spec(*STREAM, "data.max_train_samples=12", "train.grad_accum_steps=2")
    with pytest.raises(UserError) as caught:
        prepare_data(spec, world_size=2)
    assert "rank 0 of 2's share of the stream 6 block(s)" in caught.value.render()
    assert "at least 16" in caught.value.render()
    spec = compose_spec(*STREAM, "data.max_train_samples=16", "train.grad_accum_steps=2")
    prepare_data(spec, world_size=2)  # a whole step a rank: accepted


def test_a_short_file_names_the_file_not_the_cap(compose_spec, tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"text": "only a few words, far fewer than one step's blocks. " * 12}) + "\n")
    spec = compose_spec(*STREAM, f"data.train_file={path}", "data.max_train_samples=null", "data.validation_blocks=1")
    with pytest.raises(UserError) as caught:
        prepare_data(spec)
    line = caught.value.render()
    assert "short.jsonl" in line and "fewer than one optimizer step of 4" in line and "max_train_samples" not in line
