"""Compile the Triton MHLA kernels for an H100/H200 (sm_90) without a GPU, exactly as a CUDA run launches them.

The operator's host code is run on small CPU tensors with ``triton_ops._RECORD`` set: kernels are
not launched but their arguments, grids and meta-parameters are recorded, with the GPU launch
configuration (tiles, warps, splits). Each recorded launch is then specialised by Triton's own
JIT binder (the same signature, constexprs and divisibility attributes a CUDA launch would get,
pointer alignment included) and compiled through ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``
down to a cubin (ptxas from the Triton wheel). ptxas's report gives registers, spills and shared
memory per kernel; a launch needing more shared memory than the target allows counts as a failure.

Catches what the interpreter cannot: dtype rules of ``tl.dot`` on tensor cores, power-of-two and
minimum tile shapes, shared-memory overflows, register spills. It cannot catch wrong numbers
(``tests/ops/test_triton.py`` runs the kernels in the interpreter for that) nor measure speed.

Usage (must NOT run under TRITON_INTERPRET=1)::

    python tests/ops/triton_compile_check.py                       # full grid, JSON lines on stdout
    python tests/ops/triton_compile_check.py --dims 72 --dtypes bfloat16 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("triton_compile_check.py compiles for a GPU target: unset TRITON_INTERPRET")
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="mhla-triton-cache-"))  # fresh: ptxas runs
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

# float64 is not compiled: on a GPU the operator sends fp64 inputs to the torch backend.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Largest shared memory one block may use (opt-in), bytes, by compute capability.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def record_launches(d, dtype, *, normalize=True, feature_map=True, rotary=False, grid=(7, 9), block_grid=(2, 3), heads=2, dv=None):
    """Run forward + backward on CPU tensors with launches recorded; returns [(kernel, grid, args, meta)]."""
    from mhla_diffusers.ops import triton_ops
    from mhla_diffusers.ops.layout import BlockLayout

    layout = BlockLayout(grid, block_grid)
    dv = d if dv is None else dv
    # diffusers' memory layout: [B, N, H, d] viewed as [B, H, N, d]
    q, k, v = (torch.zeros(1, layout.num_tokens, heads, w, dtype=dtype).transpose(1, 2).requires_grad_() for w in (d, d, dv))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks).requires_grad_()
    rot = None
    if rotary:  # Wan's RoPE fused into the kernels
        from mhla_diffusers.ops import InterleavedRotary

        angles = torch.rand(layout.num_tokens, d // 2)
        rot = InterleavedRotary(angles.cos(), angles.sin())
    triton_ops._RECORD = []
    try:
        out = triton_ops._MHLATriton.apply(q, k, v, mixing, layout, normalize, 1e-6, feature_map, rot, True)
        out.backward(torch.zeros_like(out))
        return triton_ops._RECORD
    finally:
        triton_ops._RECORD = None


def compile_launch(kernel, args, meta, target):
    """Specialise like a CUDA launch (Triton's binder) and compile; returns (compiled kernel, ptxas log)."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(meta), bound_args, specialization, options)
    log = io.StringIO()
    old = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = old
    return compiled, log.getvalue()


def parse_ptxas(log: str) -> dict:
    regs = re.findall(r"Used (\d+) registers", log)
    spill_st = re.findall(r"(\d+) bytes spill stores", log)
    spill_ld = re.findall(r"(\d+) bytes spill loads", log)
    return {
        "registers": int(regs[-1]) if regs else None,
        "spill_store_bytes": int(spill_st[-1]) if spill_st else None,
        "spill_load_bytes": int(spill_ld[-1]) if spill_ld else None,
    }


def check(dims, dtypes, variants, arch=90):
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for dtype_name in dtypes:
        for d in dims:
            for normalize, feature_map, rotary in variants:
                launches = record_launches(d, DTYPES[dtype_name], normalize=normalize, feature_map=feature_map, rotary=rotary)
                seen = set()
                for kernel, grid, args, meta in launches:
                    key = (kernel.__name__, tuple(sorted(meta.items())))
                    if key in seen:  # e.g. the mixing GEMM of S and of z: one compile per kernel and meta
                        continue
                    seen.add(key)
                    row = dict(kernel=kernel.__name__, d=d, dtype=dtype_name, normalize=normalize, feature_map=feature_map,
                               rotary=rotary, arch=arch, num_warps=meta.get("num_warps"), block_t=meta.get("BLOCK_T"), grid=list(grid))
                    t0 = time.time()
                    try:
                        compiled, log = compile_launch(kernel, args, meta, target)
                        shared = compiled.metadata.shared
                        limit = MAX_SHARED.get(arch, 101376)
                        row.update(ok=shared <= limit, shared_bytes=shared, **parse_ptxas(log))
                        if shared > limit:
                            row["error"] = f"needs {shared} bytes of shared memory; sm_{arch} allows {limit}"
                    except Exception as exc:  # report and continue: the caller decides
                        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
                    row["seconds"] = round(time.time() - t0, 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[32, 64, 72, 128])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--quick", action="store_true",
                   help="only normalize + feature_map on (else also both off, and the fused RoPE with normalize on and off)")
    p.add_argument("--rotary", action="store_true", help="with --quick: also the fused RoPE (normalize + feature_map on)")
    p.add_argument("--arch", type=int, default=90)
    a = p.parse_args(argv)
    if a.quick:
        variants = [(True, True, False)] + ([(True, True, True)] if a.rotary else [])
    else:
        variants = [(True, True, False), (False, False, False), (True, True, True), (False, True, True)]
    rows = check(a.dims, a.dtypes, variants, a.arch)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
