"""peft=lora|dora: the adapters peft builds from the spec, on any architecture's own linear
layers, with only they (and modules_to_save) trainable, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from runner.components.adapters import add_adapters, linear_layer_names, lora_config
from runner.components.model import count_trainable_parameters
from runner.components.optim import build_optimizer
from runner.config.errors import UserError
from runner.config.spec import OptimSpec, PeftKind, PeftSpec
from runner.config.validate import check_peft

CONFIGS = {
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64),
    # grouped-query attention, gated MLP, untied head
    "llama": lambda: LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=32),
    # its head tied to the input embedding, as small Llama and Qwen models are
    "tied-llama": lambda: LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                      tie_word_embeddings=True),
}


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]())


def test_every_linear_layer_of_the_blocks_is_found_on_the_model_itself():
    assert linear_layer_names(model("gpt2")) == ["c_attn", "c_fc", "c_proj"]  # transformers' Conv1D
    assert linear_layer_names(model("llama")) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                  "v_proj"]  # the output head is not one


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("peft", [PeftKind.lora, PeftKind.dora])
def test_only_the_adapters_train_and_only_they_get_gradients_and_adam_state(kind, peft):
    from transformers.pytorch_utils import Conv1D

    spec = PeftSpec(kind=peft, rank=4, alpha=8.0, dropout=0.0)
    base = model(kind)
    head = base.get_output_embeddings()
    layers = sum(isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head for m in base.modules())
    wrapped = add_adapters(spec, base)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable), sorted(trainable)[:5]
    assert len({n.rsplit(".lora_", 1)[0] for n in trainable}) == layers  # every linear layer of both blocks
    optimizer = build_optimizer(OptimSpec(lr=1e-2, fused=False), wrapped, 1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for name, p in wrapped.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    stated = {id(p) for p in optimizer.state}
    assert stated == {id(p) for n, p in wrapped.named_parameters() if n in trainable}
    assert count_trainable_parameters(wrapped) == sum(p.numel() for n, p in wrapped.named_parameters() if n in trainable)


def test_a_target_list_is_peft_names_and_modules_to_save_train_fully():
    spec = PeftSpec(kind=PeftKind.lora, target_modules=["q_proj", "self_attn.v_proj"], modules_to_save=["lm_head"])
    wrapped = add_adapters(spec, model("llama"))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in wrapped.named_parameters() if ".lora_" in n}
    assert adapted == {"q_proj", "v_proj"}
    assert any("lm_head.modules_to_save" in n and p.requires_grad for n, p in wrapped.named_parameters())


def test_a_target_that_matches_no_layer_is_refused_naming_the_models_linear_layers():
    with pytest.raises(UserError) as err:
        add_adapters(PeftSpec(kind=PeftKind.lora, target_modules=["q_proj", "qproj"]), model("llama"))
    line = err.value.problems[0]
    assert "['qproj'] matches no layer" in line and "'down_proj', 'gate_proj'" in line and "target_modules=null" in line
    with pytest.raises(UserError, match=r"\['q_proj'\] matches no layer of this gpt2 model; its linear layers are "
                                        r"\['c_attn', 'c_fc', 'c_proj'\]"):
        add_adapters(PeftSpec(kind=PeftKind.lora, target_modules=["q_proj"]), model("gpt2"))


def test_the_config_is_all_linear_by_default_and_dora_is_peft_use_dora():
    config = lora_config(PeftSpec(kind=PeftKind.dora, rank=16, alpha=32.0, dropout=0.1))
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_dora) == (16, 32.0, 0.1, True)
    assert config.target_modules == "all-linear" and config.modules_to_save is None
    assert lora_config(PeftSpec(kind=PeftKind.lora)).use_dora is False


def test_gradient_checkpointing_gives_the_adapters_the_same_gradients():
    """A frozen embedding's output does not require grad; under re-entrant checkpointing
    the blocks' adapters would then get none (add_adapters makes it require grad)."""
    grads = []
    for checkpointing in (False, True):
        base = model("llama")
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        wrapped = add_adapters(PeftSpec(kind=PeftKind.lora, dropout=0.0), base, gradient_checkpointing=checkpointing)
        with torch.no_grad():  # lora_B starts at zero, so lora_A's gradient would be zero either way
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.01)
        wrapped.train()
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        wrapped(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in wrapped.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_adapters_are_refused_on_a_model_from_scratch_and_bad_sizes_are_named(compose_spec):
    spec = compose_spec("recipe=gpt2_clm_tiny", "peft=lora")
    assert any("model.name_or_path is null" in p for p in check_peft(spec))
    spec = compose_spec("recipe=gpt2_clm_tiny", "peft=lora", "model.name_or_path=/some/model", "peft.rank=0",
                        "peft.alpha=0", "peft.dropout=1.0", "peft.target_modules=[]")
    problems = check_peft(spec)
    assert [p.split("=")[0] for p in problems] == ["peft.rank", "peft.alpha", "peft.dropout", "peft.target_modules"]
    spec = compose_spec("recipe=gpt2_clm_tiny", "peft.save_merged=true")  # peft=none
    assert check_peft(spec) == ["peft.save_merged set without adapters (peft=none trains every weight): add peft=lora "
                                "(or peft=dora), or remove them."]
    assert check_peft(compose_spec("recipe=gpt2_clm_tiny", "peft=dora", "model.name_or_path=/some/model")) == []


def test_a_quantized_base_is_refused_in_one_line(compose_spec, tmp_path):
    """QLoRA: a saved 4-bit bitsandbytes model (its config's quantization_config)."""
    import json

    from runner.launch.preflight import check_model

    model("gpt2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = check_model(compose_spec("recipe=gpt2_clm_tiny", "peft=lora", f"model.name_or_path={tmp_path}"))
    assert len(problems) == 1 and "holds 4-bit weights (quant_method=bitsandbytes)" in problems[0], problems
    assert "QLoRA needs a CUDA GPU and bitsandbytes" in problems[0]


@pytest.mark.parametrize("kind, saved", [("gpt2", ["wte"]), ("gpt2", ["lm_head"]), ("gpt2", ["transformer.wte"]),
                                         ("tied-llama", ["embed_tokens"]), ("tied-llama", ["embed_tokens", "lm_head"])])
def test_a_tied_embedding_in_modules_to_save_stays_tied_to_the_head(kind, saved, tmp_path):
    """GPT-2 (and a Llama with tie_word_embeddings) reads tokens and predicts them with one
    weight. Naming either half in modules_to_save trains that one weight, read and
    predicted alike (peft's ensure_weight_tying): a trained input embedding with the
    original head beside it would read added tokens and never predict them. adapter/
    loads back with the same logits."""
    from peft import PeftModel

    base = model(kind)
    original = base.get_input_embeddings().weight.detach().clone()
    wrapped = add_adapters(PeftSpec(kind=PeftKind.lora, rank=4, dropout=0.0, modules_to_save=saved), base)
    optimizer = build_optimizer(OptimSpec(lr=1e-2, fused=False), wrapped, 1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        wrapped(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    embedding, head = wrapped.get_input_embeddings(), wrapped.get_output_embeddings()
    read = getattr(embedding, "modules_to_save", {"default": embedding})["default"].weight
    predicted = getattr(head, "modules_to_save", {"default": head})["default"].weight
    moved = (read - original).abs().max().item()
    gap = (predicted - read).abs().max().item()
    assert moved > 1e-3 and gap == 0.0, f"input embedding moved {moved:.3g}; the head is {gap:.3g} from it"
    wrapped.eval()
    wrapped.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(model(kind), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, wrapped(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_a_tied_pair_peft_cannot_tie_is_refused_by_name():
    """peft ties a pair only by the names embed_tokens and lm_head: BERT as a decoder
    (word_embeddings tied to cls.predictions.decoder) is refused rather than trained with
    half of its pair."""
    from transformers import BertConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
        max_position_embeddings=32, is_decoder=True))
    with pytest.raises(UserError) as err:
        add_adapters(PeftSpec(kind=PeftKind.lora, target_modules=["query"], modules_to_save=["word_embeddings"]), base)
    assert err.value.problems == [
        "peft.modules_to_save: ['word_embeddings'] names one of this bert model's tied pair "
        "(bert.embeddings.word_embeddings, cls.predictions.decoder: one weight), which peft can keep tied only under "
        "the names ['embed_tokens', 'lm_head']. Remove them from peft.modules_to_save."]
