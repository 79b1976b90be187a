#!/usr/bin/env python
"""One-command GPU check of the Triton MHLA backend: correctness in bf16/fp16, speed, bandwidth.

Run on an H100/H200 from the repository root (needs only torch and triton: diffusers is NOT
imported, the script loads mhla_diffusers.ops / layout / mixing without the package's __init__)::

    python benchmarks/gpu_check.py --out gpu_check_out            # full run, ~2-4 minutes
    python benchmarks/gpu_check.py --quick --out gpu_check_out    # fewer shapes and repetitions

What it does (each case in its own try/except: an error is printed, recorded, and the run goes on):

1. Correctness: ``mhla_attention(..., backend="triton")`` in bf16, fp16 and fp32 against the
   float64 reference (the dense ``mhla_attention_reference`` up to N = 4096, an O(N d^2) loop over
   blocks beyond), outputs AND gradients (dq, dk, dv, dmixing), by relative error
   ``max |x - ref| / max(max |ref|, quotient-rule term scale)`` (as in tests/ops/test_ops.py), and
   against the torch backend on the same inputs. Uneven layouts, head dims 32/72/128,
   non-contiguous inputs, normalize and feature_map off, CASES C01 (fp16, N(0, 30^2), M = 1),
   Wan's RoPE variant fused into the kernels (an ``InterleavedRotary``; random angles), and that
   variant under ``torch.compile`` (inductor, fullgraph: the ``mhla_diffusers::attention`` operator).
2. Timing (CUDA events, median of repetitions after warm-up; first call = compile reported apart):
   forward (no grad) and forward + backward of
       triton      mhla_attention(..., backend="triton")
       torch       mhla_attention(..., backend="torch")
       sdpa        F.scaled_dot_product_attention (FlashAttention on H100/H200 for bf16)
       linear      plain ReLU linear attention, M = 1, through the Triton kernels
       triton-rope MHLA with Wan's RoPE fused into the Triton kernels (Wan shapes only)
       triton-rope-composed  the same rotation given as a plain function: two kernel calls (numerator,
                   denominator) around a torch rotation, what fusing saves (Wan shapes only)
       torch-rope  the same through the torch backend (rotation composed; Wan shapes only)
   at the SANA (B=2, H=36, N=4096 = 64x64, d=32), DiT-XL (B=2, H=16, N=1024 and 4096, d=72) and Wan
   2.1 (B=2, H=12, N=32,760 = 21x30x52, d=128, block grids (3,5,7): M=105 and (3,5,10): M=150) shapes.
3. Bandwidth: compulsory bytes of the forward = read q, k, v + write the output (input dtype);
   achieved = bytes / time; roofline time = bytes / peak HBM bandwidth (``--hbm-tbps``, H200: 4.8).
   The issue's targets are checked and reported: forward within 1.5x of the roofline at the Wan
   shapes; forward + backward at least 2x faster than the torch backend.

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``.

``--device cpu --interpret`` is a smoke mode for machines without a GPU (the test suite runs it):
TRITON_INTERPRET=1, tiny shapes, fp32/fp16 only (the interpreter's bf16 arithmetic is wrong),
one repetition; every code path runs, the numbers mean nothing.
"""

from __future__ import annotations

import sys

if "--interpret" in sys.argv[1:]:  # must precede the first import of triton (kernels are defined then)
    import os as _os

    _os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime as _dt
import json
import math
import platform
import statistics
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_library():
    """Import mhla_diffusers.ops / layout / mixing without running mhla_diffusers/__init__.py,
    which imports diffusers (absent on the GPU machine). Returns (ops, BlockLayout, choose_block_grid, mixing_init)."""
    if "mhla_diffusers" not in sys.modules:
        pkg = types.ModuleType("mhla_diffusers")
        pkg.__path__ = [str(ROOT / "mhla_diffusers")]
        pkg.__file__ = str(ROOT / "mhla_diffusers" / "__init__.py")
        sys.modules["mhla_diffusers"] = pkg
    from mhla_diffusers import ops
    from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid
    from mhla_diffusers.ops.mixing import mixing_init

    return ops, BlockLayout, choose_block_grid, mixing_init


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ops, BlockLayout, choose_block_grid, mixing_init = _import_library()

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5, torch.float64: 1e-10}

