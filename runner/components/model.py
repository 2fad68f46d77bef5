"""Builders for the model config, tokenizer and model (one sub-spec in, one object out)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlparse

from runner.components.activations import fuse_activations
from runner.config.errors import UserError
from runner.config.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

OFFLINE_FIX = (
    "Use the offline recipe (recipe=gpt2_clm_tiny), or download the files on a "
    "connected machine and point at them (model.name_or_path=/local/dir)."
)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Fast check so an offline machine fails at once instead of retrying for minutes."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hub_source(name: str, what: str, override: str) -> None:
    """Raise a UserError unless `name` (not a local folder) can be had from cache or hub."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json" if what == "model" else "tokenizer_config.json")
    if isinstance(cached, str) or hub_reachable():
        return
    raise UserError(
        f"{override}='{name}' is not a local folder, is not in the Hugging Face cache, "
        f"and the hub is unreachable. {OFFLINE_FIX}"
    )


def tokenizer_source(spec: ModelSpec) -> Optional[str]:
    return spec.tokenizer_name or spec.name_or_path


def check_sources(spec: ModelSpec) -> list[str]:
    """Can the config, weights and tokenizer be had? One message per problem."""
    if tokenizer_source(spec) is None:
        return [
            "model.tokenizer_name is required when training from scratch "
            "(model.tokenizer_name='${asset:gpt2_tokenizer}' is the vendored GPT-2 tokenizer)."
        ]
    sources: dict[str, tuple[str, str]] = {}  # value -> (what, override); a shared name is checked once
    if spec.name_or_path:
        sources[spec.name_or_path] = ("model", "model.name_or_path")
    sources.setdefault(str(tokenizer_source(spec)), ("tokenizer", "model.tokenizer_name"))
    problems: list[str] = []
    for value, (what, override) in sources.items():
        local = Path(value).expanduser()
        if local.is_dir():
            continue
        if value.startswith(("/", ".", "~")):
            problems.append(f"{override}: no such folder '{value}'. Fix the path.")
            continue
        try:
            _hub_source(value, what, override)
        except UserError as err:
            problems += err.problems
    return problems


def _override_value(key: str, text: str, default: Any) -> Any:
    """One config_overrides value, typed as the config's default for the key (as
    transformers' update_from_string types it); a key whose default is None (derived
    later, e.g. Llama's num_key_value_heads) takes an int, a float, a bool or the text."""
    words = {"true": True, "yes": True, "y": True, "1": True, "false": False, "no": False, "n": False, "0": False}
    if isinstance(default, bool):
        if text.lower() not in words:
            raise ValueError(f"can't derive true or false from {text} (key {key})")
        return words[text.lower()]
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    if default is None:
        for cast in (int, float):
            try:
                return cast(text)
            except ValueError:
                pass
        return words.get(text.lower(), text) if text.lower() in ("true", "false") else text
    raise ValueError(f"{key} is a {type(default).__name__} in the config; only int, float, bool and text values can be set")


def parse_config_overrides(overrides: str, defaults: "PretrainedConfig") -> dict[str, Any]:
    """run_clm's `key=value,key=value` string, typed by the config's defaults."""
    parsed = {}
    for item in overrides.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"'{item}' is not key=value")
        if not hasattr(defaults, key):
            raise ValueError(f"key {key} isn't in the original config dict")
        parsed[key] = _override_value(key, value.strip(), getattr(defaults, key))
    return parsed


def _last_line(err: BaseException) -> str:
    """The line of an error that says what is wrong (a config validator wraps its reason
    in a header line: 'Class validation error ...:' then 'ValueError: The hidden size ...')."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1].rstrip(".") if lines else type(err).__name__


def build_config(spec: ModelSpec) -> "PretrainedConfig":
    """The model's config. From scratch (model.model_type), config_overrides are the
    config class's constructor arguments, so what the constructor derives from them
    follows (Qwen's layer_types from num_hidden_layers, Llama's num_key_value_heads from
    num_attention_heads); run_clm's update_from_string after construction left those at
    the defaults' values. A pretrained config (model.name_or_path) is only updated: its
    architecture is its weights'."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if spec.name_or_path:
        config = AutoConfig.from_pretrained(os.path.expanduser(spec.name_or_path))
    elif spec.model_type not in CONFIG_MAPPING:
        raise UserError(f"model.model_type='{spec.model_type}' is not a transformers model type (e.g. gpt2).")
    else:
        config = CONFIG_MAPPING[spec.model_type]()
    if not spec.config_overrides:
        return config
    try:
        overrides = parse_config_overrides(spec.config_overrides, config)
    except (ValueError, TypeError) as err:
        raise UserError(
            f"model.config_overrides='{spec.config_overrides}': {err}. "
            "Use run_clm's form, e.g. model.config_overrides='n_embd=128,n_layer=2'."
        ) from None
    try:
        if spec.name_or_path:
            for key, value in overrides.items():
                setattr(config, key, value)
        else:
            config = CONFIG_MAPPING[spec.model_type](**overrides)
    except Exception as err:  # the config class's own validation (huggingface_hub's strict dataclasses, ValueError)
        raise UserError(f"model.config_overrides='{spec.config_overrides}' describes no valid "
                        f"{config.model_type} model: {_last_line(err)}. Change those settings.") from None
    return config


