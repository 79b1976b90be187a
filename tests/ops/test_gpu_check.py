"""benchmarks/gpu_check.py without a GPU: its CPU rehearsal, its budget, its JSONL, its plan.

- A full rehearsal (``--device cpu --interpret``, Triton's interpreter, tiny shapes): every stage runs in its
  own process and appends its records; the device probe, SDPA probe, timing, per-kernel times, the CUDA-graph
  stub, the determinism check and the correctness checks all run; the summaries are written.
- A rehearsal whose budget stops it: it ends within the budget (plus a small margin) and says what it skipped.
- The kill of a stage that outlives the budget, the JSONL's torn-line repair, the arguments and the plan.
- ``--plan``: the first-run profile makes the Triton compilations the plan says (10: 6 + 4 new), recounted with
  Triton's own binder for sm_90.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def _module():
    """benchmarks/gpu_check.py as a module (the real mhla_diffusers imported first: the script stubs it only when absent)."""
    import mhla_diffusers  # noqa: F401

    if "gpu_check_under_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["gpu_check_under_test"]


def _run(args, *, interpret, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def _records(folder: Path) -> list[dict]:
    lines = (folder / "gpu_check.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]  # every line one JSON object


@needs_triton
def test_full_rehearsal(tmp_path):
    """Every stage and every kind of case runs in the rehearsal; the JSONL tells the whole run."""
    proc, seconds = _run(["--device", "cpu", "--interpret", "--budget-s", "240", "--out", str(tmp_path)], interpret=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = _records(tmp_path)
    assert records[0]["type"] == "run_start" and records[-1]["type"] == "run_end"
    assert seconds < 240 and not [r for r in records if r["type"] == "budget_stop"]
    module = _module()
    ends = {r["stage"]: r for r in records if r["type"] == "stage_end"}
    assert list(ends) == list(module.STAGE_NAMES)
    assert all(e["status"] == "ok" and e["compiles"] == 0 for e in ends.values()), ends
    assert all(e["planned_compiles"] == 0 and e["compile_note"].startswith("interpreter") for e in ends.values())
    assert len({r["pid"] for r in records if r["type"] == "stage_ready"}) == len(ends)  # one process per stage
    cases = [r for r in records if r["type"] == "case"]
    assert not [r for r in cases if "error" in r], [r["error"] for r in cases if "error" in r]
    device = [r for r in cases if r["kind"] == "device"]
    assert len(device) == 1 and device[0]["stage"] == "profile-M105" and device[0]["copy_gbps"] > 0
    assert device[0]["environment"]["diffusers_imported"] is False
    sdpa = [r for r in cases if r["kind"] == "sdpa"][0]
    assert sdpa["sdpa"]["chosen"] and sdpa["sdpa"]["ran"] != "unknown" and "flash" in sdpa["backends"]
    timing = [r for r in cases if r["kind"] == "timing"]
    assert {r["method"] for r in timing} == set(module.METHODS)
    profile = {(r["stage"], r["method"]) for r in timing if r["stage"].startswith("profile")}
    assert {("profile-M105", "sdpa"), ("profile-M105", "torch-rope"), ("profile-M105", "triton-rope"),
            ("profile-M64", "triton-rope"), ("profile-M64", "torch-rope")} <= profile
    fused = [r for r in timing if r["method"] == "triton-rope"]
    for r in fused:
        assert r["determinism"]["deterministic"] and r["graph"].startswith("stub") and r["graph_ms"] > 0
        assert {k["kernel"] for k in r["kernels"]} == {"fwd_summaries", "mix_gemm", "fwd_output", "bwd_query", "bwd_key"}
        assert r["bytes"]["forward_bytes"] >= r["bytes"]["floor_bytes"] > 0 and {"fwd_ms", "fwdbwd_ms"} <= set(r["target"])
    correctness = [r for r in cases if r["kind"] == "correctness"]
    assert correctness and all(r["ok"] for r in correctness)
    assert any(r["compiled"] and r["rotary"] for r in correctness)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not report["problems"]
    assert (tmp_path / "gpu_check.md").read_text().startswith("# Triton MHLA backend: GPU check")


@needs_triton
def test_budget_stopped_rehearsal(tmp_path):
    """A budget too small for the plan: the run ends within it, records what it skipped, and the JSONL stays whole."""
    budget = 6.0
    proc, seconds = _run(["--device", "cpu", "--interpret", "--budget-s", str(budget), "--out", str(tmp_path)], interpret=True,
                         timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert seconds < budget + 4  # interpreter start-up and the summary included
    records = _records(tmp_path)
    assert records[-1]["type"] == "run_end" and records[-1]["elapsed_s"] <= budget + 1
    stop = [r for r in records if r["type"] == "budget_stop"]
    assert len(stop) == 1 and stop[0]["skipped_stages"]
    skipped = {r["stage"] for r in records if r["type"] == "stage_skipped"}
    assert skipped == set(stop[0]["skipped_stages"]) and all(r["reason"].startswith("budget") for r in records
                                                               if r["type"] == "stage_skipped")
    assert [r["stage"] for r in records if r["type"] == "stage_start"] == ["profile-M105"]  # the first stage always starts
    assert "Stopped by the budget" in (tmp_path / "gpu_check.md").read_text()


def test_a_stage_past_the_budget_is_killed():
    """The orchestrator's hard stop: a stage process still running at its deadline is killed with its process group."""
    module = _module()
    start = time.perf_counter()
    status, rc, seconds = module.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
    assert status == "killed" and rc is not None and time.perf_counter() - start < 5


