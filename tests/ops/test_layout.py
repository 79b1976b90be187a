"""BlockLayout, choose_block_grid, default_num_blocks and the locality init (``mixing_init``).

Every property is checked against an independent statement of DESIGN.md ("Layout" math):
token ``(t, h, w)`` -> block ``(t*bt//T, h*bh//H, w*bw//W)``, block ids row-major over the block
grid, tokens row-major over the token grid, no divisibility required (CASES C04, C05, C07).
"""

from __future__ import annotations

import math
from itertools import product

import pytest
import torch

from mhla_diffusers import BlockLayout, choose_block_grid, default_num_blocks, mixing_init
from mhla_diffusers.ops.layout import normalize_grid

# (grid, block_grid): 1D / 2D / 3D, uneven blocks, M = 1, one token, 1xW, Wan shapes (CASES C04, C07).
LAYOUTS = [
    ((5,), (3,)),
    ((6,), (3,)),  # even 1D: tokens already block-major
    ((1, 1), (1, 1)),  # one token
    ((1, 9), (1, 4)),  # 1 x W
    ((7, 9), (2, 3)),
    ((7, 9), (1, 1)),  # one block
    ((8, 8), (2, 2)),
    ((32, 8), (8, 2)),  # SANA 1024x256 px (C05)
    ((3, 5, 7), (2, 2, 3)),
    ((4, 4, 4), (2, 2, 2)),
    ((21, 30, 52), (3, 5, 7)),  # Wan 480x832x81, M = 105
    ((21, 30, 52), (3, 5, 10)),  # the authors' released block grid, on the true 52 columns
]
LAYOUT_IDS = [f"{'x'.join(map(str, g))}-{'x'.join(map(str, b))}" for g, b in LAYOUTS]


def _formula_block_index(grid, block_grid):
    """DESIGN.md's formula, written out token by token (independent of layout.py)."""
    t_, h_, w_ = (1,) * (3 - len(grid)) + tuple(grid)
    bt, bh, bw = (1,) * (3 - len(block_grid)) + tuple(block_grid)
    ids = []
    for t in range(t_):
        for h in range(h_):
            for w in range(w_):
                it, ih, iw = t * bt // t_, h * bh // h_, w * bw // w_
                ids.append((it * bh + ih) * bw + iw)
    return torch.tensor(ids, dtype=torch.int64)


def _token_coords(grid3):
    t, h, w = grid3
    return torch.tensor(list(product(range(t), range(h), range(w))), dtype=torch.int64).reshape(-1, 3)


# ----------------------------------------------------------------------------------------------
# BlockLayout


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=LAYOUT_IDS)
def test_block_index_matches_formula(grid, block_grid):
    layout = BlockLayout(grid, block_grid)
    expected = _formula_block_index(grid, block_grid)
    assert layout.block_index.dtype == torch.int64
    assert layout.block_index.shape == (math.prod(grid),)
    assert torch.equal(layout.block_index, expected)
    assert layout.num_tokens == math.prod(grid)
    assert layout.num_blocks == math.prod(block_grid)


