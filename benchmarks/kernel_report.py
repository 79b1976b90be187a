#!/usr/bin/env python
"""The compiler's word on MHLA's Triton kernels, and a bytes model of both backends, without a GPU.

For each shape (Wan2.1-1.3B 480p at M = 105, 84, 64; Wan2.1-14B 720p; SANA-1600M 4K; DiT-XL/2 at 256 and
512 px), dtype (bf16, fp16) and RoPE variant (fused Wan RoPE on / off, Wan only), every launch of the Triton
backend's forward and backward is recorded as a CUDA run would make it and compiled for each ``--arch``
with the Triton wheel's ptxas; the JSON gets, per build, registers, spills, shared memory, warps and CTAs per
SM. ``bytes_model``: HBM bytes of the forward and backward against the compulsory floor, from each kernel's
loads and stores. ``torch_backend``: ATen op count and bytes of the torch backend's CUDA code path. Method
and assumptions: ``benchmarks/kernel_costs.py``; tables and reading: docs/triton.md ("Compile report") and
docs/performance.md ("Bytes per pass").

Usage (from the repository root; not under TRITON_INTERPRET=1)::

    python benchmarks/kernel_report.py --arch sm_90 --json kernel_report.json
    python benchmarks/kernel_report.py --arch sm_90 sm_80 --json kernel_report.json --markdown kernel_report.md
    python benchmarks/kernel_report.py --shapes wan2.1-1.3b-480p --dtypes bfloat16 --rope on --json /tmp/k.json
    python benchmarks/kernel_report.py --no-compile --json /tmp/bytes.json      # bytes model and torch backend only
    python benchmarks/kernel_report.py --render kernel_report.json               # the markdown tables again

Other scripts: ``from kernel_report import bytes_model`` (``benchmarks/`` on ``sys.path``); see
:func:`kernel_costs.bytes_model`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from kernel_costs import (  # noqa: E402
    ARCHS,
    SCENARIOS,
    SHAPES,
    BuildCache,
    build_rows,
    bytes_model,
    compile_available,
    record,
    torch_backend_traffic,
)
from kernel_launches import _layout  # noqa: E402

__all__ = ["bytes_model", "main"]

DTYPES = ("bfloat16", "float16")
ROPE = {"both": (False, True), "on": (True,), "off": (False,)}


def _shape_row(shape) -> dict:
    layout = _layout(shape.grid, shape.block_grid, shape.num_blocks)
    return {"shape": shape.name, "heads": shape.heads, "head_dim": shape.head_dim, "grid": list(layout.grid),
            "block_grid": list(layout.block_grid), "num_blocks": layout.num_blocks, "max_block_size": layout.max_block_size,
            "tokens": layout.num_tokens, "rope_variants": shape.rope, "note": shape.note}


def _ropes(shape, wanted: tuple[bool, ...]) -> tuple[bool, ...]:
    """RoPE variants of a shape: only families with RoPE (Wan) get ``True``."""
    return tuple(r for r in wanted if shape.rope or not r)


def compile_section(shapes, dtypes, ropes, archs, batch, log) -> tuple[list[dict], dict]:
    """Rows of every distinct build per (shape, dtype, RoPE, arch); identical builds compile once per run."""
    cache, rows, t0 = BuildCache(), [], time.perf_counter()
    for shape in shapes:
        for dtype in dtypes:
            for rope in _ropes(shape, ropes):
                rec = record(batch, shape.heads, shape.grid, shape.head_dim, shape.block_grid, dtype, rope, shape.num_blocks)
                for arch in archs:
                    new = build_rows(rec, ARCHS[arch], cache, shape=shape.name, dtype=dtype, rope=rope)
                    rows += new
                    for r in new:
                        log(_build_line(r))
    stats = {"compiles": cache.compiles, "rows": len(rows), "seconds": round(time.perf_counter() - t0, 1)}
    return rows, stats


def _build_line(r: dict) -> str:
    if "error" in r:
        return f"{r['arch']} {r['shape']} {r['dtype']} rope={r['rope']} {r['kernel']}: ERROR {r['error'][:200]}"
    occ = r["occupancy"]
    return (f"{r['arch']} {r['shape']} {r['dtype']} rope={r['rope']} {r['kernel']:<13} regs {r['registers']:>3} "
            f"spill {r['spill_bytes']:>4} B smem {r['shared_bytes'] // 1024:>3} KB warps {r['num_warps']} "
            f"CTAs/SM {occ['ctas_per_sm']} ({'+'.join(occ['limited_by'])}){' [cached]' if r['cached'] else ''}")


def bytes_section(shapes, ropes, batch) -> list[dict]:
    """The bytes model per (shape, RoPE variant); bf16 and fp16 move the same bytes (bf16 here)."""
    rows = []
    for shape in shapes:
        for rope in _ropes(shape, ropes):
            model = bytes_model(batch, shape.heads, shape.grid, shape.head_dim, _block_grid(shape), "bfloat16", rope)
            rows.append({"shape": shape.name, **model})
    return rows


def _block_grid(shape):
    return _layout(shape.grid, shape.block_grid, shape.num_blocks).block_grid


def torch_section(shapes, ropes, batch) -> list[dict]:
    """The torch backend's ATen ops and bytes per (shape, RoPE variant, memory layout), bf16."""
    rows = []
    for shape in shapes:
        for rope in _ropes(shape, ropes):
            for memory in ("bhnd", "bnhd"):
                r = torch_backend_traffic(batch, shape.heads, shape.grid, shape.head_dim, _block_grid(shape), "bfloat16", rope, memory)
                rows.append({"shape": shape.name, **r})
    return rows


