"""The compiler's word on the Triton kernels in every run: ``benchmarks/kernel_report.py`` at one shape.

Wan2.1-1.3B 480p (12 heads x 128, 21 x 30 x 52 tokens, M = 105), bf16, Wan's RoPE fused, compiled for sm_90 by
the Triton wheel's ptxas without a GPU (one subprocess, about 10 s on 2 cores): the report's structure, every build
within shared memory, and no register spill in bf16 for any kernel (none spills since 2026-12-04; a build
that must be let spill for a while goes into ``KNOWN_SPILLS``, a strict xfail, so the file fails again when it
stops). The full report (all shapes, fp16, sm_80): ``python benchmarks/kernel_report.py --arch sm_90 sm_80``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SHAPE = "wan2.1-1.3b-480p"

# One build per entry: a kernel, and for the mixing GEMM which operand layout (Mc, or Mc^T with unit row stride).
BUILDS = ("fwd_summaries", "mix_gemm (Mc)", "fwd_output", "bwd_query", "mix_gemm (Mc^T)", "bwd_key")
# Builds allowed to spill (Triton 3.9, sm_90, bf16, RoPE on), by build id -> reason: strict xfails, so a fix shows
# as XPASS. Empty since 2026-12-04 (issue 33 item 3): `bwd_query` (24 + 12 B) and the backward's mixing GEMM with
# A = Mc^T (64 + 64 B) no longer spill.
KNOWN_SPILLS: dict[str, str] = {}


def _build_id(row: dict) -> str:
    if row["kernel"] != "mix_gemm":
        return row["kernel"]
    return "mix_gemm (Mc^T)" if any("Mc^T" in use for use in row["uses"]) else "mix_gemm (Mc)"


def _kernel_costs():
    return benchmark_module("kernel_costs")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the report compiles for a GPU target
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    reason = _kernel_costs().compile_available(env)
    if reason:
        pytest.skip(f"cannot compile Triton kernels for sm_90 here: {reason}")
    out = tmp_path_factory.mktemp("kernel_report") / "report.json"
    cmd = [sys.executable, "benchmarks/kernel_report.py", "--arch", "sm_90", "--shapes", SHAPE, "--dtypes", "bfloat16",
           "--rope", "on", "--json", str(out), "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-5000:]
    return json.loads(out.read_text()), proc


def _builds(report) -> dict[str, dict]:
    return {_build_id(r): r for r in report[0]["builds"]}


def test_report_structure(report):
    """Every build compiled within sm_90's shared memory, with the fields the docs' tables read."""
    data, proc = report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["archs"] == ["sm_90"] and data["dtypes"] == ["bfloat16"]
    assert sorted(_builds(report)) == sorted(BUILDS)
    for row in data["builds"]:
        assert row["ok"] and "error" not in row, row
        assert (row["arch"], row["dtype"], row["shape"], row["rope"]) == ("sm_90", "bfloat16", SHAPE, True)
        for key in ("registers", "spill_bytes", "shared_bytes", "num_warps"):
            assert isinstance(row[key], int) and row[key] >= 0, (key, row)
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] <= 232448
        assert 1 <= row["occupancy"]["ctas_per_sm"] <= 32 and row["occupancy"]["limited_by"]
    model = data["bytes_model"]
    assert [m["shape"] for m in model] == [SHAPE] and model[0]["rope"] is True
    m = model[0]
    assert m["floor_bytes"] == 12 * 32760 * 128 * 2 * 4  # read q, k, v + write the output, bf16, batch 1
    assert m["floor_bytes"] < m["forward_bytes"] < m["scenarios"]["no_l2"]["forward_bytes"]
    assert m["backward_floor_bytes"] < m["backward_bytes"] and m["assumes"]
    torch_rows = data["torch_backend"]
    assert {r["memory"] for r in torch_rows} == {"bhnd", "bnhd"}
    assert all(r["forward"]["ops"] > 0 and r["forward"]["bytes"] > m["floor_bytes"] for r in torch_rows)


@pytest.mark.parametrize("build", [
    pytest.param(b, marks=pytest.mark.xfail(strict=True, reason=KNOWN_SPILLS[b])) if b in KNOWN_SPILLS else b
    for b in BUILDS
])
def test_no_spill_in_bf16(report, build):
    """ptxas reports no spill stores or loads for this kernel's bf16 build."""
    row = _builds(report)[build]
    assert row["spill_bytes"] == 0, f"{build} spills {row['spill_store_bytes']} B stored + {row['spill_load_bytes']} B loaded"


def test_bytes_model_is_importable_with_its_signature():
    """``bytes_model(batch, heads, grid, head_dim, block_grid, dtype, rope)``, the name other scripts import."""
    kernel_costs = _kernel_costs()
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_report
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert kernel_report.bytes_model is kernel_costs.bytes_model
    params = list(inspect.signature(kernel_costs.bytes_model).parameters)
    assert params == ["batch", "heads", "grid", "head_dim", "block_grid", "dtype", "rope"]
    small = kernel_costs.bytes_model(2, 2, (3, 5, 7), 128, (2, 2, 3), "float16", True)
    assert {"forward_bytes", "backward_bytes", "floor_bytes", "assumes"} <= set(small)
    assert small["floor_bytes"] == 2 * 2 * 105 * 128 * 2 * 4
    assert small["forward_bytes"] > small["floor_bytes"] and small["backward_bytes"] > small["backward_floor_bytes"]