def test_block_index_hand_checked_1d_and_2d():
    """Small cases written out by hand: (5,) in 3 blocks; 3x4 in 2x3 blocks (CASES C07)."""
    assert BlockLayout((5,), (3,)).block_index.tolist() == [0, 0, 1, 1, 2]
    assert BlockLayout((3, 4), (2, 3)).block_index.tolist() == [
        0, 0, 1, 2,
        0, 0, 1, 2,
        3, 3, 4, 5,
    ]  # fmt: skip


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=LAYOUT_IDS)
def test_block_sizes_near_equal(grid, block_grid):
    """Per axis, block extents are floor or ceil of n/m; overall max - min is bounded by that."""
    layout = BlockLayout(grid, block_grid)
    sizes = layout.block_sizes
    assert sizes.shape == (layout.num_blocks,)
    assert int(sizes.sum()) == layout.num_tokens
    assert int(sizes.min()) >= 1
    floors = [n // m for n, m in zip(layout.grid, layout.block_grid)]
    ceils = [-(-n // m) for n, m in zip(layout.grid, layout.block_grid)]
    assert int(sizes.max()) - int(sizes.min()) <= math.prod(ceils) - math.prod(floors)
    assert int(sizes.max()) <= math.prod(ceils) and int(sizes.min()) >= math.prod(floors)
    assert layout.max_block_size == int(sizes.max())
    assert torch.equal(sizes, torch.bincount(_formula_block_index(grid, block_grid), minlength=layout.num_blocks))


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=LAYOUT_IDS)
def test_blocks_are_contiguous_boxes(grid, block_grid):
    """Each block is a full axis-aligned box, and block (it, ih, iw) sits at box position (it, ih, iw)."""
    layout = BlockLayout(grid, block_grid)
    coords = _token_coords(layout.grid)
    bt, bh, bw = layout.block_grid
    for block, (it, ih, iw) in enumerate(product(range(bt), range(bh), range(bw))):
        mine = coords[layout.block_index == block]
        lo, hi = mine.min(0).values, mine.max(0).values
        extent = (hi - lo + 1).tolist()
        assert mine.shape[0] == math.prod(extent), f"block {block} is not a full box"
        # The box of block (it, ih, iw) lies strictly after the box of (it-1, ih, iw) on axis T, etc.
        for axis, (i, m) in enumerate(zip((it, ih, iw), (bt, bh, bw))):
            n = layout.grid[axis]
            assert int(lo[axis]) == -(-i * n // m), f"block {block} starts at the wrong place on axis {'THW'[axis]}"


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=LAYOUT_IDS)
def test_gather_scatter_round_trip(grid, block_grid):
    layout = BlockLayout(grid, block_grid)
    n, m, length = layout.num_tokens, layout.num_blocks, layout.max_block_size
    gather, scatter, valid, identity = layout.gather_tensors()
    assert gather.shape == (m * length,) and scatter.shape == (n,)
    # Round trip: tokens -> padded block-major slots -> tokens.
    x = torch.randn(n, 3)
    assert torch.equal(x.index_select(0, gather).index_select(0, scatter), x)
    assert torch.equal(gather[scatter], torch.arange(n))
    # Every slot (padded ones included) reads a token of its own block.
    slot_block = torch.arange(m * length) // length
    assert torch.equal(layout.block_index[gather], slot_block)
    # Real slots hold every token exactly once, in row-major order inside the block.
    if valid is None:
        assert torch.equal(torch.sort(gather).values, torch.arange(n))
        assert int(layout.block_sizes.min()) == length
    else:
        assert valid.shape == (m, length) and valid.dtype == torch.bool
        assert torch.equal(valid.sum(1), layout.block_sizes)
        real = gather[valid.reshape(-1)]
        assert torch.equal(torch.sort(real).values, torch.arange(n))
        assert torch.equal(valid.reshape(-1)[scatter], torch.ones(n, dtype=torch.bool))
        # Real slots come first in each block.
        assert torch.equal(valid, torch.arange(length)[None, :] < layout.block_sizes[:, None])
    for b in range(m):
        toks = gather[b * length : b * length + int(layout.block_sizes[b])]
        assert torch.all(toks[1:] > toks[:-1]), "tokens inside a block must keep row-major order"
    assert identity == (valid is None and torch.equal(gather, torch.arange(n)))
    # Cached per device: the same tensors come back.
    assert layout.gather_tensors("cpu")[0] is gather


def test_identity_flag_only_when_tokens_already_block_major():
    assert BlockLayout((6,), (3,)).gather_tensors()[3] is True
    assert BlockLayout((4, 4), (4, 1)).gather_tensors()[3] is True  # row bands
    assert BlockLayout((7, 9), (1, 1)).gather_tensors()[3] is True  # M = 1
    assert BlockLayout((4, 4), (2, 2)).gather_tensors()[3] is False  # needs a permutation
    assert BlockLayout((5,), (3,)).gather_tensors()[3] is False  # padded


@pytest.mark.parametrize(
    "grid,block_grid,axis",
    [((3,), (4,), "W"), ((7, 3), (2, 4), "W"), ((2, 9), (3, 3), "H"), ((2, 8, 8), (3, 2, 2), "T")],
)
def test_more_blocks_than_tokens_on_an_axis_is_a_clear_error(grid, block_grid, axis):
    """CASES C04: a clear error, naming the axis and the fix, only when blocks outnumber tokens on an axis."""
    with pytest.raises(ValueError, match=f"axis {axis}") as info:
        BlockLayout(grid, block_grid)
    msg = str(info.value)
    assert "choose_block_grid" in msg and "fewer blocks" in msg


def test_as_many_blocks_as_tokens_is_fine():
    layout = BlockLayout((2, 3), (2, 3))
    assert layout.block_sizes.tolist() == [1] * 6
    assert torch.equal(layout.block_index, torch.arange(6))


def test_normalize_grid():
    assert normalize_grid(5) == (1, 1, 5)
    assert normalize_grid((5,)) == (1, 1, 5)
    assert normalize_grid((3, 4)) == (1, 3, 4)
    assert normalize_grid((2, 3, 4)) == (2, 3, 4)
    for bad in [(), (1, 2, 3, 4), (0, 3), (3, -1)]:
        with pytest.raises(ValueError):
            normalize_grid(bad)
    layout = BlockLayout(12, 3)
    assert layout.grid == (1, 1, 12) and layout.block_grid == (1, 1, 3)
    assert BlockLayout((3, 4), (2,)).block_grid == (1, 1, 2)  # fewer block axes: leading ones = 1


def test_block_centres():
    centres = BlockLayout((4, 6), (2, 3)).block_centres
    assert centres.dtype == torch.float64
    expected = torch.tensor([[0.5, ih + 0.5, iw + 0.5] for ih in range(2) for iw in range(3)], dtype=torch.float64)
    assert torch.equal(centres, expected)


# ----------------------------------------------------------------------------------------------
# mixing_init (the paper's locality-biased init)

BLOCK_GRIDS = [(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 2), (1, 3, 3), (1, 4, 4), (1, 3, 5), (2, 2, 2), (3, 5, 7), (1, 8, 2)]


@pytest.mark.parametrize("block_grid", BLOCK_GRIDS, ids=lambda b: "x".join(map(str, b)))
def test_mixing_init_rows_sum_to_one_in_unit_range_diagonal_largest(block_grid):
    init = mixing_init(block_grid, dtype=torch.float64)
    m = math.prod(block_grid)
    assert init.shape == (m, m) and init.dtype == torch.float64
    torch.testing.assert_close(init.sum(1), torch.ones(m, dtype=torch.float64), rtol=0, atol=1e-12)
    assert init.min() >= 0 and init.max() <= 1
    diag = init.diagonal()
    off = init - torch.diag(diag) - torch.eye(m, dtype=torch.float64)  # diagonal pushed below every entry
    if m > 1:
        assert torch.all(diag[:, None] > off), "the diagonal must be strictly largest in each row"
        # The farthest block of every row gets weight 0 (1 - max/max).
        assert torch.all(init.min(1).values == 0)


@pytest.mark.parametrize("block_grid", BLOCK_GRIDS, ids=lambda b: "x".join(map(str, b)))
def test_mixing_init_matches_formula(block_grid):
    """Mc0[i, j] = 1 - dist/max_k dist (block-centre Euclidean distance), rows normalised (independent loop)."""
    bt, bh, bw = block_grid
    cells = list(product(range(bt), range(bh), range(bw)))
    m = len(cells)
    expected = torch.ones(1, 1, dtype=torch.float64)
    if m > 1:
        rows = []
        for a in cells:
            dist = [math.dist(a, c) for c in cells]
            far = max(dist)
            row = [1 - x / far for x in dist]
            s = sum(row)
            rows.append([r / s for r in row])
        expected = torch.tensor(rows, dtype=torch.float64)
    torch.testing.assert_close(mixing_init(block_grid, dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_mixing_init_hand_checked_three_blocks():
    # centres 0.5, 1.5, 2.5: row 0 -> (1, 1/2, 0)/1.5; row 1 -> (0, 1, 0) (both others are farthest).
    expected = torch.tensor([[2 / 3, 1 / 3, 0], [0, 1, 0], [0, 1 / 3, 2 / 3]], dtype=torch.float64)
    torch.testing.assert_close(mixing_init((3,), dtype=torch.float64), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block_grid", [(1, 3, 3), (1, 3, 5), (2, 2, 2), (3, 5, 7), (1, 4, 4)], ids=lambda b: "x".join(map(str, b)))
def test_mixing_init_symmetric_under_grid_symmetries(block_grid):
    """Reflecting the block grid along any axis (or transposing a square one) permutes rows and columns alike.

    Note: the matrix itself is not symmetric in general (rows are normalised and a corner's farthest
    block is farther than the centre's); it is symmetric when all blocks are equivalent (2x2, 2x2x2).
    """
    init = mixing_init(block_grid, dtype=torch.float64)
    ids = torch.arange(init.shape[0]).reshape(block_grid)
    perms = [ids.flip(axis).reshape(-1) for axis in range(3)]
    if block_grid[1] == block_grid[2]:
        perms.append(ids.transpose(1, 2).reshape(-1))
    for p in perms:
        torch.testing.assert_close(init[p][:, p], init, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block_grid", [(1, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_mixing_init_is_a_symmetric_matrix_when_all_blocks_are_equivalent(block_grid):
    init = mixing_init(block_grid, dtype=torch.float64)
    torch.testing.assert_close(init, init.T, rtol=0, atol=1e-12)


def test_mixing_init_one_block_and_layout_argument():
    assert torch.equal(mixing_init((1, 1, 1)), torch.ones(1, 1))
    assert torch.equal(mixing_init(BlockLayout((7, 9), (1, 1))), torch.ones(1, 1))
    layout = BlockLayout((7, 9), (2, 3))
    from_layout = mixing_init(layout)
    assert from_layout.dtype == torch.float32 and from_layout.shape == (6, 6)
    assert torch.equal(from_layout, mixing_init((2, 3)))
    assert mixing_init((2, 3), dtype=torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# choose_block_grid / default_num_blocks

SWEEP_GRIDS = [
    (1, 1), (1, 9), (5,), (7, 9), (16, 16), (32, 32), (32, 8), (8, 32), (64, 16), (3, 5, 7), (21, 30, 52), (1, 3, 4096), (5, 1, 1),
]


@pytest.mark.parametrize("grid", SWEEP_GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_choose_block_grid_respects_cost_rule_and_axes(grid):
    g3 = normalize_grid(grid)
    n = math.prod(g3)
    for target in [None, 1, 2, 4, 16, 105, 10_000]:
        bg = choose_block_grid(grid, target)
        assert len(bg) == 3 and all(isinstance(b, int) and b >= 1 for b in bg)
        m = math.prod(bg)
        assert m * m <= n, f"M^2 > N for {grid} with target {target}: {bg}"
        assert all(b <= s for b, s in zip(bg, g3)), f"more blocks than tokens on an axis: {grid} -> {bg}"
        BlockLayout(grid, bg)  # valid
        assert choose_block_grid(grid, target) == bg  # deterministic


def test_choose_block_grid_near_square_blocks():
    """CASES C05: blocks follow the true grid's aspect ratio (a square guess would be a bug)."""
    assert choose_block_grid((32, 8), 16) == (1, 8, 2)  # 4x4-token blocks
    assert choose_block_grid((8, 32), 16) == (1, 2, 8)
    assert choose_block_grid((32, 32), 16) == (1, 4, 4)
    assert choose_block_grid((1, 1)) == (1, 1, 1)
    assert choose_block_grid((7, 9), 1) == (1, 1, 1)
    # Wan 480x832x81 (21x30x52) at the paper's M = 105: blocks near-cubic in token units.
    bg = choose_block_grid((21, 30, 52), 105)
    sides = [n / b for n, b in zip((21, 30, 52), bg)]
    assert max(sides) / min(sides) < 2, (bg, sides)
    assert 0.5 <= math.prod(bg) / 105 <= 2


def test_choose_block_grid_rejects_bad_target():
    with pytest.raises(ValueError, match="num_blocks"):
        choose_block_grid((8, 8), 0)


def test_default_num_blocks():
    assert default_num_blocks(1) == 1
    assert default_num_blocks(1024) == 16  # DiT 512 px, the paper's best M
    assert default_num_blocks(32_760) == 90  # Wan2.1 480x832x81
    assert default_num_blocks(4096) == 32
    for n in range(1, 5000):
        m = default_num_blocks(n)
        assert m >= 1 and m * m <= n, n
        assert m == max(1, round(math.sqrt(n) / 2))


def test_grid_sizes_must_be_integers():
    """Fractional sizes are refused, never truncated (4.7 x 4.2 tokens is no grid)."""
    import numpy as np

    with pytest.raises(ValueError, match="integers"):
        BlockLayout((4.7, 4.2), (2.9, 2))
    with pytest.raises(ValueError, match="integers"):
        BlockLayout((4, 4), (2.0, 2))
    with pytest.raises(ValueError, match="integers"):
        BlockLayout((True, 4), (1, 2))
    assert BlockLayout((np.int64(4), 4), (2, np.int32(2))).grid == (1, 4, 4)
