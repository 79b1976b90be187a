"""Everything that differs per model family lives here, and only here.

A :class:`Family` says which diffusers transformer classes it covers, where their self-attention
modules are, which submodule embeds the latent into tokens (its input gives the token grid
exactly), the model's default token grid (for picking a block grid once, at conversion), and
which stock processors restore the original model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["Family", "FAMILIES", "family_of", "find_family", "self_attention_modules"]


@dataclass(frozen=True)
class Family:
    """Model-family facts used by the processor, the grid hooks and conversion.

    Attributes:
        name: short name used in configs and on the command line (``"dit"``).
        model_classes: diffusers class names of the transformers of this family.
        self_attention: regex over ``named_modules()`` names matching self-attention layers;
            group 1 is the layer index.
        patch_embed: name of the submodule that turns the latent into tokens; its first
            positional input is the latent.
        grid_from_latent: ``(latent, config) -> (T, H, W)``, the token grid of one forward.
        reference_grid: ``config -> (T, H, W)``, the token grid at the model's native resolution.
        stock_self_processor: factory of the processor the model's self-attention ships with.
        default_eps: denominator epsilon used when the processor does not set one.
    """

    name: str
    model_classes: tuple[str, ...]
    self_attention: str
    patch_embed: str
    grid_from_latent: Callable[[torch.Tensor, dict], tuple[int, int, int]]
    reference_grid: Callable[[dict], tuple[int, int, int]]
    stock_self_processor: Callable[[], object]
    default_eps: float = 1e-6


def _patch(config) -> tuple[int, ...]:
    p = config["patch_size"]
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def _grid_2d(latent: torch.Tensor, config) -> tuple[int, int, int]:
    if latent.ndim != 4:
        raise ValueError(f"expected a latent [batch, channels, height, width]; got shape {tuple(latent.shape)}")
    (p,) = _patch(config)[-1:]
    return (1, latent.shape[-2] // p, latent.shape[-1] // p)


def _reference_grid_2d(config) -> tuple[int, int, int]:
    size = config["sample_size"]
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    (p,) = _patch(config)[-1:]
    return (1, h // p, w // p)


def _attn_processor_2_0():
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0()


DIT = Family(
    name="dit",
    model_classes=("DiTTransformer2DModel",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="pos_embed",
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,
    stock_self_processor=_attn_processor_2_0,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (DIT,)}
_BY_CLASS = {cls: f for f in FAMILIES.values() for cls in f.model_classes}


_BY_TYPE: dict[type, Family | None] = {}


def find_family(model: nn.Module) -> Family | None:
    """The :class:`Family` of ``model`` (by class name, walking the MRO; cached per type), or ``None``."""
    model_type = type(model)
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        pass
    family = next((_BY_CLASS[c.__name__] for c in model_type.__mro__ if c.__name__ in _BY_CLASS), None)
    _BY_TYPE[model_type] = family
    return family


def family_of(model: nn.Module) -> Family:
    """Like :func:`find_family` but raises ``ValueError`` naming the supported classes."""
    family = find_family(model)
    if family is None:
        supported = sorted(_BY_CLASS)
        raise ValueError(
            f"{type(model).__name__} is not a supported transformer; MHLA supports {supported}. "
            f"Pass the pipeline's transformer (pipe.transformer), not the pipeline."
        )
    return family


def self_attention_modules(model: nn.Module, family: Family | None = None) -> list[tuple[str, nn.Module]]:
    """``[(name, attention module)]`` of the self-attention layers, ordered by layer index."""
    family = family or family_of(model)
    pattern = re.compile(family.self_attention)
    found = []
    for name, module in model.named_modules():
        match = pattern.match(name)
        if match:
            found.append((int(match.group(1)), name, module))
    found.sort(key=lambda item: item[0])
    return [(name, module) for _, name, module in found]
