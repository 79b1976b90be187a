#!/usr/bin/env python
"""GPU check of the Triton MHLA backend within a time budget: a first-run profile, then the rest.

Run on an H100/H200 from the repository root (torch and triton only: diffusers is not imported)::

    python benchmarks/gpu_check.py --budget-s 300 --out gpu_check_out    # stops itself within 300 s
    python benchmarks/gpu_check.py --plan                                 # the stages, estimates, compiles
    python benchmarks/gpu_check.py --device cpu --interpret --budget-s 60 --out /tmp/gc   # CPU rehearsal

Stages, in order of value (each in its own process: a kernel fault costs one stage):

    profile-M105    Wan2.1-1.3B 480p self-attention with RoPE (B=1, H=12, d=128, 21x30x52 tokens), the
                    default block grid (3, 5, 7), M = 105: the device's copy bandwidth first, then SDPA
                    (which backend ran, each backend's forward), the torch backend, and the Triton kernels
                    (bf16 outputs and gradients against a float64 oracle, timing, per-kernel times and bytes,
                    a CUDA-graph forward, a determinism check, targets from the bytes model)
    profile-M64     the same Triton and torch cases at block grid (4, 4, 4), M = 64
    wan-variants    Wan without RoPE, the authors' released layer (numerator only) at (3, 5, 10), M = 150,
                    RoPE composed around the kernels, plain linear attention (M = 1)
    correctness-bf16  bf16 outputs and gradients: Wan, SANA and DiT head dims, diffusers' memory layout,
                    normalize / feature map off, uneven blocks
    timing-image    SANA (2 x 36 x 4096 x 32) and DiT-XL (2 x 16 x 1024 / 4096 x 72): triton, torch, SDPA, linear
    correctness-more  the same grid in fp16, fp32 cases, one token, CASES C01
    compiled        the fused-RoPE operator under torch.compile (inductor)

Before a stage starts its estimate (process start + compiles + work, recalibrated from the stages already
run) must fit the time left (the first stage always starts); a stage that does not fit is skipped with a
record, a case inside a stage likewise, and a stage still running at the budget's end is killed. Every result is appended to
``<out>/gpu_check.jsonl`` as soon as it exists (one JSON object per line); ``gpu_check.json`` and
``gpu_check.md`` summarise it at the end. Format and how to read it: docs/triton.md, "The GPU check".

``--device cpu --interpret`` rehearses every stage on the CPU in Triton's interpreter (tiny shapes, fp32 /
fp16; the CUDA graph replaced by an eager replay, events by the wall clock): the control flow, the JSONL,
the budget; the numbers mean nothing.
"""

import sys  # no `from __future__ import annotations`: the dataclasses below must not need their module registered

if "--interpret" in sys.argv[1:]:  # must precede the first import of triton (kernels are defined then)
    import os as _os

    _os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JSONL, SUMMARY_JSON, SUMMARY_MD = "gpu_check.jsonl", "gpu_check.json", "gpu_check.md"

# name -> (batch, heads, token grid, head dim, block grid). Wan2.1-1.3B runs cond and uncond as two calls
# of batch 1; SANA and DiT as one batch of 2.
SHAPES = {
    "wan-M105": (1, 12, (21, 30, 52), 128, (3, 5, 7)),
    "wan-M64": (1, 12, (21, 30, 52), 128, (4, 4, 4)),
    "wan-M150": (1, 12, (21, 30, 52), 128, (3, 5, 10)),
    "sana-4096": (2, 36, (64, 64), 32, (6, 6)),
    "dit-1024": (2, 16, (32, 32), 72, (4, 4)),
    "dit-4096": (2, 16, (64, 64), 72, (6, 6)),
}
# --interpret: the same names at toy sizes
TINY_SHAPES = {
    "wan-M105": (1, 2, (3, 5, 7), 32, (1, 2, 2)),
    "wan-M64": (1, 2, (3, 5, 7), 32, (1, 1, 2)),
    "wan-M150": (1, 2, (3, 5, 7), 32, (2, 1, 2)),
    "sana-4096": (1, 2, (8, 8), 32, (1, 2)),
    "dit-1024": (1, 2, (7, 9), 72, (1, 2)),
    "dit-4096": (1, 2, (9, 7), 72, (3, 2)),
}
REST_SHAPES = ("wan-M105", "wan-M150", "sana-4096", "dit-1024", "dit-4096")  # --shapes: the timing shapes after the profile
QUICK_SHAPES = ("wan-M105", "wan-M150", "sana-4096", "dit-1024")
METHODS = ("triton", "torch", "sdpa", "linear", "triton-rope", "triton-rope-composed", "torch-rope")


