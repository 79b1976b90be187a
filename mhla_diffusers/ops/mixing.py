"""The learned block-mixing matrix ``Mc`` (``[M, M]``, one per layer, shared by all heads).

Row ``i`` says how much query block ``i`` reads each block's summary: ``S~_i = sum_b Mc[i, b] S_b``
(MHLA paper, Sec. 3.2). Init and clamping: ``docs/operator.md``, "The mixing matrix".
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mhla_diffusers.ops.layout import BlockLayout, normalize_grid

__all__ = ["mixing_init", "MixingMatrix", "clamp_mixing_", "mixing_parameters"]


def mixing_init(layout: BlockLayout | Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The paper's locality-biased initial mixing matrix ``[M, M]`` (CPU), rows summing to 1 (Sec. 3.3).

    ``Mc0[i, j] = 1 - dist(i, j) / max_k dist(i, k)`` over block centres, then each row normalised
    (the paper's rows, not the authors' code's columns). ``layout``: a :class:`BlockLayout` or a block grid.
    """
    if isinstance(layout, BlockLayout):
        block_grid = layout.block_grid
    else:
        block_grid = normalize_grid(tuple(layout), "block_grid")
    m = block_grid[0] * block_grid[1] * block_grid[2]
    if m == 1:
        return torch.ones(1, 1, dtype=dtype)
    centres = BlockLayout(block_grid, block_grid).block_centres  # one token per block
    dist = torch.cdist(centres, centres)
    init = 1.0 - dist / dist.max(dim=1, keepdim=True).values
    init = init / init.sum(dim=1, keepdim=True)
    return init.to(dtype)


class MixingMatrix(nn.Module):
    """Per-layer MHLA state: the mixing matrix ``weight`` ``[M, M]`` of ``block_grid``.

    Installed as ``<attention module>.mhla_mixing``. ``init``: ``"locality"`` (the paper's) or
    ``"uniform"`` (all ones: plain linear attention); ``clamp=False`` uses the matrix as stored (the
    authors' Wan model, trained unclamped). ``seen_grids`` and ``verified`` are bookkeeping, not state.
    """

    def __init__(self, block_grid: Iterable[int], init: str = "locality", clamp: bool = True):
        super().__init__()
        self.block_grid = normalize_grid(tuple(block_grid), "block_grid")
        self.clamp = bool(clamp)
        if init == "locality":
            weight = mixing_init(self.block_grid)
        elif init == "uniform":
            m = self.num_blocks
            weight = torch.ones(m, m)
        else:
            raise ValueError(f"init must be 'locality' or 'uniform'; got {init!r}")
        self.weight = nn.Parameter(weight)
        self.seen_grids: dict[int, set[tuple[int, int, int]]] = {}
        self.verified = False

    @property
    def num_blocks(self) -> int:
        return self.block_grid[0] * self.block_grid[1] * self.block_grid[2]

    def clamped(self) -> torch.Tensor:
        """The matrix the operator uses: clamped to ``[0, 1]``, or as stored when ``clamp=False``."""
        return self.weight.clamp(0.0, 1.0) if self.clamp else self.weight

    def extra_repr(self) -> str:
        return f"block_grid={self.block_grid}, num_blocks={self.num_blocks}" + ("" if self.clamp else ", clamp=False")


def mixing_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All mixing-matrix parameters of ``model``, in module order."""
    return [m.weight for m in model.modules() if isinstance(m, MixingMatrix)]


@torch.no_grad()
def clamp_mixing_(model: nn.Module, low: float = 0.0, high: float = 1.0) -> int:
    """Clamp every clamped mixing matrix of ``model`` in place to ``[low, high]``; call after each optimizer step.

    The paper clips to ``[0, 1]`` on every update (Sec. 3.3); ``clamp=False`` matrices are left alone.
    Returns the number of matrices clamped.
    """
    params = [m.weight for m in model.modules() if isinstance(m, MixingMatrix) and m.clamp]
    for p in params:
        p.clamp_(low, high)
    return len(params)
