"""model/config.json names the dtype of the weights written beside it (issue 61, 6): under
zero2/zero3 with bf16 the engine's module is bf16 while model/ holds its fp32 master
weights, and transformers' save_pretrained records the module's dtype. A user or lm-eval
loading with dtype="auto" must get the weights' own dtype, under every strategy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from runner.config.paths import asset_path
from runner.config.spec import PeftSpec, RunSpec
from runner.distributed.accelerator import build_accelerator, reset_accelerate_state
from runner.distributed.strategies import build_strategy
from runner.train.finish import save_outputs


class EngineLike:
    """What a ZeRO engine hands the save: a module cast to bf16, its fp32 master weights
    gathered into the state dict."""

    def __init__(self, master: dict[str, torch.Tensor]) -> None:
        self.master = master

    def full_state_dict(self, accelerator, model):
        return {name: tensor.clone() for name, tensor in self.master.items()}

    def alone(self, accelerator):
        from contextlib import nullcontext

        return nullcontext()


@pytest.fixture
def accelerator():
    reset_accelerate_state()
    spec = RunSpec()
    yield build_accelerator(build_strategy(spec.strategy, spec.precision), grad_accum_steps=1, max_grad_norm=1.0)
    reset_accelerate_state()


@pytest.mark.parametrize("module_dtype, weights_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                          (torch.float32, torch.bfloat16)])
def test_config_names_the_dtype_of_the_weights_written(tmp_path, accelerator, module_dtype, weights_dtype):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=50257))
    master = {name: tensor.to(weights_dtype) for name, tensor in model.state_dict().items()}
    model = model.to(module_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(asset_path("gpt2_tokenizer")))
    spec = SimpleNamespace(peft=PeftSpec())
    out = save_outputs(spec, EngineLike(master), accelerator, model, tokenizer, tmp_path)
    name = str(weights_dtype).split(".")[1]
    assert json.loads((out / "config.json").read_text())["dtype"] == name
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == weights_dtype
    for key, tensor in loaded.state_dict().items():
        if key in master:
            assert torch.equal(tensor, master[key]), key
