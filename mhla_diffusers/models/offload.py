"""MHLA made on a model whose group offloading diffusers enabled before: the new modules follow that offloading.

diffusers' ``enable_group_offload`` registers its hooks on the modules a model has at that moment. A layer's MHLA
(``attn.mhla``) made later is outside every group: on a GPU its parameters would stay where they were made. Each such
layer gets diffusers' leaf-level group offloading with the model's settings (:func:`follow_group_offloading`), its
own disk folder when the model offloads to disk. MHLA made first, offloading enabled after, needs nothing: diffusers
hooks the modules it finds, and every part of ``attn.mhla`` runs as a module.
"""

from __future__ import annotations

import os
import uuid

import torch
from torch import nn

__all__ = ["follow_group_offloading"]

_GROUP_OFFLOADING = "group_offloading"  # the name diffusers registers its group-offloading hooks under


def _hooks(model: nn.Module) -> list:
    """diffusers' group-offloading hooks on ``model`` and its submodules."""
    found = []
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = None if registry is None else registry.get_hook(_GROUP_OFFLOADING)
        if hook is not None:
            found.append(hook)
    return found


def _in_modules(group, tensor: torch.Tensor) -> bool:
    return any(tensor is p for module in group.modules for p in module.parameters())


def _managed(group, tensor: torch.Tensor) -> bool:
    """Whether diffusers' ``group`` moves ``tensor``: a group with a disk file, the tensors it listed when made;
    otherwise its listed parameters and every parameter of its modules, read at each move."""
    if getattr(group, "offload_to_disk_path", None) is not None:
        return tensor in group.tensor_to_key
    return any(tensor is p for p in group.parameters) or _in_modules(group, tensor)


def _pin_into_streamed(group, tensor: torch.Tensor) -> None:
    """A streamed group keeps a pinned CPU copy of each tensor of its modules, made when the group was: add one for
    a tensor of its modules made later (else its next onload fails)."""
    disk = getattr(group, "offload_to_disk_path", None) is not None
    if not disk and group.stream is not None and tensor not in group.cpu_param_dict and _in_modules(group, tensor):
        group.cpu_param_dict[tensor] = group._to_cpu(tensor, group.low_cpu_mem_usage)


def follow_group_offloading(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> list[str]:
    """Give each layer's MHLA that diffusers' group offloading of ``model`` does not move the same offloading,
    at leaf level (each part onloaded when it runs).

    Args:
        model: the transformer (no-op unless ``enable_group_offload`` was called on it).
        layers: ``[(attention path, attention module)]``; those without ``attn.mhla`` are skipped.

    Returns:
        The attention paths whose MHLA got hooks now.
    """
    hooks = _hooks(model)
    if not hooks:
        return []
    from diffusers.hooks import apply_group_offloading  # function level: only models under group offloading need it

    config, followed = hooks[0].config, []
    for name, attn in layers:
        layer = getattr(attn, "mhla", None)
        if layer is None:
            continue
        for tensor in layer.parameters():
            for hook in hooks:
                _pin_into_streamed(hook.group, tensor)
        if any(_managed(hook.group, layer.mixing.weight) for hook in hooks):
            continue
        disk = config.offload_to_disk_path
        if disk is not None:  # a folder of its own: diffusers names its files by module path, "mixing" in every layer
            disk = os.path.join(disk, f"mhla-{name}-{uuid.uuid4().hex[:8]}")
        apply_group_offloading(layer, onload_device=config.onload_device, offload_device=config.offload_device,
                               offload_type="leaf_level", non_blocking=config.non_blocking, offload_to_disk_path=disk)
        followed.append(name)
    return followed
