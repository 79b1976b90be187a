"""The measurements of ``benchmarks/gpu_check.py``: what one stage's process runs, case by case.

Imported by a stage's own process (``gpu_check.py --run-stage NAME``), never by the orchestrating
process. Needs torch and triton only: the MHLA operator is loaded from ``mhla_diffusers/ops`` without
running ``mhla_diffusers/__init__.py`` (which imports diffusers, absent on the GPU machine); the inputs
and the calls measured: ``gpu_check_inputs.py``.

Every function here works on a CUDA device and, in its CPU form, under Triton's interpreter
(``--device cpu --interpret``): CUDA events become wall-clock stamps, the CUDA-graph replay becomes a
replay of the eager call (recorded as a stub), the copy-bandwidth and SDPA probes run on CPU tensors.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
import traceback
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gpu_check_inputs import (  # noqa: E402, F401  (the calls measured; gpu_check_plan.count_builds reaches them here)
    LIB,
    correctness_inputs,
    correctness_triton_run,
    dtype_name,
    forward_only,
    fwd_bwd,
    import_library,
    leaves_of,
    make_inputs,
    method_call,
    random_rotary,
    run_leaves,
    triton_function,
)

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5, torch.float64: 1e-10}
# A kernel meets its target when it runs at >= this fraction of the measured copy bandwidth on the
# bytes the bytes model says it moves.
TARGET_FRACTION = 0.8
# SDPA's math backend materialises B x H x N^2 scores: probed only up to this many tokens.
MATH_SDPA_MAX_TOKENS = 8192
_TRITON_METHODS = ("triton", "linear", "triton-rope", "triton-rope-composed")


# ----------------------------------------------------------------------------------------------
# Device: synchronisation and time stamps (CUDA events, or wall clock on a CPU)


class Device:
    """One device's clock: ``stamp()`` / ``seconds(a, b)`` are CUDA events on a GPU, ``perf_counter`` on a CPU."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def time_fn(fn, dev: Device, reps: int, warmup: int) -> float:
    """Median seconds of one ``fn()`` over ``reps`` calls after ``warmup`` calls (each call between two stamps)."""
    for _ in range(warmup):
        fn()
    dev.sync()
    times = []
    for _ in range(max(1, reps)):
        start = dev.stamp()
        fn()
        end = dev.stamp()
        times.append(dev.seconds(start, end))
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# The device itself: environment and the practical peak bandwidth


def environment(dev: Device, interpret: bool) -> dict:
    """Versions, the device's name and limits, and torch's SDPA / TF32 switches."""
    import platform

    import triton

    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__, interpret=interpret,
               diffusers_imported="diffusers" in sys.modules, device_name="cpu (Triton interpreter)" if interpret else "cpu")
    if dev.cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, capability=[props.major, props.minor], sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), l2_mb=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   sdpa_enabled=dict(flash=torch.backends.cuda.flash_sdp_enabled(),
                                     efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                                     cudnn=torch.backends.cuda.cudnn_sdp_enabled(), math=torch.backends.cuda.math_sdp_enabled()))
    return env


def copy_bandwidth(dev: Device, nbytes: int, reps: int = 10) -> dict:
    """A device-to-device copy of ``nbytes``: the practical peak, in GB/s counting bytes read and written."""
    pair = [torch.empty(nbytes, dtype=torch.uint8, device=dev.name).fill_(1)]
    pair.append(torch.empty_like(pair[0]))
    seconds = time_fn(lambda: pair[1].copy_(pair[0]), dev, reps, warmup=3)
    pair.clear()
    dev.empty_cache()
    return dict(copy_bytes=nbytes, copy_ms=seconds * 1e3, copy_gbps=2 * nbytes / seconds / 1e9)


# ----------------------------------------------------------------------------------------------
# Bytes: the bytes model of benchmarks/kernel_report.py when present, else the floor computed here