def build_meta_model(config: "PretrainedConfig") -> "PreTrainedModel":
    """The causal LM `config` describes, without memory or weights: call under
    `torch.device("meta")` (shapes, module tree and layer classes only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


# The config fields that decide attention's and the MLP's shapes, named when a model
# cannot run a micro-batch (with transformers' defaults for those not overridden).
SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "num_hidden_layers", "vocab_size")


def not_a_causal_lm(spec: ModelSpec, config: "PretrainedConfig") -> Optional[str]:
    """Why `config` cannot be trained here, when transformers has no causal-LM class for its
    type (T5 and other encoder-decoders, encoder-only and vision models); None when it has."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    given = f"model.name_or_path={spec.name_or_path} is a {config.model_type} model" if spec.name_or_path else (
        f"model.model_type={config.model_type}")
    kind = " (an encoder-decoder)" if getattr(config, "is_encoder_decoder", False) else ""
    return (f"{given}{kind} is not a causal LM: transformers has no causal-LM class for it, and runner trains "
            "causal LMs. Choose a decoder model (gpt2, llama, qwen2, mistral, ...).")


def probe_model(spec: ModelSpec, config: "PretrainedConfig", sequence_length: int = 8) -> list[str]:
    """Build the model on the meta device (no memory, no weights) and run one micro-batch's
    shapes through it: an inconsistent config (heads that do not divide the width,
    grouped-query heads left at a default that does not divide the heads) becomes one
    line naming its shape settings, not a traceback from inside attention; an encoder
    built as a causal LM without is_decoder (whose attention would see the token it
    predicts; transformers only warns) is refused, and a type with no causal-LM class at
    all (T5) in one short line. Seconds even for a 7B config."""
    import copy
    import logging as std_logging

    import torch
    from transformers import AutoModelForCausalLM

    warnings_seen: list[str] = []

    class Catch(std_logging.Handler):
        def emit(self, record: std_logging.LogRecord) -> None:
            warnings_seen.append(record.getMessage())

    not_causal = not_a_causal_lm(spec, config)
    if not_causal:
        return [not_causal]  # building it would only list every causal-LM config class
    handler, logger = Catch(level=std_logging.WARNING), std_logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with torch.device("meta"):
            # A mixture of experts runs its experts as one grouped matmul (transformers'
            # default), whose meta kernel takes bf16 only, or eagerly, which asks which
            # experts a token chose (nonzero: data the meta device does not have).
            # batched_mm has the same shapes and no data-dependent step. A copy: the
            # choice is written into the config, and the run's own model keeps the default.
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="batched_mm")
        if any("is_decoder=True" in w for w in warnings_seen):
            return [f"model.model_type={config.model_type} builds {type(model).__name__}, an encoder: without "
                    "is_decoder=true its attention sees the token it is asked to predict, so every loss it prints "
                    "is meaningless. Add is_decoder=true to model.config_overrides, or choose a decoder model."]
        ids = torch.zeros(1, sequence_length, dtype=torch.long, device="meta")
        model(input_ids=ids)
    except Exception as err:  # any shape error from inside the model
        given = {item.partition("=")[0].strip() for item in (spec.config_overrides or "").split(",")}
        shown = ", ".join(
            f"{k}={getattr(config, k)}" + ("" if k in given or spec.name_or_path else " (default)")
            for k in SHAPE_FIELDS if isinstance(getattr(config, k, None), int)
        )
        return [f"the model these settings describe cannot run a micro-batch ({_last_line(err)}): {shown}. "
                "Make the head counts divide the width and each other (num_key_value_heads divides "
                "num_attention_heads; hidden_size = num_attention_heads x head_dim where the model has head_dim) "
                "in model.config_overrides."]
    finally:
        logger.removeHandler(handler)
    return []