def _machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "gpu": "none: nothing run on a device"}
    try:
        import triton
        from triton import knobs

        info.update(triton=triton.__version__, ptxas=knobs.nvidia.ptxas.version)
    except Exception as exc:  # the bytes model and torch counts need no compiler
        info["triton"] = f"unavailable: {exc}"
    return info


# ---------------------------------------------------------------------------------------------
# Markdown


def _mb(x) -> str:
    return f"{x / 1e6:,.0f}"


def compile_table(builds: list[dict], shape: str, dtype: str, arch: str) -> str:
    """Registers, spills, shared memory and occupancy per build at one (shape, dtype, arch), RoPE off and on."""
    lines = ["| kernel | launches | RoPE | registers | spills (st + ld, B) | shared KB | warps | CTAs / SM (limit) | programs | waves |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in builds:
        if (r["shape"], r["dtype"], r["arch"]) != (shape, dtype, arch) or "error" in r:
            continue
        occ = r["occupancy"]
        uses = _uses(r["uses"]) if r["kernel"] == "mix_gemm" else r["uses"][0].split(": ")[0]
        lines.append(f"| `{r['kernel']}` | {uses} | {'on' if r['rope'] else 'off'} | {r['registers']} | "
                     f"{r['spill_store_bytes']} + {r['spill_load_bytes']} | {r['shared_bytes'] / 1024:.0f} | {r['num_warps']} | "
                     f"{occ['ctas_per_sm']} ({', '.join(occ['limited_by'])}) | {r['programs']:,} | {r['waves']} |")
    return "\n".join(lines)


def _uses(uses: list[str]) -> str:
    """``"S~ = Mc S, z~ = Mc z (forward, backward)"`` from ``["forward: S~ = Mc S", ...]``."""
    phases = list(dict.fromkeys(u.split(": ", 1)[0] for u in uses))
    roles = list(dict.fromkeys(u.split(": ", 1)[1].replace(" (recomputed)", "") for u in uses))
    return f"{', '.join(roles)} ({', '.join(phases)})"


def spill_summary(builds: list[dict]) -> str:
    """Every build that spills or fails, one line each."""
    out = []
    for r in builds:
        if "error" in r or not r["ok"]:
            out.append(f"- {r['arch']} {r['shape']} {r['dtype']} RoPE {r['rope']} `{r['kernel']}`: {r.get('error', 'over shared memory')}")
        elif r["spill_bytes"]:
            what = _uses(r["uses"]) if r["kernel"] == "mix_gemm" else r["uses"][0].split(": ")[0]
            out.append(f"- {r['arch']} {r['shape']} {r['dtype']} RoPE {'on' if r['rope'] else 'off'} `{r['kernel']}` "
                       f"({what}): {r['spill_store_bytes']} + {r['spill_load_bytes']} B")
    return "\n".join(out) or "- none"


def bytes_table(rows: list[dict]) -> str:
    """Forward and backward bytes of the Triton backend beside the floor, three L2 scenarios, estimated times."""
    lines = ["| shape | M | RoPE | floor fwd MB | fwd MB | fwd / floor (no L2, on-chip) | est. fwd us (floor) | "
             "floor bwd MB | bwd MB | bwd / floor (no L2, on-chip) | est. bwd us (floor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, us = r["scenarios"], r["estimated_us"]
        lines.append(
            f"| {r['shape']} | {r['num_blocks']} | {'on' if r['rope'] else 'off'} | {_mb(r['floor_bytes'])} | {_mb(r['forward_bytes'])} | "
            f"{r['forward_ratio']:.2f} ({s['no_l2']['forward_ratio']:.2f}, {s['summaries_on_chip']['forward_ratio']:.2f}) | "
            f"{us['forward']:.0f} ({us['forward_floor']:.0f}) | {_mb(r['backward_floor_bytes'])} | {_mb(r['backward_bytes'])} | "
            f"{r['backward_ratio']:.2f} ({s['no_l2']['backward_ratio']:.2f}, {s['summaries_on_chip']['backward_ratio']:.2f}) | "
            f"{us['backward']:.0f} ({us['backward_floor']:.0f}) |")
    return "\n".join(lines)


def torch_table(rows: list[dict]) -> str:
    """The torch backend's ATen ops and bytes, forward and forward + backward, against the floor."""
    lines = ["| shape | RoPE | memory | fwd ops | fwd GB | fwd / floor | est. fwd us | fwd+bwd ops | fwd+bwd GB | fwd+bwd / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, b = r["forward"], r["forward_backward"]
        lines.append(f"| {r['shape']} | {'on' if r['rope'] else 'off'} | {r['memory']} | {f['ops']} | {f['bytes'] / 1e9:.2f} | "
                     f"{f['floor_ratio']:.1f} | {f['estimated_us']:.0f} | {b['ops']} | {b['bytes'] / 1e9:.2f} | {b['floor_ratio']:.1f} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The report's tables (compile table at each arch for the first shape and dtype, all bytes and torch rows)."""
    builds = report.get("builds") or []
    compiler = f"; compiled with ptxas {report['machine'].get('ptxas')} (Triton {report['machine'].get('triton')})" if builds else ""
    parts = [f"# Kernel report ({report['date']}; GPU {report['machine'].get('gpu')}{compiler})", ""]
    for arch in report["archs"]:
        for dtype in report["dtypes"]:
            shape = report["shapes"][0]["shape"]
            if any(b["arch"] == arch and b["dtype"] == dtype and b["shape"] == shape for b in builds):
                parts += [f"## Compile report: {shape}, {dtype}, {arch}", "", compile_table(builds, shape, dtype, arch), ""]
    if builds:
        parts += ["## Spills and failures (every build)", "", spill_summary(builds), ""]
    parts += ["## Bytes model (Triton backend, batch %d)" % report["batch"], "", bytes_table(report["bytes_model"]), "",
              "Scenarios: " + "; ".join(f"**{k}**: {v}" for k, v in SCENARIOS.items()), ""]
    if report.get("torch_backend"):
        parts += ["## Torch backend, CUDA code path (bf16)", "", torch_table(report["torch_backend"]), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["sm_90"], help="targets to compile for (default sm_90)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--markdown", type=Path, help="write the markdown tables here (also printed)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--rope", choices=sorted(ROPE), default="both", help="fused Wan RoPE variants (Wan shapes only)")
    p.add_argument("--batch", type=int, default=1, help="samples (default 1; tiles and splits do not depend on it)")
    p.add_argument("--no-compile", action="store_true", help="skip compiling (bytes model and torch backend only)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch backend's op count")
    p.add_argument("--render", type=Path, help="print the markdown of an existing report and exit")
    p.add_argument("--quiet", action="store_true", help="no line per build")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the report; exit status 1 when a build fails or needs more shared memory than the target has."""
    a = _parse(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
    if a.render:
        print(markdown(json.loads(a.render.read_text())))
        return 0
    shapes = [SHAPES[s] for s in a.shapes]
    ropes = ROPE[a.rope]
    log = (lambda line: None) if a.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = {"report": "mhla kernel report", "date": _dt.date.today().isoformat(), "command": " ".join(sys.argv),
              "machine": _machine(), "archs": a.arch, "dtypes": a.dtypes, "batch": a.batch,
              "shapes": [_shape_row(s) for s in shapes], "builds": [], "compile": None}
    if not a.no_compile:
        reason = compile_available()
        if reason:
            print(f"kernel_report.py: cannot compile: {reason}", file=sys.stderr)
            return 2
        report["builds"], report["compile"] = compile_section(shapes, a.dtypes, ropes, a.arch, a.batch, log)
    report["bytes_model"] = bytes_section(shapes, ropes, a.batch)
    report["torch_backend"] = [] if a.no_torch else torch_section(shapes, ropes, a.batch)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    if a.markdown:
        a.markdown.write_text(text)
    print(text)
    return 0 if all(b["ok"] for b in report["builds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
