"""What trains and how: trainable set, parameter dtypes, AdamW, per-group gradient clipping (``docs/training.md``)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from mhla_diffusers.checkpoint.lora import add_lora, lora_parameters, mhla_parameters
from mhla_diffusers.families import self_attention_modules
from mhla_diffusers.ops.mixing import mixing_parameters
from mhla_diffusers.training.config import TRAINABLE_SETS

__all__ = ["set_trainable", "prepare_parameter_dtypes", "build_optimizer", "gradient_groups", "clip_grad_norms_", "clip_step_gradients"]


def set_trainable(
    transformer: torch.nn.Module, trainable: str = "full", *, lora: Mapping | None = None, train_mixing: bool = True
) -> int:
    """Choose which parameters train, in place: ``"full"``, ``"lora"``, ``"attention"`` or ``"mixing"``; the trainable element count.

    With ``train_mixing`` the MHLA parameters train in every set, else they are frozen in every set.

    Raises:
        ValueError: unknown ``trainable``, ``"mixing"`` without MHLA, nothing left to train.
    """
    if trainable not in TRAINABLE_SETS:
        raise ValueError(f"trainable must be one of {TRAINABLE_SETS}; got {trainable!r}")
    mixing = mhla_parameters(transformer)
    if trainable == "full":
        transformer.requires_grad_(True)
    elif trainable == "lora":
        lo = dict(lora or {})
        add_lora(
            transformer, rank=int(lo.get("rank", 16)), alpha=lo.get("alpha"), dropout=float(lo.get("dropout", 0.0)),
            target_modules=lo.get("target_modules") or ("to_q", "to_k", "to_v", "to_out.0"), train_mixing=train_mixing,
        )
    elif trainable == "attention":
        transformer.requires_grad_(False)
        for _, attn in self_attention_modules(transformer):
            attn.requires_grad_(True)
    else:
        if not mixing:
            raise ValueError("train.trainable=mixing needs a model with MHLA (set the mhla section)")
        transformer.requires_grad_(False)
    for p in mixing:
        p.requires_grad_(bool(train_mixing))
    count = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    if count == 0:
        raise ValueError(f"train.trainable={trainable} with train_mixing={train_mixing} leaves nothing to train")
    return count


def prepare_parameter_dtypes(model: torch.nn.Module, weight_dtype: torch.dtype) -> dict[str, int]:
    """Frozen parameters to ``weight_dtype``, trainable ones to fp32 (a ``GradScaler`` cannot unscale fp16 grads).

    Frozen parameters of ``_keep_in_fp32_modules`` stay fp32.

    Returns:
        ``{"frozen", "trainable", "kept_fp32"}`` element counts.
    """
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    frozen = trainable = kept = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.requires_grad or any(k in parts for k in keep):
            if p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
            if p.requires_grad:
                trainable += p.numel()
            else:
                kept += p.numel()
        else:
            if p.dtype != weight_dtype:
                p.data = p.data.to(weight_dtype)
            frozen += p.numel()
    return {"frozen": frozen, "trainable": trainable, "kept_fp32": kept}


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    *,
    mixing_lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW: group ``model`` and group ``mhla_mixing`` (the mixing matrices: ``mixing_lr``, no decay); ``ValueError`` if nothing trains."""
    mixing = [p for p in mixing_parameters(model) if p.requires_grad]
    ids = {id(p) for p in mixing}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    if not rest and not mixing:
        raise ValueError("the model has no trainable parameters")
    groups = []
    if rest:
        groups.append({"params": rest, "lr": lr, "weight_decay": weight_decay, "name": "model"})
    if mixing:
        groups.append({"params": mixing, "lr": lr if mixing_lr is None else mixing_lr, "weight_decay": 0.0, "name": "mhla_mixing"})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def gradient_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The trainable parameters as ``{"model", "lora", "mhla_mixing"}`` (empty groups left out), clipped one by one."""
    mixing = [p for p in mixing_parameters(model) if p.requires_grad]
    lora_ids = {id(p) for p in lora_parameters(model)}
    taken = {id(p) for p in mixing} | lora_ids
    groups = {
        "model": [p for p in model.parameters() if p.requires_grad and id(p) not in taken],
        "lora": [p for p in model.parameters() if p.requires_grad and id(p) in lora_ids],
        "mhla_mixing": mixing,
    }
    return {name: params for name, params in groups.items() if params}


@torch.no_grad()
def clip_grad_norms_(groups: Mapping[str, Sequence[torch.nn.Parameter]], max_norm: float | None) -> dict[str, float]:
    """Clip each group's gradients to a 2-norm of at most ``max_norm`` (0 / ``None``: measure only), in place.

    Returns ``{name: norm before clipping}``; a non-finite norm is not scaled. A collective under FSDP2.
    """
    norms = {}
    for name, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            norms[name] = 0.0
            continue
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
        norms[name] = float(norm)
        if max_norm and math.isfinite(norms[name]):
            scale = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
    return norms


def clip_step_gradients(accelerator, model, groups: Mapping[str, Sequence[torch.nn.Parameter]], max_norm: float | None,
                    per_group: bool) -> dict[str, float]:
    """Unscale (fp16) and clip one step's gradients, per group or (DeepSpeed, XLA) globally; the norms."""
    if per_group:
        accelerator.unscale_gradients()
        return clip_grad_norms_(groups, max_norm)
    if not max_norm:
        return {}
    total = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return {} if total is None else {"all": float(total)}