def floor_bytes(batch: int, heads: int, tokens: int, head_dim: int, element_size: int) -> dict:
    """Compulsory traffic: forward reads q, k, v and writes the output; backward reads q, k, v and the
    output's gradient and writes dq, dk, dv (input dtype; tables and summaries not counted)."""
    unit = batch * heads * tokens * head_dim * element_size
    return dict(floor_bytes=4 * unit, backward_floor_bytes=7 * unit)


@lru_cache(maxsize=None)
def _kernel_report_model():
    """``kernel_report.bytes_model`` (benchmarks/kernel_report.py), or ``(None, why not)``. The one import of it."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        from kernel_report import bytes_model
    except Exception as exc:  # absent, or it needs what this machine lacks: fall back to the floor
        return None, f"benchmarks/kernel_report.py not usable ({type(exc).__name__}: {str(exc)[:200]})"
    return bytes_model, None


_MODEL_KEYS = ("forward_bytes", "backward_bytes", "floor_bytes", "backward_floor_bytes", "forward_ratio", "backward_ratio",
               "scenario", "scenarios", "assumes")


def _model_kernels(model: dict) -> dict:
    """``{"forward": [(kernel, role, bytes)], "backward": [...]}`` of the model's default scenario, launch order."""
    scenario, out = model.get("scenario"), {}
    for phase in ("forward", "backward"):
        rows = (model.get("kernels") or {}).get(phase) or []
        out[phase] = [(r.get("kernel"), r.get("role"), (r.get("bytes") or {}).get(scenario)) for r in rows]
    return out


@lru_cache(maxsize=64)
def bytes_for(batch: int, heads: int, grid: tuple, head_dim: int, block_grid: tuple, dtype: torch.dtype, rope: bool) -> dict:
    """``forward_bytes``, ``backward_bytes``, ``floor_bytes``, ``assumes``, ``source`` (and per-kernel bytes in
    ``kernel_bytes`` when the model gives them) for one call of the Triton backend.

    From ``kernel_report.bytes_model(batch, heads, grid, head_dim, block_grid, dtype, rope)`` when that file can
    be imported (called with the dtype's name, then with the torch dtype), else the floor."""
    tokens = math.prod(grid)
    floor = floor_bytes(batch, heads, tokens, head_dim, torch.tensor([], dtype=dtype).element_size())
    model, why = _kernel_report_model()
    if model is not None:
        for dt in (dtype_name(dtype), dtype):
            try:
                got = dict(model(batch, heads, tuple(grid), head_dim, tuple(block_grid), dt, rope))
                kept = {k: got[k] for k in _MODEL_KEYS if k in got}
                return dict(floor, **kept, kernel_bytes=_model_kernels(got), source="benchmarks/kernel_report.py bytes_model")
            except Exception as exc:  # a dtype spelled the other way, or a shape the model does not take
                why = f"kernel_report.bytes_model failed ({type(exc).__name__}: {str(exc)[:200]})"
    return dict(floor, forward_bytes=floor["floor_bytes"], backward_bytes=floor["backward_floor_bytes"],
                assumes=f"the floor only: {why}", source="floor (gpu_check_cases.floor_bytes)")


def bandwidth(nbytes: float, seconds: float | None, copy_gbps: float | None, nominal_gbps: float) -> dict:
    """Achieved GB/s for ``nbytes`` in ``seconds``, as a fraction of the measured copy and of the nominal peak."""
    if not seconds:
        return {}
    gbps = nbytes / seconds / 1e9
    out = dict(gbps=gbps, of_nominal=gbps / nominal_gbps)
    if copy_gbps:
        out["of_copy"] = gbps / copy_gbps
    return out


