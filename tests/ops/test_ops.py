"""The MHLA operator: ``mhla_attention(..., backend="torch")`` against oracles, outputs AND gradients.

Oracles:
- ``mhla_attention_reference``: the dense O(N^2) implied-attention form, in float64, fed the same
  (already rounded) inputs as the fast path; used up to N ~ 600.
- independent O(N d^2) float64 implementations written here (plain linear attention, block-local
  attention, a loop over blocks) for the degenerate identities of DESIGN.md and for grids too large
  for the dense form (CASES C01, C04).

Errors are relative: max |fast - oracle| / max |oracle|, per tensor (output, dq, dk, dv, dmixing),
with a random upstream gradient (``torch.autograd.grad``). With the normaliser on, gradients are
measured against max(|oracle|, |the two terms of the quotient rule|): see ``quotient_term_scales``.
"""

from __future__ import annotations

import pytest
import torch

from mhla_diffusers import BlockLayout, available_backends, mhla_attention, mhla_attention_reference, mixing_init
from mhla_diffusers.ops import naive
from mhla_diffusers.ops.naive import relative_error as rel_err

# Relative-error tolerances per input dtype. Low precision: inputs are rounded to the dtype, the
# operator accumulates in fp32 and rounds the output (and each gradient) once more to the dtype,
# so the error is a few ulps of the dtype (bf16 ulp 2^-8, fp16 ulp 2^-11).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_inputs(batch, heads, n, d, dv=None, dtype=torch.float32, scale=1.0):
    dv = d if dv is None else dv
    q = (torch.randn(batch, heads, n, d, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(batch, heads, n, d, dtype=torch.float64) * scale).to(dtype)
    v = (torch.randn(batch, heads, n, dv, dtype=torch.float64) * scale).to(dtype)
    return q, k, v


def make_mixing(layout, kind, dtype=torch.float32):
    m = layout.num_blocks
    if kind == "rand":
        return torch.rand(m, m, dtype=torch.float64).to(dtype)
    if kind == "locality":
        return mixing_init(layout, dtype=dtype)
    if kind == "ones":
        return torch.ones(m, m, dtype=dtype)
    if kind == "identity":
        return torch.eye(m, dtype=dtype)
    raise ValueError(kind)


def fast_and_grads(q, k, v, mixing, layout, grad_out, **kw):
    """Output and (dq, dk, dv, dmixing) of the torch backend, in the inputs' own dtypes."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
    out = mhla_attention(*leaves, layout, backend="torch", **kw)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), grads


def oracle_and_grads(fn, q, k, v, mixing, layout, grad_out, **kw):
    """Output and gradients of ``fn`` computed in float64 from the same (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    out = fn(*leaves, layout, **kw)
    grads = torch.autograd.grad(out, leaves, grad_out.double(), allow_unused=True)  # None: oracle ignores it
    return out.detach(), grads


def quotient_term_scales(q, k, v, mixing, layout, grad_out, eps=1e-6):
    """Per input, the size of the two terms whose difference is the gradient of ``num / den``.

    d(num/den) = dnum/den - num dden/den^2. When the two nearly cancel the true gradient is tiny
    (one token: out ~= v whatever q is, so dq ~ eps; one block: the output is invariant to the
    scalar Mc, so dmixing ~ eps; generally sum_j Mc[i, j] dMc[i, j] ~ 0 for every row i), and any
    floating-point evaluation of it errs by ulps of the TERMS, not of the result. Gradient errors
    are therefore measured relative to max(|reference|, |term|), the standard bound.
    """
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    num, den = blockwise_parts(*leaves, layout, eps=eps)
    g = grad_out.double()
    first = torch.autograd.grad(num / den.detach(), leaves, g, allow_unused=True, retain_graph=True)
    second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, leaves, g, allow_unused=True)
    return [
        max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item())
        for a, b in zip(first, second)
    ]


def reference(q, k, v, mixing, layout, **kw):
    return mhla_attention_reference(q, k, v, mixing, layout, dtype=torch.float64, **kw)


