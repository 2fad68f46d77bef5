"""transformers' Python tanh-GELU modules swapped for torch's fused kernel
(model.fused_activations).

GPT-2, GPT-Neo, GPT-J, CodeGen and Phi name `gelu_new` (transformers' NewGELUActivation;
`gelu_fast` is the same formula): the tanh approximation of GELU written as seven
elementwise torch ops, each a pass over the MLP's (tokens x 4 x width) activations in
forward, and more in backward. transformers' own `gelu_pytorch_tanh` module computes the
same function with torch's one kernel (F.gelu(approximate="tanh")), which transformers
documents as equivalent, not bit for bit. Both are as close to the float64 formula
(6.5e-7 at most in fp32, bench/activations.py). One GPT-2 124M layer's activation at
8 x 128, forward and backward on 2 CPU cores: fp32 28.7 against 7.8 ms, bf16 10.3
against 6.8 (bench/activations.py), over 12 layers about 5% of the fp32 step. The model's config still names
its own activation, so the saved model is the architecture as published.
"""

from __future__ import annotations

from typing import Any

#: The activation names whose modules are swapped: the tanh approximation, in Python.
PYTHON_TANH_GELU = ("gelu_new", "gelu_fast")
#: What they become: transformers' module over torch's fused kernel.
FUSED_TANH_GELU = "gelu_pytorch_tanh"


def fuse_activations(model: Any) -> int:
    """Replace each Python tanh-GELU module in `model` by the fused one, in place;
    returns how many were replaced. The modules hold no parameters or buffers, so the
    state dict, the checkpoints and the saved model are unchanged."""
    from transformers.activations import ACT2FN

    slow = tuple({_module_class(name) for name in PYTHON_TANH_GELU})
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in slow:
                setattr(parent, name, ACT2FN[FUSED_TANH_GELU])
                swapped += 1
    return swapped


def activation_note(config: Any, model: Any) -> str:
    """The banner's line for the activations fuse_activations swapped in `model` ("" when
    its config names no Python tanh-GELU or none was swapped)."""
    named = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
    if named not in PYTHON_TANH_GELU:
        return ""
    fused = _module_class(FUSED_TANH_GELU)
    swapped = sum(type(m) is fused for m in model.modules())
    return f"{swapped} x {named} by torch's fused tanh GELU (model.fused_activations)" if swapped else ""


def _module_class(name: str) -> type:
    """The module class transformers builds for activation `name` (ACT2FN makes an
    instance; its class table's entries may carry arguments, so the instance is asked)."""
    from transformers.activations import ACT2FN

    return type(ACT2FN[name])
