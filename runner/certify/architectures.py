"""Tiny random-init configs of the causal LMs people train, one per transformers model type.

Each is the architecture's own config class built with these constructor arguments
(model.config_overrides), so what the class derives from them follows (layer types,
grouped-query heads, head_dim). Every one is small enough for a CPU in seconds, keeps
the features that make its architecture what it is (grouped-query attention, gated
MLPs, sliding windows, soft-capping, QK-norm, a mixture of experts, untied embeddings)
and has dropout off: certification compares layouts, which only equal math can pass.
The GPT-2 tokenizer's 50,257 tokens are the vocabulary; 64 positions fit block size 32.
"""

from __future__ import annotations

from dataclasses import dataclass

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
}
ROWS = (*TINY, *VARIANTS)


def model_type(row: str) -> str:
    return VARIANTS[row].model_type if row in VARIANTS else row


def tiny_config(row: str) -> str:
    return VARIANTS[row].config if row in VARIANTS else TINY[row]


def run_overrides(row: str) -> tuple[str, ...]:
    return VARIANTS[row].overrides if row in VARIANTS else ()


def reference_layout(row: str) -> tuple[str, ...]:
    return VARIANTS[row].reference_layout if row in VARIANTS else ()