def targets(model: dict, fwd_s: float | None, fwdbwd_s: float | None, copy_gbps: float | None) -> dict:
    """Per-shape targets from the bytes model: the model's bytes at TARGET_FRACTION of the copy bandwidth."""
    if not copy_gbps:
        return dict(note="no copy bandwidth measured: targets not computed")
    rate = TARGET_FRACTION * copy_gbps * 1e9
    fwd_target = model["forward_bytes"] / rate
    fb_target = (model["forward_bytes"] + model["backward_bytes"]) / rate
    out = dict(rule=f"bytes model's bytes at {TARGET_FRACTION:.0%} of the measured copy bandwidth",
               fwd_ms=fwd_target * 1e3, fwdbwd_ms=fb_target * 1e3,
               fwd_floor_ms=model["floor_bytes"] / (copy_gbps * 1e9) * 1e3,
               model_fwd_x_floor=model["forward_bytes"] / model["floor_bytes"],
               model_bwd_x_floor=model["backward_bytes"] / model["backward_floor_bytes"])
    if fwd_s:
        out.update(fwd_met=fwd_s <= fwd_target, fwd_x_target=fwd_s / fwd_target, fwd_x_floor=fwd_s * 1e3 / out["fwd_floor_ms"])
    if fwdbwd_s:
        out.update(fwdbwd_met=fwdbwd_s <= fb_target, fwdbwd_x_target=fwdbwd_s / fb_target)
    return out


# ----------------------------------------------------------------------------------------------
# CUDA graph, determinism, per-kernel times


