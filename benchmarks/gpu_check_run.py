"""The runner of ``benchmarks/gpu_check.py``: the JSONL journal, one stage in its own process, the run in a budget.

The orchestrating process (:func:`orchestrate`) starts one process per stage (``gpu_check.py --run-stage NAME``,
:func:`run_stage`), kills one still running at the budget's end, and writes the summaries
(``gpu_check_summary``) from the JSONL. A stage's process imports ``gpu_check_cases`` (torch and triton); the
orchestrating process imports neither. Records and their fields: docs/triton.md, "What each stage records".
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from gpu_check_plan import (
    CPU_COSTS,
    GPU_COSTS,
    Case,
    Costs,
    Stage,
    build_plan,
    calibrate,
    case_cost,
    device_case,
    plan_row,
    shapes_of,
)
from gpu_check_summary import markdown, summarise

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "gpu_check.py"  # a stage's process runs the command line again with --run-stage
JSONL, SUMMARY_JSON, SUMMARY_MD = "gpu_check.jsonl", "gpu_check.json", "gpu_check.md"

# ----------------------------------------------------------------------------------------------
# The JSONL journal


class Journal:
    """Appends one JSON object per line to ``path``, flushed at once; ``t`` = seconds since the run began."""

    def __init__(self, path: Path, stage: str | None, t0: float):
        self.path, self.stage, self.t0 = Path(path), stage, t0

    def write(self, record_type: str, /, **record) -> dict:
        line = dict(type=record_type, stage=record.pop("stage", self.stage), t=round(time.time() - self.t0, 3), **record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")
            f.flush()
        return line


def end_torn_line(path: Path) -> None:
    """Close a line a killed writer left unfinished, so that the next record starts on its own line."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            f.write(b"\n")


def read_records(path: Path, offset: int = 0) -> list[dict]:
    """The JSONL's records from byte ``offset`` on (a torn last line, from a killed writer, is skipped)."""
    if not Path(path).exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


# ----------------------------------------------------------------------------------------------
# One stage, in its own process


