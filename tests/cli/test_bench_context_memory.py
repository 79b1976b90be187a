"""benchmarks/bench_context_memory.py, its wiring at a tiny width: one process, then two under torchrun (one context
group), then the report. The exchange it records is MHLA's all-reduce of the block summaries, forward and backward, of
the size the byte formulas give; the table has one row per degree."""

from __future__ import annotations

import json
import math

from helpers import load_script
from helpers_parallel import torchrun


def test_quick_runs_at_degree_one_and_two_and_their_report(tmp_path):
    bench = load_script("benchmarks/bench_context_memory.py")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    run = torchrun(2, "benchmarks/bench_context_memory.py", "--quick", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"context_memory_{p}.json").read_text()) for p in (1, 2))
    assert one["degree"] == 1 and len(one["ranks"]) == 1 and one["ranks"][0]["exchanges"] == 0
    assert two["degree"] == 2 and len(two["ranks"]) == 2 and two["tokens"] == math.prod(two["grid"]) == 32
    blocks = math.prod(two["block_grid"])
    payload = 2 * blocks * 12 * 13 * 4  # heads x M x d x (d + 1) float32 numbers: tiny Wan, 2 heads of 12
    for rank in two["ranks"]:
        assert rank["exchange_bytes"] == {"forward": payload, "backward": payload}, rank
        assert rank["peak_bytes"] >= 0 and rank["wall_s"] > 0  # a tiny block may fit pages the process already holds
    assert two["formulas_forward_bytes"]["mhla"] == payload  # 2 (P - 1) / P of it leaves a rank: P = 2
    assert bench.main(["--report", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "context_memory.md").read_text()
    assert "| 1 | " in table and "| 2 | " in table and table.count("\n| ") == 3  # the header, two degrees


def test_report_without_runs_says_what_to_do(tmp_path, capsys):
    bench = load_script("benchmarks/bench_context_memory.py")
    assert bench.main(["--report", "--out", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err
