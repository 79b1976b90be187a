"""The operator's feature options and the mixing-matrix starts of the authors' code.

- ``feature_power`` (``phi = ReLU(x) ** p``) and ``feature_eps`` on the torch backend against the dense
  float64 reference, outputs and all four gradients, over uneven layouts, dtypes, both normalisations
  and the RoPE variant; the reference itself against features computed here and fed through
  ``feature_map=None``. (The Triton kernels get the same ready features: ``triton_interpret_check.py``'s
  ``features-*`` cases.)
- ``mixing_init(kind=...)``: ``cos``, ``exp``, ``gaussian``, ``local`` against values worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_ops import TOL, make_inputs, make_mixing, rel_err

from mhla_diffusers import BlockLayout, MixingMatrix, mhla_attention, mhla_attention_reference, mixing_init
from mhla_diffusers.ops import naive
from mhla_diffusers.ops.mixing import MIXING_INITS

LAYOUTS = [((13,), (4,)), ((7, 9), (2, 3)), ((3, 6, 13), (2, 3, 4))]
LAYOUT_IDS = ["1d", "2d", "3d"]


def _rotation(n, d):
    """A fixed random rotation of interleaved channel pairs per token (a plain callable)."""
    angles = torch.rand(n, d // 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 6.0

    def rotate(x):
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    return rotate


def _term_scales(q, k, v, mixing, layout, grad_out, **features):
    """Per input, the larger of the quotient rule's two terms (see ``test_ops.quotient_term_scales``)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    num, den = naive.blockwise_parts(*leaves, layout, **features)
    g = grad_out.double()
    first = torch.autograd.grad(num / den.detach(), leaves, g, allow_unused=True, retain_graph=True)
    second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, leaves, g, allow_unused=True)
    return [max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item())
            for a, b in zip(first, second)]


