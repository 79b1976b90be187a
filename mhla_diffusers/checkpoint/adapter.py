"""LoRA adapters for MHLA fine-tuning through peft: add, merge, unload, save beside a checkpoint, load.

:func:`add_lora` adds adapters (``add_adapter`` on SANA / Wan, ``peft.inject_adapter_in_model`` on
DiT) and keeps the MHLA parameters trainable; :func:`merge_lora_` folds ``W + (alpha / r) B A`` in for
good; :func:`lora_merged` does so only while a block runs (how ``save_mhla_*(merge_lora=True)``
writes); :func:`save_lora` / :func:`load_lora` keep the adapter in peft's format in
``<pipeline>/transformer_lora/``, which the loaders apply by default. A model with peft layers must
never go through plain ``save_pretrained`` (its ``base_layer`` keys reload re-initialised).

Below the checkpoint format (``format.py`` imports this module; this module imports no loader).
Rules in full: ``docs/checkpoints.md`` (LoRA).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from mhla_diffusers.checkpoint.io import atomic_output, atomic_write_json
from mhla_diffusers.checkpoint.safetensors_file import load_safetensors

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LORA_DIR_NAME",
    "add_lora",
    "has_lora",
    "describe_lora",
    "lora_is_fused",
    "lora_merged",
    "lora_parameters",
    "mhla_parameters",
    "merge_lora_",
    "unload_lora_",
    "lora_state_dict",
    "save_lora",
    "load_lora",
]

# Every attention projection (self- and cross-attention); peft matches names by suffix.
DEFAULT_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
LORA_DIR_NAME = "transformer_lora"
_CONFIG_FILE = "adapter_config.json"
_WEIGHTS_FILE = "adapter_model.safetensors"
_ADAPTER = "default"


def add_lora(
    transformer: nn.Module,
    *,
    rank: int = 16,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    train_mixing: bool = True,
):
    """Add LoRA adapters (``peft.LoraConfig``, adapter name ``"default"``) to ``transformer`` in place.

    Afterwards exactly the LoRA matrices (and, with ``train_mixing``, :func:`mhla_parameters`) have
    ``requires_grad=True``. LoRA B starts at zero, so the output is unchanged.

    Args:
        rank: LoRA rank ``r``. alpha: scale numerator (``None``: ``rank``, i.e. scale 1).
        dropout: LoRA dropout. target_modules: peft ``target_modules`` (module-name suffixes).
        train_mixing: keep the MHLA parameters trainable.

    Returns:
        The ``LoraConfig`` used.

    Raises:
        ValueError: the model already has LoRA adapters, bad rank, or no module matches ``target_modules``.
    """
    # function-level import: peft (heavy, imports transformers) is needed only when LoRA is used
    from peft import LoraConfig, inject_adapter_in_model

    if has_lora(transformer):
        raise ValueError("the model already has LoRA adapters (merge_lora_ or unload_lora_ first)")
    if int(rank) != rank or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer; got {rank!r}")
    config = LoraConfig(
        r=int(rank),
        lora_alpha=float(rank if alpha is None else alpha),
        lora_dropout=float(dropout),
        target_modules=list(target_modules),
        init_lora_weights=True,
    )
    try:
        if hasattr(transformer, "add_adapter"):
            transformer.add_adapter(config, adapter_name=_ADAPTER)
        else:
            inject_adapter_in_model(config, transformer, adapter_name=_ADAPTER)
    except ValueError as err:
        raise ValueError(f"cannot add LoRA with target_modules={list(target_modules)}: {err}") from err
    for name, p in transformer.named_parameters():
        p.requires_grad_("lora_" in name)
    if train_mixing:
        for p in mhla_parameters(transformer):
            p.requires_grad_(True)
    return config


def mhla_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters MHLA adds to a model: every parameter of an attention layer's MHLA (``<attention>.mhla``: the
    mixing matrix, and the output norm, gate, LePE, input norm where it has them)."""
    return [p for name, p in model.named_parameters() if ".mhla." in f".{name}"]


