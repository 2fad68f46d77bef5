"""Model builders: counting parameters whatever the strategy did to them."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.components.model import count_parameters


def _tiny() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=100))


def test_tied_weights_are_counted_once():
    model = _tiny()
    # wte (100 x 32) and lm_head are one tensor: the sum of unique tensors.
    unique = {id(p): p.numel() for p in model.parameters()}
    assert count_parameters(model) == sum(unique.values())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_zero3_partitioned_parameters_count_at_full_size():
    """DeepSpeed ZeRO-3 (partition_parameters.py) frees each parameter's data to an empty
    tensor and keeps its full size in `ds_numel`: reproduce that and count the same total."""
    model = _tiny()
    full = count_parameters(model)
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert sum(p.numel() for p in model.parameters()) == 0  # what the banner summed before
    assert count_parameters(model) == full
