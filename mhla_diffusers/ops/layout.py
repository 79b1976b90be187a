"""Token grids, block grids and the tensors the MHLA operator needs to work block by block.

A token grid ``(T, H, W)`` (``T = 1`` for images) is split into a block grid ``(bt, bh, bw)`` of
``M = bt * bh * bw`` contiguous boxes of near-equal size. Token ``(t, h, w)`` belongs to block
``(t * bt // T, h * bh // H, w * bw // W)``; no divisibility is required (Wan at 832 px has 52
token columns). Block ids are row-major over the block grid, tokens row-major over the token
grid (``t * H * W + h * W + w``), which is how diffusers lays tokens out.

Source: MHLA paper (arXiv 2601.07832), Sec. 3 "token-level multi-head".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import product
from typing import Sequence

import torch

__all__ = ["BlockLayout", "choose_block_grid", "default_num_blocks", "get_layout", "normalize_grid", "occupied_layout"]


def normalize_grid(grid: int | Sequence[int], name: str = "grid") -> tuple[int, int, int]:
    """Return a 3-tuple ``(T, H, W)`` from a 1-, 2- or 3-element grid (or an int ``N`` = 1D grid).

    1D ``(N,)`` -> ``(1, 1, N)``; 2D ``(H, W)`` -> ``(1, H, W)``; 3D stays.

    Raises:
        ValueError: for an empty or longer grid, a non-integer or a non-positive size.
    """
    if isinstance(grid, int):
        grid = (grid,)
    sizes = tuple(grid)
    if any(isinstance(g, bool) or not isinstance(g, (numbers.Integral, torch.SymInt)) for g in sizes):
        raise ValueError(f"{name} sizes must be integers; got {sizes}")
    grid = tuple(int(g) for g in sizes)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{name} must have 1, 2 or 3 axes (T, H, W); got {grid}")
    if any(g < 1 for g in grid):
        raise ValueError(f"{name} sizes must be >= 1; got {grid}")
    return (1,) * (3 - len(grid)) + grid


# Tensors cached across calls are created outside inference mode: a layout first used inside a
# pipeline's torch.inference_mode() must still serve training and no_grad calls afterwards
# (inference tensors cannot be updated in place or saved for backward outside that mode).
_normal_tensors = torch.inference_mode(False)


@dataclass(frozen=True)
class BlockLayout:
    """How the tokens of a ``(T, H, W)`` grid fall into a ``(bt, bh, bw)`` grid of blocks.

    Args:
        grid: token grid, 1D ``(N,)``, 2D ``(H, W)`` or 3D ``(T, H, W)``; stored as 3D.
        block_grid: block grid with the same number of axes (or fewer: leading axes = 1).

    Attributes:
        grid, block_grid: 3-tuples.
        num_tokens: ``N = T * H * W``.
        num_blocks: ``M = bt * bh * bw``.
        block_index: ``[N]`` int64 tensor (CPU), the block id of every token.

    Raises:
        ValueError: if an axis has fewer tokens than blocks (e.g. 3 token columns split into 4
            block columns): some blocks would be empty. Choose a smaller block grid, e.g. with
            :func:`choose_block_grid`.
    """

    grid: tuple[int, int, int]
    block_grid: tuple[int, int, int]
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __init__(self, grid: int | Sequence[int], block_grid: int | Sequence[int]):
        g = normalize_grid(grid, "grid")
        b = normalize_grid(block_grid, "block_grid")
        for axis, (n, m) in enumerate(zip(g, b)):
            if m > n:
                raise ValueError(
                    f"block grid {b} has more blocks than tokens on axis {'THW'[axis]} of the token grid {g} "
                    f"({m} > {n}): every block needs at least one token. Use fewer blocks on that axis "
                    f"(mhla_diffusers.choose_block_grid picks a valid one) or a larger resolution."
                )
        object.__setattr__(self, "grid", g)
        object.__setattr__(self, "block_grid", b)
        object.__setattr__(self, "_cache", {})

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def num_blocks(self) -> int:
        return self.block_grid[0] * self.block_grid[1] * self.block_grid[2]

    def _axis_blocks(self, axis: int) -> torch.Tensor:
        n, m = self.grid[axis], self.block_grid[axis]
        return torch.arange(n, dtype=torch.int64) * m // n

    @cached_property
    @_normal_tensors
    def block_index(self) -> torch.Tensor:
        """``[N]`` int64: block id of each token (row-major tokens, row-major blocks)."""
        it, ih, iw = (self._axis_blocks(a) for a in range(3))
        _, bh, bw = self.block_grid
        return ((it[:, None, None] * bh + ih[None, :, None]) * bw + iw[None, None, :]).reshape(-1)

    @cached_property
    @_normal_tensors
    def block_sizes(self) -> torch.Tensor:
        """``[M]`` int64: number of tokens in each block (all >= 1)."""
        return torch.bincount(self.block_index, minlength=self.num_blocks)

    @cached_property
    def max_block_size(self) -> int:
        """Largest block, in tokens (the padded block length ``L`` of the torch backend)."""
        return int(self.block_sizes.max())

    @cached_property
    @_normal_tensors
    def block_centres(self) -> torch.Tensor:
        """``[M, 3]`` float64: centre of every block in block-grid units, ``(it, ih, iw) + 0.5``."""
        coords = torch.tensor(list(product(*(range(m) for m in self.block_grid))), dtype=torch.float64)
        return coords.reshape(-1, 3) + 0.5

    @cached_property
    @_normal_tensors
    def _gather(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        # Tokens sorted by block (stable: row-major inside a block), each block padded to L slots.
        m, length = self.num_blocks, self.max_block_size
        order = torch.argsort(self.block_index, stable=True)
        sizes = self.block_sizes
        starts = torch.cumsum(sizes, 0) - sizes
        slot = torch.arange(self.num_tokens) - starts[self.block_index[order]]  # slot of order[i] in its block
        flat = self.block_index[order] * length + slot  # position of order[i] in [M * L]
        gather = torch.zeros(m * length, dtype=torch.int64)
        valid = torch.zeros(m * length, dtype=torch.bool)
        gather[flat] = order
        valid[flat] = True
        # Padded slots point at the first token of their own block (a valid index); the
        # operator zeroes their keys with the mask, so they contribute nothing.
        first = order[starts]
        pad_rows = ~valid
        gather[pad_rows] = first.repeat_interleave(length)[pad_rows]
        scatter = torch.empty(self.num_tokens, dtype=torch.int64)
        scatter[order] = flat  # token -> its position in [M * L]
        padded = bool(pad_rows.any())
        identity = (not padded) and bool(torch.equal(gather, torch.arange(self.num_tokens)))
        return gather, scatter, (valid.reshape(m, length) if padded else None), identity

    @_normal_tensors
    def gather_tensors(self, device: torch.device | str | None = None):
        """Index tensors for the padded block-major form, cached per device.

        Returns ``(gather, scatter, valid, identity)``:
            gather: ``[M * L]`` int64, token read into each padded slot;
            scatter: ``[N]`` int64, slot of each token;
            valid: ``[M, L]`` bool mask of real slots, or ``None`` when all blocks are full;
            identity: ``True`` when tokens are already block-major with equal blocks (a view suffices).
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        key = (device.type, device.index)
        if key not in self._cache:
            gather, scatter, valid, identity = self._gather
            self._cache[key] = (
                gather.to(device),
                scatter.to(device),
                None if valid is None else valid.to(device),
                identity,
            )
        return self._cache[key]

    def __repr__(self) -> str:
        return f"BlockLayout(grid={self.grid}, block_grid={self.block_grid}, num_blocks={self.num_blocks})"


