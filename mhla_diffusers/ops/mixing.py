"""The learned block-mixing matrix ``Mc`` of MHLA: locality init, the per-layer parameter, clamping.

Row ``i`` of ``Mc`` (``[M, M]``) says how much query block ``i`` reads each block's key-value
summary: ``S~_i = sum_b Mc[i, b] S_b`` (MHLA paper, Eq. for the mixed summaries, Sec. 3.2).
One matrix per attention layer, shared by all heads.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mhla_diffusers.ops.layout import BlockLayout, normalize_grid

__all__ = ["mixing_init", "MixingMatrix", "clamp_mixing_", "mixing_parameters"]


def mixing_init(layout: BlockLayout | Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The paper's locality-biased initial mixing matrix.

    ``Mc0[i, j] = 1 - dist(i, j) / max_k dist(i, k)`` with ``dist`` the Euclidean distance between
    block centres in block-grid units, then each row normalised to sum 1 (MHLA paper, Sec. 3.3,
    "locality-biased initialisation"; the authors' code normalises columns, the paper rows: we
    follow the paper). Every entry lies in ``[0, 1]``; ``M = 1`` gives ``[[1.]]``.

    Args:
        layout: a :class:`BlockLayout`, or just a block grid ``(bt, bh, bw)``.
        dtype: floating dtype of the result.

    Returns:
        ``[M, M]`` tensor on the CPU.
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
    """Per-layer MHLA state: the mixing matrix ``weight`` ``[M, M]`` and the block grid it belongs to.

    Installed by :func:`mhla_diffusers.apply_mhla` as ``<attention module>.mhla_mixing``, so the
    state-dict key is ``<attention path>.mhla_mixing.weight``. It follows ``.to(device / dtype)``
    like any parameter (CASES C13); the operator accumulates in fp32 whatever its dtype, and the
    fine-tuning recipe keeps trainable parameters, this one included, in fp32.

    Args:
        block_grid: ``(bt, bh, bw)``.
        init: ``"locality"`` (the paper's init) or ``"uniform"`` (all ones: plain linear attention).
        clamp: the operator uses the matrix clamped to ``[0, 1]`` (the paper's, default) or as stored
            (``False``: the authors' Wan model, trained without the clamp, has negative entries);
            :func:`clamp_mixing_` leaves unclamped matrices alone. A plain attribute, recorded in
            the converted checkpoint's ``mhla_config.json`` as ``mixing_clamp``.

    Two plain attributes (not in ``state_dict``) are the layer's bookkeeping: ``seen_grids``, the token
    grids it ran on by token count (to recall a grid when the layer is recomputed in the backward
    pass), and ``verified``, whether the processor now on the layer has checked it against its settings.
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
        """The matrix as the operator uses it: clamped to ``[0, 1]`` (gradient passes inside the range),
        or the stored weight itself for a matrix built with ``clamp=False``."""
        return self.weight.clamp(0.0, 1.0) if self.clamp else self.weight

    def extra_repr(self) -> str:
        return f"block_grid={self.block_grid}, num_blocks={self.num_blocks}" + ("" if self.clamp else ", clamp=False")


def mixing_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All MHLA mixing-matrix parameters of ``model`` (in module order)."""
    return [m.weight for m in model.modules() if isinstance(m, MixingMatrix)]


@torch.no_grad()
def clamp_mixing_(model: nn.Module, low: float = 0.0, high: float = 1.0) -> int:
    """Clamp every mixing matrix of ``model`` in place to ``[low, high]``; call after each optimizer step.

    The paper clips the coefficients to ``[0, 1]`` on every update (Sec. 3.3). Matrices built with
    ``clamp=False`` (the authors' Wan model, trained unclamped) are left as they are. Returns the
    number of matrices clamped.
    """
    params = [m.weight for m in model.modules() if isinstance(m, MixingMatrix) and m.clamp]
    for p in params:
        p.clamp_(low, high)
    return len(params)