class CompileCounter:
    """Counts Triton JIT builds (and their seconds) through ``triton.knobs.runtime``'s JIT hooks.

    Writes a ``compile`` record per build. Under the interpreter nothing is compiled (count 0)."""

    def __init__(self, journal: Journal):
        import triton

        self.journal, self.count, self.seconds, self.by_kernel, self._started = journal, 0, 0.0, {}, {}
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        self.available = runtime is not None and hasattr(runtime, "jit_post_compile_hook")
        if self.available:
            self._runtime, self._previous = runtime, (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after

    def _before(self, **kw):
        self._started[str(kw.get("key"))] = time.perf_counter()
        previous = self._previous[0]
        return previous(**kw) if previous else None  # a true value would skip the build: never ours

    def _after(self, **kw):
        seconds = time.perf_counter() - self._started.pop(str(kw.get("key")), time.perf_counter())
        name = getattr(kw.get("fn"), "name", "?")
        self.count += 1
        self.seconds += seconds
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1
        self.journal.write("compile", kernel=name, seconds=round(seconds, 3))
        previous = self._previous[1]
        return previous(**kw) if previous else None

    def summary(self, interpret: bool) -> dict:
        note = "interpreter: kernels are not compiled" if interpret else None if self.available else "triton has no JIT hooks"
        return dict(compiles=self.count, compile_s=round(self.seconds, 2), compiles_by_kernel=self.by_kernel, compile_note=note)


def run_case(case: Case, args, dev, ctx: dict, cases_module) -> dict:
    """One case's measurements (a dict for its ``case`` record)."""
    C = cases_module
    import torch

    shapes = shapes_of(args)
    reps, warmup = args.reps, 0 if args.interpret else 3
    nominal = args.hbm_tbps * 1e3
    dtype = getattr(torch, case.dtype) if case.dtype else None
    if case.kind == "device":
        copy = C.copy_bandwidth(dev, (16 if args.interpret else 2048) * 2**20)
        ctx["copy_gbps"] = copy["copy_gbps"]
        return dict(environment=C.environment(dev, args.interpret), nominal_gbps=nominal, **copy)
    if case.kind == "sdpa":
        batch, heads, grid, d, block_grid = shapes[case.shape]
        x = C.make_inputs(batch, heads, grid, d, block_grid, dtype, dev.name)
        q, k, v = x["q"], x["k"], x["v"]
        return dict(shape=case.shape, sdpa=C.sdpa_backend(q, k, v, dev), backends=C.sdpa_backends(q, k, v, dev, min(reps, 10)))
    if case.kind == "timing":
        row = C.time_method(case.method, shapes[case.shape], dtype, dev, reps=reps, warmup=warmup, copy_gbps=ctx.get("copy_gbps"),
                            nominal_gbps=nominal, normalize=case.opts.get("normalize", True))
        return dict(shape=case.shape, **row)
    if case.kind == "correctness":
        batch, heads, grid, d, block_grid = case.opts["spec"]
        opts = {k: v for k, v in case.opts.items() if k != "spec"}
        return C.check_correctness(batch, heads, grid, block_grid, d, dtype, opts, dev.name)
    raise ValueError(f"unknown case kind {case.kind!r}")


def _case_line(case: Case, result: dict) -> str:
    """One progress line for a finished case."""
    if "error" in result:
        return f"  [error] {case.name}: {result['error'][:200]}"
    if case.kind == "timing":
        graph = f", graph {result['graph_ms']:.3f} ms" if "graph_ms" in result else ""
        return f"  {case.name:34s} fwd {result['fwd_ms']:9.3f} ms{graph}, fwd+bwd {result['fwdbwd_ms']:9.3f} ms"
    if case.kind == "correctness":
        return (f"  {case.name:34s} max err vs ref {max(result['vs_reference'].values()):.1e}, vs torch "
                f"{max(result['vs_torch'].values()):.1e} (tol {result['tol']:.0e}) {'ok' if result['ok'] else 'FAIL'}")
    if case.kind == "device":
        return f"  device: {result['environment']['device_name']}, copy {result['copy_gbps']:.0f} GB/s (read + write)"
    return f"  {case.name}: chosen {result['sdpa'].get('chosen')}, ran {result['sdpa'].get('ran')}"


def run_stage(args) -> int:
    """The body of ``--run-stage NAME``: run the stage's cases, append a record per case to the JSONL."""
    t_import = time.perf_counter()
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import gpu_check_cases as C

    args.run_t0 = args.run_t0 or time.time()  # set by the orchestrating process; these for a stage started by hand
    args.deadline = args.deadline or time.time() + args.budget_s
    Path(args.out).mkdir(parents=True, exist_ok=True)
    journal = Journal(Path(args.out) / JSONL, args.run_stage, args.run_t0)
    dev = C.Device(args.device)
    if dev.cuda:
        import torch

        if not torch.cuda.is_available():
            journal.write("stage_done", error="no CUDA device", compiles=0)
            return 2
        torch.cuda.init()
    start_watchdog(args.deadline)
    journal.write("stage_ready", pid=os.getpid(), import_s=round(time.perf_counter() - t_import, 2))
    stage = next(s for s in build_plan(args) if s.name == args.run_stage)
    counter = CompileCounter(journal)
    cases = ([device_case(args.interpret)] if args.measure_device else []) + stage.cases
    run_cases(cases, args, dev, journal, C)
    journal.write("stage_done", **counter.summary(args.interpret))
    return 0


def run_cases(cases: list[Case], args, dev, journal: Journal, C) -> None:
    """The case loop of :func:`run_stage`: each case that fits before the deadline, one record each; after a fault that
    loses the CUDA context, the rest skipped with a record."""
    costs = CPU_COSTS if args.interpret else GPU_COSTS
    ctx = dict(copy_gbps=args.copy_gbps)
    lost = None
    for case in cases:
        need, left = case_cost(case, costs), args.deadline - time.time()
        if lost or need > left:
            reason = f"CUDA context lost: {lost}" if lost else f"budget: needs ~{need:.0f} s, {max(left, 0):.0f} s left"
            journal.write("case_skipped", case=case.name, kind=case.kind, reason=reason)
            print(f"  [skipped] {case.name}: {reason}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            result = run_case(case, args, dev, ctx, C)
        except Exception as exc:
            result = C.format_error(exc)
            if dev.cuda and C.fatal_cuda_error(result["error"]):
                lost = result["error"][:200]
        journal.write("case", **{"case": case.name, "kind": case.kind, "dtype": case.dtype, **result,
                                 "seconds": round(time.perf_counter() - t0, 2)})
        print(_case_line(case, result), flush=True)
        dev.empty_cache()


# ----------------------------------------------------------------------------------------------
# The run: stages one after another within the budget


def stop_process(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM to the process group of ``proc`` (its own session), SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: list[str], timeout_s: float) -> tuple[str, int | None, float]:
    """Run ``cmd`` in a new session; ``("ok" | "failed" | "killed", return code, seconds)``."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(0.1, timeout_s))
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        stop_process(proc)
        status = "killed"
    except BaseException:  # interrupted (SIGINT, or SIGTERM from an outer timeout): no stage outlives the run
        stop_process(proc)
        raise
    return status, proc.returncode, time.perf_counter() - start


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def start_watchdog(deadline: float, grace_s: float = 5.0) -> None:
    """In a stage's process: exit ``grace_s`` after ``deadline`` even if the orchestrating process is gone."""
    import threading

    timer = threading.Timer(max(0.0, deadline - time.time()) + grace_s, lambda: os._exit(124))
    timer.daemon = True
    timer.start()


def stage_end_record(stage: Stage, status: str, rc, seconds: float, estimate: float, records: list[dict]) -> dict:
    """What a finished (or killed) stage did, from its own records."""
    mine = [r for r in records if r.get("stage") == stage.name]
    cases = [r for r in mine if r["type"] == "case"]
    done = next((r for r in mine if r["type"] == "stage_done"), {})
    compiles = [r for r in mine if r["type"] == "compile"]
    errors = [r["case"] for r in cases if "error" in r]
    failed = [r["case"] for r in cases if r.get("kind") == "correctness" and not r.get("ok", True)]
    skipped = [r["case"] for r in mine if r["type"] == "case_skipped"]
    if status == "ok" and (errors or failed):
        status = "errors"
    elif status == "ok" and skipped:
        status = "partial"
    return dict(stage=stage.name, status=status, returncode=rc, seconds=round(seconds, 2), estimate_s=round(estimate, 1),
                cases_done=len(cases), cases_skipped=skipped,
                case_errors=errors, correctness_failures=failed, planned_compiles=stage.planned_compiles,
                compiles=done.get("compiles", len(compiles)),
                compile_s=done.get("compile_s", round(sum(r["seconds"] for r in compiles), 2)),
                compile_note=done.get("compile_note"), compiles_by_kernel=done.get("compiles_by_kernel"))


def child_command(argv: list[str], stage: str, t0: float, deadline: float, copy_gbps: float | None) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), *argv, "--run-stage", stage, "--run-t0", repr(t0), "--deadline", repr(deadline)]
    return cmd + (["--copy-gbps", repr(copy_gbps)] if copy_gbps else ["--measure-device"])


