"""The attention-cost model of hybrid selection: per-layer attention FLOPs of a transformer, stock
and MHLA, at its native token grid (from :func:`~mhla_diffusers.selection.hybrid.attention_flops`),
and the cost of a choice of MHLA layers as a fraction of the stock model's."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from mhla_diffusers.models.families import family_of, self_attention_modules
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.selection.hybrid import attention_flops, select_layers

__all__ = ["layer_attention_flops", "attention_cost", "cost_fraction"]


def cost_fraction(stock: Sequence[int], mhla: Sequence[int], chosen: Sequence[int]) -> float:
    """``sum_l (mhla[l] if l in chosen else stock[l]) / sum_l stock[l]``: the attention cost with MHLA on
    the layers ``chosen``, as a fraction of the stock model's (per-layer FLOPs as
    :func:`layer_attention_flops` returns them). Raises ``ZeroDivisionError`` for a zero stock cost."""
    cost = sum(mhla[i] if i in chosen else stock[i] for i in range(len(stock)))
    return cost / sum(stock)


def layer_attention_flops(
    transformer: nn.Module, *, num_blocks: int | None = None, block_grid: Sequence[int] | str | None = None
) -> tuple[list[int], list[int]]:
    """Per self-attention layer, the attention FLOPs at the model's native token grid (``N`` tokens,
    the family's :attr:`~mhla_diffusers.models.families.Family.reference_grid`) of the stock layer
    (softmax ``heads * 4 N^2 d``; SANA's linear attention ``heads * 4 N d^2``) and of MHLA with the block
    grid these settings give (``heads * (4 N d^2 + 2 M^2 d^2)``), see
    :func:`~mhla_diffusers.selection.hybrid.attention_flops`. Returns ``(stock, mhla)``, two lists of ints.
    """
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
    """The attention cost of the model with MHLA on ``layers``, as a fraction of the stock model's.

    ``sum over layers of (MHLA FLOPs if converted else stock FLOPs) / sum of stock FLOPs``, per layer
    from :func:`layer_attention_flops`: at the native token grid (``N`` tokens), softmax
    ``heads * 4 N^2 d`` vs MHLA ``heads * (4 N d^2 + 2 M^2 d^2)`` (projections, the same for both,
    excluded). E.g. the demo DiT (4 heads x 32, M = 16 at N = 256): MHLA costs 0.14 of softmax per layer.

    Args:
        layers: as :func:`~mhla_diffusers.apply_mhla` takes them (not ``"auto"``): the layers that would be MHLA.
        num_blocks, block_grid: the MHLA settings (as :func:`~mhla_diffusers.apply_mhla`).

    Raises:
        ValueError: unsupported model or bad ``layers``.
    """
    stock, mhla = layer_attention_flops(transformer, num_blocks=num_blocks, block_grid=block_grid)
    return cost_fraction(stock, mhla, select_layers(len(stock), layers))
