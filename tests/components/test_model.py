"""Model builders: counting parameters whatever the strategy did to them."""

import pytest
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


# Tiny from-scratch configs of the architectures people train besides GPT-2.
TINY = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,max_position_embeddings=128"


def _spec(model_type: str, overrides: str):
    from runner.config.spec import ModelSpec

    return ModelSpec(model_type=model_type, config_overrides=overrides)


@pytest.mark.parametrize("model_type, extra", [("qwen2", ""), ("qwen3", ",head_dim=16")])
def test_overrides_are_constructor_arguments_so_derived_fields_follow(model_type, extra):
    """run_clm's update_from_string left layer_types at the default 32 entries for 2 layers."""
    from transformers import AutoModelForCausalLM

    from runner.components.model import build_config

    config = build_config(_spec(model_type, f"{TINY},num_key_value_heads=2{extra}"))
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 100, (2, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_an_unparsable_override_and_an_invalid_architecture_are_one_line_each():
    from runner.components.model import build_config
    from runner.config.errors import UserError

    with pytest.raises(UserError, match="key nope isn't in the original config dict.*run_clm's form"):
        build_config(_spec("gpt2", "n_embd=32,nope=3"))
    with pytest.raises(UserError, match=r"no valid llama model: .*hidden size \(64\) is not a multiple.*\(3\)"):
        build_config(_spec("llama", "hidden_size=64,num_attention_heads=3"))


def test_a_config_whose_shapes_do_not_fit_is_named_before_any_worker_starts():
    """Qwen2 keeps num_key_value_heads at its default 32 when only the heads are overridden."""
    from runner.components.model import build_config, probe_model

    spec = _spec("qwen2", TINY)
    [problem] = probe_model(spec, build_config(spec))
    assert "cannot run a micro-batch" in problem and "num_key_value_heads=32 (default)" in problem
    assert "num_attention_heads=4," in problem  # given, so not marked as a default
    fixed = _spec("qwen2", f"{TINY},num_key_value_heads=2")
    assert probe_model(fixed, build_config(fixed)) == []


def test_an_encoder_without_is_decoder_is_refused_as_a_causal_lm():
    from runner.components.model import build_config, probe_model

    spec = _spec("bert", "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4")
    [problem] = probe_model(spec, build_config(spec))
    assert "BertLMHeadModel, an encoder" in problem and "is_decoder=true" in problem
    decoder = _spec("bert", "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,is_decoder=true")
    assert probe_model(decoder, build_config(decoder)) == []
    for model_type in ("gpt2", "llama", "gpt_neox"):  # decoders, gpt_neox with an is_decoder=False field of its own
        assert probe_model(_spec(model_type, ""), build_config(_spec(model_type, ""))) == [], model_type


@pytest.mark.parametrize("model_type, layer", [("gpt2", "GPT2Block"), ("llama", "LlamaDecoderLayer"),
                                               ("qwen3", "Qwen3DecoderLayer"), ("mixtral", "MixtralDecoderLayer")])
def test_fsdp_wraps_the_layer_class_each_model_names(model_type, layer):
    from runner.components.model import build_config, build_meta_model, layer_class_names

    with torch.device("meta"):
        model = build_meta_model(build_config(_spec(model_type, "")))
    assert layer_class_names(model) == [layer]


def test_fsdp_refuses_a_model_that_names_no_layer_class(compose_spec, monkeypatch):
    from transformers.models.gpt2.modeling_gpt2 import GPT2PreTrainedModel

    from runner.launch.preflight import fsdp_layer_problems

    from conftest import MICRO

    spec = compose_spec(*MICRO, "strategy=fsdp")  # GPT-2 from scratch: no hub needed
    assert fsdp_layer_problems(spec) == []
    monkeypatch.setattr(GPT2PreTrainedModel, "_no_split_modules", [])  # as a model without transformers' list
    [problem] = fsdp_layer_problems(spec)
    assert "GPT2LMHeadModel names no layer class to wrap" in problem and "strategy=zero3" in problem


def test_a_mixture_of_experts_passes_the_probe_and_its_config_is_left_alone():
    """Transformers' grouped matmul of experts has a bf16-only meta kernel: the probe once
    refused every Mixtral as 'cannot run a micro-batch'. It runs the experts batched."""
    from runner.certify.architectures import TINY
    from runner.components.model import build_config, probe_model

    spec = _spec("mixtral", TINY["mixtral"])
    config = build_config(spec)
    before = (config.to_dict(), getattr(config, "_experts_implementation", None))
    assert probe_model(spec, config) == []
    # The run's own model keeps transformers' default experts.
    assert (config.to_dict(), getattr(config, "_experts_implementation", None)) == before


def test_a_checkpoint_saved_in_bf16_loads_as_fp32_weights(tmp_path):
    """Most hub checkpoints are saved in bf16, and transformers 5 loads a checkpoint in its
    saved dtype: runner's weights are fp32 under every precision (bf16 is autocast over fp32
    weights, the strategy's low-precision copy its own), so a pretrained model is read into
    fp32, every value its bf16 one exactly."""
    from runner.components.model import build_config, build_model
    from runner.config.spec import ModelSpec

    torch.manual_seed(0)
    saved = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=128)).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "bf16")
    spec = ModelSpec(name_or_path=str(tmp_path / "bf16"))
    model = build_model(spec, build_config(spec), 128)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.float()), name