@dataclass
class Case:
    """One unit of a stage: ``kind`` is ``device``, ``sdpa``, ``timing`` or ``correctness``.

    ``work_s``: expected seconds on an H200 (or in the interpreter), compiles excluded; ``compiles``: Triton
    builds this case adds to the run on a GPU (planned; ``--plan`` recounts them)."""

    kind: str
    name: str
    shape: str | None = None
    dtype: str | None = None
    method: str | None = None
    opts: dict = field(default_factory=dict)
    work_s: float = 1.0
    compiles: int = 0


@dataclass
class Stage:
    """A named list of cases run by one process."""

    name: str
    title: str
    cases: list[Case]

    def estimate(self, costs: "Costs") -> float:
        """Seconds: the process's start, its cases' work and compiles."""
        return costs.start_s + sum(case_cost(c, costs) for c in self.cases)

    @property
    def planned_compiles(self) -> int:
        return sum(c.compiles for c in self.cases)


@dataclass
class Costs:
    """Seconds per stage process start and per Triton build; ``reserve_s`` kept for the summary."""

    start_s: float
    compile_s: float
    reserve_s: float


GPU_COSTS = Costs(start_s=12.0, compile_s=3.0, reserve_s=4.0)
FRESH_BUILD_S = 0.5  # a JIT build at least this long compiled; a shorter one was loaded from Triton's disk cache
CPU_COSTS = Costs(start_s=3.5, compile_s=0.0, reserve_s=1.5)


def device_case(interpret: bool) -> Case:
    """Measured once per run, at the start of the first stage that runs: versions, limits, copy bandwidth."""
    return Case("device", "device: environment and copy bandwidth", work_s=0.3 if interpret else 3.0)


def case_cost(case: Case, costs: Costs) -> float:
    return case.work_s + case.compiles * costs.compile_s


# ----------------------------------------------------------------------------------------------
# The plan


def shapes_of(args) -> dict:
    return TINY_SHAPES if args.interpret else SHAPES


def _timing(shape: str, method: str, dtype: str, work_s: float, compiles: int = 0, **opts) -> Case:
    suffix = "" if opts.get("normalize", True) else " (numerator only)"
    return Case("timing", f"{shape} {method}{suffix}", shape=shape, dtype=dtype, method=method, opts=opts,
                work_s=work_s, compiles=compiles)


def _correctness(name, shape, dtype, work_s, compiles, **opts) -> Case:
    """``shape``: (batch, heads, grid, d, block grid) of the check itself."""
    return Case("correctness", f"{name} {dtype}", shape=None, dtype=dtype, opts=dict(opts, spec=shape), work_s=work_s,
                compiles=compiles)


def _work_picker(tiny: bool):
    """``w(gpu_seconds, interpreter_seconds)``: a case's expected work in this mode."""
    return lambda gpu, cpu: cpu if tiny else gpu


def profile_stages(args) -> list[Stage]:
    """The first-run profile: Wan2.1-1.3B 480p with RoPE at M = 105 and M = 64, beside SDPA and the torch backend."""
    tiny = args.interpret
    dt = "float32" if tiny else args.dtype
    s105, s64 = shapes_of(args)["wan-M105"], shapes_of(args)["wan-M64"]
    w = _work_picker(tiny)
    m105 = [
        Case("sdpa", "wan-M105 sdpa backends", shape="wan-M105", dtype=dt, work_s=w(8, 1.0)),
        _timing("wan-M105", "sdpa", dt, w(5, 0.5)),
        _timing("wan-M105", "torch-rope", dt, w(4, 0.8)),
        _correctness("wan-rope-M105", s105, dt, w(10, 1.5), 6, rotary=True, memory="bnhd"),
        _timing("wan-M105", "triton-rope", dt, w(3, 1.5)),
    ]
    m64 = [
        _correctness("wan-rope-M64", s64, dt, w(10, 1.5), 4, rotary=True, memory="bnhd"),
        _timing("wan-M64", "triton-rope", dt, w(3, 1.5)),
        _timing("wan-M64", "torch-rope", dt, w(4, 0.8)),
    ]
    return [Stage("profile-M105", "Wan2.1-1.3B 480p + RoPE, M = 105: SDPA, torch, Triton", m105),
            Stage("profile-M64", "Wan2.1-1.3B 480p + RoPE, M = 64: Triton, torch", m64)]