def orchestrate(args, argv: list[str]) -> int:
    """Run the plan's stages, each in its own process, within ``--budget-s``; write the summaries."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / JSONL
    path.write_text("")
    t0 = time.time()
    deadline = t0 + args.budget_s
    costs = Costs(**asdict(CPU_COSTS if args.interpret else GPU_COSTS))
    journal = Journal(path, None, t0)
    plan = build_plan(args)
    journal.write("run_start", date=_dt.datetime.now().isoformat(timespec="seconds"), budget_s=args.budget_s, args=vars(args),
                  costs=asdict(costs), plan=[plan_row(s, costs) for s in plan])
    print(f"gpu_check: {len(plan)} stages, budget {args.budget_s:.0f} s, results in {path}", flush=True)
    killed, skipped, totals = None, [], dict(compiles=0, compile_s=0.0, fresh=0, fresh_s=0.0)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        killed = run_stages(plan, argv, path, journal, costs, t0, deadline, skipped, totals)
    except KeyboardInterrupt as exc:  # the run was stopped from outside: what ran is in the JSONL
        end_torn_line(path)
        journal.write("interrupted", reason=str(exc) or "SIGINT", elapsed_s=round(time.time() - t0, 1))
    budget_cases = [dict(stage=r["stage"], case=r["case"]) for r in read_records(path)
                    if r["type"] == "case_skipped" and r["reason"].startswith("budget")]
    if skipped or killed or budget_cases:
        journal.write("budget_stop", budget_s=args.budget_s, elapsed_s=round(time.time() - t0, 1), skipped_stages=skipped,
                      killed_stage=killed, skipped_cases=budget_cases)
    journal.write("run_end", elapsed_s=round(time.time() - t0, 1), compiles=totals["compiles"], compile_s=round(totals["compile_s"], 1))
    report = summarise(read_records(path))
    (out / SUMMARY_JSON).write_text(json.dumps(report, indent=1, default=str))
    (out / SUMMARY_MD).write_text(markdown(report))
    bad = report["problems"]
    print(f"done in {time.time() - t0:.1f} s: {out / SUMMARY_MD}; problems: {bad or 'none'}", flush=True)
    return 1 if bad else 0


def run_stages(plan, argv, path, journal, costs, t0, deadline, skipped, totals):
    """The stage loop of :func:`orchestrate` (appends to ``skipped``, adds to ``totals``); returns the stage killed at
    the budget, or ``None``."""
    copy_gbps, killed, started = None, None, False
    for stage in plan:
        left = deadline - costs.reserve_s - time.time()
        estimate = stage.estimate(costs)
        if killed or left <= 0 or (estimate > left and started):  # the first stage starts anyway: its cases are budgeted
            reason = f"budget: a stage was stopped at the budget ({killed})" if killed else \
                f"budget: estimate {estimate:.0f} s > {max(left, 0):.0f} s left"
            journal.write("stage_skipped", stage=stage.name, reason=reason, estimate_s=round(estimate, 1))
            print(f"[{stage.name}] skipped: {reason}", flush=True)
            skipped.append(stage.name)
            continue
        start = journal.write("stage_start", stage=stage.name, estimate_s=round(estimate, 1), left_s=round(left, 1),
                              planned_compiles=stage.planned_compiles)
        print(f"[{stage.name}] {stage.title} (estimate {estimate:.0f} s, {left:.0f} s left)", flush=True)
        started = True
        offset = path.stat().st_size
        status, rc, seconds = run_child(child_command(argv, stage.name, t0, deadline - costs.reserve_s, copy_gbps), left)
        end_torn_line(path)
        records = read_records(path, offset)
        end = journal.write("stage_end", **stage_end_record(stage, status, rc, seconds, estimate, records))
        print(f"[{stage.name}] {end['status']} in {seconds:.1f} s, {end['compiles']} compiles", flush=True)
        calibrate(costs, records, stage.name, start["t"], totals)
        copy_gbps = copy_gbps or next((r.get("copy_gbps") for r in records if r.get("kind") == "device" and "copy_gbps" in r), None)
        if status == "killed":
            killed = stage.name
    return killed
