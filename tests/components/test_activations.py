"""model.fused_activations: transformers' Python tanh-GELU computed by torch's fused kernel."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.activations import ACT2FN

from runner.components.activations import activation_note, fuse_activations
from runner.config.spec import ModelSpec

pytestmark = pytest.mark.unit

FUSED = type(ACT2FN["gelu_pytorch_tanh"])
PYTHON = type(ACT2FN["gelu_new"])


def _gpt2(activation: str = "gelu_new", layers: int = 3) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=layers, n_head=2, n_positions=32, vocab_size=100, activation_function=activation,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.5)  # pre-activations of order 1, where GELU's forms differ
    return GPT2LMHeadModel(config)


def _loss_and_grad_norm(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    return float(loss), float(norm)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_fast"])
def test_every_python_tanh_gelu_is_swapped_and_the_loss_and_gradients_stay(activation):
    """Every layer's (not the first alone), in a model whose config names either spelling;
    the loss and the gradient norm equal the unswapped model's to float rounding, at each
    of several points along a training run (the swapped copy given the same weights at
    each: a run itself would magnify rounding step by step)."""
    plain, fused = _gpt2(activation), _gpt2(activation)
    assert fuse_activations(fused) == 3
    assert [type(block.mlp.act) for block in fused.transformer.h] == [FUSED] * 3
    assert all(type(block.mlp.act) is not FUSED for block in plain.transformer.h)
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(4):
        fused.load_state_dict(plain.state_dict())
        batch = ids[step % 2::2]
        (loss_a, norm_a), (loss_b, norm_b) = _loss_and_grad_norm(plain, batch), _loss_and_grad_norm(fused, batch)
        assert loss_b == pytest.approx(loss_a, rel=5e-7) and norm_b == pytest.approx(norm_a, rel=1e-6), step
        optimizer.step()


def test_the_state_dict_and_the_saved_config_are_the_architectures_own(tmp_path):
    """The swapped modules hold nothing: the same keys and values, and the saved model
    still names gelu_new, so it loads anywhere as the architecture published."""
    plain, fused = _gpt2(), _gpt2()
    fuse_activations(fused)
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fused.save_pretrained(tmp_path)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.config.activation_function == "gelu_new"
    assert type(reloaded.transformer.h[0].mlp.act) is PYTHON


def test_other_activations_are_left_alone():
    """The exact GELU (a different function) and Llama's SiLU are not tanh-GELU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    exact = _gpt2("gelu")
    before = [type(block.mlp.act) for block in exact.transformer.h]
    assert fuse_activations(exact) == 0
    assert [type(block.mlp.act) for block in exact.transformer.h] == before
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=100))
    assert fuse_activations(llama) == 0
    assert activation_note(llama.config, llama) == ""


def test_the_builder_swaps_only_when_asked_and_the_banner_says_so():
    """build_model applies model.fused_activations (on by default) to a scratch model of
    another architecture that names gelu_new (Phi, as its hidden_act), and the banner counts them."""
    from runner.components.model import build_config, build_model

    overrides = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,vocab_size=100"
    on = ModelSpec(model_type="phi", config_overrides=overrides)
    assert on.fused_activations is True
    config = build_config(on)
    assert config.hidden_act == "gelu_new"
    model = build_model(on, config, 100)
    assert activation_note(config, model) == "2 x gelu_new by torch's fused tanh GELU (model.fused_activations)"
    off = build_model(ModelSpec(model_type="phi", config_overrides=overrides, fused_activations=False), config, 100)
    assert activation_note(config, off) == ""
    assert sum(type(m) is PYTHON for m in off.modules()) == 2
