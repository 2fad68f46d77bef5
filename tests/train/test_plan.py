"""Batch arithmetic and the dry-run plan (the memory estimate's own arithmetic:
tests/launch/test_memory_estimate.py)."""

import math
import re

import pytest

from runner.train.plan import batches_per_rank, steps_per_epoch, total_steps


def test_batches_and_steps():
    assert batches_per_rank(100, 8, 1) == 13
    assert batches_per_rank(100, 8, 2) == 7  # 13 batches round-robin over 2 ranks, the last round padded
    assert steps_per_epoch(13, 2) == 7  # the short last accumulation still steps
    assert total_steps(None, 3, 7) == 21 and total_steps(5, 3, 7) == 5 and total_steps(None, 0.5, 7) == 4


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    from runner.cli import main

    run_dir = tmp_path / "run"
    main(["recipe=gpt2_clm_tiny", "dry_run=true", "launch.nproc_per_node=2", "train.grad_accum_steps=2",
          "strategy=zero3", f"hydra.run.dir={run_dir}"])
    out = capsys.readouterr().out
    blocks = 7364  # the vendored corpus at block 128, 95% for training
    per_epoch = math.ceil(batches_per_rank(blocks, 8, 2) / 2)
    assert "global batch    32 = 8 per device x 2 process(es) x 2 accumulation" in out
    assert "tokens/step     4,096 = 32 x 128" in out
    assert f"data            {blocks:,} train / " in out
    assert f"epochs of {per_epoch:,} steps)" in out
    assert "parameters      3,324,736" in out
    assert "buffers       " in out and "activations   " in out
    # evaluation planned beside the step (chunked by default: the training step decides)
    assert "\n    evaluation    below the step  (the chunked head evaluating a batch of 8, no larger than " in out
    assert re.search(r"\n    peak +[\d.,]+ MiB  \(training step\)", out)
    # each strategy's verdict on this machine's host memory, at the same global batch
    assert re.search(r"fits on this machine's host memory \([\d.]+ GiB available, 2 rank\(s\)\)\? per rank, "
                     r"global batch 32 kept:", out)
    for strategy in ("ddp", "zero2", "zero3", "fsdp"):
        assert re.search(rf"\n    {strategy} +peak +[\d.,]+ MiB  fits, [\d.,]+ GiB headroom; largest micro-batch 16 x 1 "
                         "accumulation", out), out
    assert not run_dir.exists()


# Hand counts of two tiny models of runner/certify/architectures.py (h 64, 4 query heads of
# 16 over 2 key-value heads, MLP 128, 2 layers, the GPT-2 tokenizer's 50,257 tokens, an
# untied output head): attention q, o 64x64 each and k, v 64x32 each = 12,288; two norms
# of 64 = 128; a gated MLP (gate, up, down) 3 x 64 x 128 = 24,576.
GQA_LAYER = 12_288 + 128 + 24_576
# A mixture of 4 such MLPs with a 64 x 4 router: every expert sits in memory.
MOE_LAYER = 12_288 + 128 + 4 * 24_576 + 64 * 4
OUTSIDE = 2 * 50_257 * 64 + 64  # embedding, untied head, final norm


@pytest.mark.parametrize("model_type, layer", [("llama", GQA_LAYER), ("mixtral", MOE_LAYER)])
def test_the_memory_plan_counts_the_models_own_layers(compose_spec, model_type, layer):
    """Grouped-query attention, a gated MLP, a mixture of experts, an untied head: the plan
    counts them from the model (on the meta device), not as GPT-2's 12 h² a layer."""
    from runner.certify.architectures import TINY
    from runner.launch.fit import estimate_for, model_shape

    spec = compose_spec("recipe=gpt2_clm_tiny", f"model.model_type={model_type}",
                        f"model.config_overrides='{TINY[model_type]}'")
    shape = model_shape(spec)
    assert (shape.parameters, shape.layer_parameters, shape.layers) == (2 * layer + OUTSIDE, layer, 2)
    fsdp = estimate_for(shape, "fsdp", "fp32", 2)
    assert fsdp.buffers == (OUTSIDE + 2 * layer) * 4 + layer * 4  # the root gathered, two layers, one layer's grads
    zero3 = estimate_for(shape, "zero3", "fp32", 2)
    assert zero3.buffers == 4 * 64 * 64 + 4 * (OUTSIDE + int(0.9 * 64 * 64))  # CPU: the head gathered alone + a bucket
