"""Run the Triton MHLA kernels in Triton's CPU interpreter over a grid of cases; report errors as JSON.

``tests/ops/test_triton.py`` runs this script in a subprocess with ``TRITON_INTERPRET=1`` (the variable
must be set before the kernels are defined, so it cannot share a process with the rest of the
suite) and asserts on what it prints. Runnable by hand::

    TRITON_INTERPRET=1 python tests/ops/triton_interpret_check.py [--only NAME_SUBSTRING] [--json out.json]

Each case runs ``mhla_attention(..., backend="triton")`` forward and backward (a random output
gradient) and compares the output and the gradients (dq, dk, dv, dmixing) with
- the float64 dense reference ``mhla_attention_reference`` (or, for N = 4096, an O(N d^2) float64
  loop over blocks, ``mhla_diffusers/ops/naive.py``), fed the same rounded inputs, and
- the torch backend on the same inputs,
by relative error: ``max |x - ref| / max(max |ref|, scale)`` with, when the normaliser is on, the
scale of the two terms of the quotient rule (as in tests/ops/test_ops.py: where ``dnum/den`` and
``num dden/den^2`` cancel, e.g. dmixing for M = 1, any evaluation errs by ulps of the terms).

The case grid covers CASES C01 (fp16 and fp32, N = 4096, values ~30), C02 (fp16 and fp32), C04 and
C07 (uneven 1D/2D/3D layouts, one token, N below a tile, a partial last block), C06 (head dims 32,
64, 72, 128), normalize on/off, feature_map on/off, non-contiguous inputs and output gradients,
forced splits and multi-tile blocks, partial ``requires_grad``, eps, mixed dtypes, the RoPE
variant, an empty batch and batch invariance. fp16 runs too (the interpreter computes fp16 dots
and casts correctly; only bf16 arithmetic is wrong there, so bf16 is left to the GPU check).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# name -> dtype name; the module is importable without torch / triton for the case list.
TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3}

GRIDS = [  # (grid, block_grid): tests/ops/test_ops.py's list (C04, C07)
    ((5,), (3,)),
    ((13,), (4,)),
    ((12,), (3,)),
    ((1, 1), (1, 1)),
    ((1, 9), (1, 4)),
    ((9, 1), (4, 1)),
    ((7, 9), (2, 3)),
    ((7, 9), (1, 1)),
    ((7, 9), (7, 9)),
    ((8, 8), (2, 2)),
    ((3, 5, 7), (2, 2, 3)),
    ((3, 6, 13), (2, 3, 4)),
    ((4, 6, 1), (3, 2, 1)),
]


def _case(name, **kw):
    base = dict(
        name=name, grid=(7, 9), block_grid=(2, 3), batch=1, heads=2, d=16, dv=None, dtype="float32", kv_dtype=None,
        mix_dtype=None, normalize=True, feature_map=True, mixing="rand", memory="contiguous", eps=1e-6, inputs="randn",
        requires="qkvm", split=None, block_t=None, rotary=False, oracle="dense", feature_eps=0.0, feature_power=1.0,
    )
    unknown = set(kw) - set(base)
    assert not unknown, unknown
    base.update(kw)
    base["dv"] = base["d"] if base["dv"] is None else base["dv"]
    return base


def cases() -> list[dict]:
    """The case grid (names are unique; tests/ops/test_triton.py parametrises over them)."""
    out = []
    # C04 / C07: every layout of test_ops, float64, d = 8 and d_v = 5 (tiles padded on both axes),
    # normalize on and off, the feature map alternating.
    for i, (grid, block_grid) in enumerate(GRIDS):
        gname = f"{'x'.join(map(str, grid))}-{'x'.join(map(str, block_grid))}"
        for normalize in (True, False):
            fm = (i + normalize) % 2 == 0
            inputs = "shifted" if (normalize and not fm) else "randn"
            batch = 2 if math.prod(block_grid) <= 16 else 1  # ~1 ms per op per program in the interpreter
            out.append(_case(f"grid-{gname}-{'norm' if normalize else 'nonorm'}-{'relu' if fm else 'nofm'}-fp64", grid=grid,
                             block_grid=block_grid, batch=batch, d=8, dv=5, dtype="float64", normalize=normalize, feature_map=fm,
                             inputs=inputs))
    # C06: head dims, fp32 (and fp64 for 72, 128); DiT's 72 also without the feature map and with normalize off.
    for d in (32, 64, 72, 128):
        out.append(_case(f"headdim-{d}-fp32", d=d))
    for d in (72, 128):
        out.append(_case(f"headdim-{d}-fp64", d=d, dtype="float64", grid=(3, 5, 7), block_grid=(2, 2, 3)))
    out.append(_case("headdim-72-nofm-norm-fp32", d=72, feature_map=False, inputs="shifted"))
    out.append(_case("headdim-72-nofm-nonorm-fp32", d=72, feature_map=False, normalize=False))
    out.append(_case("headdim-128-nonorm-fp32", d=128, normalize=False, grid=(3, 5, 7), block_grid=(2, 2, 3)))
    # feature_map off on an uneven 3D layout, both dtypes, both normalisations.
    for dtype in ("float32", "float64"):
        for normalize in (True, False):
            out.append(_case(f"nofm-3d-{'norm' if normalize else 'nonorm'}-{dtype}", grid=(3, 6, 13), block_grid=(2, 3, 4),
                             dtype=dtype, feature_map=False, normalize=normalize, inputs="shifted" if normalize else "randn"))
    # diffusers' memory layout: [B, N, H, d] viewed as [B, H, N, d]; output gradient in that layout too.
    for dtype in ("float32", "float64"):
        out.append(_case(f"noncontiguous-{dtype}", batch=2, heads=3, memory="bnhd", dtype=dtype))
    out.append(_case("noncontiguous-strided-slice-fp32", memory="slice"))
    # C07: a single token, N smaller than a tile, a partial last block (fp64 and fp32, |q|, |k|).
    for grid, block_grid in (((1, 1), (1, 1)), ((2,), (2,)), ((3,), (2,)), ((2, 3), (2, 2))):
        for dtype in ("float64", "float32"):
            gname = f"{'x'.join(map(str, grid))}-{'x'.join(map(str, block_grid))}"
            out.append(_case(f"tiny-{gname}-{dtype}", grid=grid, block_grid=block_grid, d=8, dtype=dtype, inputs="abs"))
    # Several tiles per block and several splits per block (the GPU's partial-summary path).
    out.append(_case("splits-and-tiles-fp64", grid=(9, 13), block_grid=(2, 2), dtype="float64", split=16))
    out.append(_case("splits-and-tiles-nonorm-fp32", grid=(9, 13), block_grid=(2, 2), normalize=False, split=16))
    out.append(_case("splits-and-mixing-tiles-fp64", grid=(9, 13), block_grid=(5, 4), dtype="float64", split=16))
    # Splits of two token tiles (blocks of 24-35 tokens, splits of 32, tiles of 16): programs that walk several
    # tiles from a split's start, a partial last tile, and splits past a shorter block's end that return at once.
    out.append(_case("splits-of-two-tiles-fp64", grid=(9, 13), block_grid=(2, 2), dtype="float64", split=32, block_t=16))
    # Mixing matrices of the degenerate identities.
    for kind in ("identity", "ones", "locality"):
        out.append(_case(f"mixing-{kind}-fp64", dtype="float64", mixing=kind, grid=(3, 5, 7), block_grid=(2, 2, 3)))
    # eps
    out.append(_case("eps-0-fp64", dtype="float64", eps=0.0, inputs="abs"))
    out.append(_case("eps-10-fp64", dtype="float64", eps=10.0, inputs="abs"))
    # Partial requires_grad (kernel branches that skip dq, dk or dv).
    out.append(_case("grad-q-only-fp32", requires="q"))
    out.append(_case("grad-v-and-mixing-fp32", requires="vm"))
    out.append(_case("grad-k-only-nonorm-fp32", requires="k", normalize=False))
    # Mixed dtypes (C08): fp16 keys/values with fp32 queries, fp32 keys/values with fp64 queries.
    out.append(_case("mixed-q32-kv16-fp32", kv_dtype="float16"))
    out.append(_case("mixed-q64-kv32-mix16", dtype="float64", kv_dtype="float32", mix_dtype="float16"))
    # fp16 (the interpreter runs fp16 dots): an uneven layout, d = 72.
    out.append(_case("fp16-72", d=72, dtype="float16", grid=(3, 5, 7), block_grid=(2, 2, 3)))
    # C02: fp16 and fp32, 8x8 grid, 2x2 blocks, Mc = identity, query 0 and all keys of block 0 negative.
    out.append(_case("c02-fp16", grid=(8, 8), block_grid=(2, 2), batch=2, d=32, dtype="float16", mixing="identity", inputs="c02"))
    out.append(_case("c02-fp32", grid=(8, 8), block_grid=(2, 2), batch=2, d=32, mixing="identity", inputs="c02"))
    # C01: fp16 and fp32, N(0, 30^2), one block, N = 4096 (normaliser sums far past 65504).
    for dtype in ("float16", "float32"):
        out.append(_case(f"c01-{dtype}", grid=(64, 64), block_grid=(1, 1), d=32, dtype=dtype, mixing="ones", inputs="c01",
                         oracle="blockwise"))
    # The RoPE variant composed from a plain callable (a numerator and a denominator call of the kernels).
    for normalize in (True, False):
        out.append(_case(f"rotary-{'norm' if normalize else 'nonorm'}-fp64", dtype="float64", rotary="callable",
                         normalize=normalize, grid=(3, 5, 7), block_grid=(2, 2, 3)))
    # The RoPE variant fused into the kernels (an InterleavedRotary, Wan's): both normalisations and
    # feature maps, head dims 72 (pairs in a padded tile) and 128, diffusers' memory layout, splits
    # and several tiles per block, partial requires_grad, fp16.
    fused = dict(rotary="fused", grid=(3, 5, 7), block_grid=(2, 2, 3))
    for normalize in (True, False):
        out.append(_case(f"rotary-fused-{'norm' if normalize else 'nonorm'}-fp64", dtype="float64", normalize=normalize, **fused))
    out.append(_case("rotary-fused-nofm-norm-fp64", dtype="float64", feature_map=False, inputs="shifted", **fused))
    out.append(_case("rotary-fused-headdim-72-fp32", d=72, **fused))
    out.append(_case("rotary-fused-headdim-128-nonorm-fp32", d=128, normalize=False, **fused))
    out.append(_case("rotary-fused-noncontiguous-fp32", batch=2, heads=3, memory="bnhd", **fused))
    out.append(_case("rotary-fused-splits-fp64", dtype="float64", split=16, rotary="fused", grid=(9, 13), block_grid=(2, 2)))
    out.append(_case("rotary-fused-splits-of-two-tiles-fp64", dtype="float64", split=32, block_t=16, rotary="fused", grid=(9, 13),
                     block_grid=(2, 2)))
    out.append(_case("rotary-fused-grad-q-only-fp32", requires="q", **fused))
    out.append(_case("rotary-fused-grad-k-only-fp32", requires="k", **fused))
    out.append(_case("rotary-fused-grad-v-and-mixing-fp32", requires="vm", **fused))
    out.append(_case("rotary-fused-fp16-72", d=72, dtype="float16", **fused))
    # Features computed in front of the kernels: phi = ReLU(x) ** p + feature_eps (uneven 3D layout, RoPE fused).
    out.append(_case("features-power2-eps-fp64", dtype="float64", feature_power=2.0, feature_eps=1e-3, grid=(3, 5, 7),
                     block_grid=(2, 2, 3)))
    out.append(_case("features-power-half-nonorm-fp32", feature_power=0.5, normalize=False))
    out.append(_case("features-power2-rotary-fused-fp64", dtype="float64", feature_power=2.0, feature_eps=1e-3, **fused))
    names = [c["name"] for c in out]
    assert len(names) == len(set(names)), "duplicate case names"
    return out


# ----------------------------------------------------------------------------------------------
# Running (needs torch, triton and TRITON_INTERPRET=1)


def _rotation(n, d, torch, kind):
    """A random interleaved-pair rotation: a plain function (``"callable"``) or an InterleavedRotary (``"fused"``)."""
    gen = torch.Generator().manual_seed(1)
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()
    if kind == "fused":
        from mhla_diffusers.ops import InterleavedRotary

        return InterleavedRotary(cos, sin)

    def rotate(x):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        out = torch.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    return rotate


def _inputs(c, layout, torch):
    dt = getattr(torch, c["dtype"])
    kvdt = getattr(torch, c["kv_dtype"] or c["dtype"])
    mixdt = getattr(torch, c["mix_dtype"] or ("float64" if c["dtype"] == "float64" else "float32"))
    b, h, n, d, dv = c["batch"], c["heads"], layout.num_tokens, c["d"], c["dv"]

    def draw(width):
        x = torch.randn(b, h, n, width, dtype=torch.float64)
        if c["inputs"] == "abs":
            x = x.abs()
        elif c["inputs"] == "c01":
            x = x * 30
        return x

    q, k, v = draw(d), draw(d), draw(dv)
    if c["inputs"] == "shifted":  # some negative entries, denominators safely positive
        q, k = q * 0.5 + 0.5, k * 0.5 + 0.5
    if c["inputs"] == "c02":
        block0 = layout.block_index == 0
        q[:, :, 0] = -q[:, :, 0].abs() - 0.1
        k[:, :, block0] = -k[:, :, block0].abs() - 0.1
    q, k, v = q.to(dt), k.to(kvdt), v.to(kvdt)
    if c["memory"] == "bnhd":  # [B, N, H, w] storage viewed as [B, H, N, w]
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    elif c["memory"] == "slice":  # every other channel of a twice wider tensor (channel stride 2)
        q, k, v = (torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2] for x in (q, k, v))
    m = layout.num_blocks
    if c["mixing"] == "rand":
        mixing = torch.rand(m, m, dtype=torch.float64)
    elif c["mixing"] == "identity":
        mixing = torch.eye(m, dtype=torch.float64)
    elif c["mixing"] == "ones":
        mixing = torch.ones(m, m, dtype=torch.float64)
    else:
        from mhla_diffusers.ops.mixing import mixing_init

        mixing = mixing_init(layout, dtype=torch.float64)
    return q, k, v, mixing.to(mixdt)


def run_case(c, torch, ops, layout_cls):
    layout = layout_cls(c["grid"], c["block_grid"])
    q, k, v, mixing = _inputs(c, layout, torch)
    fm = "relu" if c["feature_map"] else None
    rotary = _rotation(layout.num_tokens, c["d"], torch, c["rotary"]) if c["rotary"] else None
    features = dict(feature_eps=c["feature_eps"], feature_power=c["feature_power"])
    kw = dict(normalize=c["normalize"], eps=c["eps"], feature_map=fm, rotary=rotary, **features)
    grad_out = torch.randn(*q.shape[:3], c["dv"], dtype=torch.float64).to(q.dtype)
    if c["memory"] == "bnhd":
        grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    flags = [name in c["requires"] for name in "qkvm"]

    def grads(fn, cast=None):
        leaves = [(t.detach().to(cast) if cast else t.detach()).requires_grad_(f) for t, f in zip((q, k, v, mixing), flags)]
        out = fn(*leaves)
        wanted = [t for t, f in zip(leaves, flags) if f]
        got = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True))
        return out.detach(), [next(got) if f else None for f in flags]

    t0 = time.time()
    calls = []  # kernel launches of the forward: a fused rotary runs fwd_summaries once, a composed one twice
    kernels = ops.get_backend("triton")
    original = kernels.forward
    kernels.forward = lambda *a, **k: calls.append(k.get("rotary")) or original(*a, **k)
    try:
        out, dgrads = grads(lambda q, k, v, m: ops.mhla_attention(q, k, v, m, layout, backend="triton", **kw))
    finally:
        del kernels.forward  # the class's method again
    seconds = time.time() - t0
    out_t, tgrads = grads(lambda q, k, v, m: ops.mhla_attention(q, k, v, m, layout, backend="torch", **kw))
    if c["oracle"] == "dense":
        out_r, rgrads = grads(lambda q, k, v, m: ops.mhla_attention_reference(q, k, v, m, layout, dtype=torch.float64, **kw),
                              cast=torch.float64)
    else:
        def blockwise(q, k, v, m):
            return ops.naive.mhla_attention_blockwise(q, k, v, m, layout, **kw)

        out_r, rgrads = grads(blockwise, cast=torch.float64)

    # Quotient-rule term scales (normalize on): see the module docstring.
    scales = [None] * 4
    if c["normalize"]:
        leaves = [t.detach().double().requires_grad_(f) for t, f in zip((q, k, v, mixing), flags)]
        num, den = ops.naive.blockwise_parts(*leaves, layout, eps=c["eps"], feature_map=fm, rotary=rotary, **features)
        wanted = [t for t, f in zip(leaves, flags) if f]
        g = grad_out.double()
        first = torch.autograd.grad(num / den.detach(), wanted, g, retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, wanted, g, allow_unused=True)
        it = iter(zip(first, second))
        for i, f in enumerate(flags):
            if f:
                a, b = next(it)
                scales[i] = max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item())

    names = ("dq", "dk", "dv", "dmixing")
    vs_ref = {"out": ops.naive.relative_error(out, out_r)}
    vs_torch = {"out": ops.naive.relative_error(out, out_t, None)}
    finite = {"out": bool(torch.isfinite(out).all())}
    dtypes_ok = out.dtype == q.dtype and tuple(out.shape) == (*q.shape[:3], c["dv"])
    for name, x, g, rg, tg, sc in zip(names, (q, k, v, mixing), dgrads, rgrads, tgrads, scales):
        if g is None:
            continue
        dtypes_ok &= g.dtype == x.dtype and g.shape == x.shape
        finite[name] = bool(torch.isfinite(g).all())
        vs_ref[name] = ops.naive.relative_error(g, rg, sc) if rg is not None else 0.0
        vs_torch[name] = ops.naive.relative_error(g, tg, sc)
    tols = [TOL[c["dtype"]], TOL[c["kv_dtype"] or c["dtype"]]]
    if c["mix_dtype"]:
        tols.append(TOL.get(c["mix_dtype"], 1e-5))
    result = dict(name=c["name"], seconds=round(seconds, 3), tol=max(tols), vs_reference=vs_ref, vs_torch=vs_torch,
                  finite=finite, dtypes_ok=bool(dtypes_ok))
    if c["rotary"]:  # the fused path is one backend call given the rotation; the composed one, 1 or 2 without it
        result["rotary_path_ok"] = (
            calls == [rotary] if c["rotary"] == "fused" else (len(calls) == 1 + c["normalize"] and not any(calls))
        )
    if c["memory"] == "bnhd":  # output and input gradients keep diffusers' memory layout
        result["layout_kept"] = bool(out.transpose(1, 2).is_contiguous() and all(
            g is None or g.transpose(1, 2).is_contiguous() for g in dgrads[:3]))
    if c["inputs"] == "c02":
        block0 = layout.block_index == 0
        result["c02"] = dict(
            token0_zero=bool((out[:, :, 0] == 0).all()),
            block0_zero=bool((out[:, :, block0] == 0).all()),
            dq0_zero=bool((dgrads[0][:, :, 0] == 0).all()),
            dk_block0_zero=bool((dgrads[1][:, :, block0] == 0).all()),
            dv_block0_zero=bool((dgrads[2][:, :, block0] == 0).all()),
            no_nan=not any(bool(torch.isnan(t).any()) for t in (out, *[g for g in dgrads if g is not None])),
        )
    return result


def _batch_invariance(torch, ops, layout_cls):
    """C03 for the kernels (see tests/ops/batch_check.py); the differences found, as text ('' when none)."""
    from batch_check import differences, mhla_runner

    from mhla_diffusers.ops import triton_ops

    found = []
    # one head, two blocks: few programs (each costs ~1 ms per op in the interpreter)
    for grid, block_grid, heads, d, dv, memory, split in (((5, 6), (1, 2), 1, 16, 16, "contiguous", None),
                                                         ((7, 6), (1, 2), 1, 8, 5, "bnhd", 16)):
        layout = layout_cls(grid, block_grid)
        n = layout.num_tokens
        sample = [torch.randn(1, heads, n, w) for w in (d, d, dv, dv)]
        saved = triton_ops._INTERPRET_SPLIT_TOKENS, triton_ops._INTERPRET_BLOCK_T, triton_ops._INTERPRET_MIX_BLOCKS
        if split:  # 2 splits and tiles per block of 21 tokens, mixing strips of 16 columns (3 per sample, the last partial)
            triton_ops._INTERPRET_SPLIT_TOKENS = triton_ops._INTERPRET_BLOCK_T = split
            triton_ops._INTERPRET_MIX_BLOCKS = (16, 16, 16)
        try:
            run = mhla_runner(ops.mhla_attention, torch.rand(layout.num_blocks, layout.num_blocks), layout, memory=memory,
                              backend="triton")
            found += [f"{grid}/{block_grid}: {line}" for line in differences(run, sample)]
        finally:
            triton_ops._INTERPRET_SPLIT_TOKENS, triton_ops._INTERPRET_BLOCK_T, triton_ops._INTERPRET_MIX_BLOCKS = saved
    return "; ".join(found)


def extra_checks(torch, ops, layout_cls):
    """Checks that are not comparisons: an empty batch, batch invariance (C03), inputs unchanged, determinism;
    torch.compile around the kernels (fused RoPE) and opcheck of the custom operator with the Triton backend."""
    res = {}
    layout = layout_cls((7, 9), (2, 3))
    mixing = torch.rand(6, 6)
    out = ops.mhla_attention(*(torch.randn(0, 2, 63, 8) for _ in range(3)), mixing, layout, backend="triton")
    res["empty_batch_shape_ok"] = tuple(out.shape) == (0, 2, 63, 8)
    sample = [torch.randn(1, 3, 63, 16) for _ in range(3)]
    # C03: a sample alone and at every position of batches of 1, 2, 3, 5: output, dq, dk, dv bitwise
    # (tests/ops/batch_check.py); once with the interpreter's large tiles, once with split blocks,
    # several tiles per block and several mixing strips per sample, uneven d_v and diffusers' layout.
    res["batch_invariant_bitwise"] = _batch_invariance(torch, ops, layout_cls) or True  # else: the differences
    copies = [t.clone() for t in sample]
    leaves = [t.clone().requires_grad_() for t in sample] + [mixing.clone().requires_grad_()]
    out1 = ops.mhla_attention(*leaves[:3], leaves[3], layout, backend="triton")
    g1 = torch.autograd.grad(out1, leaves, torch.ones_like(out1))
    out2 = ops.mhla_attention(*leaves[:3], leaves[3], layout, backend="triton")
    g2 = torch.autograd.grad(out2, leaves, torch.ones_like(out2))
    res["deterministic_bitwise"] = bool(torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2)))
    res["inputs_unchanged"] = all(torch.equal(a, b) for a, b in zip(sample, copies))
    # An expanded output gradient (stride 0 everywhere: out.sum().backward()) is read through its strides.
    grads = []
    for backend in ("triton", "torch"):
        leaves = [t.clone().double().requires_grad_() for t in sample] + [mixing.double().requires_grad_()]
        ops.mhla_attention(*leaves[:3], leaves[3], layout, backend=backend).sum().backward()
        grads.append([t.grad for t in leaves])
    res["expanded_grad_out_ok"] = all(bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12)) for a, b in zip(*grads))
    # torch.compile (fullgraph, aot_eager): the mhla_diffusers::attention operator around the kernels,
    # the fused RoPE included; outputs and gradients equal eager; opcheck of the operator with tables.
    import torch._dynamo

    from mhla_diffusers.ops import InterleavedRotary, compiled

    layout3 = layout_cls((3, 5, 7), (2, 2, 3))
    n3 = layout3.num_tokens
    angles = torch.rand(n3, 4, dtype=torch.float64) * 6.3
    rot = InterleavedRotary(angles.cos(), angles.sin())
    inputs = [torch.randn(2, n3, 3, 8).transpose(1, 2) for _ in range(3)] + [torch.rand(12, 12)]
    g = torch.randn(2, 3, n3, 8)

    def f(q, k, v, m):
        return ops.mhla_attention(q, k, v, m, layout3, backend="triton", rotary=rot)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, g)])
    res["compiled_fused_rotary_matches_eager"] = all(
        bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6)) for a, b in zip(*results))
    torch._dynamo.reset()
    leaves = [t.clone().double().requires_grad_() for t in inputs]
    cos, sin = rot.tables(torch.device("cpu"), torch.float64)
    try:
        torch.library.opcheck(compiled._attention_op, (*leaves, list(layout3.grid), list(layout3.block_grid), True, 1e-6,
                                                       True, "triton", cos, sin))
        res["opcheck_triton_with_rotary_tables"] = True
    except Exception as exc:  # reported as a failed check
        res["opcheck_triton_with_rotary_tables"] = f"{type(exc).__name__}: {exc}"[:500]
    # The triton entry point refuses nothing here and goes through the kernels (no torch fallback).
    from mhla_diffusers.ops import triton_ops

    res["fallback_none_for_d128"] = triton_ops.torch_fallback_reason(torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 1, 128)) is None
    res["fallback_for_d256"] = triton_ops.torch_fallback_reason(torch.zeros(1, 1, 1, 256), torch.zeros(1, 1, 1, 8)) is not None
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    p.add_argument("--json", default=None, help="write the results here (else: stdout)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 (before Python starts) to run this check")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    torch.set_num_threads(1)
    import mhla_diffusers  # noqa: F401
    from mhla_diffusers import ops
    from mhla_diffusers.ops.layout import BlockLayout

    kernels_imported_by_package = any(m in sys.modules for m in ("mhla_diffusers.ops.triton_ops", "mhla_diffusers.ops.triton_kernels"))
    from mhla_diffusers.ops import triton_ops

    results, t_start = [], time.time()
    for i, c in enumerate(cases()):
        if a.only and a.only not in c["name"]:
            continue
        torch.manual_seed(1000 + i)
        saved = triton_ops._INTERPRET_SPLIT_TOKENS, triton_ops._INTERPRET_BLOCK_T, triton_ops._INTERPRET_MIX_BLOCKS
        if c["split"]:  # small tiles: several tiles and splits per block, mixing GEMM in 16 x 16 x 64 tiles
            triton_ops._INTERPRET_SPLIT_TOKENS, triton_ops._INTERPRET_BLOCK_T = c["split"], c["block_t"] or c["split"]
            triton_ops._INTERPRET_MIX_BLOCKS = (16, 16, 64)
        try:
            results.append(run_case(c, torch, ops, BlockLayout))
        except Exception as exc:  # reported per case
            import traceback

            results.append(dict(name=c["name"], error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]))
        finally:
            triton_ops._INTERPRET_SPLIT_TOKENS, triton_ops._INTERPRET_BLOCK_T, triton_ops._INTERPRET_MIX_BLOCKS = saved
    torch.manual_seed(0)
    extra = {} if a.only else extra_checks(torch, ops, BlockLayout)
    extra["package_import_leaves_kernels_unimported"] = not kernels_imported_by_package
    report = dict(cases=results, extra=extra, seconds=round(time.time() - t_start, 1))
    text = json.dumps(report, indent=1)
    if a.json:
        Path(a.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