def correctness_cases(args) -> tuple[list[Case], list[Case]]:
    """The correctness grid after the profile: ``(bf16 cases, fp16 / fp32 and edge cases)``, most telling first."""
    if args.interpret:  # fp32 stands in for bf16 (the interpreter's bf16 arithmetic is wrong)
        first = [_correctness("uneven-2d-d72-noncontig", (1, 2, (7, 9), 72, (2, 3)), "float32", 1.0, 0, memory="bnhd"),
                 _correctness("d32-nonorm-nofm", (1, 2, (8, 8), 32, (2, 2)), "float32", 0.8, 0, normalize=False, feature_map=False)]
        more = [_correctness("uneven-2d-d72-noncontig", (1, 2, (7, 9), 72, (2, 3)), "float16", 1.0, 0, memory="bnhd"),
                _correctness("c01-M1-scale30", (1, 2, (16, 16), 32, (1, 1)), "float16", 0.8, 0, scale=30.0, mixing="ones")]
        return (first[:1], more[1:]) if args.quick else (first, more)
    wan = (21, 30, 52)

    def grid_of(dt, compiles):
        return [
            _correctness("wan-M105-d128", (1, 2, wan, 128, (3, 5, 7)), dt, 4, compiles[0], memory="bnhd"),
            _correctness("wan-rope-nonorm-M150", (1, 2, wan, 128, (3, 5, 10)), dt, 4, compiles[1], rotary=True, normalize=False),
            _correctness("wan-nonorm-nofm-M150", (1, 2, wan, 128, (3, 5, 10)), dt, 4, compiles[2], normalize=False, feature_map=False),
            _correctness("sana-64x64-d32", (1, 4, (64, 64), 32, (6, 6)), dt, 3, compiles[3]),
            _correctness("dit-32x32-d72-noncontig", (2, 2, (32, 32), 72, (4, 4)), dt, 3, compiles[4], memory="bnhd"),
            _correctness("uneven-45x23-d72", (1, 2, (45, 23), 72, (3, 4)), dt, 3, compiles[5]),
        ]

    first = grid_of("bfloat16", (2, 0, 4, 4, 4, 4))
    more = grid_of("float16", (4, 4, 4, 4, 4, 4)) + [
        _correctness("tiny-uneven-7x9-d64", (2, 2, (7, 9), 64, (2, 3)), "float16", 2, 4),
        _correctness("one-token", (1, 2, (1, 1), 32, (1, 1)), "float16", 2, 2, absolute=True),
        _correctness("c01-M1-scale30", (1, 4, (64, 64), 32, (1, 1)), "float16", 3, 4, scale=30.0, mixing="ones"),
        _correctness("fp32-uneven-3d-d128", (1, 2, (5, 12, 21), 128, (2, 3, 5)), "float32", 3, 4),
        _correctness("fp32-dit-d72", (1, 2, (32, 32), 72, (4, 4)), "float32", 3, 6),
    ]
    if args.quick:
        first = [c for c in first if c.name.split()[0] in ("wan-M105-d128", "sana-64x64-d32", "dit-32x32-d72-noncontig")]
        more = [c for c in more if c.name.split()[0] in ("c01-M1-scale30", "fp32-dit-d72")]
    return first, more


