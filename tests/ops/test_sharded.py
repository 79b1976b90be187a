"""ops/sharded.py against the dense oracle: summaries of contiguous shards, summed, then each shard's
queries' outputs, equal MHLA of the whole sequence (outputs and gradients), wherever the shards cut blocks."""

import pytest
import torch

from mhla_diffusers.ops import InterleavedRotary
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.naive import mhla_attention_reference, relative_error
from mhla_diffusers.ops.sharded import shard_attention, shard_blocks, shard_summaries


def _rotary(n, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, d // 2, generator=g, dtype=torch.float64) * 6.28
    return InterleavedRotary(theta.cos(), theta.sin())


def _sharded(q, k, v, mixing, layout, cuts, rotary=None, eps=1e-6, **kw):
    """Run the two halves shard by shard (the sum over shards stands in for the collective)."""
    bounds = list(zip([0, *cuts], [*cuts, layout.num_tokens]))
    rot = (lambda a, b: None) if rotary is None else (lambda a, b: InterleavedRotary(rotary.cos[a:b], rotary.sin[a:b]))
    total = sum(shard_summaries(k[:, :, a:b], v[:, :, a:b], layout, offset=a, rotary=rot(a, b), **kw) for a, b in bounds)
    return torch.cat(
        [shard_attention(q[:, :, a:b], total, mixing, layout, offset=a, rotary=rot(a, b), eps=eps, **kw) for a, b in bounds], 2
    )


@pytest.mark.parametrize(
    "grid, block_grid, cuts, normalize, rope",
    [
        ((1, 7, 9), (1, 3, 2), [17, 18, 40], True, False),  # uneven blocks, a one-token shard
        ((3, 5, 6), (2, 2, 3), [31, 59], False, True),  # numerator only, RoPE
        ((3, 5, 6), (2, 2, 3), [1, 44, 89], True, True),  # shards of 1 token and of many blocks
        ((1, 1, 13), (1, 1, 4), [], True, False),  # one shard = the plain operator
    ],
)
def test_shards_equal_the_whole_sequence(grid, block_grid, cuts, normalize, rope):
    layout = BlockLayout(grid, block_grid)
    n, m, d = layout.num_tokens, layout.num_blocks, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mixing = torch.rand(m, m, generator=g, dtype=torch.float64, requires_grad=True)
    rotary = _rotary(n, d) if rope else None
    out = _sharded(q, k, v, mixing, layout, cuts, rotary, normalize=normalize, eps=1e-6)
    ref = mhla_attention_reference(q, k, v, mixing, layout, normalize=normalize, eps=1e-6, rotary=rotary)
    assert relative_error(out, ref) < 1e-12
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, mixing))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v, mixing))
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-12


def test_float32_feature_eps_and_dtype():
    layout = BlockLayout((2, 4, 4), (2, 2, 2))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    mixing = torch.rand(8, 8, generator=g)
    out = _sharded(q, k, v, mixing, layout, [13], feature_eps=1e-3)
    ref = mhla_attention_reference(q, k, v, mixing, layout, feature_eps=1e-3)
    assert out.dtype == torch.float32 and relative_error(out, ref) < 1e-5
    s = shard_summaries(q.half(), v.half(), layout)
    assert s.dtype == torch.float32 and s.shape == (1, 2, 8, 16, 17)


def test_shard_blocks_and_errors():
    layout = BlockLayout((1, 4, 4), (1, 2, 2))
    sb = shard_blocks(layout, 6, 3)  # tokens 6, 7, 8: (1, 2) (1, 3) in block 1, (2, 0) in block 2
    assert sb.blocks.tolist() == [1, 2] and sb.length == 2 and sb.slots.tolist() == [0, 1, 2]
    sb = shard_blocks(layout, 0, 16)  # rows 0-1: blocks 0 0 1 1, rows 2-3: blocks 2 2 3 3; 4 tokens each
    assert sb.length == 4 and sb.slots.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    with pytest.raises(ValueError, match="does not fit"):
        shard_blocks(layout, 10, 7)
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="summaries must be"):
        shard_attention(q, torch.zeros(1, 1, 3, 4, 5), torch.eye(4), layout, offset=6)
    with pytest.raises(ValueError, match="mixing must be"):
        shard_attention(q, torch.zeros(1, 1, 4, 4, 5), torch.eye(3), layout, offset=6)
    with pytest.raises(ValueError, match="v must be"):
        shard_summaries(q, torch.zeros(1, 1, 3, 4), layout, offset=6)