# name -> (batch, heads, token grid, head dim, block grid or None = choose_block_grid's default)
SHAPES = {
    "sana-4096": (2, 36, (64, 64), 32, None),
    "dit-1024": (2, 16, (32, 32), 72, None),
    "dit-4096": (2, 16, (64, 64), 72, None),
    "wan-M105": (2, 12, (21, 30, 52), 128, (3, 5, 7)),
    "wan-M150": (2, 12, (21, 30, 52), 128, (3, 5, 10)),
}
QUICK_SHAPES = ("sana-4096", "dit-1024", "wan-M105")
# --interpret: the same families at toy sizes
TINY_SHAPES = {
    "sana-tiny": (1, 2, (8, 8), 32, (2, 2)),
    "dit-tiny": (1, 2, (7, 9), 72, (2, 3)),
    "wan-tiny": (1, 2, (3, 5, 7), 128, (2, 2, 3)),
}
METHODS = ("triton", "torch", "sdpa", "linear", "triton-rope", "triton-rope-composed", "torch-rope")
ROPE_METHODS = ("triton-rope", "triton-rope-composed", "torch-rope")  # timed at the Wan shapes only


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--quick", action="store_true", help=f"shapes {list(QUICK_SHAPES)}, fewer correctness cases and repetitions")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--interpret", action="store_true", help="with --device cpu: Triton interpreter smoke mode (tiny shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of the timing runs")
    p.add_argument("--shapes", nargs="+", default=None, help=f"timing shapes (default: all of {list(SHAPES)})")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; --quick 8; --interpret 1)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth in TB/s (H200: 4.8, H100 SXM: 3.35)")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.interpret:
        p.error("--device cpu needs --interpret (the Triton kernels run on CPU tensors only in the interpreter)")
    if a.interpret and a.device != "cpu":
        p.error("--interpret needs --device cpu")
    if a.reps is None:
        a.reps = 1 if a.interpret else 8 if a.quick else 20
    return a


# ----------------------------------------------------------------------------------------------
# Correctness


def _random_rotary(n, d, gen, device):
    """An InterleavedRotary with random angles (tables float32 [n, d / 2] on ``device``)."""
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return ops.InterleavedRotary(angles.cos().float().to(device), angles.sin().float().to(device))


def correctness_cases(interpret: bool, quick: bool):
    """(name, batch, heads, grid, block_grid, d, dtype, options) of the correctness grid."""
    low = [torch.float32, torch.float16] if interpret else [torch.bfloat16, torch.float16]
    cases = []
    if interpret:
        for dt in low:
            cases += [
                ("uneven-2d-d72-noncontig", 1, 2, (7, 9), (2, 3), 72, dt, dict(memory="bnhd")),
                ("uneven-3d-d128", 1, 2, (3, 5, 7), (2, 2, 3), 128, dt, {}),
                ("d32-nonorm-nofm", 1, 2, (8, 8), (2, 2), 32, dt, dict(normalize=False, feature_map=False)),
                ("rope-3d-d128", 1, 2, (3, 5, 7), (2, 2, 3), 128, dt, dict(rotary=True, memory="bnhd")),
            ]
        cases.append(("rope-compiled-d32", 1, 2, (3, 5, 7), (2, 2, 3), 32, torch.float32, dict(rotary=True, compile=True)))
        cases.append(("c01-M1-scale30", 1, 2, (16, 16), (1, 1), 32, torch.float16, dict(scale=30.0, mixing="ones")))
        return cases
    for dt in low:
        cases += [
            ("sana-64x64-d32", 1, 4, (64, 64), None, 32, dt, {}),
            ("dit-32x32-d72-noncontig", 2, 2, (32, 32), (4, 4), 72, dt, dict(memory="bnhd")),
            ("uneven-45x23-d72", 1, 2, (45, 23), (3, 4), 72, dt, {}),
            ("wan-21x30x52-M105-d128", 1, 2, (21, 30, 52), (3, 5, 7), 128, dt, dict(memory="bnhd")),
            ("wan-nonorm-nofm-d128", 1, 2, (21, 30, 52), (3, 5, 10), 128, dt, dict(normalize=False, feature_map=False)),
            ("wan-rope-M105-d128", 1, 2, (21, 30, 52), (3, 5, 7), 128, dt, dict(rotary=True, memory="bnhd")),
            ("wan-rope-nonorm-M150-d128", 1, 2, (21, 30, 52), (3, 5, 10), 128, dt, dict(rotary=True, normalize=False)),
            ("wan-rope-compiled-M105-d128", 1, 2, (21, 30, 52), (3, 5, 7), 128, dt,
             dict(rotary=True, memory="bnhd", compile=True)),
            ("tiny-uneven-7x9-d64", 2, 2, (7, 9), (2, 3), 64, dt, {}),
            ("one-token", 1, 2, (1, 1), (1, 1), 32, dt, dict(absolute=True)),
        ]
    cases += [
        ("c01-M1-scale30-fp16", 1, 4, (64, 64), (1, 1), 32, torch.float16, dict(scale=30.0, mixing="ones")),
        ("fp32-uneven-3d-d128", 1, 2, (5, 12, 21), (2, 3, 5), 128, torch.float32, {}),
        ("fp32-dit-d72", 1, 2, (32, 32), (4, 4), 72, torch.float32, {}),
    ]
    if quick:
        keep = ("sana-64x64-d32", "dit-32x32-d72-noncontig", "wan-21x30x52-M105-d128", "wan-rope-M105-d128",
                "wan-rope-compiled-M105-d128", "c01-M1-scale30-fp16", "fp32-dit-d72")
        cases = [c for c in cases if c[0] in keep]
    return cases