def _errors(q, k, v, mixing, layout, *, normalize=True, **features):
    """Relative errors of the torch backend against the float64 dense reference: output, dq, dk, dv, dmixing."""
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64).to(q.dtype)
    fast = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
    out = mhla_attention(*fast, layout, backend="torch", normalize=normalize, **features)
    grads = torch.autograd.grad(out, fast, grad_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    ref = mhla_attention_reference(*ref_leaves, layout, normalize=normalize, **features)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    scale_features = {key: value for key, value in features.items() if key != "rotary"}
    scales = _term_scales(q, k, v, mixing, layout, grad_out, rotary=features.get("rotary"), **scale_features) \
        if normalize else [None] * 4
    assert out.dtype == q.dtype and all(torch.isfinite(g).all() for g in grads)
    errors = {"out": rel_err(out, ref)}
    for name, g, rg, sc in zip(("dq", "dk", "dv", "dmixing"), grads, ref_grads, scales):
        errors[name] = rel_err(g, rg, sc)
    return errors


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("power,feature_eps", [(2.0, 0.0), (0.5, 1e-3), (3.0, 1e-3)], ids=["p2", "p0.5-eps", "p3-eps"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_feature_power_matches_reference_fp64(grid, block_grid, power, feature_eps, normalize):
    torch.manual_seed(0)
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 2, layout.num_tokens, 8, dv=5, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    errors = _errors(q, k, v, mixing, layout, normalize=normalize, feature_power=power, feature_eps=feature_eps)
    assert max(errors.values()) < TOL[torch.float64], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_feature_power_dtypes(dtype):
    torch.manual_seed(1)
    layout = BlockLayout((3, 5, 7), (2, 2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 16, dtype=dtype)
    errors = _errors(q, k, v, make_mixing(layout, "rand", torch.float32), layout, feature_power=2.0, feature_eps=1e-3)
    # squared features double the relative rounding of 16-bit inputs: 2x the operator's tolerance keeps 10x over the
    # worst error seen (bf16 2.6e-3, fp16 and fp32 far lower)
    assert max(errors.values()) < 2 * TOL[dtype], errors


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_feature_power_with_rotary(normalize):
    """RoPE after phi (numerator only): the rotation sees ``ReLU(x) ** p + feature_eps``."""
    torch.manual_seed(2)
    layout = BlockLayout((3, 5, 7), (2, 2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    errors = _errors(q, k, v, make_mixing(layout, "rand", torch.float64), layout, normalize=normalize,
                     feature_power=2.0, feature_eps=1e-3, rotary=_rotation(layout.num_tokens, 8))
    assert max(errors.values()) < TOL[torch.float64], errors


def test_reference_power_is_relu_to_the_power():
    """The reference's ``feature_power`` against features computed here (``feature_map=None``); and it changes the result."""
    torch.manual_seed(3)
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    phi_q, phi_k = torch.relu(q) ** 2 + 1e-3, torch.relu(k) ** 2 + 1e-3
    want = mhla_attention_reference(phi_q, phi_k, v, mixing, layout, feature_map=None)
    got = mhla_attention_reference(q, k, v, mixing, layout, feature_power=2.0, feature_eps=1e-3)
    assert rel_err(got, want) < 1e-13
    blockwise = naive.mhla_attention_blockwise(q, k, v, mixing, layout, feature_power=2.0, feature_eps=1e-3)
    assert rel_err(blockwise, want) < 1e-12
    assert rel_err(mhla_attention_reference(q, k, v, mixing, layout, feature_eps=1e-3), want) > 1e-2


def test_feature_power_one_is_the_plain_path():
    """``feature_power=1.0`` takes the backend's own ReLU: the very same computation as leaving it out."""
    torch.manual_seed(4)
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8)
    mixing = make_mixing(layout, "rand")
    assert torch.equal(mhla_attention(q, k, v, mixing, layout, feature_power=1.0), mhla_attention(q, k, v, mixing, layout))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "2"], ids=repr)
def test_bad_feature_power_is_refused(bad):
    layout = BlockLayout((4,), (2,))
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="feature_power must be a finite number > 0"):
        mhla_attention(q, q, q, torch.ones(2, 2), layout, feature_power=bad)


def test_feature_power_needs_the_relu_feature_map():
    layout = BlockLayout((4,), (2,))
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match='needs feature_map="relu"'):
        mhla_attention(q, q, q, torch.ones(2, 2), layout, feature_map=None, feature_power=2.0)
    with pytest.raises(ValueError, match='needs feature_map="relu"'):
        mhla_attention_reference(q, q, q, torch.ones(2, 2), layout, feature_map=None, feature_power=2.0)


# ----------------------------------------------------------------------------------------------
# Mixing-matrix starts

# Three blocks in a row: centres 0.5, 1.5, 2.5, distances |i - j|, max 2.
D3 = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]], dtype=torch.float64)


def _rows(x):
    return x / x.sum(dim=1, keepdim=True)


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("locality", _rows(torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.5, 1.0]], dtype=torch.float64))),
        ("cos", _rows(torch.cos(D3 * math.pi / 8))),
        ("exp", _rows(torch.exp(-D3 / 3))),
        ("gaussian", torch.exp(-9 * D3**2 / 8)),  # sigma = 2 / 3
        ("local", _rows(torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64))),
        ("uniform", torch.ones(3, 3, dtype=torch.float64)),
    ],
)
def test_mixing_inits_by_hand(kind, expected):
    torch.testing.assert_close(mixing_init((3,), dtype=torch.float64, kind=kind), expected, rtol=0, atol=1e-12)


def test_local_init_reaches_the_diagonal_neighbours():
    """On a 3 x 3 block grid the centre block reads all 9 (diagonals at sqrt(2) <= 1.5), a corner block 4."""
    init = mixing_init((3, 3), dtype=torch.float64, kind="local")
    assert (init[4] > 0).sum() == 9 and (init[0] > 0).sum() == 4
    torch.testing.assert_close(init.sum(dim=1), torch.ones(9, dtype=torch.float64))
    assert torch.equal(mixing_init((3, 3), dtype=torch.float64, kind="local", local_radius=0.0) > 0, torch.eye(9, dtype=torch.bool))


