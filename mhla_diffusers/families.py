"""Everything that differs per model family lives here, and only here.

A :class:`Family` says which diffusers transformer classes it covers, where their self- and
cross-attention modules are, which submodule embeds the latent into tokens (its input gives the
token grid exactly), the model's default token grid (for picking a block grid once, at conversion),
which stock processors restore the original model, and how the stock self-attention processor
handles q/k norms, dtypes and the output (so that MHLA with one block reproduces it).

Families:

* ``dit`` — ``DiTTransformer2DModel``: softmax self-attention (``AttnProcessor2_0``), no
  cross-attention, per-head q/k norms after the head split (none in released models).
* ``sana`` — ``SanaTransformer2DModel``: ReLU linear self-attention (``SanaLinearAttnProcessor2_0``:
  eps 1e-15, q/k norms over all heads before the head split, output cast to the layer input's dtype
  and clipped to +-65504 for fp16 inputs), softmax cross-attention (``SanaAttnProcessor2_0``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["Family", "FAMILIES", "family_of", "find_family", "get_family", "self_attention_modules", "stock_processor"]


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
        default_eps: denominator epsilon used when the processor does not set one (the stock
            linear attention's own eps where the model has one: SANA 1e-15).
        cross_attention: regex over ``named_modules()`` names matching cross-attention layers
            (group 1 the layer index), ``None`` when the model has none.
        stock_cross_processor: factory of the processor the model's cross-attention ships with;
            an MHLA processor installed there runs it unchanged. ``None``: diffusers' default
            ``AttnProcessor2_0``.
        qk_norm_across_heads: the stock self-attention applies ``attn.norm_q`` / ``attn.norm_k`` to
            the projected ``[B, N, heads * d]`` tensors before the head split (SANA), not per head
            after it (``AttnProcessor2_0``).
        attention_output_dtype: ``"query"`` — the attention output is cast to the query's dtype
            before ``to_out`` (``AttnProcessor2_0``); ``"input"`` — to the dtype of the layer's
            ``hidden_states`` input (``SanaLinearAttnProcessor2_0``).
        fp16_output_clip: when set, the self-attention output (after ``to_out``) is clipped to
            ``[-clip, clip]`` if the layer's input is float16, as the stock processor does (SANA:
            65504, part of the trained function).
    """

    name: str
    model_classes: tuple[str, ...]
    self_attention: str
    patch_embed: str
    grid_from_latent: Callable[[torch.Tensor, dict], tuple[int, int, int]]
    reference_grid: Callable[[dict], tuple[int, int, int]]
    stock_self_processor: Callable[[], object]
    default_eps: float = 1e-6
    cross_attention: str | None = None
    stock_cross_processor: Callable[[], object] | None = None
    qk_norm_across_heads: bool = False
    attention_output_dtype: str = "query"
    fp16_output_clip: float | None = None

    def __post_init__(self):
        if self.attention_output_dtype not in ("query", "input"):
            raise ValueError(f"attention_output_dtype must be 'query' or 'input'; got {self.attention_output_dtype!r}")

    def make_stock_cross_processor(self):
        """A fresh instance of the stock cross-attention processor of this family."""
        if self.stock_cross_processor is not None:
            return self.stock_cross_processor()
        return _attn_processor_2_0()


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


def _sana_linear_attn_processor():
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    return SanaLinearAttnProcessor2_0()


def _sana_attn_processor():
    from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0

    return SanaAttnProcessor2_0()


DIT = Family(
    name="dit",
    model_classes=("DiTTransformer2DModel",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="pos_embed",
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,
    stock_self_processor=_attn_processor_2_0,
)

SANA = Family(
    name="sana",
    model_classes=("SanaTransformer2DModel",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="patch_embed",  # PatchEmbed(latent [B, C, H, W]); tokens (H / p) x (W / p), row-major
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,  # sample_size 32, patch 1 -> 32 x 32 (1024 px); 16 -> 512 px
    stock_self_processor=_sana_linear_attn_processor,
    default_eps=1e-15,
    cross_attention=r"^transformer_blocks\.(\d+)\.attn2$",
    stock_cross_processor=_sana_attn_processor,
    qk_norm_across_heads=True,
    attention_output_dtype="input",
    fp16_output_clip=65504.0,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (DIT, SANA)}
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


def get_family(family: "str | Family") -> Family:
    """The :class:`Family` named ``family`` (a :class:`Family` is returned as is).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if isinstance(family, Family):
        return family
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def stock_processor(family: Family, module_name: str):
    """A fresh stock processor for the attention module ``module_name`` of a model of ``family``:
    the stock cross-attention processor for cross-attention layers, the stock self-attention
    processor otherwise (what ``remove_mhla`` must restore there)."""
    if family.cross_attention is not None and re.match(family.cross_attention, module_name):
        return family.make_stock_cross_processor()
    return family.stock_self_processor()


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
