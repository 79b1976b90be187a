"""The operator's ``feature_map`` and ``rotary`` options (Wan 2.1's RoPE after the feature map).

With ``rotary = R`` the numerator uses rotated features and the denominator un-rotated ones
(DESIGN.md): ``out_i = sum_t Mc[b(i), b(t)] (R phi(q_i)).(R phi(k_t)) v_t / (sum_t Mc[b(i), b(t)]
phi(q_i).phi(k_t) + eps)``. Oracles: the dense float64 reference, itself checked here against an
explicit per-token loop written from that formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_ops import TOL, make_inputs, make_mixing, rel_err

from mhla_diffusers import BlockLayout, mhla_attention, mhla_attention_reference
from mhla_diffusers.ops import implied_attention


def make_rotary(n: int, d: int, seed: int = 0):
    """An interleaved-pair rotation (Wan's convention: pairs (2i, 2i+1)) with random angles per token and pair."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out

    return rotate


def grads_of(fn, q, k, v, mixing, grad_out, dtype=None):
    leaves = [(t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_(True) for t in (q, k, v, mixing)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out.detach(), grads


def quotient_scales(q, k, v, mixing, layout, grad_out, *, normalize=True, eps=1e-6, **kw):
    """Per input, max |term| of d(num/den) = dnum/den - num dden/den^2 (float64).

    Where the two terms cancel (one token: the rotation of a token's own q and k cancels in
    q.k, so out ~ v and dk ~ eps) a correct evaluation errs by ulps of the terms, not of the
    result: errors are measured relative to max(|reference|, |term|), as in test_ops.
    """
    if not normalize:
        return [None] * 4
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    num = mhla_attention_reference(*leaves, layout, normalize=False, **kw)
    den = implied_attention(leaves[0], leaves[1], leaves[3], layout, dtype=torch.float64, feature_map=kw.get("feature_map", "relu"))
    den = den.sum(-1, keepdim=True) + eps
    g = grad_out.double()
    first = torch.autograd.grad(num / den.detach(), leaves, g, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(num.detach() / den, leaves, g, allow_unused=True)
    return [max((t.abs().max().item() if t is not None else 0.0) for t in pair) for pair in zip(first, second)]


def compare(q, k, v, mixing, layout, tol, **kw):
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64).to(q.dtype)
    out, grads = grads_of(lambda *a: mhla_attention(*a, layout, backend="torch", **kw), q, k, v, mixing, grad_out)
    ref, ref_grads = grads_of(lambda *a: mhla_attention_reference(*a, layout, **kw), q, k, v, mixing, grad_out, torch.float64)
    scales = quotient_scales(q, k, v, mixing, layout, grad_out, **kw)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    errors = {"out": rel_err(out, ref)}
    for name, g, rg, x, sc in zip(("dq", "dk", "dv", "dmixing"), grads, ref_grads, (q, k, v, mixing), scales):
        assert g.dtype == x.dtype and g.shape == x.shape and torch.isfinite(g).all(), name
        errors[name] = rel_err(g, rg, sc)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all {errors})"
    return errors


GRIDS = [((7, 9), (2, 3)), ((3, 5, 7), (2, 2, 3)), ((11,), (3,)), ((1, 1), (1, 1)), ((4, 6), (1, 1))]


@pytest.mark.parametrize("feature_map", ["relu", None], ids=["relu", "features"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("grid,block_grid", GRIDS, ids=[str(g) for g, _ in GRIDS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rotary_matches_reference(grid, block_grid, normalize, feature_map, dtype):
    layout = BlockLayout(grid, block_grid)
    if dtype == torch.float32 and layout.num_tokens == 1 and normalize:
        # One token: (R q).(R k) = q.k exactly, but in fp32 the rotated dot product cancels (rotated
        # features have both signs) and the quotient is as ill-conditioned as |q||k| / q.k: checked
        # in float64 only.
        pytest.skip("ill-conditioned in fp32 by construction; the float64 case covers it")
    q, k, v = make_inputs(2, 3, layout.num_tokens, 8, dv=6, dtype=dtype)
    if feature_map is None and normalize:  # features must be non-negative for a meaningful denominator
        q, k = q.abs(), k.abs()
    rotary = make_rotary(layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand", dtype)
    compare(q, k, v, mixing, layout, TOL[dtype] * 10, normalize=normalize, feature_map=feature_map, rotary=rotary)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rotary_low_precision_inputs(dtype, normalize):
    layout = BlockLayout((6, 10), (2, 3))
    q, k, v = make_inputs(2, 2, layout.num_tokens, 16, dtype=dtype)
    rotary = make_rotary(layout.num_tokens, 16)
    compare(q, k, v, make_mixing(layout, "locality", torch.float32), layout, TOL[dtype] * 2, normalize=normalize, rotary=rotary)


def test_reference_rotary_against_explicit_loop():
    """The dense reference of the RoPE variant equals the formula evaluated token by token."""
    layout = BlockLayout((3, 4), (2, 2))
    n, d = layout.num_tokens, 4
    q, k, v = make_inputs(1, 1, n, d, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    rotary = make_rotary(n, d)
    eps = 1e-3
    fq, fk = torch.relu(q[0, 0]), torch.relu(k[0, 0])
    rq, rk = rotary(fq[None, None])[0, 0], rotary(fk[None, None])[0, 0]
    blk = layout.block_index
    expected = torch.zeros(n, d, dtype=torch.float64)
    for i in range(n):
        num = sum(mixing[blk[i], blk[t]] * (rq[i] @ rk[t]) * v[0, 0, t] for t in range(n))
        den = sum(mixing[blk[i], blk[t]] * (fq[i] @ fk[t]) for t in range(n))
        expected[i] = num / (den + eps)
    got = mhla_attention_reference(q, k, v, mixing, layout, eps=eps, rotary=rotary)[0, 0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    fast = mhla_attention(q, k, v, mixing, layout, eps=eps, rotary=rotary)[0, 0]
    torch.testing.assert_close(fast, expected, rtol=1e-10, atol=1e-12)


def test_identity_rotary_is_plain_mhla():
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(2, 3, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    for normalize in (True, False):
        plain = mhla_attention(q, k, v, mixing, layout, normalize=normalize)
        rotated = mhla_attention(q, k, v, mixing, layout, normalize=normalize, rotary=lambda x: x)
        torch.testing.assert_close(rotated, plain, rtol=1e-5, atol=1e-6)


def test_rotary_changes_the_output_and_denominator_is_unrotated():
    """A real rotation changes the output; with normalize the row weights of the denominator are the
    un-rotated ones (all-ones values: numerator = rotated row sums, not 1)."""
    layout = BlockLayout((6, 6), (2, 2))
    q, k, _ = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    v = torch.ones(1, 2, layout.num_tokens, 1, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    rotary = make_rotary(layout.num_tokens, 8)
    plain = mhla_attention(q, k, v, mixing, layout, eps=0.0)
    torch.testing.assert_close(plain, torch.ones_like(plain))  # un-rotated: weights sum to 1
    rotated = mhla_attention(q, k, v, mixing, layout, eps=0.0, rotary=rotary)
    assert (rotated - 1).abs().max() > 1e-2


def test_feature_map_none_equals_relu_on_nonnegative_inputs():
    layout = BlockLayout((5, 7), (2, 2))
    q, k, v = make_inputs(2, 2, layout.num_tokens, 8, dtype=torch.float64)
    q, k = torch.relu(q), torch.relu(k)
    mixing = make_mixing(layout, "rand", torch.float64)
    for normalize in (True, False):
        a = mhla_attention(q, k, v, mixing, layout, normalize=normalize)
        b = mhla_attention(q, k, v, mixing, layout, normalize=normalize, feature_map=None)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_feature_map_none_gradients_have_no_relu_mask(normalize):
    """feature_map=None: negative entries of q and k get gradients (no ReLU derivative)."""
    layout = BlockLayout((4, 5), (2, 2))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 6, dtype=torch.float64)
    if normalize:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    compare(q, k, v, make_mixing(layout, "rand", torch.float64), layout, 1e-9, normalize=normalize, feature_map=None)


def test_gradcheck_rotary_float64():
    layout = BlockLayout((3, 5), (2, 2))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 4, 3, dtype=torch.float64)
    q = torch.where(q.abs() < 0.05, q + 0.1, q)
    k = torch.where(k.abs() < 0.05, k + 0.1, k)
    mixing = torch.rand(4, 4, dtype=torch.float64) + 0.1
    rotary = make_rotary(layout.num_tokens, 4)
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v, mixing))
    fn = lambda q, k, v, m: mhla_attention(q, k, v, m, layout, rotary=rotary)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_rotary_non_contiguous_diffusers_layout():
    """diffusers' [B, N, H, d] tensors viewed as [B, H, N, d]."""
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_inputs(2, 3, layout.num_tokens, 8, dtype=torch.float64))
    assert not q.is_contiguous()
    compare(q, k, v, make_mixing(layout, "rand", torch.float64), layout, 1e-9, rotary=make_rotary(layout.num_tokens, 8))


def test_errors_feature_map_and_rotary_shape():
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    with pytest.raises(ValueError, match="feature_map"):
        mhla_attention(q, k, v, mixing, layout, feature_map="elu")
    with pytest.raises(ValueError, match="rotary must return"):
        mhla_attention(q, k, v, mixing, layout, rotary=lambda x: x[..., :4])
    with pytest.raises(ValueError, match="feature_map"):
        mhla_attention_reference(q, k, v, mixing, layout, feature_map="gelu")


# ----------------------------------------------------------------------------------------------
# InterleavedRotary: the rotation the Triton kernels fuse (its kernel path: tests/ops/test_triton.py)


def _tables(n, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_interleaved_rotary_equals_the_slice_formula(dtype):
    """The class's rotation (complex product for fp32 / fp64, slice form otherwise) is the formula, on a strided view too."""
    from mhla_diffusers import InterleavedRotary

    n, d = 30, 8
    cos, sin = _tables(n, d)
    rot = InterleavedRotary(cos, sin)
    x = torch.randn(2, n, 3, d, dtype=torch.float64).transpose(1, 2)  # diffusers' layout, non-contiguous
    expected = make_rotary(n, d)(x)
    got = rot(x.to(dtype))
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, expected) <= {torch.float64: 1e-14, torch.float32: 1e-6, torch.float16: 5e-3}[dtype]
    assert (rot.num_tokens, rot.head_dim) == (n, d)
    c32, s32 = rot.tables(torch.device("cpu"))
    assert c32.dtype == torch.float32 and c32.is_contiguous() and torch.equal(c32, cos.float()) and torch.equal(s32, sin.float())
    assert rot.tables("cpu") [0] is c32  # cached per device and dtype


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_interleaved_rotary_in_the_operator_matches_reference(normalize):
    """mhla_attention(rotary=InterleavedRotary) on the torch backend (composed) == the dense reference with the same map."""
    from mhla_diffusers import InterleavedRotary

    layout = BlockLayout((3, 5, 7), (2, 2, 3))
    q, k, v = make_inputs(2, 3, layout.num_tokens, 8, dtype=torch.float64)
    rot = InterleavedRotary(*_tables(layout.num_tokens, 8))
    compare(q, k, v, make_mixing(layout, "rand", torch.float64), layout, 1e-9, rotary=rot, normalize=normalize)


def test_interleaved_rotary_tables_with_gradients_are_composed():
    """Tables that require a gradient get it (the composed path), equal to the slice formula's gradient."""
    from mhla_diffusers import InterleavedRotary

    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    grads = []
    for complex_form in (True, False):
        cos, sin = (t.clone().requires_grad_() for t in _tables(layout.num_tokens, 8))
        if complex_form:
            rot = InterleavedRotary(cos, sin)
        else:
            def rot(x, cos=cos, sin=sin):
                return torch.stack((x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 0::2] * sin + x[..., 1::2] * cos), -1).flatten(-2)
        mhla_attention(q, k, v, mixing, layout, rotary=rot, backend="torch").square().sum().backward()
        grads.append((cos.grad, sin.grad))
    assert grads[0][0] is not None and grads[0][0].abs().max() > 0
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_interleaved_rotary_errors():
    from mhla_diffusers import InterleavedRotary

    with pytest.raises(ValueError, match=r"\[N, d / 2\]"):
        InterleavedRotary(torch.ones(4, 3), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"\[N, d / 2\]"):
        InterleavedRotary(torch.ones(1, 4, 1, 8), torch.ones(1, 4, 1, 8))
    with pytest.raises(ValueError, match="tensors"):
        InterleavedRotary([1.0], [0.0])
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    with pytest.raises(ValueError, match="30 tokens x 6 channels"):  # head dim 8 vs tables for 6
        mhla_attention(q, k, v, mixing, layout, rotary=InterleavedRotary(*_tables(30, 6)))
    with pytest.raises(ValueError, match="31 tokens"):
        mhla_attention(q, k, v, mixing, layout, rotary=InterleavedRotary(*_tables(31, 8)))


def test_interleaved_rotary_mixed_table_dtypes_and_in_place_edits():
    """cos / sin of different dtypes are promoted to one; an in-place edit of the tables after first use is
    seen by the rotation and by the kernels' table copies (no stale cache)."""
    from mhla_diffusers import InterleavedRotary

    cos, sin = _tables(30, 8)
    rot = InterleavedRotary(cos.float(), sin)
    assert rot.cos.dtype == rot.sin.dtype == torch.float64
    x = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    assert rel_err(rot(x), make_rotary(30, 8)(x)) < 1e-6
    first = rot.tables("cpu")[0].clone()
    with torch.no_grad():
        rot.cos.fill_(1.0), rot.sin.zero_()  # the identity rotation now
    assert torch.equal(rot(x), x)
    assert torch.equal(rot.tables("cpu")[0], torch.ones(30, 4)) and not torch.equal(first, torch.ones(30, 4))
