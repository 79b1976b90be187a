"""What trains and how: the trainable set, parameter dtypes, AdamW with the mixing matrices in their
own group, and gradient norms clipped per parameter group."""

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
    """Choose which parameters train, in place; returns how many parameter elements do.

    - ``"full"``: every parameter.
    - ``"lora"``: LoRA adapters from :func:`mhla_diffusers.checkpoint.lora.add_lora` (``lora``: the config's
      ``lora`` section: rank, alpha, dropout, target_modules); everything else frozen.
    - ``"attention"``: the parameters of the self-attention modules (q, k, v, out projections, norms).
    - ``"mixing"``: nothing but the MHLA parameters (mixing matrices, Wan's output norms).

    With ``train_mixing`` the MHLA parameters (mixing matrices, Wan's output norms:
    :func:`mhla_diffusers.checkpoint.lora.mhla_parameters`) train in every set (``add_lora`` would freeze them
    otherwise); without it they are frozen in every set.

    Raises:
        ValueError: unknown ``trainable``, ``"mixing"`` on a model without MHLA, nothing left to train.
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
    """Frozen parameters to ``weight_dtype`` (memory), trainable ones (mixing matrices included) to fp32.

    The fp16 recipe (CASES C16): a ``GradScaler`` refuses to unscale fp16 gradients ("Attempting to
    unscale FP16 gradients"), so every parameter that receives a gradient must be fp32; frozen
    weights may be fp16 / bf16 and run under autocast. Trainable parameters are never round-tripped
    through the low-precision dtype (no precision is lost). Same end state as casting the model and
    then :func:`diffusers.training_utils.cast_training_params`.

    Frozen parameters of the modules the model class keeps in fp32 (diffusers'
    ``_keep_in_fp32_modules``, e.g. Wan's time embedder and norms) stay fp32, as
    ``from_pretrained(torch_dtype=...)`` keeps them.

    Returns:
        ``{"frozen": elements in weight_dtype, "trainable": elements in fp32, "kept_fp32": frozen elements kept in fp32}``.
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
    """AdamW over the trainable parameters of ``model``; MHLA mixing matrices in a second group.

    Group 0: every other trainable parameter (``lr``, ``weight_decay``). Group 1 (if the model has
    trainable mixing matrices): the mixing matrices (``mixing_lr`` or ``lr``, no weight decay).

    Raises:
        ValueError: no trainable parameters.
    """
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
    """The trainable parameters of ``model`` in the groups whose gradient norms are clipped and logged
    one by one (:func:`clip_grad_norms_`), so that a spike in one group cannot scale the others' step
    to nothing.

    ``"model"``: every trainable parameter not in the next two (Wan's MHLA output norms included);
    ``"lora"``: the LoRA adapter weights (:func:`mhla_diffusers.checkpoint.lora.lora_parameters`);
    ``"mhla_mixing"``: the MHLA mixing matrices. Empty groups are left out; the order is that one.
    """
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
    """Clip the gradients of each group of ``groups`` to a 2-norm of at most ``max_norm``, in place.

    Each group is scaled on its own by ``min(1, max_norm / (norm + 1e-6))`` (what
    ``torch.nn.utils.clip_grad_norm_`` does to all parameters at once), so one group's gradient
    spike leaves the others' as they are. ``max_norm`` 0 or ``None``: nothing is clipped, the norms
    are still measured. A group with a non-finite norm is not scaled (the caller skips the step).
    Gradients may be FSDP2 shards (DTensors): DTensor's norm is then the whole gradient's, the same on
    every process (a collective: every process calls this with the same groups).

    Args:
        groups: ``{name: parameters}`` (e.g. :func:`gradient_groups`); parameters without a
            gradient are ignored.
        max_norm: the largest gradient norm of a group, or 0 / ``None``.

    Returns:
        ``{name: norm before clipping}`` (Python floats; ``0.0`` for a group without gradients).
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
    """Unscale (fp16) and clip the gradients of one optimizer step; returns the norms before clipping.

    ``per_group``: each of ``groups`` on its own (:func:`clip_grad_norms_`; FSDP2's sharded gradients
    included). Otherwise (DeepSpeed, XLA: engine-managed gradients) the global norm, as ``"all"``.
    """
    if per_group:
        accelerator.unscale_gradients()
        return clip_grad_norms_(groups, max_norm)
    if not max_norm:
        return {}
    total = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return {} if total is None else {"all": float(total)}
