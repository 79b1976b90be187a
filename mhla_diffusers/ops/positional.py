"""The normaliser of the authors' DiT layer (``MHLA4DiT``, DAGroup-PKU/MHLA ``mhla_dit/mhla/mhla.py``).

The paper normalises a query by its own features against its block's mixed key sum,
``den_i = phi(q_i) . z~_{b(i)}`` with ``z~_b = sum_j Mc[b, j] z_j`` (Sec. 3.2). The authors' DiT code
mixes the per-block products instead: for the query at position ``l`` (row-major inside its block) of block ``b``,

    den[b, l] = sum_j Mc[b, j] (phi(q[j, l]) . z_j) + eps,

that is, each block's query at the same position dotted with that block's own key sum. It needs blocks of
equal size (their code needs the grid divisible by the block grid). The numerator is the paper's. Written
from their equations, not from their code; ``mhla_attention(..., denominator="authors_dit")`` uses it,
``ops/naive.py`` holds its dense oracle.
"""

from __future__ import annotations

import math

import torch

from mhla_diffusers.ops.layout import BlockLayout

__all__ = ["DENOMINATORS", "check_equal_blocks", "positional_denominator"]

DENOMINATORS = ("paper", "authors_dit")
"""``"paper"``: ``phi(q_i) . z~_{b(i)}``; ``"authors_dit"``: the authors' DiT layer's (module docstring)."""


def check_equal_blocks(layout: BlockLayout) -> None:
    """Raises ``ValueError`` unless every block of ``layout`` has the same number of tokens.

    Read from the layout's static sizes (no tensor, so nothing to trace under ``torch.compile``): blocks are equal
    exactly when the block grid divides the token grid on every axis (an axis of ``n`` tokens in ``m`` blocks
    has blocks of ``n // m`` and ``ceil(n / m)`` tokens).
    """
    if all(n % m == 0 for n, m in zip(layout.grid, layout.block_grid)):
        return
    smallest = math.prod([n // m for n, m in zip(layout.grid, layout.block_grid)])  # lists: dynamo traces no generator here
    largest = math.prod([-(-n // m) for n, m in zip(layout.grid, layout.block_grid)])
    raise ValueError(
        f'denominator="authors_dit" pairs the tokens of different blocks by their position, so it needs blocks of '
        f"equal size; {layout} has blocks of {smallest} to {largest} tokens. Use a token grid the "
        f"block grid {layout.block_grid} divides (as the authors' DiT code requires)"
    )


def positional_denominator(phi_q: torch.Tensor, phi_k: torch.Tensor, mixing: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``sum_j Mc[b, j] phi(q[j, l]) . z_j`` ``[B, heads, N, 1]`` for every token (block ``b``, position ``l``), without eps.

    Views and einsums only (the blocks are equal, so block-major order is a reshape of the token grid): it traces
    under ``torch.compile(fullgraph=True)`` without a graph break.

    Args:
        phi_q, phi_k: features ``[B, heads, N, d]`` (already through the feature map), one dtype.
        mixing: ``[M, M]``, rows = query blocks; cast to the features' dtype.
        layout: a :class:`BlockLayout` of ``N`` tokens in blocks of equal size.

    Raises:
        ValueError: blocks of unequal size.
    """
    check_equal_blocks(layout)
    q_blocks, k_blocks = _to_blocks(phi_q, layout), _to_blocks(phi_k, layout)  # [B, heads, M, L, d]
    z = k_blocks.sum(dim=3)  # [B, heads, M, d]
    products = torch.einsum("bhjld,bhjd->bhjl", q_blocks, z)  # phi(q[j, l]) . z_j
    mixed = torch.einsum("ij,bhjl->bhil", mixing.to(phi_q.dtype), products)  # [B, heads, M, L]
    return _from_blocks(mixed, layout).unsqueeze(-1)  # back to the tokens' order


def _to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[B, heads, N, c]`` (row-major ``(T, H, W)`` tokens) -> ``[B, heads, M, L, c]``: blocks row-major, and the
    tokens of each block row-major inside it (the layout's order, for blocks of equal size)."""
    (t, h, w), (bt, bh, bw) = layout.grid, layout.block_grid
    b, heads, _, c = x.shape
    x = x.reshape(b, heads, bt, t // bt, bh, h // bh, bw, w // bw, c)
    return x.permute(0, 1, 2, 4, 6, 3, 5, 7, 8).reshape(b, heads, bt * bh * bw, (t // bt) * (h // bh) * (w // bw), c)


def _from_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The inverse of :func:`_to_blocks` for one value per token: ``[B, heads, M, L]`` -> ``[B, heads, N]``."""
    (t, h, w), (bt, bh, bw) = layout.grid, layout.block_grid
    b, heads = x.shape[:2]
    x = x.reshape(b, heads, bt, bh, bw, t // bt, h // bh, w // bw)
    return x.permute(0, 1, 2, 5, 3, 6, 4, 7).reshape(b, heads, t * h * w)
