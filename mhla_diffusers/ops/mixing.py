"""The learned block-mixing matrix ``Mc`` (``[M, M]``, one per layer, shared by all heads).

Row ``i`` says how much query block ``i`` reads each block's summary: ``S~_i = sum_b Mc[i, b] S_b``
(MHLA paper, Sec. 3.2). Init and clamping: ``docs/operator.md``, "The mixing matrix".
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mhla_diffusers.ops.layout import BlockLayout, normalize_grid

__all__ = ["MIXING_INITS", "mixing_init", "MixingMatrix", "clamp_mixing_", "mixing_parameters"]


MIXING_INITS = ("locality", "uniform", "cos", "exp", "gaussian", "local")
"""The mixing-matrix starts :class:`MixingMatrix` knows (``docs/operator.md``, "The mixing matrix")."""


def mixing_init(
    layout: BlockLayout | Iterable[int],
    dtype: torch.dtype = torch.float32,
    kind: str = "locality",
    *,
    exp_scale: float = 3.0,
    local_radius: float = 1.5,
) -> torch.Tensor:
    """An initial mixing matrix ``[M, M]`` (CPU, rows = query blocks) built from block-centre distances.

    With ``d[i, j]`` the distance between the centres of blocks ``i`` and ``j`` in block units:

    - ``"locality"`` (the paper's, Sec. 3.3): ``1 - d[i, j] / max_k d[i, k]``;
    - ``"uniform"``: all ones (plain linear attention, every block reads every summary);
    - ``"cos"``: ``cos(pi / 4 * d / max d)``; ``"exp"``: ``exp(-d / exp_scale)``;
    - ``"gaussian"``: ``exp(-d^2 / (2 sigma^2))``, ``sigma = max d / 3``, not normalised;
    - ``"local"``: ``1`` where ``d <= local_radius`` (a block and its 8 / 26 neighbours at 1.5), else ``0``.

    ``locality``, ``cos``, ``exp`` and ``local`` are then normalised so that each row sums to 1 (the paper's
    convention; the authors' code normalises columns of the same symmetric matrix). ``cos``, ``exp``,
    ``gaussian`` and ``local`` are the distance transforms of the authors' ``BlockDistanceConv``
    (DAGroup-PKU/MHLA, ``mhla_dit/mhla/mhla.py``), written from their formulas. With normalised
    attention (the default) a row's scale cancels, so only the shape of each row matters there.

    Args:
        layout: a :class:`BlockLayout` or a block grid (1 to 3 ints).
        dtype: of the result.
        kind: one of :data:`MIXING_INITS`.
        exp_scale: ``"exp"``'s length scale in blocks (> 0).
        local_radius: ``"local"``'s radius in blocks (>= 0; 0 keeps only the diagonal).

    Raises:
        ValueError: an unknown ``kind``; a bad ``exp_scale`` or ``local_radius``.
    """
    if kind not in MIXING_INITS:
        raise ValueError(f"init must be one of {', '.join(map(repr, MIXING_INITS))}; got {kind!r}")
    if not exp_scale > 0 or not local_radius >= 0:
        raise ValueError(f"exp_scale must be > 0 and local_radius >= 0; got {exp_scale!r}, {local_radius!r}")
    if isinstance(layout, BlockLayout):
        block_grid = layout.block_grid
    else:
        block_grid = normalize_grid(tuple(layout), "block_grid")
    m = block_grid[0] * block_grid[1] * block_grid[2]
    if kind == "uniform":
        return torch.ones(m, m, dtype=dtype)
    if m == 1:
        return torch.ones(1, 1, dtype=dtype)
    centres = BlockLayout(block_grid, block_grid).block_centres  # one token per block: block units
    dist = torch.cdist(centres, centres)
    init = _distance_transform(dist, kind, exp_scale, local_radius)
    if kind != "gaussian":
        init = init / init.sum(dim=1, keepdim=True)
    return init.to(dtype)


def _distance_transform(dist: torch.Tensor, kind: str, exp_scale: float, local_radius: float) -> torch.Tensor:
    """The unnormalised weight of each block pair ``[M, M]`` from their distances (see :func:`mixing_init`)."""
    if kind == "locality":
        return 1.0 - dist / dist.max(dim=1, keepdim=True).values
    if kind == "cos":
        return torch.cos(dist / dist.max() * (torch.pi / 4))
    if kind == "exp":
        return torch.exp(-dist / exp_scale)
    if kind == "gaussian":
        sigma = dist.max() / 3
        return torch.exp(-dist.square() / (2 * sigma.square()))
    return (dist <= local_radius + 1e-9).to(dist.dtype)  # "local" (the margin keeps d == radius in despite rounding)


class MixingMatrix(nn.Module):
    """The mixing matrix ``weight`` ``[M, M]`` of ``block_grid`` (fp32, rows = query blocks); called, it gives the
    matrix the operator uses.

    Installed as ``<attention module>.mhla.mixing``. ``init``: one of :data:`MIXING_INITS` (see :func:`mixing_init`;
    ``"locality"``, the paper's, by default; ``"uniform"`` is plain linear attention); ``clamp=False`` uses the matrix
    as stored (the authors' Wan model, trained unclamped).
    """

    def __init__(self, block_grid: Iterable[int], init: str = "locality", clamp: bool = True):
        super().__init__()
        self.block_grid = normalize_grid(tuple(block_grid), "block_grid")
        self.clamp = bool(clamp)
        self.weight = nn.Parameter(mixing_init(self.block_grid, kind=init))

    @property
    def num_blocks(self) -> int:
        return self.block_grid[0] * self.block_grid[1] * self.block_grid[2]

    def clamped(self) -> torch.Tensor:
        """The matrix the operator uses: clamped to ``[0, 1]``, or as stored when ``clamp=False`` (no hook runs)."""
        return self.weight.clamp(0.0, 1.0) if self.clamp else self.weight

    def forward(self, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix the operator uses (:meth:`clamped`), as a new tensor ``[M, M]``, differentiable in ``weight``.

        Called as a module, so that hooks on it (diffusers' group offloading, accelerate's device hooks) move the
        weight first. Never the parameter itself: an offloading hook may swap the parameter's storage after the call.
        ``blocks``: ``[M']`` long, the rows and columns kept (the blocks that hold tokens), giving ``[M', M']``.
        """
        weight = self.weight.clamp(0.0, 1.0) if self.clamp else self.weight.clone()
        if blocks is None:
            return weight
        blocks = blocks.to(weight.device)
        return weight.index_select(0, blocks).index_select(1, blocks)

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
