"""The Triton backend without a GPU: kernels in Triton's CPU interpreter, dispatch, sm_90 compilation, the GPU check script.

- Numbers: ``tests/ops/triton_interpret_check.py`` runs in a subprocess with ``TRITON_INTERPRET=1``
  (the variable must be set before the kernels are defined, so the rest of the suite stays
  unaffected) and reports, per case, the relative errors of the output and of dq, dk, dv, dmixing
  against the float64 reference and against the torch backend; each case is one test here.
- Compilation: ``tests/ops/triton_compile_check.py`` compiles the exact launches of a CUDA run for an
  H100/H200 (sm_90) with the Triton wheel's own ptxas: dtype rules of ``tl.dot``, tile shapes,
  shared memory within the device's limit.
- Dispatch (in process): ``backend="triton"`` on CPU tensors without the interpreter is a clear
  ValueError; ``"auto"`` stays on torch for CPU tensors; importing mhla_diffusers does not import
  the kernels (checked in the interpreter's fresh process).
- ``benchmarks/gpu_check.py``'s CPU rehearsal, budget and plan: tests/ops/test_gpu_check.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_interpret_check as interp

ROOT = Path(__file__).resolve().parents[2]
HAVE_TRITON = __import__("importlib").util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def _env(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def _run(args, *, interpret, timeout):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(interpret), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory):
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    out = tmp_path_factory.mktemp("triton") / "report.json"
    proc = _run(["tests/ops/triton_interpret_check.py", "--json", str(out)], interpret=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(out.read_text())
    return {c["name"]: c for c in report["cases"]}, report["extra"]


CASES = interp.cases()


@needs_triton
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_kernels_match_reference_and_torch_backend(interpreter_report, name):
    """Output and dq, dk, dv, dmixing of the Triton kernels (interpreter) vs the float64 reference and the torch backend."""
    results, _ = interpreter_report
    r = results[name]
    assert "error" not in r, r.get("traceback", r.get("error"))
    assert all(r["finite"].values()), r["finite"]
    assert r["dtypes_ok"], "output / gradient dtype or shape differs from the inputs'"
    bad_ref = {k: e for k, e in r["vs_reference"].items() if not e <= r["tol"]}
    bad_torch = {k: e for k, e in r["vs_torch"].items() if not e <= r["tol"]}
    assert not bad_ref, f"vs reference above {r['tol']}: {bad_ref} (all {r['vs_reference']})"
    assert not bad_torch, f"vs torch backend above {r['tol']}: {bad_torch} (all {r['vs_torch']})"
    if "layout_kept" in r:
        assert r["layout_kept"], "output / gradients lost the [B, N, H, d] memory layout of the inputs"
    if "rotary_path_ok" in r:
        assert r["rotary_path_ok"], "the rotation did not take the expected path (fused in the kernels / composed)"
    if "c02" in r:  # CASES C02: exact zeros where phi(q) or phi(k) vanish, no NaN
        assert all(r["c02"].values()), r["c02"]


@needs_triton
def test_interpreter_extra_checks(interpreter_report):
    """Empty batch, bitwise batch invariance (C03), bitwise determinism (no atomics), inputs unchanged,
    an expanded (stride-0) output gradient; torch.compile around the kernels with the fused RoPE
    (== eager) and opcheck of the custom operator on the Triton backend;
    ``import mhla_diffusers`` (in that fresh process) did not import the kernel module."""
    _, extra = interpreter_report
    assert extra and all(value is True for value in extra.values()), extra  # a failed check holds its error text


def test_case_grid_covers_the_issue():
    """The interpreter grid holds the head dims, both flags, fp32 and fp64, C01/C02, non-contiguous and split cases."""
    dims = {c["d"] for c in CASES}
    assert {32, 64, 72, 128} <= dims
    assert {(c["normalize"], c["feature_map"]) for c in CASES} == {(a, b) for a in (True, False) for b in (True, False)}
    assert {"float32", "float64", "float16"} <= {c["dtype"] for c in CASES}
    names = " ".join(c["name"] for c in CASES)
    for word in ("c01-float32", "c02-", "noncontiguous", "splits", "tiny-1x1", "rotary"):
        assert word in names


# ----------------------------------------------------------------------------------------------
# Dispatch (in process: no interpreter here)


def _small():
    from mhla_diffusers import BlockLayout

    layout = BlockLayout((5, 6), (2, 3))
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    return q, k, v, torch.rand(6, 6), layout


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from mhla_diffusers import mhla_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, mixing, layout = _small()
    expected = "CUDA tensors" if HAVE_TRITON else "not installed"
    with pytest.raises(ValueError, match=f"backend 'triton' is not usable here: .*{expected}"):
        mhla_attention(q, k, v, mixing, layout, backend="triton")


def test_auto_stays_on_torch_for_cpu_tensors(monkeypatch):
    """'auto' never picks the interpreter, even with TRITON_INTERPRET=1 set."""
    from mhla_diffusers.ops import resolve_backend

    for value in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_backend_names():
    from mhla_diffusers import available_backends
    from mhla_diffusers.ops import resolve_backend

    assert "torch" in available_backends()
    assert ("triton" in available_backends()) == HAVE_TRITON
    with pytest.raises(ValueError, match="unknown MHLA backend 'cuda'"):
        resolve_backend("cuda", torch.device("cpu"))


@needs_triton
def test_cuda_tensors_without_driver_give_a_reason():
    """On a machine without a GPU driver, explicit 'triton' for CUDA tensors names the reason; 'auto' picks torch."""
    from mhla_diffusers.ops import resolve_backend, triton_backend

    if triton_backend._gpu_problem() is None:
        pytest.skip("this machine has a working GPU driver")
    with pytest.raises(ValueError, match="no working GPU driver"):
        resolve_backend("triton", torch.device("cuda"))
    assert resolve_backend("auto", torch.device("cuda")) == "torch"


@needs_triton
def test_interpreter_switched_on_after_import_is_a_clear_error(monkeypatch):
    """TRITON_INTERPRET=1 set after the kernels were defined for a GPU: the kernel module says so."""
    from mhla_diffusers import mhla_attention
    from mhla_diffusers.ops import triton_ops

    if triton_ops._INTERPRETED:
        pytest.skip("this process runs the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, mixing, layout = _small()
    with pytest.raises(ValueError, match="set after"):
        mhla_attention(q, k, v, mixing, layout, backend="triton")


# ----------------------------------------------------------------------------------------------
# sm_90 compilation and the GPU script


@needs_triton
def test_kernels_compile_for_sm90():
    """The exact CUDA launches (bf16, d = 72 and 128, normalize and feature_map on, with and without the
    fused RoPE) compile to sm_90 cubins within the shared memory of an H100/H200 (the full grid:
    ``python tests/ops/triton_compile_check.py``)."""
    proc = _run(["tests/ops/triton_compile_check.py", "--dims", "72", "128", "--dtypes", "bfloat16", "--quick", "--rotary"],
                interpret=False, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows and ("ptxas" in proc.stderr or "No such file" in proc.stderr):
        pytest.skip(f"no ptxas in this Triton installation: {proc.stderr[-500:]}")
    assert rows, proc.stderr[-5000:]
    kernels = {"fwd_summaries", "mix_gemm", "fwd_output", "bwd_query", "bwd_key"}
    assert len(rows) == 2 * 2 * len(kernels), rows
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert {r["kernel"] for r in rows} == kernels
    assert {r["kernel"] for r in rows if r["rotary"]} == kernels


def _recorded_launches(batch, layout, heads, d, dtype):
    """The CUDA launches (kernel, grid, args by name, meta) of a forward + backward, recorded, not run."""
    from mhla_diffusers.ops import triton_ops

    q, k, v = (torch.zeros(batch, layout.num_tokens, heads, d, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks).requires_grad_()
    triton_ops._RECORD = []
    try:
        out = triton_ops._MHLATriton.apply(q, k, v, mixing, layout, True, 1e-6, True, None, True)
        out.backward(torch.zeros_like(out))
        return [(kernel.__name__, grid, dict(zip(kernel.arg_names, args)), meta) for kernel, grid, args, meta in triton_ops._RECORD]
    finally:
        triton_ops._RECORD = None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_launches_do_not_depend_on_the_batch(dtype):
    """C03 on a GPU, checked without one: every choice that sets an order of summation (tile sizes,
    warps, token splits of a block, the mixing GEMM's tiles and per-sample strips) is the same for a
    sample alone and in batches of 2 and 40; only the grid's batch axis and the batch-wide counts
    (``BH`` = batch x heads, ``NCOL`` = batch x columns per sample) grow with the batch. Long blocks,
    few heads: the case where the kernels split blocks (4 splits of 256 tokens per 1024-token block)."""
    from mhla_diffusers import BlockLayout

    layout = BlockLayout((64, 64), (2, 2))
    alone = _recorded_launches(1, layout, 2, 64, dtype)
    assert any(args.get("P", 1) > 1 for _, _, args, _ in alone), "the case no longer splits blocks"
    for batch in (2, 40):
        launches = _recorded_launches(batch, layout, 2, 64, dtype)
        assert [x[0] for x in launches] == [x[0] for x in alone]
        for (name, grid, args, meta), (_, grid1, args1, meta1) in zip(launches, alone):
            assert meta == meta1, name
            grid, grid1 = (*grid, 1)[:2], (*grid1, 1)[:2]
            assert (grid[0], grid[1]) == (grid1[0], grid1[1] * batch), (name, grid, grid1)
            scalars = {key: value for key, value in args.items() if not isinstance(value, torch.Tensor)}
            expected = {key: value for key, value in args1.items() if not isinstance(value, torch.Tensor)}
            for key in ("BH", "NCOL"):
                if key in expected:
                    expected[key] *= batch
            assert scalars == expected, name


def test_auto_picks_triton_on_cuda_only_when_opted_in(monkeypatch):
    """'auto' keeps CUDA tensors on torch until MHLA_AUTO_TRITON=1 (kernels not yet run on a GPU here)."""
    from mhla_diffusers import ops
    from mhla_diffusers.ops import triton_backend

    monkeypatch.setattr(triton_backend, "_gpu_problem", lambda: None)  # pretend a working driver
    monkeypatch.delenv("MHLA_AUTO_TRITON", raising=False)
    assert ops.resolve_backend("auto", torch.device("cuda")) == "torch"
    monkeypatch.setenv("MHLA_AUTO_TRITON", "1")
    assert ops.resolve_backend("auto", torch.device("cuda")) == "triton"
    assert ops.resolve_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(triton_backend, "_gpu_problem", lambda: "no driver")
    assert ops.resolve_backend("auto", torch.device("cuda")) == "torch"


@needs_triton
def test_interpreter_refuses_bfloat16():
    """bf16 arithmetic is wrong in Triton's interpreter: a clear error, not silently wrong numbers."""
    code = (
        "import torch\n"
        "from mhla_diffusers import BlockLayout, mhla_attention, mixing_init\n"
        "lay = BlockLayout((4, 4), (2, 2)); q = torch.randn(1, 2, 16, 8)\n"
        "mhla_attention(q, q, q, mixing_init(lay), lay, backend='triton')\n"
        "try:\n"
        "    mhla_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), mixing_init(lay), lay, backend='triton')\n"
        "except ValueError as err:\n"
        "    print('REFUSED', err)\n"
    )
    proc = _run(["-c", code], interpret=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout and "bfloat16" in proc.stdout, proc.stdout