def assert_matches_reference(q, k, v, mixing, layout, tol, oracle=reference, **kw):
    """Compare output and all four gradients of the fast path with ``oracle`` (float64)."""
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64).to(q.dtype)
    out, grads = fast_and_grads(q, k, v, mixing, layout, grad_out, **kw)
    ref, ref_grads = oracle_and_grads(oracle, q, k, v, mixing, layout, grad_out, **kw)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert torch.isfinite(out).all()
    if kw.get("normalize", True):
        scales = quotient_term_scales(q, k, v, mixing, layout, grad_out, eps=kw.get("eps", 1e-6))
    else:
        scales = [None] * 4
    errors = {"out": rel_err(out, ref)}
    for name, g, rg, x, sc in zip(("dq", "dk", "dv", "dmixing"), grads, ref_grads, (q, k, v, mixing), scales):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert torch.isfinite(g).all(), name
        if rg is not None:
            errors[name] = rel_err(g, rg, sc)
    bad = {name: e for name, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors


# Independent O(N d^2) float64 oracles --------------------------------------------------------


def formula_block_index(layout):
    """Block of each token from DESIGN.md's formula (not from layout.py), cross-checked with layout.block_index."""
    t_, h_, w_ = layout.grid
    bt, bh, bw = layout.block_grid
    t = torch.arange(t_)[:, None, None] * bt // t_
    h = torch.arange(h_)[None, :, None] * bh // h_
    w = torch.arange(w_)[None, None, :] * bw // w_
    idx = ((t * bh + h) * bw + w).reshape(-1)
    assert torch.equal(idx, layout.block_index)
    return idx


def plain_linear_attention(q, k, v, eps=1e-6, normalize=True):
    """relu(q) (relu(k)^T v) / (relu(q) . sum_t relu(k_t) + eps), in the inputs' dtype (float64 here)."""
    pq, pk = torch.relu(q), torch.relu(k)
    num = pq @ (pk.transpose(-1, -2) @ v)
    if not normalize:
        return num
    den = pq @ pk.sum(-2).unsqueeze(-1)
    return num / (den + eps)


def blockwise_parts(q, k, v, mixing, layout, *, eps=1e-6):
    """MHLA numerator and denominator by the block-wise oracle (``ops/naive.py``: an explicit loop over
    blocks with boolean masks), after checking layout.block_index against DESIGN.md's formula."""
    formula_block_index(layout)
    return naive.blockwise_parts(q, k, v, mixing, layout, eps=eps)


def blockwise_loop(q, k, v, mixing, layout, *, normalize=True, eps=1e-6):
    """MHLA from :func:`blockwise_parts` (independent of layout.py's gather/scatter and of torch_ops)."""
    num, den = blockwise_parts(q, k, v, mixing, layout, eps=eps)
    return num / den if normalize else num


def block_local_attention(q, k, v, layout, *, normalize=True, eps=1e-6):
    """Plain linear attention run separately inside each block (the Mc = identity case)."""
    idx = formula_block_index(layout)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for b in range(layout.num_blocks):
        mask = idx == b
        out[:, :, mask] = plain_linear_attention(q[:, :, mask], k[:, :, mask], v[:, :, mask], eps, normalize)
    return out


# ----------------------------------------------------------------------------------------------
# Against the dense reference: grids (CASES C04, C07)

GRIDS = [
    ((5,), (3,)),  # 1D, last block smaller
    ((13,), (4,)),
    ((12,), (3,)),  # 1D, even (block-major view path)
    ((1, 1), (1, 1)),  # one token (C07)
    ((1, 9), (1, 4)),  # 1 x W
    ((9, 1), (4, 1)),  # H x 1
    ((7, 9), (2, 3)),  # C04
    ((7, 9), (1, 1)),  # one block
    ((7, 9), (7, 9)),  # one token per block
    ((8, 8), (2, 2)),  # even 2D, permuted but unpadded
    ((3, 5, 7), (2, 2, 3)),
    ((3, 6, 13), (2, 3, 4)),  # Wan-like 3D, 13 columns in 4 blocks (cf. 52 columns)
    ((4, 6, 1), (3, 2, 1)),
]
GRID_IDS = [f"{'x'.join(map(str, g))}-{'x'.join(map(str, b))}" for g, b in GRIDS]


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("grid,block_grid", GRIDS, ids=GRID_IDS)
def test_matches_reference_on_grids_fp64(grid, block_grid, normalize):
    """CASES C04 / C07: uneven blocks, 1D/2D/3D, M = 1, one token, partial last block; output and grads."""
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 2, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    assert_matches_reference(q, k, v, mixing, layout, TOL[torch.float64], normalize=normalize)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("grid,block_grid", [((7, 9), (2, 3)), ((3, 5, 7), (2, 2, 3)), ((1, 1), (1, 1))], ids=["7x9", "3x5x7", "1x1"])
def test_matches_reference_on_grids_fp32(grid, block_grid, normalize):
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 3, layout.num_tokens, 16)
    assert_matches_reference(q, k, v, make_mixing(layout, "rand"), layout, TOL[torch.float32], normalize=normalize)