def test_journal_survives_a_torn_line(tmp_path):
    """A line a killed writer left unfinished is closed, skipped when read, and later records are whole."""
    module = _module()
    path = tmp_path / "gpu_check.jsonl"
    journal = module.Journal(path, "s", time.time())
    journal.write("case", case="a")
    with open(path, "a") as f:
        f.write('{"type": "case", "case": "tor')
    module.end_torn_line(path)
    journal.write("stage_end", status="killed")
    assert [r["type"] for r in module.read_records(path)] == ["case", "stage_end"]


def test_arguments_and_plan():
    """Defaults, refusals and the plan's shape: the profile first, few compiles in it, estimates that fit the default budget."""
    module = _module()
    a = module.parse_args(["--out", "x"])
    assert a.device == "cuda" and a.reps == 20 and a.budget_s == 450 and not a.interpret
    assert module.parse_args(["--quick"]).reps == 8 and module.parse_args(["--device", "cpu", "--interpret"]).reps == 1
    for bad in (["--device", "cpu"], ["--interpret"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit):
            module.parse_args(bad)
    assert module.SHAPES["wan-M105"] == (1, 12, (21, 30, 52), 128, (3, 5, 7))
    assert module.SHAPES["wan-M64"][4] == (4, 4, 4)
    plan = module.build_plan(a)
    assert [s.name for s in plan] == list(module.STAGE_NAMES)
    profile = plan[:2]
    assert sum(s.planned_compiles for s in profile) == 10
    assert sum(s.estimate(module.GPU_COSTS) for s in profile) < 150  # the profile's numbers come in the first minutes
    assert [c.kind for c in profile[0].cases][:2] == ["sdpa", "timing"]  # safe cases before the kernels in that process
    only = module.build_plan(module.parse_args(["--skip-timing", "--stages", "profile-M105", "correctness-bf16"]))
    assert [s.name for s in only] == ["profile-M105", "correctness-bf16"] and all(c.kind == "correctness" for s in only for c in s.cases)


@needs_triton
def test_plan_recounts_the_profile_compiles():
    """``--plan`` specialises the profile's launches with Triton's binder for sm_90: 6 builds, then 4 new."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--plan", "--stages", "profile-M105", "profile-M64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("profile")}
    assert "6 (6 new)" in rows["profile-M105"] and "6 (4 new)" in rows["profile-M64"], proc.stdout


def _step_module():
    spec = importlib.util.spec_from_file_location("gpu_step_under_test", ROOT / "benchmarks" / "gpu_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_step_arguments():
    """benchmarks/gpu_step.py parses here; a GPU measurement on the CPU is refused unless --dry-run."""
    module = _step_module()
    a = module.parse_args([])
    assert (a.device, a.blocks, a.frames, a.height, a.width, a.dtype) == ("cuda", 30, 81, 480, 832, "bfloat16")
    with pytest.raises(SystemExit):
        module.parse_args(["--device", "cpu"])
    with pytest.raises(SystemExit):
        module.parse_args(["--frames", "80"])
    dry = module.parse_args(["--dry-run"])
    assert dry.device == "cpu" and dry.backends == ["torch"] and dry.blocks <= 3


def test_gpu_step_dry_run(tmp_path):
    """--dry-run: a tiny Wan on the CPU runs every variant through the script and writes its JSON."""
    out = tmp_path / "step.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert set(rows) == {"sdpa", "mhla-torch", "hybrid-torch"} and all(r["step_ms"] > 0 for r in rows.values())
    assert rows["mhla-torch"]["layers"] == [0, 1, 2] and rows["hybrid-torch"]["layers"] == [1, 2]  # softmax kept on 0, 3, ...
    assert set(report["speedup_vs_sdpa"]) == {"mhla-torch", "hybrid-torch"}
