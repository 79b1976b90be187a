"""benchmarks/bench_vace.py at tiny widths of the real class (seconds, CPU): both parts run, the shares follow from
the per-layer times as documented, the FLOP model prices a VACE layer as a main one, the deviations and scores
cover both kinds of layers."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("vace")
    assert load_script("benchmarks/bench_vace.py").main(["--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "bench_vace.json").read_text())


def test_cost_part(quick):
    _, report = quick
    cost = report["cost"]
    assert [r["n"] for r in cost["layers"]] == [24, 48]
    for r in cost["layers"]:
        assert set(r["seconds"]) == {f"{k}_{v}" for k in ("blocks", "vace_blocks") for v in ("stock", "mhla")}
        assert all(s > 0 for s in r["seconds"].values())
    s = cost["layers"][1]["seconds"]
    share = cost["shares"]["Wan2.1-VACE-1.3B"]["48"]
    assert (share["main_layers"], share["vace_layers"]) == (30, 15)
    stock = 30 * s["blocks_stock"] + 15 * s["vace_blocks_stock"]
    assert share["vace_share"] == pytest.approx(15 * s["vace_blocks_stock"] / stock)
    assert share["time_left"]["all"] == pytest.approx((30 * s["blocks_mhla"] + 15 * s["vace_blocks_mhla"]) / stock)
    assert (cost["shares"]["Wan2.1-VACE-14B"]["48"]["main_layers"], cost["shares"]["Wan2.1-VACE-14B"]["48"]["vace_layers"]) == (40, 8)
    for name, layers in (("Wan2.1-VACE-1.3B", 45), ("Wan2.1-VACE-14B", 48)):
        flops = cost["flops"][name]
        assert flops["layers"] == layers and flops["stock_main"] == flops["stock_vace"] and flops["mhla_main"] == flops["mhla_vace"]
    small = cost["flops"]["Wan2.1-VACE-1.3B"]
    assert small["vace_only_cost"] == pytest.approx(1 - (1 - small["all_mhla_cost"]) / 3)  # a third of the layers


def test_sensitivity_part_and_report(quick):
    out, report = quick
    s = report["sensitivity"]
    assert [r["seed"] for r in s["per_seed"]] == [0]
    assert all(s["mean"][k] > 0 for k in ("main_only", "vace_only", "all"))
    assert [x["module"] for x in s["scores"]] == ["blocks.0.attn1", "blocks.1.attn1", "blocks.2.attn1", "vace_blocks.0.attn1",
                                                  "vace_blocks.1.attn1"]
    md = (out / "bench_vace.md").read_text()
    assert "VACE share" in md and "`vace_blocks.1.attn1`" in md and "MHLA VACE only" in md