def check_correctness(name, batch, heads, grid, block_grid, d, dtype, opts, device):
    layout = BlockLayout(grid, block_grid or choose_block_grid(grid))
    n, m = layout.num_tokens, layout.num_blocks
    normalize, feature_map = opts.get("normalize", True), opts.get("feature_map", True)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def draw(width):
        x = torch.randn(batch, heads, n, width, generator=gen, dtype=torch.float64) * opts.get("scale", 1.0)
        if opts.get("absolute") or (normalize and not feature_map):
            x = x.abs()
        x = x.to(device=device, dtype=dtype)
        if opts.get("memory") == "bnhd":  # diffusers: [B, N, H, d] viewed as [B, H, N, d]
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x

    q, k, v = draw(d), draw(d), draw(d)
    if opts.get("mixing") == "ones":
        mixing = torch.ones(m, m, device=device)
    else:
        mixing = (mixing_init(layout) * 0.5 + 0.5 * torch.rand(m, m, generator=gen)).to(device)
    grad_out = torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    fm = "relu" if feature_map else None
    rotary = _random_rotary(n, d, gen, device) if opts.get("rotary") else None
    kw = dict(normalize=normalize, eps=1e-6, feature_map=fm, rotary=rotary)

    def run(fn, cast=None):
        leaves = [(t.detach().to(cast) if cast else t.detach()).requires_grad_(True) for t in (q, k, v, mixing)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        return out.detach(), grads

    def triton_call(*a):
        return ops.mhla_attention(*a, layout, backend="triton", **kw)

    if opts.get("compile"):  # the custom operator inside a compiled graph (inductor on a GPU)
        torch._dynamo.reset()
        triton_call = torch.compile(triton_call, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    t0 = time.perf_counter()
    out, grads = run(triton_call)
    _sync(device)
    first_call = time.perf_counter() - t0
    out_t, grads_t = run(lambda *a: ops.mhla_attention(*a, layout, backend="torch", **kw))
    if n <= 4096:
        out_r, grads_r = run(lambda *a: ops.mhla_attention_reference(*a, layout, dtype=torch.float64, **kw), torch.float64)
    else:
        # the O(N d^2) block-wise oracle where the dense one's N^2 matrix does not fit
        out_r, grads_r = run(lambda *a: ops.naive.mhla_attention_blockwise(*a, layout, **kw), torch.float64)
    scales = [None] * 4
    if normalize:
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mixing)]
        num, den = ops.naive.blockwise_parts(*leaves, layout, eps=1e-6, feature_map=fm, rotary=rotary)
        g = grad_out.double()
        first = torch.autograd.grad(num / den.detach(), leaves, g, retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, leaves, g, allow_unused=True)
        scales = [max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item())
                  for a, b in zip(first, second)]
    names = ("out", "dq", "dk", "dv", "dmixing")
    vs_ref = {nm: ops.naive.relative_error(a, r, sc) for nm, a, r, sc in zip(names, (out, *grads), (out_r, *grads_r), (None, *scales))}
    vs_torch = {nm: ops.naive.relative_error(a, r, sc) for nm, a, r, sc in zip(names, (out, *grads), (out_t, *grads_t), (None, *scales))}
    finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
    tol = TOL[dtype]
    ok = finite and max(vs_ref.values()) <= tol and max(vs_torch.values()) <= tol
    return dict(case=name, dtype=str(dtype).replace("torch.", ""), batch=batch, heads=heads, grid=list(grid),
                block_grid=list(layout.block_grid), num_blocks=m, d=d, normalize=normalize, feature_map=feature_map,
                rotary=rotary is not None, compiled=bool(opts.get("compile")),
                memory=opts.get("memory", "contiguous"), tol=tol, ok=ok, finite=finite, vs_reference=vs_ref, vs_torch=vs_torch,
                first_call_s=round(first_call, 3))


