"""Parameter-efficient fine-tuning: peft's LoRA / DoRA adapters on a frozen base (peft=lora|dora).

Built on the `peft` library: this module only turns the spec's `peft` group into a
`LoraConfig`, wraps the model, and says what was found. Which layers get adapters is
read off the model itself (its linear layers, for any architecture), so a target list
that matches nothing is refused naming the layers there are.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

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


def lora_config(spec: PeftSpec) -> "LoraConfig":
    """peft's config for the spec: "all-linear" (every linear layer of the blocks, not the
    output head) unless a target list is given."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules) if spec.target_modules else "all-linear",
        modules_to_save=list(spec.modules_to_save) or None,
        use_dora=spec.kind is PeftKind.dora,
        task_type="CAUSAL_LM",
    )


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
            return get_peft_model(model, lora_config(spec))
    except ValueError as err:  # peft's own refusal (a module type it cannot adapt, DoRA on a layer kind)
        raise UserError(f"peft={spec.kind.value} cannot be applied to this {model.config.model_type} model: "
                        f"{str(err).strip().splitlines()[0]}. Change peft.target_modules (its linear layers: "
                        f"{linear}).") from None

