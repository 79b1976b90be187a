"""The command-line tools as a user runs them: conversion/convert.py, pipelines/generate.py, and the
demo's wiring (demo/run_study.py --quick, what `make demo` runs) on the committed pretrained base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_main, tiny_dit_pipeline

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def base_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "base"
    tiny_dit_pipeline(num_layers=3).save_pretrained(folder)
    return folder


def test_convert_then_generate(base_pipeline, tmp_path):
    """convert.py writes the converted format (hybrid: layers 1, 2 of 3); generate.py loads it through
    DiTPipeline and writes a PNG grid; converting the result again is refused with exit code 3 (C15)."""
    out = tmp_path / "mhla"
    result = _run("conversion/convert.py", "--family", "dit", "--src", base_pipeline, "--out", out,
                  "--layers", "hybrid", "--block-grid", "2,2")
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)
    assert spec["layers"] == [1, 2] and spec["block_grid"] == [1, 2, 2]
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["layers"] == [1, 2] and config["family"] == "dit"
    assert (out / "model_index.json").is_file() and (out / "transformer" / "mhla.safetensors").is_file()

    png = tmp_path / "grid.png"
    result = _run("pipelines/generate.py", "--checkpoint", out, "--class-labels", "1", "2", "3",
                  "--steps", "2", "--seed", "0", "--out", png)
    assert result.returncode == 0, result.stderr
    from PIL import Image

    image = Image.open(png)
    assert image.size == (3 * 8, 8)  # three 8 x 8 images in one row

    again = _run("conversion/convert.py", "--family", "dit", "--src", out, "--out", tmp_path / "again")
    assert again.returncode == 3 and "already an MHLA checkpoint" in again.stderr
    assert not (tmp_path / "again").exists()


def test_convert_rejects_bad_input(base_pipeline, tmp_path, capsys):
    cases = [
        (["--family", "nosuchfamily"], "unknown family"),
        (["--family", "sana"], "holds a DiTTransformer2DModel"),  # a family, but not this model's
        (["--family", "dit", "--layers", "0,7"], "out of range"),
        (["--family", "dit", "--block-grid", "9,9"], "does not fit"),
    ]
    for extra, message in cases:
        code, err = run_main("conversion/convert.py", "--src", base_pipeline, "--out", tmp_path / "x", *extra, capsys=capsys)
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "x").exists()
    code, err = run_main("conversion/convert.py", "--family", "dit", "--src", tmp_path / "nothing", "--out", tmp_path / "y",
                      capsys=capsys)
    assert code == 2 and "does not exist" in err


def test_generate_rejects_unknown_label(base_pipeline, tmp_path, capsys):
    for label, message in (("zebra", "unknown class label 'zebra'"), ("1000", "outside")):
        code, err = run_main("pipelines/generate.py", "--checkpoint", base_pipeline, "--class-labels", label,
                          "--steps", "1", "--out", tmp_path / "g.png", capsys=capsys)
        assert code == 2 and message in err, err
    assert not (tmp_path / "g.png").exists()


def test_demo_and_study_wiring_quick(tmp_path):
    """`make demo` / demo/run_study.py in a few-step mode on the committed 256-token base: every model is
    converted (the auto hybrid by measured sensitivity), distilled, fine-tuned, evaluated and sampled;
    the report holds finite numbers for each; --resume reuses finished results and refuses other settings."""
    if not (ROOT / "demo" / "base_dit" / "model_index.json").is_file():
        pytest.fail("demo/base_dit is missing: the demo's pretrained checkpoint must be committed")
    out = tmp_path / "study"
    result = _run("demo/run_study.py", "--quick", "--sizes", "256", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    results = report["sizes"]["256"]["results"]
    assert set(results) == {"softmax", "mhla_all", "mhla_hybrid", "mhla_auto", "linear"}
    for name, r in results.items():
        assert r["steps"] == ({"distill": 0, "finetune": 4} if name == "softmax" else {"distill": 2, "finetune": 2}), name
        for stage, value in r["heldout_loss"].items():
            assert torch.isfinite(torch.tensor(value)), (name, stage)
        assert (out / f"samples_256_{name}.png").is_file()
    assert results["softmax"]["mhla_layers"] is None and results["mhla_hybrid"]["mhla_layers"] == [1, 2, 4, 5]
    auto = results["mhla_auto"]
    assert len(auto["mhla_layers"]) == 4 and auto["selection"]["method"] == "auto" and len(auto["selection"]["scores"]) == 6
    kept = sorted(set(range(6)) - set(auto["mhla_layers"]))
    scores = auto["selection"]["scores"]
    assert kept == auto["selection"]["softmax_layers"] and min(scores[i] for i in kept) >= max(scores[i] for i in auto["mhla_layers"])
    gap = report["sizes"]["256"]["gap_closed"]
    assert gap["softmax"] == 1.0 and gap["linear"] == 0.0
    assert (out / "heldout.png").read_bytes()[:4] == b"\x89PNG" and "| MHLA hybrid, auto |" in (out / "report.md").read_text()
    # --resume: nothing recomputed (the checkpoints are not even looked at), other settings refused
    stamp = (out / "results" / "256_linear.json").stat().st_mtime_ns
    again = _run("demo/run_study.py", "--quick", "--sizes", "256", "--variants", "linear", "--out", out, "--resume")
    assert again.returncode == 0 and "reusing" in again.stdout and (out / "results" / "256_linear.json").stat().st_mtime_ns == stamp
    other = _run("demo/run_study.py", "--quick", "--sizes", "256", "--out", out, "--resume", "--keep-softmax", "1")
    assert other.returncode == 2 and "other settings" in other.stderr
