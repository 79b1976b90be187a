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

import torch

from mhla_diffusers.ops.layout import BlockLayout

__all__ = ["DENOMINATORS", "check_equal_blocks", "positional_denominator"]

DENOMINATORS = ("paper", "authors_dit")
"""``"paper"``: ``phi(q_i) . z~_{b(i)}``; ``"authors_dit"``: the authors' DiT layer's (module docstring)."""


def check_equal_blocks(layout: BlockLayout) -> None:
    """Raises ``ValueError`` unless every block of ``layout`` has the same number of tokens."""
    sizes = layout.block_sizes
    if not bool((sizes == sizes[0]).all()):
        raise ValueError(
            f'denominator="authors_dit" pairs the tokens of different blocks by their position, so it needs blocks of '
            f"equal size; {layout} has blocks of {int(sizes.min())} to {int(sizes.max())} tokens. Use a token grid the "
            f"block grid {layout.block_grid} divides (as the authors' DiT code requires)"
        )


def positional_denominator(phi_q: torch.Tensor, phi_k: torch.Tensor, mixing: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``sum_j Mc[b, j] phi(q[j, l]) . z_j`` ``[B, heads, N, 1]`` for every token (block ``b``, position ``l``), without eps.

    Args:
        phi_q, phi_k: features ``[B, heads, N, d]`` (already through the feature map), one dtype.
        mixing: ``[M, M]``, rows = query blocks; cast to the features' dtype.
        layout: a :class:`BlockLayout` of ``N`` tokens in blocks of equal size.

    Raises:
        ValueError: blocks of unequal size.
    """
    check_equal_blocks(layout)
    b, h, n, d = phi_q.shape
    m = layout.num_blocks
    order = torch.argsort(layout.block_index.to(phi_q.device), stable=True)  # block-major, row-major inside a block
    q_blocks = phi_q[:, :, order].reshape(b, h, m, n // m, d)
    z = phi_k[:, :, order].reshape(b, h, m, n // m, d).sum(dim=3)  # [B, heads, M, d]
    products = torch.einsum("bhjld,bhjd->bhjl", q_blocks, z)  # phi(q[j, l]) . z_j
    mixed = torch.einsum("ij,bhjl->bhil", mixing.to(phi_q.dtype), products).reshape(b, h, n)
    return mixed[:, :, torch.argsort(order)].unsqueeze(-1)  # back to the tokens' order
