"""Smoke test of benchmarks/bench_pipeline.py: tiny DiT and SANA configs, in-process (seconds, CPU)."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_pipeline.py")


def test_quick_run_writes_json_and_markdown(bench, tmp_path):
    out = tmp_path / "res"
    report = bench.main(["--quick", "--out", str(out)])

    data = json.loads((out / "bench_pipeline.json").read_text())
    assert data["machine"]["threads"] == 1
    for key in ("cpu_model", "torch", "date_utc", "loadavg_start", "loadavg_end"):
        assert data["machine"][key], key
    assert data["settings"]["quick"] is True
    rows = data["results"]
    latents = {"dit": (8, 16), "sana": (8, 16)}
    want = {(m, v, lat) for m in latents for v in bench.VARIANTS for lat in latents[m]}
    assert {(r["model"], r["variant"], r["latent"]) for r in rows} == want
    for r in rows:
        assert r["time_ms"] > 0 and r["runs"] >= 1 and r["finite"], r
        patch = 2 if r["model"] == "dit" else 1
        assert r["n"] == (r["latent"] // patch) ** 2
        assert (r["m"] is None) == (r["variant"] == "stock")
        if r["m"] is not None:
            assert r["m"] >= 1
    # one ratio per (model, MHLA variant, latent), consistent with the rows
    assert len(data["ratios"]) == len(want) - 4
    for q in data["ratios"]:
        get = lambda v: next(r for r in rows if (r["model"], r["variant"], r["latent"]) == (q["model"], v, q["latent"]))  # noqa: E731
        assert q["ratio"] == pytest.approx(get(q["variant"])["time_ms"] / get("stock")["time_ms"])
    assert report["results"] == rows

    md = (out / "bench_pipeline.md").read_text()
    assert "| model | px | latent | N | M | stock ms | MHLA all ms | MHLA hybrid ms | all / stock | hybrid / stock |" in md
    table = [line for line in md.splitlines() if line.startswith("| DiT") or line.startswith("| SANA")]
    assert len(table) == 4 and all(line.count("|") == 11 for line in table)
    assert "1 thread(s)" in md and "--quick" in md

    # --render rewrites the markdown from the JSON alone, identically
    (out / "bench_pipeline.md").unlink()
    bench.main(["--render", str(out / "bench_pipeline.json")])
    assert (out / "bench_pipeline.md").read_text() == md


def test_full_configs_are_the_published_ones(bench):
    dit, sana = bench.DIT_XL_2, bench.SANA_600M
    assert (dit["num_layers"], dit["num_attention_heads"], dit["attention_head_dim"], dit["patch_size"]) == (28, 16, 72, 2)
    assert (sana["num_layers"], sana["num_attention_heads"], sana["attention_head_dim"]) == (28, 36, 32)
    assert (sana["num_cross_attention_heads"], sana["cross_attention_head_dim"], sana["cross_attention_dim"]) == (16, 72, 1152)
    args = bench.parse_args(["--device", "cuda"])
    assert args.dtype == "bfloat16"
    assert bench.latents_for("dit", args) == [64] and bench.latents_for("sana", args) == [32]
