"""The plan of ``benchmarks/gpu_check.py``: the shapes, the stages and their cases, the costs the budget uses.

Imported by the orchestrating process and by each stage's process (the same plan, rebuilt from the same
arguments). Standard library only, except :func:`count_builds` (``--plan``: torch, triton and
``gpu_check_cases``). The stages and what each measures: docs/triton.md, "The GPU check".
"""

# no `from __future__ import annotations`: the dataclasses below must not need their module registered
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpu_check_summary import _f

HERE = Path(__file__).resolve().parent

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



def plan_row(stage: Stage, costs: Costs) -> dict:
    return dict(stage=stage.name, title=stage.title, cases=[c.name for c in stage.cases], estimate_s=round(stage.estimate(costs), 1),
                planned_compiles=stage.planned_compiles)


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

    keys = _build_keys(C)
    from mhla_diffusers.ops import triton_backend, triton_ops

    saved = (triton_ops.check_supported, triton_backend.TritonBackend.unsupported_reason)
    triton_ops.check_supported = lambda *a, **k: None
    triton_backend.TritonBackend.unsupported_reason = lambda self, device: None
    seen_run, counts = set(), {}
    try:
        for stage in plan:
            seen_stage, per_case = set(), {}
            for case in stage.cases:
                found = _case_builds(case, C, triton_ops, keys)
                per_case[case.name] = len(found - seen_run - seen_stage)
                seen_stage |= found
            counts[stage.name] = (len(seen_stage), len(seen_stage - seen_run), per_case)
            seen_run |= seen_stage
    finally:
        triton_ops.check_supported, triton_backend.TritonBackend.unsupported_reason = saved
    return counts


def _build_keys(C):
    """``keys(launches)``: the set of ``(kernel, specialisation, options)`` of recorded launches, each bound by Triton's
    binder for sm_90 (one binder per kernel, made on first use)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

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

    return keys


def _case_calls(case: Case, C) -> list:
    """The Triton calls of one case on empty CPU tensors at the GPU shapes (none for the cases that run no kernel)."""
    import torch

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


def _case_builds(case: Case, C, triton_ops, keys) -> set:
    """The builds one case's calls make: each call run with its launches recorded, not run."""
    found = set()
    for call in _case_calls(case, C):
        triton_ops._RECORD = []
        try:
            call()
            found |= keys(triton_ops._RECORD)
        finally:
            triton_ops._RECORD = None
    return found


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