def test_reference_sanity_mixing_matters():
    """Guards the comparisons above: different mixing matrices give clearly different outputs."""
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    a = mhla_attention(q, k, v, make_mixing(layout, "rand", torch.float64), layout, backend="torch")
    b = mhla_attention(q, k, v, make_mixing(layout, "locality", torch.float64), layout, backend="torch")
    assert rel_err(a, b) > 1e-2


# ----------------------------------------------------------------------------------------------
# head dims (CASES C06) and value dims


@pytest.mark.parametrize("head_dim", [32, 64, 72, 128])
def test_head_dims(head_dim):
    """CASES C06: SANA 32, 64, DiT-XL 72 (not a power of two), Wan 128 — fp32 and bf16."""
    layout = BlockLayout((7, 9), (2, 3))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_inputs(1, 2, layout.num_tokens, head_dim, dtype=dtype)
        assert_matches_reference(q, k, v, make_mixing(layout, "rand"), layout, TOL[dtype])


@pytest.mark.parametrize("d,dv", [(16, 24), (32, 8), (72, 1)])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_value_head_dim_differs_from_query(d, dv, normalize):
    layout = BlockLayout((3, 5, 7), (2, 2, 3))
    q, k, v = make_inputs(2, 2, layout.num_tokens, d, dv, dtype=torch.float64)
    assert_matches_reference(q, k, v, make_mixing(layout, "rand", torch.float64), layout, TOL[torch.float64], normalize=normalize)


# ----------------------------------------------------------------------------------------------
# dtypes (CASES C08)


@pytest.mark.parametrize("mixing_kind", ["rand", "locality"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dtypes(dtype, normalize, mixing_kind):
    """Output and gradients in the input dtype; the mixing matrix in the same dtype (low-precision included)."""
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(2, 2, layout.num_tokens, 32, dtype=dtype)
    mixing = make_mixing(layout, mixing_kind, dtype)
    assert_matches_reference(q, k, v, mixing, layout, TOL[dtype], normalize=normalize)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,mix_dtype",
    [
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.float16, torch.float64),
        (torch.float32, torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float64, torch.float32, torch.bfloat16),
    ],
    ids=str,
)
def test_mixed_dtypes_are_cast(q_dtype, kv_dtype, mix_dtype):
    """CASES C08: inputs (and the mixing matrix) of different dtypes: no crash, output in q's dtype, right values."""
    layout = BlockLayout((5, 6), (2, 3))
    q, _, _ = make_inputs(1, 2, layout.num_tokens, 16, dtype=q_dtype)
    _, k, v = make_inputs(1, 2, layout.num_tokens, 16, dtype=kv_dtype)
    mixing = make_mixing(layout, "rand", mix_dtype)
    tol = max(TOL[q_dtype], TOL[kv_dtype], TOL[mix_dtype])
    assert_matches_reference(q, k, v, mixing, layout, tol)