@pytest.mark.parametrize("kind", MIXING_INITS)
def test_every_init_builds_a_matrix_on_video_grids(kind):
    matrix = MixingMatrix((2, 3, 4), init=kind)
    w = matrix.weight.detach()
    assert w.shape == (24, 24) and w.dtype == torch.float32 and torch.isfinite(w).all() and (w >= 0).all()
    if kind in ("gaussian", "uniform"):  # not normalised: the symmetric transform of the distances
        assert torch.equal(w, w.T) and w.max() == 1.0
    else:  # rows sum to 1
        torch.testing.assert_close(w.sum(dim=1), torch.ones(24))
    assert torch.equal(MixingMatrix((1, 1, 1), init=kind).weight.detach(), torch.ones(1, 1))


def test_unknown_init_lists_the_known_ones():
    with pytest.raises(ValueError, match="'locality', 'uniform', 'cos', 'exp', 'gaussian', 'local'"):
        MixingMatrix((2, 2), init="linear")
    with pytest.raises(ValueError, match="exp_scale must be > 0"):
        mixing_init((2, 2), kind="exp", exp_scale=0.0)


# ----------------------------------------------------------------------------------------------
# The authors' DiT normaliser (denominator="authors_dit", ops/positional.py)

EQUAL_LAYOUTS = [((12,), (3,)), ((8, 8), (2, 2)), ((4, 6, 8), (2, 3, 4))]


def _authors_dit_errors(q, k, v, mixing, layout, **kw):
    """Torch backend against the dense oracle (output and gradients); gradient errors against the larger quotient-rule
    term of the oracle's ``num / den`` (as ``_term_scales``)."""
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64).to(q.dtype)
    fast = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
    out = mhla_attention(*fast, layout, backend="torch", denominator="authors_dit", **kw)
    grads = torch.autograd.grad(out, fast, grad_out)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
    features = {key: value for key, value in kw.items() if key in ("feature_eps", "feature_power")}
    num = mhla_attention_reference(*leaves, layout, normalize=False, rotary=kw.get("rotary"), **features)
    den = naive.positional_denominator_reference(leaves[0], leaves[1], leaves[3], layout, **features) + 1e-6
    g = grad_out.double()
    ref_grads = torch.autograd.grad(num / den, leaves, g, retain_graph=True)
    first = torch.autograd.grad(num / den.detach(), leaves, g, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, leaves, g, allow_unused=True)
    errors = {"out": rel_err(out, (num / den).detach())}
    for name, grad, ref, a, b in zip(("dq", "dk", "dv", "dmixing"), grads, ref_grads, first, second):
        scale = max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item())
        errors[name] = rel_err(grad, ref, scale)
    return errors


