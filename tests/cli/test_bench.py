"""Smoke test of benchmarks/bench_ops.py: the CLI wiring at tiny sizes (seconds, CPU)."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_ops.py")


def test_quick_run_writes_json_markdown_and_plot(bench, tmp_path):
    out = tmp_path / "res"
    report = bench.main(
        ["--quick", "--sizes", "16", "64", "--shapes", "ref", "dit", "--reps", "1", "--gemm-size", "128", "--out", str(out)]
    )

    data = json.loads((out / "bench_ops.json").read_text())
    assert data["machine"]["threads"] == 1
    for key in ("cpu_model", "torch", "date_utc", "loadavg_start", "loadavg_end"):
        assert data["machine"][key], key
    assert data["gemm"]["gflops"] > 0
    rows = data["results"]
    # every method, both modes (io_floor: forward only), both shapes
    want = {(m, mode, shape) for m in ("sdpa", "linear", "mhla_torch") for mode in ("fwd", "fwdbwd") for shape in ("ref", "dit")}
    want |= {("io_floor", "fwd", shape) for shape in ("ref", "dit")}
    assert {(r["method"], r["mode"], r["shape"]) for r in rows} == want
    for r in rows:
        assert "skipped" not in r, r
        assert r["time_ms"] > 0 and r["runs"] >= 1 and r["peak_bytes"] >= 0
        assert r["n"] in (16, 64)
    ref_rows = [r for r in rows if r["shape"] == "ref" and r["n"] == 64]
    assert {r["num_blocks"] for r in ref_rows} == {64}  # the reference shape uses M = 64 (8 x 8 blocks)
    ratios = {(e["shape"], e["mode"]): e for e in data["summary"]["ratios"]}
    assert ratios[("ref", "fwd")]["mhla_over_linear_time"] > 0
    assert ratios[("ref", "fwd")]["mhla_over_linear_peak_mem"] >= 0
    assert "mhla_pct_of_gemm" in ratios[("dit", "fwd")]
    assert report["summary"] == data["summary"]
    scaling = {(e["shape"], e["method"], e["mode"]): e for e in data["summary"]["scaling"]}
    assert scaling[("ref", "mhla_torch", "fwd")]["token_ratio"] == 4  # N = 16 -> 64
    assert scaling[("ref", "mhla_torch", "fwd")]["time_ratio"] > 0

    md = (out / "bench_ops.md").read_text()
    assert "| N | M |" in md and "GFLOP/s" in md and data["machine"]["cpu_model"] in md
    assert (out / "bench_ops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slow_measurements_are_skipped(bench, tmp_path):
    report = bench.main(
        ["--quick", "--sizes", "16", "64", "--shapes", "sana", "--methods", "sdpa", "mhla_torch", "--modes", "fwd",
         "--reps", "1", "--gemm-size", "128", "--max-seconds", "0", "--no-plot", "--out", str(tmp_path)]
    )
    assert all("skipped" in r and "--max-seconds" in r["skipped"] for r in report["results"])
    md = (tmp_path / "bench_ops.md").read_text()
    assert "skipped sdpa fwd N=16" in md
    assert not (tmp_path / "bench_ops.png").exists()


def test_sizes_must_be_perfect_squares(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "1000"])
