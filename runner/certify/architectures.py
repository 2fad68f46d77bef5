"""Tiny random-init configs of the causal LMs people train, one per transformers model type.

Each is the architecture's own config class built with these constructor arguments
(model.config_overrides), so what the class derives from them follows (layer types,
grouped-query heads, head_dim). Every one is small enough for a CPU in seconds, keeps
the features that make its architecture what it is (grouped-query attention, gated
MLPs, sliding windows, soft-capping, QK-norm, a mixture of experts, untied embeddings)
and has dropout off: certification compares layouts, which only equal math can pass.
The GPT-2 tokenizer's 50,257 tokens are the vocabulary (the unit tests build these
configs with it); 64 positions fit block size 32. `runner certify` cuts both to VOCAB
tokens (small_vocabulary, save_small_tokenizer): the output head and the embedding over
all 50,257 words were most of each tiny step's time (certify gpt2: 110 -> 84 CPU-s), and
how many words a model knows is no part of what certify compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config.paths import asset_path

VOCAB = 2048  # the 256 bytes, GPT-2's first 1,791 merges and <|endoftext|> (its id: VOCAB - 1)
EOS = VOCAB - 1

# Grouped-query attention: 4 query heads over 2 key-value heads of 16.
_GQA = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "max_position_embeddings=64,vocab_size=50257")

TINY: dict[str, str] = {
    "gpt2": "n_embd=64,n_layer=2,n_head=4,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
    "llama": _GQA,
    "mistral": _GQA + ",sliding_window=16",
    "qwen2": _GQA,
    "qwen3": _GQA + ",head_dim=16",
    "gemma2": _GQA + ",head_dim=16,sliding_window=16",
    "phi3": _GQA + ",pad_token_id=0",
    "olmo2": _GQA + ",eos_token_id=50256",
    "gpt_neox": ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
                 "max_position_embeddings=64,vocab_size=50257,hidden_dropout=0,attention_dropout=0"),
    "opt": ("hidden_size=64,ffn_dim=128,num_hidden_layers=2,num_attention_heads=4,max_position_embeddings=64,"
            "word_embed_proj_dim=64,vocab_size=50257,dropout=0,attention_dropout=0,layerdrop=0"),
    # A mixture of experts: 4 experts, each token routed to 2.
    "mixtral": _GQA + ",num_local_experts=4,num_experts_per_tok=2,router_jitter_noise=0",
}

# Rows beyond one per model type: a setting certified on one architecture, named apart
# from its model type.
@dataclass(frozen=True)
class Variant:
    model_type: str
    config: str  # its tiny config
    overrides: tuple[str, ...] = ()  # every run's, beside the matrix's own
    # The one-process layout every strategy is held to (and a --reshard resume runs),
    # where one micro-batch of 8 rows is not the math of the cells' micro-batches of 4.
    reference_layout: tuple[str, ...] = ()
    in_default: bool = True  # among the rows `runner certify` runs when given none


VARIANTS: dict[str, Variant] = {
    # A mixture of experts with its router (load-balancing) loss on (OLMoE's coefficient,
    # 0.01), on instruction data (40 packed rows of 32 tokens, 5 steps an epoch as the
    # text rows have): every strategy weights the cross-entropy by its share of the
    # step's tokens and the router loss as a mean per micro-batch
    # (runner/components/objectives/token_weighting.py). The router loss of a micro-batch is a product
    # of means over its tokens, so 8 rows in one micro-batch are other math than two of
    # 4: the reference is 1 process x 4 rows x 2 accumulation.
    "mixtral_router_sft": Variant(
        "mixtral", TINY["mixtral"] + ",output_router_logits=True,router_aux_loss_coef=0.01",
        ("data=austen_sft", "data.packing=true", "data.too_long=truncate"),
        ("train.per_device_batch_size=4", "train.grad_accum_steps=2")),
    # The same router loss under any objective's own data (`runner certify mixtral_router
    # --objective dpo`: DPO adds it once a micro-batch, a mean over the step's micro-batches,
    # runner/components/objectives/dpo.py); its reference 1 process x 4 x 2 likewise.
    "mixtral_router": Variant(
        "mixtral", TINY["mixtral"] + ",output_router_logits=True,router_aux_loss_coef=0.01", (),
        ("train.per_device_batch_size=4", "train.grad_accum_steps=2"), in_default=False),
}
ROWS = (*TINY, *VARIANTS)
DEFAULT_ROWS = (*TINY, *(name for name, variant in VARIANTS.items() if variant.in_default))


def model_type(row: str) -> str:
    return VARIANTS[row].model_type if row in VARIANTS else row


def tiny_config(row: str) -> str:
    return VARIANTS[row].config if row in VARIANTS else TINY[row]


def run_overrides(row: str) -> tuple[str, ...]:
    return VARIANTS[row].overrides if row in VARIANTS else ()


def reference_layout(row: str) -> tuple[str, ...]:
    return VARIANTS[row].reference_layout if row in VARIANTS else ()


def save_small_tokenizer(folder: Path) -> None:
    """The vendored GPT-2 tokenizer's first VOCAB - 1 tokens and <|endoftext|> (VOCAB - 1),
    a BPE tokenizer of its own: GPT-2's merge of rank r makes token 256 + r, so its first
    merges build exactly the tokens kept, and any text still tokenizes (into shorter tokens)."""
    source = asset_path("gpt2_tokenizer")
    vocab = json.loads((source / "vocab.json").read_text(encoding="utf-8"))
    kept = {token: i for token, i in vocab.items() if i < EOS}
    kept["<|endoftext|>"] = EOS
    header, *merges = (source / "merges.txt").read_text(encoding="utf-8").splitlines()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(kept, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("\n".join([header, *merges[:EOS - 256]]) + "\n", encoding="utf-8")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_text((source / name).read_text(encoding="utf-8"), encoding="utf-8")


def small_vocabulary(config: Any) -> Any:
    """`config` over the VOCAB tokens of save_small_tokenizer: its vocabulary size, and each
    special id outside it (GPT-2's and OLMo-2's <|endoftext|> 50256, Phi-3's 32000) set to
    <|endoftext|>'s id there."""
    config.vocab_size = VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, key, EOS)
    return config