# ----------------------------------------------------------------------------------------------
# Degenerate identities (DESIGN.md "Degenerate cases that define correctness")


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("grid", [(7, 9), (3, 5, 7), (1, 1), (11,)], ids=str)
def test_one_block_is_plain_linear_attention(grid, normalize):
    """M = 1 with Mc = [[1]] (the locality init for one block) is plain ReLU linear attention."""
    layout = BlockLayout(grid, (1,) * len(grid))
    q, k, v = make_inputs(2, 2, layout.num_tokens, 16, dtype=torch.float64)
    mixing = make_mixing(layout, "locality", torch.float64)
    assert torch.equal(mixing, torch.ones(1, 1, dtype=torch.float64))

    def oracle(q, k, v, mix, lay, normalize):
        # Plain linear attention with its one summary scaled by the scalar Mc[0, 0] (so dmixing is checked too).
        pq, pk = torch.relu(q), torch.relu(k)
        num = pq @ (mix[0, 0] * (pk.transpose(-1, -2) @ v))
        return num / (pq @ (mix[0, 0] * pk.sum(-2)).unsqueeze(-1) + 1e-6) if normalize else num

    errors = assert_matches_reference(q, k, v, mixing, layout, TOL[torch.float64], oracle=oracle, normalize=normalize)
    assert set(errors) == {"out", "dq", "dk", "dv", "dmixing"}
    # Scalar Mc = [[1]] is exactly plain linear attention.
    out = mhla_attention(q, k, v, mixing, layout, normalize=normalize, backend="torch")
    assert rel_err(out, plain_linear_attention(q, k, v, normalize=normalize)) <= 1e-12


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize(
    "grid,block_grid", [((7, 9), (2, 3)), ((5,), (3,)), ((3, 5, 7), (2, 2, 3)), ((8, 8), (4, 4)), ((1, 9), (1, 9))], ids=str
)
def test_all_ones_mixing_is_plain_linear_attention_for_any_partition(grid, block_grid, normalize):
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 2, layout.num_tokens, 16, dtype=torch.float64)
    mixing = make_mixing(layout, "ones", torch.float64)
    out = mhla_attention(q, k, v, mixing, layout, normalize=normalize, backend="torch")
    expected = plain_linear_attention(q, k, v, normalize=normalize)
    assert rel_err(out, expected) <= 1e-12
    # Gradients too: dq, dk, dv against plain linear attention; dmixing (plain attention has no
    # mixing) against the dense reference.
    grad_out = torch.randn_like(out)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dq, dk, dv = torch.autograd.grad(plain_linear_attention(*leaves, normalize=normalize), leaves, grad_out)
    _, grads = fast_and_grads(q, k, v, mixing, layout, grad_out, normalize=normalize)
    for g, rg in zip(grads[:3], (dq, dk, dv)):
        assert rel_err(g, rg) <= 1e-10
    assert_matches_reference(q, k, v, mixing, layout, TOL[torch.float64], normalize=normalize)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("grid,block_grid", [((7, 9), (2, 3)), ((5,), (3,)), ((3, 5, 7), (2, 2, 3)), ((8, 8), (2, 2))], ids=str)
def test_identity_mixing_is_attention_inside_each_block(grid, block_grid, normalize):
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 2, layout.num_tokens, 16, dtype=torch.float64)
    mixing = make_mixing(layout, "identity", torch.float64)
    oracle = lambda q, k, v, mix, lay, normalize: block_local_attention(q, k, v, lay, normalize=normalize)  # noqa: E731
    grad_out = torch.randn(*q.shape, dtype=torch.float64)
    out, grads = fast_and_grads(q, k, v, mixing, layout, grad_out, normalize=normalize)
    ref, ref_grads = oracle_and_grads(oracle, q, k, v, mixing, layout, grad_out, normalize=normalize)
    assert rel_err(out, ref) <= 1e-12
    for g, rg in zip(grads[:3], ref_grads[:3]):
        assert rel_err(g, rg) <= 1e-10
    # Not vacuous: block-local attention differs from global linear attention here.
    assert rel_err(out, plain_linear_attention(q, k, v, normalize=normalize)) > 1e-2


def test_blockwise_loop_oracle_agrees_with_dense_reference():
    """The O(N d^2) loop oracle used for large grids (C04) is itself checked against the dense form."""
    layout = BlockLayout((3, 6, 13), (2, 3, 4))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, 5, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    for normalize in (True, False):
        a = blockwise_loop(q, k, v, mixing, layout, normalize=normalize)
        b = mhla_attention_reference(q, k, v, mixing, layout, normalize=normalize)
        assert rel_err(a, b) <= 1e-12


# ----------------------------------------------------------------------------------------------
# CASES


def test_c01_fp16_large_values_one_block_finite_and_accurate():
    """CASES C01: fp16 [2,16,4096,32] ~ N(0, 30^2), M = 1: normaliser sums far past 65504.

    Output must be finite and within 1e-2 relative of float64 plain linear attention on the same
    rounded inputs (computed in O(N d^2): the dense reference would need 16 x 4096^2 doubles).
    """
    layout = BlockLayout((64, 64), (1, 1))
    q, k, v = make_inputs(2, 16, layout.num_tokens, 32, dtype=torch.float16, scale=30.0)
    # The premise: the normaliser phi(q) . sum_t phi(k_t) really is far past fp16's 65504.
    den = torch.relu(q.double()) @ torch.relu(k.double()).sum(-2).unsqueeze(-1)
    assert den.median() > 100 * 65504
    out = mhla_attention(q, k, v, mixing_init(layout), layout, backend="torch")
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    expected = plain_linear_attention(q.double(), k.double(), v.double())
    assert rel_err(out, expected) <= 1e-2