def graph_forward(fn, dev: Device, reps: int) -> dict:
    """Seconds per replay of ``fn`` captured in a CUDA graph; on a CPU the eager call replayed (a stub).

    A capture that fails is recorded (``graph: "capture failed"``, the error), not raised."""
    if not dev.cuda:
        seconds = time_fn(fn, dev, reps, warmup=1)
        return dict(graph="stub: eager replay on the CPU (no CUDA graph)", graph_ms=seconds * 1e3)
    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start = dev.stamp()
        for _ in range(max(1, reps)):
            graph.replay()
        end = dev.stamp()
        return dict(graph="captured", graph_ms=dev.seconds(start, end) / max(1, reps) * 1e3)
    except Exception as exc:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return dict(graph="capture failed", graph_error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        del graph


def determinism(run) -> dict:
    """``run()`` twice on the same inputs: whether the output and every gradient are bitwise equal."""
    out_a, grads_a = run()
    out_b, grads_b = run()
    names = ["out", "dq", "dk", "dv", "dmixing"][: 1 + len(grads_a)]
    equal = {name: bool(torch.equal(a, b)) for name, a, b in zip(names, (out_a, *grads_a), (out_b, *grads_b))}
    return dict(bitwise_equal=equal, deterministic=all(equal.values()))


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", None) or repr(kernel)


def _argument_bytes(args) -> int:
    """Bytes of the distinct tensors among a launch's arguments (each read or written once)."""
    seen, total = set(), 0
    for a in args:
        if isinstance(a, torch.Tensor) and a.data_ptr() not in seen:
            seen.add(a.data_ptr())
            total += a.numel() * a.element_size()
    return total


@contextlib.contextmanager
def timed_launches(dev: Device):
    """Stamps around every Triton kernel launch of ``mhla_diffusers.ops.triton_ops`` while active.

    Yields a list that fills with ``(kernel name, start, end, argument bytes)``."""
    from mhla_diffusers.ops import triton_ops

    original, seen = triton_ops._launch, []

    def launch(kernel, grid, *args, **meta):
        start = dev.stamp()
        original(kernel, grid, *args, **meta)
        seen.append((_kernel_name(kernel), start, dev.stamp(), _argument_bytes(args)))

    triton_ops._launch = launch
    try:
        yield seen
    finally:
        triton_ops._launch = original


def kernel_times(forward, backward, dev: Device, reps: int, copy_gbps, nominal_gbps, model_kernels=None) -> list[dict]:
    """Per Triton launch of one forward and of the backward: median time, argument bytes, bandwidth.

    ``forward`` runs the forward alone; ``backward`` forward + backward (its first launches, as many as the
    forward's, are the forward's and are left out). ``model_kernels`` (:func:`bytes_for`'s ``kernel_bytes``):
    where its kernels match the launches in order, each launch also gets the model's bytes and bandwidth."""
    per = {}
    for _ in range(max(1, reps)):
        with timed_launches(dev) as fwd:
            forward()
        with timed_launches(dev) as both:
            backward()
        dev.sync()
        for passname, launches in (("forward", fwd), ("backward", both[len(fwd):])):
            for i, (name, start, end, nbytes) in enumerate(launches):
                row = per.setdefault((passname, i), dict(pass_=passname, kernel=name, bytes=nbytes, times=[]))
                row["times"].append(dev.seconds(start, end))
    rows = []
    for row in per.values():
        seconds = statistics.median(row.pop("times"))
        rows.append(dict(row, ms=seconds * 1e3, **bandwidth(row["bytes"], seconds, copy_gbps, nominal_gbps)))
    for row in rows:
        row["pass"] = row.pop("pass_")
    for phase in ("forward", "backward"):
        launched = [r for r in rows if r["pass"] == phase]
        modelled = (model_kernels or {}).get(phase) or []
        if modelled and [r["kernel"] for r in launched] == [m[0] for m in modelled]:
            for r, (_, role, nbytes) in zip(launched, modelled):
                if nbytes:
                    r.update(role=role, model_bytes=nbytes, model_bw=bandwidth(nbytes, r["ms"] / 1e3, copy_gbps, nominal_gbps))
    return rows


# ----------------------------------------------------------------------------------------------
# SDPA: which backend runs, and each backend's forward time


_SDPA_OPS = {"flash": "flash", "efficient": "efficient", "cudnn": "cudnn", "math": "math"}
_SDPA_SHORT = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn", "MATH": "math"}


def _classify_sdpa(names) -> str | None:
    """The SDPA backend named by profiler events (``aten::_scaled_dot_product_<backend>_attention...``)."""
    for name in names:
        low = name.lower()
        if "scaled_dot_product" in low:
            for key, backend in _SDPA_OPS.items():
                if key in low:
                    return backend
    for name in names:  # kernels only (no op names): FlashAttention, cutlass memory-efficient, cuDNN
        low = name.lower()
        if "flash" in low:
            return "flash"
        if "fmha" in low or "mem_eff" in low:
            return "efficient"
        if "cudnn" in low:
            return "cudnn"
    return None


def sdpa_backend(q, k, v, dev: Device) -> dict:
    """Which SDPA backend torch chooses for these inputs and which one the profiler saw run."""
    out = {}
    try:
        from torch.nn.attention import SDPBackend

        choice = int(torch._fused_sdp_choice(q, k, v))
        names = {int(value): name for name, value in SDPBackend.__members__.items()}
        out["chosen"] = _SDPA_SHORT.get(names.get(choice), names.get(choice, str(choice)))
    except Exception as exc:  # a private function: record, do not fail
        out["chosen_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.cuda else [])
        with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
            F.scaled_dot_product_attention(q, k, v)
            dev.sync()
        names = list(dict.fromkeys(e.name for e in prof.events()))
        out["ran"] = _classify_sdpa(names) or "unknown"
        out["events"] = [n[:120] for n in names if "attention" in n.lower() or "flash" in n.lower() or "fmha" in n.lower()][:8]
    except Exception as exc:
        out["ran"] = "unknown"
        out["profiler_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def sdpa_backends(q, k, v, dev: Device, reps: int) -> dict:
    """Forward time of each SDPA backend forced alone (``sdpa_kernel``); an unsupported one is recorded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = {}
    for name, backend in (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
                          ("math", "MATH")):
        if name == "math" and q.shape[2] > MATH_SDPA_MAX_TOKENS:
            rows[name] = dict(skipped=f"N = {q.shape[2]} > {MATH_SDPA_MAX_TOKENS}: the math backend stores N^2 scores")
            continue
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]), torch.no_grad():
                seconds = time_fn(lambda: F.scaled_dot_product_attention(q, k, v), dev, reps, warmup=1)
            rows[name] = dict(fwd_ms=seconds * 1e3)
        except Exception as exc:  # not available for these inputs on this device
            rows[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:160]}")
    return rows


# ----------------------------------------------------------------------------------------------
# Correctness


def quotient_scales(x: dict) -> list:
    """Per input, the larger of the two quotient-rule terms of the gradient (float64): the scale of the relative
    error of a gradient that cancels (tests/ops/test_ops.py)."""
    if not x["kw"]["normalize"]:
        return [None] * 4
    leaves = [t.detach().double().requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["mixing"])]
    kw = x["kw"]
    num, den = LIB.ops.naive.blockwise_parts(*leaves, x["layout"], eps=kw["eps"], feature_map=kw["feature_map"], rotary=kw["rotary"])
    g = x["grad_out"].double()
    first = torch.autograd.grad(num / den.detach(), leaves, g, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(num.detach() * den / den.detach() ** 2, leaves, g, allow_unused=True)
    return [max(0.0 if a is None else a.abs().max().item(), 0.0 if b is None else b.abs().max().item()) for a, b in zip(first, second)]


def check_correctness(batch, heads, grid, block_grid, d, dtype, opts, device) -> dict:
    """Triton vs the float64 oracle and vs the torch backend: outputs and dq, dk, dv, dmixing.

    Relative error ``max |x - ref| / max(max |ref|, quotient-rule term scale)`` (tests/ops/test_ops.py);
    the dense reference up to N = 4096, the O(N d^2) block-wise loop beyond. ``opts["compile"]``: the
    Triton call under torch.compile (inductor on a GPU, aot_eager on a CPU)."""
    ops = LIB.ops
    x = correctness_inputs(batch, heads, grid, block_grid, d, dtype, opts, device)
    layout, kw = x["layout"], x["kw"]
    compile_mode = ("inductor" if device == "cuda" else "aot_eager") if opts.get("compile") else None
    t0 = time.perf_counter()
    out, grads = run_leaves(triton_function(x, compile_mode), x)
    if device == "cuda":
        torch.cuda.synchronize()
    first_call = time.perf_counter() - t0
    out_t, grads_t = run_leaves(lambda *a: ops.mhla_attention(*a, layout, backend="torch", **kw), x)
    if layout.num_tokens <= 4096:
        out_r, grads_r = run_leaves(lambda *a: ops.mhla_attention_reference(*a, layout, dtype=torch.float64, **kw), x, torch.float64)
    else:
        out_r, grads_r = run_leaves(lambda *a: ops.naive.mhla_attention_blockwise(*a, layout, **kw), x, torch.float64)
    scales = quotient_scales(x)
    names = ("out", "dq", "dk", "dv", "dmixing")
    rel = ops.naive.relative_error
    vs_ref = {nm: rel(a, r, sc) for nm, a, r, sc in zip(names, (out, *grads), (out_r, *grads_r), (None, *scales))}
    vs_torch = {nm: rel(a, r, sc) for nm, a, r, sc in zip(names, (out, *grads), (out_t, *grads_t), (None, *scales))}
    finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
    tol = TOL[dtype]
    ok = finite and max(vs_ref.values()) <= tol and max(vs_torch.values()) <= tol
    return dict(batch=batch, heads=heads, grid=list(grid), block_grid=list(layout.block_grid), num_blocks=layout.num_blocks, d=d,
                normalize=kw["normalize"], feature_map=kw["feature_map"] is not None, rotary=kw["rotary"] is not None,
                compiled=bool(compile_mode), memory=opts.get("memory", "contiguous"), tol=tol, ok=ok, finite=finite,
                vs_reference=vs_ref, vs_torch=vs_torch, first_call_s=round(first_call, 3))


# ----------------------------------------------------------------------------------------------
# Timing of one method at one shape


def time_method(method, shape, dtype, dev: Device, *, reps, warmup, copy_gbps, nominal_gbps, normalize=True, extras=True) -> dict:
    """Forward and forward + backward of ``method`` at ``shape``: medians, a CUDA-graph forward, bytes,
    bandwidth, targets; for the Triton methods also per-kernel times and the determinism check."""
    batch, heads, grid, d, block_grid = shape
    rope = method.endswith("rope") or method.endswith("composed")
    inputs = make_inputs(batch, heads, grid, d, block_grid, dtype, dev.name, rope=rope)
    m = 1 if method == "linear" else None if method == "sdpa" else inputs["layout"].num_blocks
    row = dict(method=method, dtype=dtype_name(dtype), batch=batch, heads=heads, tokens=inputs["layout"].num_tokens,
               grid=list(grid), d=d, block_grid=None if m is None else [1] * len(grid) if m == 1 else list(block_grid),
               num_blocks=m, rope=rope, normalize=normalize)
    forward, both = forward_only(method, inputs, normalize), fwd_bwd(method, inputs, normalize)
    t0 = time.perf_counter()
    forward()
    dev.sync()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    fwd = time_fn(forward, dev, reps, warmup)
    fb = time_fn(both, dev, reps, warmup)
    row.update(fwd_ms=fwd * 1e3, fwdbwd_ms=fb * 1e3)
    if dev.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        both()
        torch.cuda.synchronize()
        row["fwdbwd_peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    mhla = method in _TRITON_METHODS
    model = method_bytes(method, row, dtype)
    kernel_model = model.pop("kernel_bytes", None)
    row["bytes"] = model
    fwd_bytes = model["forward_bytes"]
    row["fwd_bw"] = bandwidth(fwd_bytes, fwd, copy_gbps, nominal_gbps)
    if extras and mhla:
        fused = method != "triton-rope-composed"  # composed: two kernel calls, not what the model describes
        row["kernels"] = kernel_times(forward, both, dev, min(reps, 5), copy_gbps, nominal_gbps, kernel_model if fused else None)
        row["determinism"] = determinism(both)
    if extras:
        row.update(graph_forward(forward, dev, reps))
        if "graph_ms" in row:
            row["graph_fwd_bw"] = bandwidth(fwd_bytes, row["graph_ms"] / 1e3, copy_gbps, nominal_gbps)
    best = row.get("graph_ms", row["fwd_ms"]) / 1e3  # the forward without launch gaps where a graph was captured
    row["fwd_x_floor_at_copy"] = best / (model["floor_bytes"] / (copy_gbps * 1e9)) if copy_gbps else None
    if mhla and method != "triton-rope-composed":  # the model describes the fused kernels, not two composed calls
        row["target"] = targets(model, best, fb, copy_gbps)
    return row


def method_bytes(method: str, row: dict, dtype: torch.dtype) -> dict:
    """The bytes one call of ``method`` moves at ``row``'s shape (a fresh dict: :func:`bytes_for` is cached).

    The Triton methods: the bytes model of the kernels (the fused path; composed RoPE: the model of the fused one);
    SDPA and the torch backend: the floor."""
    batch, heads, d = row["batch"], row["heads"], row["d"]
    if method in _TRITON_METHODS:
        return dict(bytes_for(batch, heads, tuple(row["grid"]), d, tuple(row["block_grid"]), dtype, row["rope"]))
    floor = floor_bytes(batch, heads, row["tokens"], d, torch.tensor([], dtype=dtype).element_size())
    return dict(floor, forward_bytes=floor["floor_bytes"], backward_bytes=floor["backward_floor_bytes"], source="floor")


def format_error(exc: BaseException) -> dict:
    """An exception as a record's ``error`` and the tail of its traceback."""
    return dict(error=f"{type(exc).__name__}: {str(exc)[:500]}", traceback=traceback.format_exc()[-2000:])


def fatal_cuda_error(text: str) -> bool:
    """Whether an error leaves the CUDA context unusable (every later case in the process would fail)."""
    low = text.lower()
    return any(s in low for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                  "device-side assert", "misaligned address", "cuda error: an illegal"))
