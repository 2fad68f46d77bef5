"""Parameter-efficient fine-tuning: peft's LoRA / DoRA adapters on a frozen base (peft=lora|dora).

Built on the `peft` library: this module only turns the spec's `peft` group into a
`LoraConfig`, wraps the model, and says what was found. Which layers get adapters is
read off the model itself (its linear layers, for any architecture), so a target list
that matches nothing is refused naming the layers there are.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

from runner.config.errors import UserError
from runner.config.spec import PeftKind, PeftSpec

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

ADAPTER_DIRNAME = "adapter"


def uses_adapters(spec: PeftSpec) -> bool:
    return spec.kind is not PeftKind.none


def adapter_dropout(spec: PeftSpec) -> dict[str, float]:
    """The adapters' own dropout, when on: like the model's, it draws masks per rank and
    micro-batch, so a run in another layout cannot repeat it exactly."""
    return {"peft.dropout": spec.dropout} if uses_adapters(spec) and spec.dropout > 0 else {}


def lora_config(spec: PeftSpec, model: Any = None) -> "LoraConfig":
    """peft's config for the spec: "all-linear" (every linear layer of the blocks, not the
    output head) unless a target list is given. Given the model, a tied embedding named in
    `modules_to_save` stays tied (`tied_modules_to_save`)."""
    from peft import LoraConfig

    saved, tie = tied_modules_to_save(spec, model) if model is not None else (list(spec.modules_to_save), False)
    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules) if spec.target_modules else "all-linear",
        modules_to_save=saved or None,
        use_dora=spec.kind is PeftKind.dora,
        task_type="CAUSAL_LM",
        **({"ensure_weight_tying": True} if tie else {}),
    )


def tied_pair(model: Any) -> Optional[tuple[str, str]]:
    """The module names of the input embedding and the output head when they share one
    weight (GPT-2's transformer.wte and lm_head, a tied Llama's model.embed_tokens and lm_head)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is None or head is None or embedding.weight is not head.weight:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    return names[id(embedding)], names[id(head)]


def tied_modules_to_save(spec: PeftSpec, model: Any) -> tuple[list[str], bool]:
    """`peft.modules_to_save` as peft must get it, and whether peft must tie. Trained
    alone, one half of a tied pair would leave the other the frozen original (a trained
    input embedding reads added tokens the original head never predicts). peft's
    `ensure_weight_tying` trains one copy for both, but recognises the pair only by an
    entry whose last part is one of its EMBEDDING_LAYER_NAMES (embed_tokens, lm_head):
    GPT-2's `wte` is not, so the head's own name is passed beside it."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    saved = list(spec.modules_to_save)
    pair = tied_pair(model)
    if pair is None or not any(n == t or n.endswith("." + t) for n in pair for t in saved):
        return saved, False
    if not any(t.rsplit(".", 1)[-1] in EMBEDDING_LAYER_NAMES for t in saved):
        named = [n for n in pair if n.rsplit(".", 1)[-1] in EMBEDDING_LAYER_NAMES]
        if not named:  # peft could not tie them: refuse rather than train half of the pair
            raise UserError(f"peft.modules_to_save: {saved} names one of this {model.config.model_type} model's "
                            f"tied pair ({pair[0]}, {pair[1]}: one weight), which peft can keep tied only under "
                            f"the names {EMBEDDING_LAYER_NAMES}. Remove them from peft.modules_to_save.")
        saved.append(named[-1])
    return saved, True


def linear_layer_names(model: "torch.nn.Module") -> list[str]:
    """The last name part of every linear layer of the model (nn.Linear, and transformers'
    Conv1D that GPT-2 uses), without the output head: what a target list can name."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head})


def add_adapters(spec: PeftSpec, model: Any, gradient_checkpointing: bool = False) -> Any:
    """The model wrapped in peft's PeftModel: the base frozen, adapters (and
    `modules_to_save`) trainable. With gradient checkpointing, the embedding's output is
    made to require grad: under re-entrant checkpointing (transformers 4's default) a
    frozen embedding would otherwise give the checkpointed blocks inputs without grad, and
    the adapters inside them no gradient at all."""
    from peft import get_peft_model

    linear = linear_layer_names(model)
    names = [name for name, _ in model.named_modules()]
    # peft's rule: a target names a module whole or its dotted end (c_attn, attn.c_attn)
    unmatched = [t for t in spec.target_modules or () if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:  # also one typo among several names: it would silently leave those layers frozen
        raise UserError(f"peft.target_modules: {unmatched} match{'es' if len(unmatched) == 1 else ''} no layer of this "
                        f"{model.config.model_type} model; its linear layers are {linear}. Name some of them, or set "
                        "peft.target_modules=null (every linear layer of the blocks).")
    if gradient_checkpointing:
        model.enable_input_require_grads()
    try:
        with warnings.catch_warnings():
            # peft sets fan_in_fan_out itself for GPT-2's Conv1D, and asks transformers a
            # deprecated name: warnings with nothing for the user to do.
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
            return get_peft_model(model, lora_config(spec, model))
    except ValueError as err:  # peft's own refusal (a module type it cannot adapt, DoRA on a layer kind)
        raise UserError(f"peft={spec.kind.value} cannot be applied to this {model.config.model_type} model: "
                        f"{str(err).strip().splitlines()[0]}. Change peft.target_modules (its linear layers: "
                        f"{linear}).") from None