def _tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # function-level import: peft (heavy, imports transformers) is needed only when LoRA is used
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` has peft adapter layers."""
    return bool(_tuner_layers(model))


def describe_lora(model: nn.Module) -> str | None:
    """One phrase on the peft adapters of ``model`` for messages (``None`` without adapter layers): which
    adapters, on how many layers (one named), and whether they are fused into the base weights, e.g.
    ``"LoRA adapters ['default_0'] on 16 layers (blocks.0.attn1.to_q, ...), not fused"``."""
    layers = _tuner_layers(model)
    if not layers:
        return None
    adapters = sorted({a for _, layer in layers for a in layer.active_adapters})
    merged = [bool(layer.merged) for _, layer in layers]
    state = "fused into the weights" if all(merged) else "partly fused" if any(merged) else "not fused"
    if any(layer.disable_adapters for _, layer in layers):
        state += ", disabled"
    return f"LoRA adapters {adapters} on {len(layers)} layers ({layers[0][0]}, ...), {state}"


def lora_is_fused(model: nn.Module) -> bool:
    """Whether every peft adapter layer of ``model`` has all its active adapters merged into its base
    weights (diffusers' ``fuse_lora``); ``False`` without adapter layers."""
    layers = _tuner_layers(model)
    return bool(layers) and all(set(layer.active_adapters) <= set(layer.merged_adapters) for _, layer in layers)


@contextlib.contextmanager
def lora_merged(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: inside it every peft layer of ``model`` is its base layer holding ``W + scale * B A``.

    ``state_dict()`` / ``save_pretrained`` then see a plain model computing the same; the model is
    restored bit for bit on exit (unfused layers are merged in a copy: one copy of each in memory).

    Raises:
        ValueError: adapters are disabled (nothing to merge), or peft's ``safe_merge`` finds a
            non-finite merged weight.
    """
    layers = _tuner_layers(model)
    disabled = [name for name, layer in layers if layer.disable_adapters]
    if disabled:
        raise ValueError(
            f"the LoRA adapters of {disabled[0]} (and {len(disabled) - 1} more layers) are disabled: the model computes "
            "its base weights. Enable them (enable_lora()) to merge them, or remove them (unload_lora_weights()) to "
            "save the base weights"
        )
    swapped, peft_loaded = [], model.__dict__.get("_hf_peft_config_loaded")
    try:
        if peft_loaded:  # transformers' save_pretrained would write the adapter alone
            model._hf_peft_config_loaded = False
        for name, layer in layers:
            pending = [a for a in layer.active_adapters if a not in layer.merged_adapters]
            if pending:
                layer = copy.deepcopy(layer)
                layer.merge(safe_merge=True, adapter_names=pending)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swapped.append((parent, child, parent._modules[child]))
            parent._modules[child] = layer.get_base_layer()
        yield model
    finally:
        for parent, child, original in reversed(swapped):
            parent._modules[child] = original
        if peft_loaded:
            model._hf_peft_config_loaded = peft_loaded


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA parameters (``lora_A`` / ``lora_B``) of ``model``, in module order."""
    return [p for name, p in model.named_parameters() if "lora_" in name]


def _replace_with_base(model: nn.Module, merge: bool) -> int:
    layers = _tuner_layers(model)
    for name, layer in layers:
        if merge:
            layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    # diffusers' PeftAdapterMixin / peft bookkeeping: the model no longer has adapters
    if getattr(model, "_hf_peft_config_loaded", False):
        model._hf_peft_config_loaded = False
    if hasattr(model, "peft_config"):
        del model.peft_config
    return len(layers)


def merge_lora_(model: nn.Module) -> int:
    """Merge every LoRA adapter into its base weight (``W += (alpha / r) B A``) and remove the
    peft layers, in place. Returns the number of layers merged (0 without LoRA).

    Raises:
        ValueError: from peft's ``safe_merge`` when a merged weight is not finite.
    """
    return _replace_with_base(model, merge=True)


def unload_lora_(model: nn.Module) -> int:
    """Remove every LoRA adapter WITHOUT merging (the base weights as they were), in place.
    Returns the number of layers unloaded."""
    return _replace_with_base(model, merge=False)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights in peft's format (``<module>.lora_A.weight`` / ``lora_B.weight``), fp32, on the CPU."""
    # function-level import: peft (heavy, imports transformers) is needed only when LoRA is used
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=_ADAPTER)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def _lora_config_of(model: nn.Module):
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict) and _ADAPTER in config:
        return config[_ADAPTER]
    raise ValueError("the model has no LoRA adapter named 'default' (add_lora adds it)")


def save_lora(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write the model's LoRA adapter to ``folder`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, fp32, peft's key format). The folder is created or replaced.

    Raises:
        ValueError: the model has no LoRA adapter.
    """
    if not has_lora(model):
        raise ValueError("the model has no LoRA adapters to save")
    config = _lora_config_of(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    as_dict = config.to_dict()
    as_dict = {k: (sorted(v) if isinstance(v, set) else v) for k, v in as_dict.items()}
    atomic_write_json(folder / _CONFIG_FILE, as_dict, indent=2, sort_keys=True, default=str)
    with atomic_output(folder / _WEIGHTS_FILE) as tmp:
        save_file(lora_state_dict(model), str(tmp), metadata={"format": "pt"})
    return folder


def load_lora(model: nn.Module, folder: str | os.PathLike) -> None:
    """Add the adapter stored in ``folder`` (by :func:`save_lora`) to ``model`` and load its weights strictly.

    Raises:
        FileNotFoundError: the folder lacks ``adapter_config.json`` or ``adapter_model.safetensors``.
        ValueError: a LoRA key of the file has no layer in the model, or a layer of the model has no
            weights in the file.
    """
    # function-level import: peft (heavy, imports transformers) is needed only when LoRA is used
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    folder = Path(folder)
    for name in (_CONFIG_FILE, _WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: not a LoRA folder written by save_lora")
    raw = json.loads((folder / _CONFIG_FILE).read_text())
    config = LoraConfig(
        r=int(raw["r"]),
        lora_alpha=float(raw["lora_alpha"]),
        lora_dropout=float(raw.get("lora_dropout", 0.0)),
        target_modules=raw["target_modules"],
    )
    if hasattr(model, "add_adapter"):
        model.add_adapter(config, adapter_name=_ADAPTER)
    else:
        inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    tensors = load_safetensors(folder / _WEIGHTS_FILE, "LoRA weights")
    expected = set(lora_state_dict(model))
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{folder / _WEIGHTS_FILE} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    set_peft_model_state_dict(model, tensors, adapter_name=_ADAPTER)
    model.requires_grad_(False)
