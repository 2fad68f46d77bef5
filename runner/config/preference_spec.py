"""The run spec's preference section (`preference.*`): the loss a preference objective
(train.objective=dpo) trains on chosen/rejected pairs, and its reference.

Part of the schema in runner.config.spec, which nests `PreferenceSpec` as
`RunSpec.preference` and re-exports these names; apart because an objective's own
settings grow with it, beside the schema rather than in it. Every field is documented
under it, as in spec.py (docs/configuration.md is generated from both).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class PreferenceLoss(str, enum.Enum):
    sigmoid = "sigmoid"  # DPO (Rafailov et al.), with label smoothing: conservative DPO
    ipo = "ipo"  # IPO (Azar et al.), on log-ratios averaged over each answer's tokens, as TRL
    hinge = "hinge"  # SLiC's hinge on the reward margin
    simpo = "simpo"  # SimPO (Meng et al.): reference-free, length-normalised, margin gamma
    orpo = "orpo"  # ORPO (Hong et al.): reference-free, the chosen's NLL plus lambda x an odds-ratio term


class ReferenceMode(str, enum.Enum):
    frozen = "frozen"  # a frozen copy of the starting weights, sharded like the policy
    adapter_off = "adapter_off"  # with peft: the same model with its adapters disabled
    precomputed = "precomputed"  # the starting weights' log-probs, computed once before training
    none = "none"  # simpo and orpo: no reference


@dataclass
class PreferenceSpec:
    """train.objective=dpo: the loss on chosen/rejected pairs (docs/preference.md)."""

    loss_type: PreferenceLoss = PreferenceLoss.sigmoid
    """sigmoid (DPO) | ipo | hinge | simpo | orpo."""
    beta: float = 0.1
    """The reward scale: DPO's, IPO's tau, the hinge's; SimPO's beta; ORPO's lambda, the
    odds-ratio term's weight (TRL's ORPOConfig.beta)."""
    label_smoothing: float = 0.0
    """sigmoid and simpo: the share of pairs assumed mislabelled (conservative DPO), in [0, 0.5)."""
    gamma: float = 0.5
    """simpo: the target reward margin γ (TRL's simpo_gamma): the loss is
    -log σ(β x (the mean log-prob margin) - γ)."""
    reference: Optional[ReferenceMode] = None
    """frozen | adapter_off | precomputed | none. null: none for simpo and orpo; with
    peft, adapter_off; otherwise precomputed (the starting weights' log-probs, scored
    once before training and kept in the run folder). frozen: a second copy of the
    starting weights, sharded like the policy, scoring each micro-batch."""
    disable_dropout: bool = True
    """Turn the policy's dropout off, the adapters' (LoRA's) included, as TRL's DPOConfig
    does by default: the reference scores without dropout in every mode, so with it off
    a fresh run's first step is the reference (loss log 2, margins 0). false keeps the
    model's and the adapters' dropout in the policy."""
