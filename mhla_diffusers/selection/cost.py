"""Attention-cost model of hybrid selection: per-layer FLOPs at the native token grid, and cost fractions."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from mhla_diffusers.models.families import family_of, self_attention_modules
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.selection.hybrid import attention_flops, select_layers

__all__ = ["layer_attention_flops", "attention_cost", "cost_fraction"]


def cost_fraction(stock: Sequence[int], mhla: Sequence[int], chosen: Sequence[int]) -> float:
    """``sum_l (mhla[l] if l in chosen else stock[l]) / sum_l stock[l]``."""
    cost = sum(mhla[i] if i in chosen else stock[i] for i in range(len(stock)))
    return cost / sum(stock)


def layer_attention_flops(
    transformer: nn.Module, *, num_blocks: int | None = None, block_grid: Sequence[int] | str | None = None
) -> tuple[list[int], list[int]]:
    """``(stock, mhla)`` attention FLOPs per self-attention layer at the native token grid."""
    family = family_of(transformer)
    reference = family.reference_grid(transformer.config)
    grid = MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid).resolve_block_grid(reference, family)
    tokens, blocks = reference[0] * reference[1] * reference[2], grid[0] * grid[1] * grid[2]
    stock, mhla = [], []
    for _, attn in self_attention_modules(transformer, family):
        heads = int(attn.heads)
        head_dim = (attn.to_q.out_features if hasattr(attn, "to_q") else attn.inner_dim) // heads
        stock.append(attention_flops(family.stock_attention, tokens, head_dim, heads))
        mhla.append(attention_flops("mhla", tokens, head_dim, heads, blocks))
    return stock, mhla


def attention_cost(
    transformer: nn.Module,
    layers: str | Sequence[int] = "all",
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
) -> float:
    """The attention cost with MHLA on ``layers`` (not ``"auto"``) as a fraction of the stock model's; ``ValueError`` if bad."""
    stock, mhla = layer_attention_flops(transformer, num_blocks=num_blocks, block_grid=block_grid)
    return cost_fraction(stock, mhla, select_layers(len(stock), layers))