@pytest.mark.parametrize("mixing_dtype", [torch.float32, torch.float16], ids=str)
def test_c02_fp16_all_negative_query_and_block_no_nan_exact_zero(mixing_dtype):
    """CASES C02: fp16, 8x8 grid, 2x2 blocks, Mc = identity; token 0's query all negative, block 0's keys all negative.

    No NaN anywhere (output, dq, dk, dv, dmixing); token 0's output is exactly zero. Block 0's
    other queries see an all-zero summary: their output is exactly zero too (0 / (0 + eps)).
    dMc[0, b] is truly huge there (~ |phi(q)| |S_b| / eps ~ 1e9: raising Mc[0, b] from 0 switches
    block 0 from reading nothing to reading block b), so with an fp32 mixing matrix every gradient
    is finite, while an fp16 one may round it to +-inf (the correctly rounded value), never NaN.
    """
    layout = BlockLayout((8, 8), (2, 2))
    q, k, v = make_inputs(2, 2, layout.num_tokens, 32, dtype=torch.float16)
    block0 = layout.block_index == 0
    q[:, :, 0] = -q[:, :, 0].abs() - 0.1
    k[:, :, block0] = -k[:, :, block0].abs() - 0.1
    mixing = torch.eye(layout.num_blocks, dtype=mixing_dtype)
    grad_out = torch.randn(*q.shape, dtype=torch.float16)
    out, grads = fast_and_grads(q, k, v, mixing, layout, grad_out)
    assert not torch.isnan(out).any() and torch.isfinite(out).all()
    for name, g in zip(("dq", "dk", "dv", "dmixing"), grads):
        assert not torch.isnan(g).any(), name
        if name != "dmixing" or mixing_dtype == torch.float32:
            assert torch.isfinite(g).all(), name
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.all(out[:, :, block0] == 0)
    assert torch.all(grads[0][:, :, 0] == 0)  # relu'(negative) = 0
    assert torch.all(grads[1][:, :, block0] == 0)
    assert torch.all(grads[2][:, :, block0] == 0)  # block 0's values reach no query (phi(k) = 0 there)
    # Rows 1..3 of dmixing stay ordinary; the other blocks still match the reference.
    assert torch.isfinite(grads[3][1:]).all() and grads[3][1:].abs().max() < 1e4
    ref = mhla_attention_reference(q, k, v, mixing, layout)
    assert rel_err(out[:, :, ~block0], ref[:, :, ~block0]) <= TOL[torch.float16]


C03_CONFIGS = {  # name -> (grid, block_grid, heads, d, d_v, dtype, memory)
    "sana600m-fp32": ((32, 32), (4, 4), 36, 32, 32, torch.float32, "contiguous"),
    "sana600m-bf16": ((32, 32), (4, 4), 36, 32, 32, torch.bfloat16, "contiguous"),
    # uneven blocks, d_v = 5, diffusers' memory layout: samples 3 * 63 * 8 * 4 bytes apart (not 64-byte aligned)
    "uneven-bnhd-fp32": ((7, 9), (2, 3), 3, 8, 5, torch.float32, "bnhd"),
    "uneven-fp16": ((7, 9), (2, 3), 3, 8, 5, torch.float16, "contiguous"),
    # block-major layout (the backend's slice path), float64
    "stripes-fp64": ((24, 10), (4, 1), 2, 12, 12, torch.float64, "contiguous"),
}