@lru_cache(maxsize=256)
def get_layout(grid: tuple[int, ...], block_grid: tuple[int, ...]) -> BlockLayout:
    """The :class:`BlockLayout` of ``grid`` split into ``block_grid``, built once per pair: the package's
    one layout cache (the processor's per-call path and the ``torch.compile`` operator share it; each
    layout caches its index tensors per device inside).

    Arguments must be hashable (tuples). Not for code traced by ``torch.compile``: build
    ``BlockLayout(grid, block_grid)`` there (construction makes no tensors).

    Raises:
        ValueError: as :class:`BlockLayout` (a bad grid or block grid).
    """
    return BlockLayout(grid, block_grid)


@lru_cache(maxsize=128)
@torch.inference_mode(False)  # cached across calls: never inference tensors
def occupied_layout(grid: tuple[int, int, int], block_grid: tuple[int, int, int]) -> tuple[BlockLayout, torch.Tensor]:
    """The blocks of ``block_grid`` that hold tokens of ``grid``, when some axis has fewer tokens than blocks.

    Token ``(t, h, w)`` belongs to block ``(t * bt // T, h * bh // H, w * bw // W)``; on an
    axis with ``n < b`` tokens only the ``n`` blocks ``i * b // n`` hold tokens. Returns
    ``(layout, index)``: a :class:`BlockLayout` on ``grid`` with ``min(b, n)`` blocks per axis, and the
    ``[M']`` int64 ids (CPU) of those blocks in the full block grid, in the layout's block order.
    MHLA on ``layout`` with ``Mc[index][:, index]`` is exactly MHLA on the full block grid with the
    empty blocks contributing nothing (their summaries are zero).
    """
    axes = []
    for n, b in zip(grid, block_grid):
        axes.append(torch.arange(b) if b <= n else torch.arange(n) * b // n)
    it, ih, iw = axes
    _, bh, bw = block_grid
    index = ((it[:, None, None] * bh + ih[None, :, None]) * bw + iw[None, None, :]).reshape(-1)
    reduced = tuple(min(n, b) for n, b in zip(grid, block_grid))
    return BlockLayout(grid, reduced), index


def default_num_blocks(num_tokens: int) -> int:
    """The default target number of blocks for ``N`` tokens: ``round(sqrt(N) / 2)``, at least 1.

    Anchors: DiT at 512 px (N = 1024) -> 16, the paper's best DiT setting; Wan2.1 at 81 x 480 x 832
    (N = 32,760) -> 90, near the paper's M = 105. Always satisfies ``M^2 <= N``.
    """
    return max(1, round(math.sqrt(num_tokens) / 2))


def choose_block_grid(grid: int | Sequence[int], num_blocks: int | None = None) -> tuple[int, int, int]:
    """Pick a block grid ``(bt, bh, bw)`` for a token grid and a target number of blocks.

    The choice keeps ``M^2 <= N`` (the paper's cost rule: mixing then costs no more than the
    summaries), never puts more blocks than tokens on an axis, and otherwise minimises
    ``|log(M / num_blocks)| + 0.5 * log(longest / shortest block side)`` (block sides in tokens,
    over the axes of the token grid longer than 1), so blocks are near-square in token units and
    follow the grid's aspect ratio (a 32 x 8 grid with 16 blocks -> 8 x 2 blocks of 4 x 4 tokens).
    Ties go to the larger ``M``, then the lexicographically smaller grid. Deterministic.

    Args:
        grid: token grid ``(T, H, W)`` (or 1D / 2D).
        num_blocks: target ``M``; ``None`` -> :func:`default_num_blocks`.

    Returns:
        ``(bt, bh, bw)``.

    Raises:
        ValueError: for ``num_blocks < 1``.
    """
    t, h, w = normalize_grid(grid)
    n = t * h * w
    target = default_num_blocks(n) if num_blocks is None else int(num_blocks)
    if target < 1:
        raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
    cap = max(1, math.isqrt(n))  # M <= sqrt(N)
    best, best_key = (1, 1, 1), None
    for bt in range(1, min(t, cap) + 1):
        for bh in range(1, min(h, cap // bt) + 1):
            for bw in range(1, min(w, cap // (bt * bh)) + 1):
                m = bt * bh * bw
                sides = [size / blocks for size, blocks in ((t, bt), (h, bh), (w, bw)) if size > 1]
                aspect = math.log(max(sides) / min(sides)) if sides else 0.0
                score = abs(math.log(m / target)) + 0.5 * aspect
                key = (round(score, 12), -m, (bt, bh, bw))
                if best_key is None or key < best_key:
                    best, best_key = (bt, bh, bw), key
    return best