@pytest.mark.parametrize("grid,block_grid", EQUAL_LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_authors_dit_denominator_matches_its_oracle(grid, block_grid, dtype):
    torch.manual_seed(5)
    layout = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(2, 2, layout.num_tokens, 8, dv=5, dtype=dtype)
    errors = _authors_dit_errors(q, k, v, make_mixing(layout, "rand", dtype), layout, feature_eps=1e-6)
    assert max(errors.values()) < TOL[dtype], errors


def test_authors_dit_denominator_with_power_and_rotary():
    torch.manual_seed(6)
    layout = BlockLayout((4, 6, 8), (2, 3, 4))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    errors = _authors_dit_errors(q, k, v, make_mixing(layout, "rand", torch.float64), layout, feature_power=2.0,
                                 feature_eps=1e-3, rotary=_rotation(layout.num_tokens, 8))
    assert max(errors.values()) < TOL[torch.float64], errors


def test_authors_dit_denominator_is_the_papers_where_they_agree():
    """One block, or the identity mixing: every query meets only its own block, both normalisers are ``phi(q_i) . z_b``.
    A random mixing matrix: they differ (the test can fail)."""
    torch.manual_seed(7)
    for grid, block_grid, kind in (((8, 8), (1, 1), "rand"), ((8, 8), (2, 2), "identity")):
        layout = BlockLayout(grid, block_grid)
        q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
        mixing = make_mixing(layout, kind, torch.float64)
        ours = mhla_attention(q, k, v, mixing, layout, denominator="authors_dit")
        assert rel_err(ours, mhla_attention(q, k, v, mixing, layout)) < 1e-12
    mixing = make_mixing(layout, "rand", torch.float64)
    ours = mhla_attention(q, k, v, mixing, layout, denominator="authors_dit")
    assert rel_err(ours, mhla_attention(q, k, v, mixing, layout)) > 1e-2


def test_authors_dit_denominator_by_hand():
    """Two blocks of two tokens (1 x 4 grid), d = 1, no ReLU: den[b, l] = sum_j Mc[b, j] q[j, l] z_j, worked out here."""
    layout = BlockLayout((4,), (2,))
    q = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 4, 1)
    k = torch.tensor([0.5, 1.5, 2.0, 1.0], dtype=torch.float64).view(1, 1, 4, 1)
    mixing = torch.tensor([[0.7, 0.3], [0.2, 0.8]], dtype=torch.float64)
    z = [2.0, 3.0]  # key sums of the blocks
    want = [0.7 * 1 * z[0] + 0.3 * 3 * z[1], 0.7 * 2 * z[0] + 0.3 * 4 * z[1],
            0.2 * 1 * z[0] + 0.8 * 3 * z[1], 0.2 * 2 * z[0] + 0.8 * 4 * z[1]]
    got = naive.positional_denominator_reference(q, k, mixing, layout, feature_map=None).flatten().tolist()
    assert got == pytest.approx(want, rel=1e-14)
    from mhla_diffusers.ops.positional import positional_denominator

    assert positional_denominator(q, k, mixing, layout).flatten().tolist() == pytest.approx(want, rel=1e-14)


def test_authors_dit_denominator_errors():
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="needs blocks of equal size"):
        mhla_attention(q, q, q, torch.ones(2, 2), BlockLayout((5,), (2,)), denominator="authors_dit")
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="it needs normalize=True"):
        mhla_attention(q, q, q, torch.ones(2, 2), BlockLayout((4,), (2,)), denominator="authors_dit", normalize=False)
    with pytest.raises(ValueError, match="denominator must be one of 'paper', 'authors_dit'"):
        mhla_attention(q, q, q, torch.ones(2, 2), BlockLayout((4,), (2,)), denominator="positional")


def test_non_tensor_inputs_are_a_type_error():
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(TypeError, match="mixing must be a torch.Tensor; got list"):
        mhla_attention(q, q, q, [[1.0, 1.0], [1.0, 1.0]], BlockLayout((4,), (2,)))


# ----------------------------------------------------------------------------------------------
# Overflowing features (issue 32, item 6): an error naming feature_power, not NaN / inf without a word

