"""benchmarks/bench_blocks.py: tiny widths of the real classes (seconds, CPU), the derived step time and crossover,
--merge and --render; the published configs it builds."""

from __future__ import annotations

import json
import math

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_blocks.py")


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("blocks")
    bench.main(["--quick", "--models", "dit-xl", "wan-1.3b", "--out", str(out)])
    return out, json.loads((out / "bench_blocks.json").read_text())


def test_quick_run_times_every_variant_mode_and_grid(bench, quick):
    out, report = quick
    assert [(r["model"], r["threads"]) for r in report["runs"]] == [("dit-xl", 1), ("wan-1.3b", 1)]
    for run in report["runs"]:
        grids = [tuple(g) for g in bench.MODELS[run["model"]]["quick"]]
        cells = {(tuple(r["grid"]), r["variant"], r["mode"]) for r in run["rows"]}
        assert cells == {(g, v, m) for g in grids for v in bench.VARIANTS for m in bench.MODES}
        for r in run["rows"]:
            assert r["n"] == math.prod(r["grid"]) and len(r["walls"]) == 1 and r["walls"][0] > 0, r
            assert r["peak_bytes"] >= 0 and (r["m"] is None) == (r["variant"] == "stock")
            if r["variant"] != "stock":
                import mhla_diffusers

                blocks = 1 if r["variant"] == "linear" else math.prod(mhla_diffusers.choose_block_grid(tuple(r["grid"])))
                assert r["m"] == blocks, r
        for c in run["costs"]:  # the operator alone beside the FLOP model
            assert c["stock_seconds"] > 0 and c["mhla_seconds"] > 0
            assert c["measured_ratio"] == pytest.approx(c["mhla_seconds"] / c["stock_seconds"])
        assert run["machine"]["loadavg_end"] and run["layers"] == bench.MODELS[run["model"]]["config"]["num_layers"]
    md = (out / "bench_blocks.md").read_text()
    assert "## DiT-XL/2" in md and "## Wan2.1-1.3B" in md and "Crossover" in md and "measured / FLOPs" in md
    assert (out / "bench_blocks.png").stat().st_size > 0


def test_step_time_is_the_rest_plus_layers_times_the_block(bench, quick):
    _, report = quick
    run = report["runs"][1]
    for entry in bench.derive(run):
        rest = next(x for x in run["model_runs"] if x["n"] == entry["n"])["model_1layer_seconds"] - entry["stock_fwd"]
        assert entry["rest_seconds"] == pytest.approx(max(rest, 0.0))
        for v in ("stock", "mhla", "linear"):
            assert entry[f"{v}_step"] == pytest.approx(entry["rest_seconds"] + 30 * entry[f"{v}_fwd"])
            assert entry[f"{v}_train_step"] == pytest.approx(30 * entry[f"{v}_fwdbwd"])
        assert entry["speedup_mhla_step"] == pytest.approx(entry["stock_step"] / entry["mhla_step"])


def test_crossover_bracket_and_fit(bench):
    def entries(ns, stock, mhla):
        return [{"n": n, "stock_step": s, "mhla_step": m, "speedup_mhla_step": s / m} for n, s, m in zip(ns, stock, mhla)]

    # T_stock = 1 + N + N^2 / 1000, T_mhla = 1 + 2 N: equal at N = 1000
    ns = [250, 500, 2000, 4000]
    found = bench.crossover(entries(ns, [1 + n + n * n / 1000 for n in ns], [1 + 2 * n for n in ns]))
    assert 500 < found["n"] < 2000 and "between 500 and 2,000" in found["text"]
    ns = [2000, 4000, 8000]  # MHLA already faster everywhere: the fit finds the crossover below the sweep
    found = bench.crossover(entries(ns, [1 + n + n * n / 1000 for n in ns], [1 + 2 * n for n in ns]))
    assert found["n"] == pytest.approx(1000, rel=1e-6) and "below 2,000" in found["text"]
    assert "slower at every" in bench.crossover(entries(ns, [1.0] * 3, [2.0] * 3))["text"]


def test_merge_and_render_rewrite_the_report(bench, quick, tmp_path):
    out, report = quick
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bench_blocks.json").write_text(json.dumps({**report, "runs": report["runs"][:1]}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench_blocks.json").write_text(json.dumps({**report, "runs": report["runs"][1:]}))
    merged = bench.main(["--merge", str(tmp_path / "a" / "bench_blocks.json"), str(tmp_path / "b" / "bench_blocks.json"),
                         "--out", str(tmp_path / "m")])
    assert merged["runs"] == report["runs"] and len(merged["settings"]["merged"]) == 2
    md = (tmp_path / "m" / "bench_blocks.md").read_text()
    (tmp_path / "m" / "bench_blocks.md").unlink()
    bench.main(["--render", str(tmp_path / "m" / "bench_blocks.json")])
    assert (tmp_path / "m" / "bench_blocks.md").read_text() == md
    again = bench.main(["--merge", str(tmp_path / "m" / "bench_blocks.json"), str(tmp_path / "b" / "bench_blocks.json"),
                        "--out", str(tmp_path / "m2")])
    assert len(again["settings"]["merged"]) == 3  # a merged report keeps the commands of every run in it


def test_published_configs(bench):
    wan, big, sana = (bench.MODELS[k]["config"] for k in ("wan-1.3b", "wan-14b", "sana-1600m"))
    assert (wan["num_layers"], wan["num_attention_heads"], wan["attention_head_dim"], wan["ffn_dim"]) == (30, 12, 128, 8960)
    assert (big["num_layers"], big["num_attention_heads"], big["ffn_dim"]) == (40, 40, 13824)
    assert (sana["num_layers"], sana["num_attention_heads"], sana["attention_head_dim"]) == (20, 70, 32)
    assert (sana["num_cross_attention_heads"], sana["cross_attention_head_dim"]) == (20, 112)
    video = bench.MODELS["sana-video"]["config"]
    assert (video["num_layers"], video["num_attention_heads"], video["attention_head_dim"], video["caption_channels"]) == (
        20, 20, 112, 2304)
    assert max(math.prod(g) for g in bench.MODELS["wan-1.3b"]["grids"]) == 32760  # 81 frames at 480 x 832
    assert max(math.prod(g) for g in bench.MODELS["sana-1600m"]["grids"]) == 128 * 128  # 4,096 px