@pytest.mark.parametrize("config", list(C03_CONFIGS))
def test_c03_sample_results_independent_of_batch(config):
    """CASES C03: one sample alone and at every position of batches of 1, 2, 3 and 5 (other rows random):
    output, dq, dk and dv bitwise equal (the mixing gradient sums over the batch: not compared).

    Holds by construction, not by luck of the BLAS: the torch backend loops over the batch, a
    sample's GEMMs have the same shapes, strides and operand alignment wherever it sits
    (torch_ops module docstring), so ``torch.equal`` is the right check. SANA-600M's attention
    size (36 heads x 32, 32 x 32 grid, 16 blocks) and small uneven / unaligned / block-major cases.
    """
    from batch_check import differences, mhla_runner

    grid, block_grid, heads, d, dv, dtype, memory = C03_CONFIGS[config]
    layout = BlockLayout(grid, block_grid)
    mixing = mixing_init(layout, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    q, k, v = make_inputs(1, heads, layout.num_tokens, d, dv, dtype=dtype)
    grad_out = torch.randn(1, heads, layout.num_tokens, dv, dtype=torch.float64).to(dtype)
    run = mhla_runner(mhla_attention, mixing, layout, memory=memory, backend="torch")
    assert differences(run, (q, k, v, grad_out)) == []


@pytest.mark.parametrize(
    "grid,block_grid",
    [
        ((21, 30, 52), (3, 5, 7)),  # Wan 480x832x81, the paper's M = 105
        ((21, 30, 52), (3, 5, 10)),  # the authors' released block grid, on 52 (not 50) columns
        ((21, 45, 80), (3, 5, 9)),  # Wan-14B 720p
    ],
    ids=["wan480-105", "wan480-150", "wan720-135"],
)
def test_c04_wan_grids_against_blockwise_loop(grid, block_grid):
    """CASES C04: Wan token grids whose blocks do not divide them, float64, vs an independent loop over blocks."""
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(1, 1, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    for normalize in (True, False):
        out = mhla_attention(q, k, v, mixing, layout, normalize=normalize, backend="torch")
        expected = blockwise_loop(q, k, v, mixing, layout, normalize=normalize)
        assert rel_err(out, expected) <= 1e-10


def test_c04_wan_grid_gradients_against_blockwise_loop():
    """CASES C04: gradients on the Wan 21x30x52 grid with M = 105 (float64, 1 batch, 1 head, d = 8)."""
    layout = BlockLayout((21, 30, 52), (3, 5, 7))
    q, k, v = make_inputs(1, 1, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "locality", torch.float64)
    assert_matches_reference(q, k, v, mixing, layout, 1e-10, oracle=blockwise_loop)


@pytest.mark.parametrize(
    "grid,block_grid", [((1, 1), (1, 1)), ((1,), (1,)), ((1, 1, 1), (1, 1, 1)), ((2,), (2,)), ((3,), (2,)), ((2, 3), (2, 2))], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_c07_tiny_inputs(grid, block_grid, dtype):
    """CASES C07: a single token; N smaller than any kernel tile; last block partially filled."""
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=dtype)
    q, k = q.abs(), k.abs()  # keep the normaliser away from 0 for these few tokens
    assert_matches_reference(q, k, v, make_mixing(layout, "rand", dtype), layout, TOL[dtype])


def test_single_token_output_is_its_own_value():
    """One token attending to itself: out = phi(q).phi(k) v / (phi(q).phi(k) + eps) ~= v."""
    layout = BlockLayout((1, 1), (1, 1))
    q, k, v = make_inputs(1, 1, 1, 8, dtype=torch.float64)
    q, k = q.abs() + 1, k.abs() + 1
    out = mhla_attention(q, k, v, torch.ones(1, 1, dtype=torch.float64), layout, backend="torch")
    torch.testing.assert_close(out, v, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# Other behaviour


def test_non_contiguous_inputs():
    """diffusers builds q, k, v as view(B, N, heads, d).transpose(1, 2): non-contiguous."""
    layout = BlockLayout((7, 9), (2, 3))
    mixing = make_mixing(layout, "rand")
    q, k, v = (torch.randn(2, layout.num_tokens, 3, 16).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    out = mhla_attention(q, k, v, mixing, layout, backend="torch")
    expected = mhla_attention(q.contiguous(), k.contiguous(), v.contiguous(), mixing, layout, backend="torch")
    assert torch.equal(out, expected)
    # Also on the view path (tokens already block-major: M = 1).
    one = BlockLayout((7, 9), (1, 1))
    out = mhla_attention(q, k, v, torch.ones(1, 1), one, backend="torch")
    assert rel_err(out, plain_linear_attention(q.double(), k.double(), v.double())) <= TOL[torch.float32]


def _sliced_from_larger_buffer(x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x``'s values in a view that starts ``offset`` elements into a larger buffer (another address alignment)."""
    buffer = torch.zeros(x.numel() + offset + 7, dtype=x.dtype)
    view = buffer[offset : offset + x.numel()].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("offset", [1, 3, 17], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("grid,block_grid", [((7, 9), (2, 3)), ((7, 9), (1, 1)), ((3, 5, 7), (2, 2, 3))], ids=str)
def test_inputs_sliced_out_of_a_larger_buffer(grid, block_grid, offset):
    """Misaligned storage (q, k, v, mixing each a slice of a bigger tensor) meets the same bound as aligned inputs:
    output and gradients against the float64 reference, fp32, with the normaliser (the gather path and M = 1's views)."""
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 3, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    leaves = [_sliced_from_larger_buffer(t, offset).requires_grad_(True) for t in (q, k, v, mixing)]
    assert all(t.storage_offset() == offset for t in leaves)
    grad_out = torch.randn(*q.shape[:3], v.shape[-1])
    out = mhla_attention(*leaves, layout, backend="torch")
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref, ref_grads = oracle_and_grads(reference, q, k, v, mixing, layout, grad_out)
    scales = quotient_term_scales(q, k, v, mixing, layout, grad_out)
    errors = {"out": rel_err(out, ref)}
    errors.update({name: rel_err(g, rg, sc) for name, g, rg, sc in zip(("dq", "dk", "dv", "dmixing"), grads, ref_grads, scales)})
    assert max(errors.values()) <= TOL[torch.float32], errors


def test_inputs_not_modified():
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    copies = [t.clone() for t in (q, k, v, mixing)]
    for lay in (layout, BlockLayout((5, 6), (1, 1))):
        mix = mixing if lay is layout else torch.ones(1, 1)
        mhla_attention(q, k, v, mix, lay, backend="torch")
    for t, c in zip((q, k, v, mixing), copies):
        assert torch.equal(t, c)


def test_auto_backend_matches_torch():
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    assert "torch" in available_backends()
    assert torch.equal(
        mhla_attention(q, k, v, mixing, layout), mhla_attention(q, k, v, mixing, layout, backend="torch")
    )


def test_eps_is_added_to_the_denominator():
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    for eps in (0.0, 1e-6, 10.0):
        assert_matches_reference(q.abs(), k.abs(), v, mixing, layout, 1e-10, eps=eps)


def test_empty_batch():
    """A batch of 0 samples (or 0 heads) gives an empty output of the right shape."""
    layout = BlockLayout((5, 6), (2, 3))
    mixing = make_mixing(layout, "rand")
    for b, h in ((0, 2), (2, 0)):
        q, k, v = make_inputs(b, h, layout.num_tokens, 8, 4)
        out = mhla_attention(q, k, v, mixing, layout, backend="torch")
        assert out.shape == (b, h, layout.num_tokens, 4)


# ----------------------------------------------------------------------------------------------
# Input validation


def _valid(n=30, d=8):
    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = make_inputs(1, 2, n, d)
    return q, k, v, make_mixing(layout, "rand"), layout


def test_error_mismatched_shapes():
    q, k, v, mixing, layout = _valid()
    with pytest.raises(ValueError, match="equal shapes"):
        mhla_attention(q, k[..., :4], v, mixing, layout)
    with pytest.raises(ValueError, match="same"):
        mhla_attention(q, k, v[:, :1], mixing, layout)
    with pytest.raises(ValueError, match="4-D"):
        mhla_attention(q[0], k[0], v[0], mixing, layout)
    with pytest.raises(ValueError):
        mhla_attention_reference(q, k[..., :4], v, mixing, layout)


def test_error_wrong_mixing_shape():
    q, k, v, mixing, layout = _valid()
    for bad in (torch.rand(5, 5), torch.rand(6, 5), torch.rand(36)):
        with pytest.raises(ValueError, match=r"mixing must be \[6, 6\]"):
            mhla_attention(q, k, v, bad, layout)


def test_error_tokens_do_not_match_layout():
    q, k, v, mixing, _ = _valid()
    with pytest.raises(ValueError, match="true token grid"):
        mhla_attention(q, k, v, mixing, BlockLayout((6, 6), (2, 3)))
    with pytest.raises(ValueError, match="tokens"):
        mhla_attention_reference(q, k, v, mixing, BlockLayout((6, 6), (2, 3)))


@pytest.mark.parametrize("which", ["q", "k", "v", "mixing"])
def test_error_integer_dtype(which):
    q, k, v, mixing, layout = _valid()
    args = {"q": q, "k": k, "v": v, "mixing": mixing}
    args[which] = args[which].to(torch.int64)
    with pytest.raises(ValueError, match=f"{which} must be float16, bfloat16, float32 or float64"):
        mhla_attention(args["q"], args["k"], args["v"], args["mixing"], layout)


def test_error_unknown_backend_lists_choices():
    q, k, v, mixing, layout = _valid()
    with pytest.raises(ValueError, match="unknown MHLA backend 'cuda'") as info:
        mhla_attention(q, k, v, mixing, layout, backend="cuda")
    assert "'auto'" in str(info.value) and "'torch'" in str(info.value)


def test_error_layout_type_and_eps():
    q, k, v, mixing, layout = _valid()
    with pytest.raises(TypeError, match="BlockLayout"):
        mhla_attention(q, k, v, mixing, (5, 6))
    with pytest.raises(ValueError, match="eps"):
        mhla_attention(q, k, v, mixing, layout, eps=-1.0)


def test_error_head_dim_zero():
    q, k, v, mixing, layout = _valid()
    with pytest.raises(ValueError, match="head dim >= 1"):
        mhla_attention(q[..., :0], k[..., :0], v, mixing, layout)


def test_processor_refuses_eps_zero_with_the_normaliser():
    """eps = 0 with the normaliser: NaN for any query / block whose features all vanish; refused at install.
    Without the normaliser there is no division: allowed."""
    from mhla_diffusers import MHLAProcessor

    with pytest.raises(ValueError, match="eps=0 with the normaliser"):
        MHLAProcessor(eps=0.0)
    assert MHLAProcessor(eps=0.0, normalize=False).eps == 0.0
    for bad in (float("inf"), float("nan"), "1e-6", -1.0):
        with pytest.raises(ValueError, match="finite number >= 0"):
            MHLAProcessor(eps=bad)


# ----------------------------------------------------------------------------------------------
# gradcheck


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_gradcheck_float64_uneven_layout(normalize):
    """Finite differences in float64 for q, k, v and mixing on a tiny uneven layout (3x5 in 2x2 blocks)."""
    layout = BlockLayout((3, 5), (2, 2))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 3, 2, dtype=torch.float64)
    # Keep ReLU inputs away from the kink so finite differences are valid.
    q = torch.where(q.abs() < 0.05, q + 0.1, q)
    k = torch.where(k.abs() < 0.05, k + 0.1, k)
    mixing = torch.rand(4, 4, dtype=torch.float64) + 0.1
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v, mixing))
    fn = lambda q, k, v, m: mhla_attention(q, k, v, m, layout, normalize=normalize, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 256, 1 << 40], ids=["one-slot chunks", "small chunks", "one chunk"])
@pytest.mark.parametrize("keep_bytes", [0, 1 << 25], ids=["no kept workspace", "kept workspace"])
@pytest.mark.parametrize(
    "grid,block_grid",
    [((7, 9), (2, 3)), ((3, 5, 7), (2, 2, 3)), ((16,), (4,)), ((4, 8), (4, 1))],
    ids=["uneven-2d", "uneven-3d", "identity-1d", "full-rows"],
)
def test_every_chunking_and_workspace_path_matches_reference(monkeypatch, chunk_bytes, keep_bytes, grid, block_grid):
    """The CPU backend splits heads x blocks into chunks by a byte budget and keeps scratch buffers
    between calls; every split (one slot per chunk, runs of blocks, everything in one chunk) and both
    workspace policies must give the reference's outputs and gradients, twice in a row (reuse)."""
    from mhla_diffusers.ops import torch_ops

    monkeypatch.setattr(torch_ops, "_CPU_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(torch_ops, "_CPU_KEEP_BYTES", keep_bytes)
    torch_ops._chunks.cache_clear()
    torch_ops._release_workspace()
    try:
        layout = BlockLayout(grid, block_grid)
        for dtype in (torch.float64, torch.float32):
            q, k, v = make_inputs(2, 3, layout.num_tokens, 8, dv=5, dtype=dtype)
            mixing = make_mixing(layout, "rand", dtype)
            grad_out = torch.randn(2, 3, layout.num_tokens, 5, dtype=dtype)
            out_ref, grads_ref = oracle_and_grads(mhla_attention_reference, q, k, v, mixing, layout, grad_out)
            for _ in range(2):
                out, grads = fast_and_grads(q, k, v, mixing, layout, grad_out)
                for a, e in zip((out, *grads), (out_ref, *grads_ref)):
                    assert rel_err(a, e) < TOL[dtype] * 10, (dtype, rel_err(a, e))
    finally:
        torch_ops._chunks.cache_clear()
        torch_ops._release_workspace()


def test_first_call_under_inference_mode_then_training(monkeypatch):
    """Index tensors and CPU scratch buffers are cached across calls: created during a pipeline's
    torch.inference_mode(), they must still work in no_grad and autograd calls afterwards (and back)."""
    from mhla_diffusers.ops import torch_ops

    torch_ops._release_workspace()
    layout = BlockLayout((5, 7), (2, 3))  # a fresh layout: its caches are built inside inference mode
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    with torch.inference_mode():
        first = mhla_attention(q, k, v, mixing, layout, backend="torch")
    assert_matches_reference(q, k, v, mixing, layout, TOL[torch.float32])
    with torch.no_grad():
        torch.testing.assert_close(mhla_attention(q, k, v, mixing, layout, backend="torch"), first)
    with torch.inference_mode():
        torch.testing.assert_close(mhla_attention(q, k, v, mixing, layout, backend="torch"), first)