def _unit_inputs(layout, peak=None, dtype=torch.float32, seed=11):
    """Unit-scale q, k, v ``[1, 2, N, 8]``; ``peak``: channel 0 of query 5 and key 9 set to it (a unit-scale draw's tail)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, layout.num_tokens, 8, generator=gen, dtype=dtype) for _ in range(3))
    if peak is not None:
        q[0, 0, 5, 0] = k[0, 0, 9, 0] = peak
    return q, k, v


@pytest.mark.parametrize("peak", [4.0, 6.0], ids=["products-overflow", "features-overflow"])
@pytest.mark.parametrize("denominator, normalize", [("paper", True), ("paper", False), ("authors_dit", True)])
def test_overflowing_features_are_refused_naming_feature_power(denominator, normalize, peak):
    """ReLU(x) ** 50 at unit-scale fp32 inputs: 4 ** 50 = 1.3e30 (its products overflow float32), 6 ** 50 = 8e38 (the
    feature itself does): the output was NaN / inf without a word."""
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = _unit_inputs(layout, peak)
    mixing = make_mixing(layout, "rand", torch.float32)
    kw = dict(normalize=normalize, denominator=denominator)
    with pytest.raises(ValueError, match=r"feature_power=50.0 .*float32.*lower feature_power") as info:
        mhla_attention(q, k, v, mixing, layout, feature_power=50.0, **kw)
    assert "\n" not in str(info.value)
    # float64 inputs (accumulated in float64) hold these features, and a modest power holds in float32
    assert torch.isfinite(mhla_attention(q.double(), k.double(), v.double(), mixing.double(), layout, feature_power=50.0, **kw)).all()
    assert torch.isfinite(mhla_attention(q, k, v, mixing, layout, feature_power=3.0, **kw)).all()


def test_non_finite_inputs_are_not_blamed_on_feature_power():
    """NaN in v (not the feature map's doing): the output is NaN as with feature_power=1, no error."""
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = _unit_inputs(layout)
    v[0, 0, 3, 0] = float("nan")
    mixing = make_mixing(layout, "rand", torch.float32)
    plain = mhla_attention(q, k, v, mixing, layout)
    powered = mhla_attention(q, k, v, mixing, layout, feature_power=2.0)
    assert torch.equal(torch.isnan(plain), torch.isnan(powered)) and torch.isnan(powered).any()


def test_the_overflow_check_is_skipped_under_compile():
    """Traced (no graph break for the check): the compiled call returns what the arithmetic gives."""
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = _unit_inputs(layout, 4.0)
    mixing = make_mixing(layout, "rand", torch.float32)

    def f(q, k, v, mixing):
        return mhla_attention(q, k, v, mixing, layout, feature_power=50.0)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v, mixing)
    assert not torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------
# denominator="authors_dit" under torch.compile (issue 32, item 6): one graph, no break, eager's numbers

@pytest.mark.parametrize("build_layout_inside", [False, True], ids=["layout-outside", "layout-inside"])
def test_authors_dit_denominator_compiles_without_a_graph_break(build_layout_inside):
    from torch import _dynamo as dynamo

    torch.manual_seed(12)
    grid, block_grid = (4, 6), (2, 3)
    outside = BlockLayout(grid, block_grid)
    q, k, v = make_inputs(1, 2, outside.num_tokens, 8, dtype=torch.float32)
    mixing = make_mixing(outside, "rand", torch.float32)

    def f(q, k, v, mixing):
        layout = BlockLayout(grid, block_grid) if build_layout_inside else outside
        return mhla_attention(q, k, v, mixing, layout, denominator="authors_dit", feature_eps=1e-6) * 2.0

    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v, mixing)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    g = torch.randn(*q.shape[:3], 8)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
        out = fn(*leaves)
        results.append((out, torch.autograd.grad(out, leaves, g)))
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_unequal_blocks_are_refused_from_the_layout_sizes_under_compile_too():
    """The refusal is the eager one under compile (a raise in traced code: dynamo hands the frame back to eager)."""
    q = torch.randn(1, 1, 5, 4)
    layout = BlockLayout((5,), (2,))
    torch._dynamo.reset()
    f = torch.compile(lambda q: mhla_attention(q, q, q, torch.ones(2, 2), layout, denominator="authors_dit"), backend="eager")
    with pytest.raises(ValueError, match=r"needs blocks of equal size; BlockLayout\(grid=\(1, 1, 5\).* blocks of 2 to 3 tokens"):
        f(q)