def rest_stages(args) -> list[Stage]:
    """After the profile: other Wan variants, the correctness grid, the image shapes, torch.compile."""
    tiny = args.interpret
    dt = "float32" if tiny else args.dtype
    w = _work_picker(tiny)
    wan = [
        _timing("wan-M105", "triton", dt, w(3, 0.8), 4),
        _timing("wan-M150", "triton-rope", dt, w(3, 0.8), 4, normalize=False),
        _timing("wan-M150", "torch-rope", dt, w(4, 0.3), 0, normalize=False),
        _timing("wan-M105", "triton-rope-composed", dt, w(4, 1.0), 10),
        _timing("wan-M105", "linear", dt, w(3, 0.5), 6),
    ]
    image = []
    for shape, compiles in (("sana-4096", (0, 4)), ("dit-1024", (4, 4)), ("dit-4096", (4, 3))):
        if tiny and shape == "dit-4096":  # the rehearsal: one DiT shape is enough
            continue
        image += [_timing(shape, "triton", dt, w(2, 0.5), compiles[0]), _timing(shape, "torch", dt, w(2, 0.3)),
                  _timing(shape, "sdpa", dt, w(2, 0.3)), _timing(shape, "linear", dt, w(2, 0.4), compiles[1])]
    if tiny:
        compiled = [_correctness("rope-compiled-d32", (1, 2, (3, 5, 7), 32, (2, 2, 3)), "float32", 3.0, 0, rotary=True, compile=True)]
    else:
        compiled = [_correctness("wan-rope-compiled-M105", (1, 2, (21, 30, 52), 128, (3, 5, 7)), "bfloat16", 60, 2,
                                 rotary=True, memory="bnhd", compile=True)]
    first, more = correctness_cases(args)
    return [Stage("wan-variants", "Wan: no RoPE, numerator-only M = 150, RoPE composed, linear (M = 1)", wan),
            Stage("correctness-bf16", "bf16 outputs and gradients vs the float64 oracle: Wan, SANA, DiT, uneven layouts", first),
            Stage("timing-image", "SANA and DiT-XL shapes: triton, torch, SDPA, linear", image),
            Stage("correctness-more", "fp16 and fp32 outputs and gradients; edge cases (one token, C01)", more),
            Stage("compiled", "the fused-RoPE operator under torch.compile", compiled)]


STAGE_NAMES = ("profile-M105", "profile-M64", "wan-variants", "correctness-bf16", "timing-image", "correctness-more", "compiled")


def build_plan(args) -> list[Stage]:
    """The stages of this run, in order, after ``--stages``, ``--shapes``, ``--methods``, ``--skip-*``, ``--quick``."""
    stages = profile_stages(args) + rest_stages(args)
    assert tuple(s.name for s in stages) == STAGE_NAMES
    rest_shapes = set(args.shapes or (QUICK_SHAPES if args.quick else REST_SHAPES))

    def keep(stage: Stage, case: Case) -> bool:
        if case.kind in ("timing", "sdpa") and args.skip_timing:
            return False
        if case.kind == "correctness" and args.skip_correctness:
            return False
        if case.kind == "timing" and case.method not in args.methods:
            return False
        if case.kind == "timing" and not stage.name.startswith("profile") and case.shape not in rest_shapes:
            return False
        return True

    plan = []
    for stage in stages:
        if args.stages and stage.name not in args.stages:
            continue
        cases = [c for c in stage.cases if keep(stage, c)]
        for case in cases if args.interpret else ():
            case.compiles = 0  # the interpreter compiles nothing
        if cases:
            plan.append(Stage(stage.name, stage.title, cases))
    return plan


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
    costs = CPU_COSTS if args.interpret else GPU_COSTS
    counter = CompileCounter(journal)
    ctx = dict(copy_gbps=args.copy_gbps)
    cases = ([device_case(args.interpret)] if args.measure_device else []) + stage.cases
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
    journal.write("stage_done", **counter.summary(args.interpret))
    return 0


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


def calibrate(costs: Costs, records: list[dict], stage: str, started_t: float, totals: dict) -> None:
    """Update the start and per-build costs from what the last stage measured."""
    ready = next((r for r in records if r["type"] == "stage_ready" and r.get("stage") == stage), None)
    if ready:
        costs.start_s = max(0.5, ready["t"] - started_t + 0.5)
    built = [r for r in records if r["type"] == "compile" and r.get("stage") == stage]
    totals["compiles"] += len(built)
    totals["compile_s"] += sum(r["seconds"] for r in built)
    fresh = [r["seconds"] for r in built if r["seconds"] >= FRESH_BUILD_S]  # not reloaded from Triton's disk cache
    totals["fresh"] += len(fresh)
    totals["fresh_s"] += sum(fresh)
    if totals["fresh"]:
        costs.compile_s = totals["fresh_s"] / totals["fresh"]