# ----------------------------------------------------------------------------------------------
# Timing


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps, warmup=2):
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _plain_linear_layout(grid):
    return BlockLayout(grid, (1,) * len(grid))


def time_shape(name, spec, dtype, device, methods, reps, hbm_bytes_per_s):
    batch, heads, grid, d, block_grid = spec
    layout = BlockLayout(grid, block_grid or choose_block_grid(grid))
    n, m = layout.num_tokens, layout.num_blocks
    gen = torch.Generator(device="cpu").manual_seed(0)
    # diffusers' memory layout: [B, N, H, d] viewed as [B, H, N, d]
    q, k, v = (torch.randn(batch, n, heads, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    mixing = mixing_init(layout).to(device)
    grad_out = torch.randn(batch, n, heads, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    elt = torch.tensor([], dtype=dtype).element_size()
    fwd_bytes = 4 * batch * heads * n * d * elt  # read q, k, v + write out
    fwdbwd_bytes = fwd_bytes + 7 * batch * heads * n * d * elt  # + read q, k, v, out-grad, write dq, dk, dv
    one = _plain_linear_layout(grid)
    rotary = _random_rotary(n, d, gen, device) if len(grid) == 3 else None  # Wan's RoPE: video shapes only

    def call(method, q_, k_, v_, mix_):
        if method == "triton":
            return ops.mhla_attention(q_, k_, v_, mix_, layout, backend="triton")
        if method == "torch":
            return ops.mhla_attention(q_, k_, v_, mix_, layout, backend="torch")
        if method == "linear":  # plain ReLU linear attention: one block, Mc = [[1]]
            return ops.mhla_attention(q_, k_, v_, mix_, one, backend="triton")
        if method == "sdpa":
            return F.scaled_dot_product_attention(q_, k_, v_)
        if method in ROPE_METHODS:
            rot = (lambda x: rotary(x)) if method.endswith("composed") else rotary  # a plain function is not fused
            return ops.mhla_attention(q_, k_, v_, mix_, layout, backend=method.split("-")[0], rotary=rot)
        raise ValueError(method)

    rows = []
    for method in methods:
        if method in ROPE_METHODS and rotary is None:
            continue
        row = dict(shape=name, method=method, dtype=str(dtype).replace("torch.", ""), batch=batch, heads=heads, tokens=n,
                   grid=list(grid), d=d, num_blocks=1 if method == "linear" else (None if method == "sdpa" else m))
        try:
            mix = torch.ones(1, 1, device=device) if method == "linear" else mixing
            t0 = time.perf_counter()
            with torch.no_grad():
                call(method, q, k, v, mix)
            _sync(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            with torch.no_grad():
                fwd = _time(lambda: call(method, q, k, v, mix), device, reps)
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, mix)]
            wanted = leaves[:3] if method == "sdpa" else leaves

            def fwd_bwd():
                out = call(method, *leaves)
                torch.autograd.grad(out, wanted, grad_out)

            fb = _time(fwd_bwd, device, reps)
            row.update(fwd_ms=fwd * 1e3, fwdbwd_ms=fb * 1e3, fwd_bytes=fwd_bytes, fwd_gbps=fwd_bytes / fwd / 1e9,
                       fwdbwd_gbps=fwdbwd_bytes / fb / 1e9, fwd_roofline_ms=fwd_bytes / hbm_bytes_per_s * 1e3,
                       fwd_vs_roofline=fwd / (fwd_bytes / hbm_bytes_per_s))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd()
                torch.cuda.synchronize()
                row["fwdbwd_peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  [error] {name} {method}: {row['error']}", flush=True)
            traceback.print_exc()
        rows.append(row)
        if "fwd_ms" in row:
            print(f"  {name:10s} {method:7s} fwd {row['fwd_ms']:9.3f} ms ({row['fwd_gbps']:7.1f} GB/s, "
                  f"{row['fwd_vs_roofline']:6.2f}x roofline)  fwd+bwd {row['fwdbwd_ms']:9.3f} ms", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------
# Report


def summarise(timing, interpret=False):
    """The issue's targets, per shape: forward / roofline (Wan: <= 1.5) and torch / triton fwd+bwd (>= 2).

    Under the interpreter the ratios are computed but no target is judged (the numbers mean nothing)."""
    by = {(r["shape"], r["method"]): r for r in timing if "fwd_ms" in r}
    out = []
    for shape in dict.fromkeys(r["shape"] for r in timing):
        tri, tor, sdpa = by.get((shape, "triton")), by.get((shape, "torch")), by.get((shape, "sdpa"))
        s = dict(shape=shape)
        if tri:
            s["fwd_vs_roofline"] = tri["fwd_vs_roofline"]
            if shape.startswith("wan") and not interpret:
                s["target_fwd_within_1.5x_roofline"] = tri["fwd_vs_roofline"] <= 1.5
        if tri and tor:
            s["fwdbwd_speedup_vs_torch"] = tor["fwdbwd_ms"] / tri["fwdbwd_ms"]
            s["fwd_speedup_vs_torch"] = tor["fwd_ms"] / tri["fwd_ms"]
            if not interpret:
                s["target_fwdbwd_2x_torch"] = s["fwdbwd_speedup_vs_torch"] >= 2
        if tri and sdpa:
            s["fwd_speedup_vs_sdpa"] = sdpa["fwd_ms"] / tri["fwd_ms"]
            s["fwdbwd_speedup_vs_sdpa"] = sdpa["fwdbwd_ms"] / tri["fwdbwd_ms"]
        rope, rope_c, rope_t = by.get((shape, "triton-rope")), by.get((shape, "triton-rope-composed")), by.get((shape, "torch-rope"))
        if rope:
            s["rope_fwd_vs_roofline"] = rope["fwd_vs_roofline"]
            if sdpa:
                s["rope_fwd_speedup_vs_sdpa"] = sdpa["fwd_ms"] / rope["fwd_ms"]
            if rope_c:
                s["rope_fusion_fwdbwd_speedup"] = rope_c["fwdbwd_ms"] / rope["fwdbwd_ms"]
            if rope_t:
                s["rope_fwdbwd_speedup_vs_torch"] = rope_t["fwdbwd_ms"] / rope["fwdbwd_ms"]
        out.append(s)
    return out


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def write_markdown(path, report):
    env = report["environment"]
    lines = [
        "# Triton MHLA backend: GPU check",
        "",
        f"{env['date']} on {env['device_name']} (torch {env['torch']}, triton {env['triton']}, "
        f"mode {'interpreter smoke (numbers meaningless)' if env['interpret'] else 'GPU'}); "
        f"timing dtype {report.get('timing_dtype', '-')}, {report['args']['reps']} reps, HBM peak {report['args']['hbm_tbps']} TB/s.",
        "",
        "## Correctness (relative error vs the float64 reference / vs the torch backend)",
        "",
        "| case | dtype | M | d | out | dq | dk | dv | dmixing | vs torch (max) | tol | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["correctness"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r.get('dtype', '')} | | | error: {r['error'][:120]} | | | | | | | no |")
            continue
        e = r["vs_reference"]
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['num_blocks']} | {r['d']} | {_fmt(e['out'], '.1e')} | {_fmt(e['dq'], '.1e')} | "
            f"{_fmt(e['dk'], '.1e')} | {_fmt(e['dv'], '.1e')} | {_fmt(e['dmixing'], '.1e')} | "
            f"{_fmt(max(r['vs_torch'].values()), '.1e')} | {r['tol']:.0e} | {'yes' if r['ok'] else 'NO'} |"
        )
    lines += [
        "",
        "## Timing (median ms; bandwidth = compulsory bytes q, k, v read + output written / time)",
        "",
        "| shape | B x H x N x d | M | method | fwd ms | fwd GB/s | fwd / roofline | fwd+bwd ms | first call s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["timing"]:
        dims = f"{r['batch']}x{r['heads']}x{r['tokens']}x{r['d']}"
        if "error" in r:
            lines.append(f"| {r['shape']} | {dims} | {_fmt(r['num_blocks'])} | {r['method']} | error: {r['error'][:100]} | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {dims} | {_fmt(r['num_blocks'])} | {r['method']} | {r['fwd_ms']:.3f} | {r['fwd_gbps']:.0f} | "
            f"{r['fwd_vs_roofline']:.2f} | {r['fwdbwd_ms']:.3f} | {r['first_call_s']:.2f} |"
        )
    lines += ["", "## Targets (issue 5)", "",
              "| shape | fwd / roofline | fwd+bwd speed-up vs torch | fwd speed-up vs SDPA | RoPE fused: fwd / roofline | "
              "RoPE fused: fwd speed-up vs SDPA | RoPE fused vs composed (fwd+bwd) | RoPE fused vs torch (fwd+bwd) | targets met |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        met = [k for k in s if k.startswith("target_")]
        verdict = ", ".join(f"{k[7:]}: {'yes' if s[k] else 'NO'}" for k in met) or "-"
        lines.append(f"| {s['shape']} | {_fmt(s.get('fwd_vs_roofline'), '.2f')} | {_fmt(s.get('fwdbwd_speedup_vs_torch'), '.2f')} | "
                     f"{_fmt(s.get('fwd_speedup_vs_sdpa'), '.2f')} | {_fmt(s.get('rope_fwd_vs_roofline'), '.2f')} | "
                     f"{_fmt(s.get('rope_fwd_speedup_vs_sdpa'), '.2f')} | {_fmt(s.get('rope_fusion_fwdbwd_speedup'), '.2f')} | "
                     f"{_fmt(s.get('rope_fwdbwd_speedup_vs_torch'), '.2f')} | {verdict} |")
    if report["errors"]:
        lines += ["", f"{len(report['errors'])} error(s): see gpu_check.json."]
    path.write_text("\n".join(lines) + "\n")


def environment(args):
    import triton

    env = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), host=platform.node(), python=platform.python_version(),
               torch=torch.__version__, triton=triton.__version__, interpret=bool(args.interpret),
               diffusers_imported="diffusers" in sys.modules, device_name="cpu (Triton interpreter)")
    if args.device == "cuda":
        env.update(device_name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   cuda=torch.version.cuda, allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return env


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or use --device cpu --interpret for a smoke test")
    torch.manual_seed(0)
    env = environment(args)
    print(f"gpu_check: {env['device_name']}, torch {env['torch']}, triton {env['triton']}", flush=True)
    report = dict(environment=env, args=vars(args), correctness=[], timing=[], summary=[], errors=[])

    if not args.skip_correctness:
        print("correctness:", flush=True)
        for name, batch, heads, grid, block_grid, d, dtype, opts in correctness_cases(args.interpret, args.quick):
            try:
                r = check_correctness(name, batch, heads, grid, block_grid, d, dtype, opts, args.device)
                print(f"  {name:28s} {r['dtype']:9s} max err vs ref {max(r['vs_reference'].values()):.1e}, vs torch "
                      f"{max(r['vs_torch'].values()):.1e} (tol {r['tol']:.0e}) {'ok' if r['ok'] else 'FAIL'}", flush=True)
            except Exception as exc:
                r = dict(case=name, dtype=str(dtype).replace("torch.", ""), ok=False, error=f"{type(exc).__name__}: {exc}")
                report["errors"].append(r)
                print(f"  [error] {name}: {r['error']}", flush=True)
                traceback.print_exc()
            report["correctness"].append(r)
            if args.device == "cuda":
                torch.cuda.empty_cache()

    if not args.skip_timing:
        print("timing:", flush=True)
        shapes = TINY_SHAPES if args.interpret else SHAPES
        names = args.shapes or (list(shapes) if not args.quick or args.interpret else list(QUICK_SHAPES))
        dtype = torch.float32 if args.interpret else getattr(torch, args.dtype)
        report["timing_dtype"] = str(dtype).replace("torch.", "")
        for name in names:
            if name not in shapes:
                report["errors"].append(dict(shape=name, error=f"unknown shape; choose from {list(shapes)}"))
                continue
            rows = time_shape(name, shapes[name], dtype, args.device, args.methods, args.reps, args.hbm_tbps * 1e12)
            report["timing"] += rows
            report["errors"] += [r for r in rows if "error" in r]
            if args.device == "cuda":
                torch.cuda.empty_cache()
        report["summary"] = summarise(report["timing"], args.interpret)

    report["seconds"] = round(time.perf_counter() - t_start, 1)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(out_dir / "gpu_check.md", report)
    bad = [r["case"] for r in report["correctness"] if not r.get("ok")]
    print(f"done in {report['seconds']} s: {out_dir / 'gpu_check.md'}; correctness failures: {bad or 'none'}; "
          f"errors: {len(report['errors'])}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