def active_dropout(config: "PretrainedConfig") -> dict[str, float]:
    """The config's dropout probabilities above zero that a causal LM uses (GPT-2's
    resid/embd/attn_pdrop, Llama's attention_dropout, ...), by name. Heads a causal LM
    does not build (GPT-2's summary_first_dropout, classifier_dropout) are left out."""
    found = {}
    for key, value in config.to_dict().items():
        if key.startswith(("summary_", "classifier_")) or isinstance(value, bool):
            continue
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
            found[key] = float(value)
    return found


def max_positions(config: "PretrainedConfig") -> Optional[int]:
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def build_tokenizer(spec: ModelSpec) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    source = tokenizer_source(spec)
    assert source is not None, "validated: a tokenizer is always named"
    return AutoTokenizer.from_pretrained(os.path.expanduser(source), use_fast=True)


def build_model(spec: ModelSpec, config: "PretrainedConfig", vocab_size: int) -> "PreTrainedModel":
    """Pretrained weights, or a fresh model from `config` (seed first: init is random)."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation.value
    if spec.name_or_path:
        # fp32 weights under every precision (bf16 is autocast over them; a strategy keeps any
        # low-precision copy itself): transformers 5 would load a checkpoint in its saved
        # dtype, and most hub checkpoints are saved in bf16.
        import torch
        import transformers

        kwargs["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = torch.float32
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(spec.name_or_path), config=config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    # run_clm: grow the embedding only if the tokenizer has more tokens than the model.
    if vocab_size > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size)
    apply_model_settings(spec, model)
    return model


def disable_dropout(model: Any) -> int:
    """Every dropout of `model` made 0, as TRL's disable_dropout_in_model does (its
    nn.Dropout modules, peft's LoRA dropout among them), and the attention's dropout
    rate the attention modules read as a number (Llama's, Mistral's, Qwen's
    `attention_dropout`). Returns how many were on."""
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float):
            changed += rate > 0
            module.attention_dropout = 0.0
    return changed


def apply_model_settings(spec: ModelSpec, model: "PreTrainedModel") -> None:
    """What a run changes in the model transformers built: its activations
    (model.fused_activations) and gradient checkpointing. The memory plan's trace applies
    the same to its fake model (runner/components/step_trace.py)."""
    if spec.fused_activations:
        fuse_activations(model)
    if spec.gradient_checkpointing:
        # transformers 5 renamed it; 4.x only has the old name.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False


def starting_model(spec: ModelSpec, seed: int) -> tuple["PreTrainedTokenizerBase", "PretrainedConfig", "PreTrainedModel"]:
    """The tokenizer, config and model a run starts from: seeded first, so a scratch
    model's random init is the same wherever it is built (the policy by the worker, a
    frozen reference's copy by runner/components/objectives/frozen.py)."""
    from accelerate.utils import set_seed

    set_seed(seed)
    tokenizer = build_tokenizer(spec)
    config = build_config(spec)
    return tokenizer, config, build_model(spec, config, len(tokenizer))


def layer_class_names(model: "PreTrainedModel") -> list[str]:
    """The model's transformer-layer classes: those it names in `_no_split_modules`
    (transformers' own list, what Accelerate's FSDP auto-wrap reads) that its module tree
    holds. What strategy=fsdp wraps, one FSDP unit each, for any architecture."""
    present = {type(m).__name__ for m in model.modules()}
    return [name for name in (getattr(model, "_no_split_modules", None) or []) if name in present]


def layer_parameters(model: PreTrainedModel) -> int | None:
    """The parameters of one transformer layer: the first module of a class the model
    names in `_no_split_modules` (transformers' list of its layer classes, what
    Accelerate's FSDP auto-wrap reads); None when it names none. Sizes ZeRO-3's prefetch
    on a GPU (runner/distributed/deepspeed.py zero_sizes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return sum(p.numel() for p in module.parameters())
    return None


def count_parameters(model: "PreTrainedModel", trainable_only: bool = False) -> int:
    """Every parameter once (or, `trainable_only`, those the optimizer updates), at its
    full size, whatever the strategy."""
    # Tied weights (GPT-2's lm_head and wte) are one tensor; count it once.
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen and (p.requires_grad or not trainable_only):
            seen.add(id(p))
            # Under ZeRO-3 a partitioned parameter is an empty placeholder (numel() 0);
            # DeepSpeed keeps its full size in ds_numel.
            total += int(getattr(p, "ds_numel", p.numel()))
    return total


def count_trainable_parameters(model: "PreTrainedModel") -> int:
    """The parameters the optimizer updates (requires_grad), each once, at full size."""
    return count_parameters(model, trainable_only=True)