def child_command(argv: list[str], stage: str, t0: float, deadline: float, copy_gbps: float | None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--run-stage", stage, "--run-t0", repr(t0), "--deadline", repr(deadline)]
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


def plan_row(stage: Stage, costs: Costs) -> dict:
    return dict(stage=stage.name, title=stage.title, cases=[c.name for c in stage.cases], estimate_s=round(stage.estimate(costs), 1),
                planned_compiles=stage.planned_compiles)


# ----------------------------------------------------------------------------------------------
# --plan: the stages, estimates and a recount of the Triton builds a GPU run makes (no GPU needed)


def count_builds(plan: list[Stage], args) -> dict[str, tuple[int, int, dict]]:
    """Per stage ``(builds in its process, builds new to the run, {case: builds it adds to the run})``, from the host
    code's recorded launches.

    Runs each case's Triton calls on CPU tensors with ``triton_ops._RECORD`` set (launches recorded with the GPU
    configuration, not run) and specialises each launch with Triton's binder for sm_90, as a CUDA launch would.
    torch.compile's own kernels are not counted."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import gpu_check_cases as C
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from mhla_diffusers.ops import triton_backend, triton_ops

    target_backend, binders = make_backend(GPUTarget("cuda", 90, 32)), {}

    def keys(launches):
        found = set()
        for kernel, _grid, kargs, meta in launches:
            name = C._kernel_name(kernel)
            if name not in binders:
                binders[name] = create_function_from_signature(kernel.signature, kernel.params, target_backend)
            _, spec, options = binders[name](*kargs, **meta)
            found.add((name, str(spec), str(options)))
        return found

    def calls(case: Case):
        dtype = getattr(torch, case.dtype)
        if case.kind == "timing" and case.method in ("triton", "linear", "triton-rope", "triton-rope-composed"):
            batch, heads, grid, d, block_grid = SHAPES[case.shape]
            x = C.make_inputs(batch, heads, grid, d, block_grid, dtype, "cpu", rope="rope" in case.method, empty=True)
            norm = case.opts.get("normalize", True)
            return [C.forward_only(case.method, x, norm), C.fwd_bwd(case.method, x, norm)]
        if case.kind == "correctness":
            batch, heads, grid, d, block_grid = case.opts["spec"]
            return [lambda: C.correctness_triton_run(batch, heads, grid, block_grid, d, dtype, case.opts, "cpu", empty=True)]
        return []

    saved = (triton_ops.check_supported, triton_backend.TritonBackend.unsupported_reason)
    triton_ops.check_supported = lambda *a, **k: None
    triton_backend.TritonBackend.unsupported_reason = lambda self, device: None
    seen_run, counts = set(), {}
    try:
        for stage in plan:
            seen_stage, per_case = set(), {}
            for case in stage.cases:
                found = set()
                for call in calls(case):
                    triton_ops._RECORD = []
                    try:
                        call()
                        found |= keys(triton_ops._RECORD)
                    finally:
                        triton_ops._RECORD = None
                per_case[case.name] = len(found - seen_run - seen_stage)
                seen_stage |= found
            counts[stage.name] = (len(seen_stage), len(seen_stage - seen_run), per_case)
            seen_run |= seen_stage
    finally:
        triton_ops.check_supported, triton_backend.TritonBackend.unsupported_reason = saved
    return counts


def show_plan(args) -> int:
    """Print the plan: stages, cases, estimates (H200 constants) and planned / recounted Triton builds."""
    plan = build_plan(args)
    costs = CPU_COSTS if args.interpret else GPU_COSTS
    counts = {}
    if not args.interpret:
        try:
            counts = count_builds(plan, args)
        except Exception as exc:  # the binder needs triton's NVIDIA backend: print the planned numbers alone
            print(f"(builds not recounted: {type(exc).__name__}: {exc})")
    total = 0.0
    print(f"{'stage':16s} {'cases':>5s} {'estimate s':>10s} {'compiles':>8s} {'recount':>14s}  title")
    for stage in plan:
        est = stage.estimate(costs)
        total += est
        builds = counts.get(stage.name)
        recount = f"{builds[0]} ({builds[1]} new)" if builds else "-"
        print(f"{stage.name:16s} {len(stage.cases):5d} {est:10.0f} {stage.planned_compiles:8d} {recount:>14s}  {stage.title}")
        for case in stage.cases if args.verbose_plan else ():
            new = builds[2].get(case.name) if builds else None
            flag = "" if new is None or new == case.compiles else "  (planned differs)"
            print(f"    {case.name:44s} work {case.work_s:5.1f} s  compiles {case.compiles:3d}  recount {_f(new)}{flag}")
    print(f"total estimate {total:.0f} s; planned compiles {sum(s.planned_compiles for s in plan)}")
    return 0


# ----------------------------------------------------------------------------------------------
# Summary: gpu_check.json and gpu_check.md from the JSONL


def summarise(records: list[dict]) -> dict:
    """The JSONL grouped: run, device, stages, timing / correctness / SDPA cases, skips, budget stop, problems."""
    by = lambda kind: [r for r in records if r["type"] == kind]  # noqa: E731
    cases = by("case")
    device = next((r for r in cases if r.get("kind") == "device"), None)
    stages = [r for r in records if r["type"] in ("stage_end", "stage_skipped")]
    problems = [f"{r['stage']}: {r['case']}: {r['error'][:160]}" for r in cases if "error" in r]
    problems += [f"{r['stage']}: {r['case']}: correctness FAILED" for r in cases
                 if r.get("kind") == "correctness" and not r.get("ok", True)]
    problems += [f"{r['stage']}: stage {r['status']} (return code {r['returncode']})" for r in by("stage_end") if r["status"] == "failed"]
    problems += [f"run interrupted after {r['elapsed_s']} s ({r['reason']})" for r in by("interrupted")]
    return dict(run=next(iter(by("run_start")), None), device=device, stages=stages,
                timing=[r for r in cases if r.get("kind") == "timing"], correctness=[r for r in cases if r.get("kind") == "correctness"],
                sdpa=[r for r in cases if r.get("kind") == "sdpa"], skipped_cases=by("case_skipped"),
                budget_stop=next(iter(by("budget_stop")), None), run_end=next(iter(by("run_end")), None), problems=problems)


def _f(x, spec=".3g"):
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _yes(flag) -> str:
    return "-" if flag is None else "yes" if flag else "NO"


def markdown(report: dict) -> str:
    """gpu_check.md: stages, timing (with bandwidth and targets), per-kernel times, SDPA, correctness, skips."""
    run, dev = report["run"] or {}, report["device"] or {}
    env = dev.get("environment", {})
    lines = ["# Triton MHLA backend: GPU check", "",
             f"{run.get('date', '?')} on {env.get('device_name', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}); "
             f"budget {run.get('budget_s', '?')} s, ran {_f((report['run_end'] or {}).get('elapsed_s'))} s; copy bandwidth "
             f"{_f(dev.get('copy_gbps'), '.0f')} GB/s (read + write), nominal {_f(dev.get('nominal_gbps'), '.0f')} GB/s."
             + (" Interpreter rehearsal: the numbers mean nothing." if env.get("interpret") else ""), "",
             "## Stages", "", "| stage | status | seconds | estimate s | compiles (planned) | compile s | cases | skipped |",
             "|---|---|---|---|---|---|---|---|"]
    for s in report["stages"]:
        if s["type"] == "stage_skipped":
            lines.append(f"| {s['stage']} | skipped: {s['reason']} | | {_f(s.get('estimate_s'))} | | | | |")
            continue
        lines.append(f"| {s['stage']} | {s['status']} | {s['seconds']:.1f} | {_f(s['estimate_s'])} | "
                     f"{s['compiles']} ({s['planned_compiles']}) | {_f(s['compile_s'])} | {s['cases_done']} | {len(s['cases_skipped'])} |")
    lines += ["", "## Timing (median ms; graph = forward replayed in a CUDA graph)", "",
              "| stage | shape | method | M | fwd | graph fwd | fwd+bwd | fwd GB/s | of copy | x floor | target fwd / fwd+bwd ms | met "
              "| deterministic |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["timing"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | {r['case']} | | | error: {r['error'][:100]} | | | | | | | | |")
            continue
        bw, tgt = r.get("graph_fwd_bw") or r.get("fwd_bw") or {}, r.get("target") or {}
        met = f"{_yes(tgt.get('fwd_met'))} / {_yes(tgt.get('fwdbwd_met'))}" if "fwd_ms" in tgt else "-"
        lines.append(f"| {r['stage']} | {r['shape']} | {r['method']} | {_f(r['num_blocks'])} | {r['fwd_ms']:.3f} | "
                     f"{_f(r.get('graph_ms'), '.3f')} | {r['fwdbwd_ms']:.3f} | {_f(bw.get('gbps'), '.0f')} | "
                     f"{_f(bw.get('of_copy'), '.2f')} | {_f(r.get('fwd_x_floor_at_copy'), '.2f')} | "
                     f"{_f(tgt.get('fwd_ms'), '.3f')} / {_f(tgt.get('fwdbwd_ms'), '.3f')} | {met} | "
                     f"{_yes((r.get('determinism') or {}).get('deterministic'))} |")
    kernels = [(r, k) for r in report["timing"] for k in r.get("kernels", [])]
    if kernels:
        lines += ["", "## Triton kernels (median ms per launch; MB: the bytes model's, else its tensor arguments once)", "",
                  "| shape | method | pass | kernel | ms | MB | GB/s | of copy |", "|---|---|---|---|---|---|---|---|"]
        for r, k in kernels:
            bw, nbytes = k.get("model_bw") or k, k.get("model_bytes") or k["bytes"]
            lines.append(f"| {r['shape']} | {r['method']} | {k['pass']} | {k.get('role') or k['kernel']} | {k['ms']:.4f} | "
                         f"{nbytes / 1e6:.1f} | {_f(bw.get('gbps'), '.0f')} | {_f(bw.get('of_copy'), '.2f')} |")
    for r in report["sdpa"]:
        if "error" in r:
            lines += ["", f"SDPA probe at {r['case']}: error {r['error'][:200]}"]
            continue
        per = ", ".join(f"{name} {_f(b.get('fwd_ms'), '.3f')} ms" if "fwd_ms" in b
                        else f"{name}: {b.get('skipped') or b.get('error', '')[:60]}" for name, b in r["backends"].items())
        lines += ["", f"SDPA at {r['shape']}: torch chooses {r['sdpa'].get('chosen')}, the profiler saw {r['sdpa'].get('ran')}; "
                  f"forward by backend: {per}."]
    lines += ["", "## Correctness (relative error vs the float64 oracle; max over out, dq, dk, dv, dmixing)", "",
              "| stage | case | M | d | out | dq | dk | dv | dmixing | vs torch | tol | ok |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["correctness"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | {r['case']} | | | error: {r['error'][:100]} | | | | | | | NO |")
            continue
        e = r["vs_reference"]
        errs = " | ".join(_f(e[k], ".1e") for k in ("out", "dq", "dk", "dv", "dmixing"))
        lines.append(f"| {r['stage']} | {r['case']} | {r['num_blocks']} | {r['d']} | {errs} | {_f(max(r['vs_torch'].values()), '.1e')} | "
                     f"{r['tol']:.0e} | {_yes(r['ok'])} |")
    stop = report["budget_stop"]
    if stop:
        lines += ["", f"**Stopped by the budget** ({stop['budget_s']} s): stages skipped {stop['skipped_stages'] or 'none'}, "
                  f"killed {stop['killed_stage'] or 'none'}, {len(stop['skipped_cases'])} case(s) skipped."]
    if report["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.jsonl, gpu_check.json and gpu_check.md")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds for the whole run, compiles included (default 450: done within 8 minutes)")
    p.add_argument("--stages", nargs="+", choices=STAGE_NAMES, default=None, help="run only these stages (plan order kept)")
    p.add_argument("--plan", action="store_true", help="print the stages, their estimates and Triton compile counts, and exit")
    p.add_argument("--verbose-plan", action="store_true", help="with --plan: every case, its work and compile counts")
    p.add_argument("--quick", action="store_true", help="fewer correctness cases and timing shapes after the profile")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--interpret", action="store_true", help="with --device cpu: the CPU rehearsal in Triton's interpreter (tiny shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of the timing runs")
    p.add_argument("--shapes", nargs="+", choices=list(REST_SHAPES), default=None,
                   help=f"timing shapes after the profile (default: all of {list(REST_SHAPES)})")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="methods timed")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; --quick 8; --interpret 1)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="nominal peak HBM bandwidth in TB/s (H200: 4.8, H100 SXM: 3.35)")
    p.add_argument("--skip-correctness", action="store_true", help="no correctness cases (the profile's included)")
    p.add_argument("--skip-timing", action="store_true", help="no timing or SDPA cases")
    # internal: one stage's process (set by the orchestrating process)
    p.add_argument("--run-stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--run-t0", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--copy-gbps", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--measure-device", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.interpret:
        p.error("--device cpu needs --interpret (the Triton kernels run on CPU tensors only in the interpreter)")
    if a.interpret and a.device != "cpu":
        p.error("--interpret needs --device cpu")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if a.reps is None:
        a.reps = 1 if a.interpret else 8 if a.quick else 20
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.run_stage:
        return run_stage(args)
    if args.plan:
        return show_plan(args)
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())
