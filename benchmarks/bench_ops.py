#!/usr/bin/env python
"""Op-level benchmark: softmax attention (SDPA) vs plain ReLU linear attention vs MHLA.

For square token grids of N tokens and the head shapes of SANA (36 heads x 32), DiT-XL (16 x 72),
Wan (12 x 128) and the reference shape (12 x 64 with M = 64 blocks), measures the median wall time
(and process CPU time) of the forward (under ``torch.no_grad``) and of forward + backward (all
inputs require grad, random output gradient), and the peak memory of one call, for:

    sdpa          F.scaled_dot_product_attention (softmax; skipped when predicted > --max-seconds)
    linear        relu(q) @ (relu(k)^T v) / (relu(q) @ sum_t relu(k_t) + eps), in plain torch
    mhla_torch    mhla_diffusers.mhla_attention(..., backend="torch"), locality-initialised mixing
    mhla_triton   the same with backend="triton" (only when available and on CUDA)
    io_floor      torch.addcmul(q, k, v) (forward only): reads q, k, v once and writes one fresh
                  output, the memory traffic (and, on CPU, page faults) any attention op must pay

plus the same run's fp32 GEMM rate (a 4096 x 4096 matmul) as the machine's practical peak.

Peak memory. CUDA: ``torch.cuda.max_memory_allocated`` during one call minus what was allocated
before it (inputs and output gradient). CPU: every measurement runs in a freshly forked child
process (so no allocator cache carries over from another method); the child creates the inputs,
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs one call and reports
``VmHWM - VmRSS(before)`` from ``/proc/self/status``: the growth of resident memory during the
call, i.e. the output (and gradients), every temporary alive at the peak and any memory the
allocator touched but had not returned. Page granularity; shared libraries already loaded.

Useful FLOPs (for GFLOP/s): linear attention and MHLA 4 B H N d d_v per forward (MHLA's mixing,
2 B H M^2 d d_v, is not counted as useful), SDPA 4 B H N^2 d.

Usage:
    python benchmarks/bench_ops.py                                   # full run (CPU: ~30-60 min)
    python benchmarks/bench_ops.py --sizes 4096 16384 65536 --shapes ref
    python benchmarks/bench_ops.py --quick --out /tmp/bench          # tiny sizes, seconds
Writes bench_ops.json, bench_ops.md and bench_ops.png into --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (heads, head_dim, block grid or None for the library's default choose_block_grid, label)
SHAPES = {
    "ref": (12, 64, (8, 8), "reference 12 x 64, M = 64"),
    "sana": (36, 32, None, "SANA 36 x 32"),
    "dit": (16, 72, None, "DiT-XL 16 x 72"),
    "wan": (12, 128, None, "Wan 12 x 128"),
}
METHODS = ("sdpa", "linear", "mhla_torch", "mhla_triton", "io_floor")
MODES = ("fwd", "fwdbwd")
DEFAULT_SIZES = (1024, 4096, 16384, 65536)
QUICK_SIZES = (64, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", help=f"token counts N (perfect squares); default {list(DEFAULT_SIZES)}")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="head shapes (default: all)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; default 1)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (fewer for slow calls)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="skip a measurement predicted to take longer per call")
    p.add_argument("--budget-seconds", type=float, default=30.0, help="stop repeating a measurement after this long (>= 1 rep)")
    p.add_argument("--gemm-size", type=int, default=4096, help="side of the fp32 GEMM that defines the practical peak")
    p.add_argument("--quick", action="store_true", help=f"smoke test: N in {list(QUICK_SIZES)}, 2 reps, 512^2 GEMM")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<cpu | GPU name>)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or list(QUICK_SIZES)
        args.reps = min(args.reps, 2)
        args.gemm_size = min(args.gemm_size, 512)
    args.sizes = sorted(args.sizes or DEFAULT_SIZES)
    for n in args.sizes:
        if math.isqrt(n) ** 2 != n:
            p.error(f"--sizes must be perfect squares (square token grids); got {n}")
    return args


# ------------------------------------------------------------------------------------------------
# machine facts


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(args, torch) -> dict:
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "git_commit": _git_commit(),
        "loadavg_start": list(os.getloadavg()),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ------------------------------------------------------------------------------------------------
# the methods


def make_call(method, layout, mixing):
    import torch.nn.functional as F

    from mhla_diffusers import mhla_attention

    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    if method == "linear":
        from mhla_diffusers.ops.naive import plain_linear_attention

        return plain_linear_attention
    if method == "io_floor":
        import torch

        return lambda q, k, v: torch.addcmul(q, k, v)
    backend = method.split("_", 1)[1]
    return lambda q, k, v: mhla_attention(q, k, v, mixing, layout, backend=backend)


def useful_flops(method, batch, heads, n, d) -> float:
    return 4.0 * batch * heads * n * n * d if method == "sdpa" else 4.0 * batch * heads * n * d * d


# ------------------------------------------------------------------------------------------------
# one measurement


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(spec: dict) -> dict:
    """Time one (method, shape, N, mode) and measure the peak memory of its first call."""
    import torch

    from mhla_diffusers import BlockLayout, mixing_init

    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    side = math.isqrt(spec["n"])
    layout = BlockLayout((side, side), tuple(spec["block_grid"]))
    gen = torch.Generator().manual_seed(0)
    shape = (spec["batch"], spec["heads"], spec["n"], spec["head_dim"])
    backward = spec["mode"] == "fwdbwd"
    q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(backward) for _ in range(3))
    grad_out = torch.randn(shape, generator=gen).to(device=device, dtype=dtype) if backward else None
    mixing = mixing_init(layout).to(device)
    call = make_call(spec["method"], layout, mixing)

    def run():
        if backward:
            out = call(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            return out, grads
        with torch.no_grad():
            return call(q, k, v)

    # Warm-up on a tiny problem (lazy library initialisation, code pages), then the first real
    # call: its peak memory (and warm-up).
    tiny_layout = BlockLayout((2, 2), (1, 1))
    tiny = [torch.randn(1, spec["heads"], 4, spec["head_dim"]).to(device=device, dtype=dtype).requires_grad_(backward) for _ in range(3)]
    tiny_out = make_call(spec["method"], tiny_layout, mixing_init(tiny_layout).to(device))(*tiny)
    if backward:
        torch.autograd.grad(tiny_out, tiny, torch.ones_like(tiny_out))
    del tiny, tiny_out
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        result = run()
        _sync(device)
        first = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
        t0 = time.perf_counter()
        result = run()
        first = time.perf_counter() - t0
        peak = (_status_kib("VmHWM") - base) * 1024
    del result

    walls, cpus = [], []
    reps = spec["reps"] if first * spec["reps"] <= spec["budget_seconds"] else max(1, int(spec["budget_seconds"] // max(first, 1e-9)))
    if first > spec["budget_seconds"] / 2:
        walls, cpus, reps = [first], [float("nan")], 0  # too slow to repeat: the first call is the measurement
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        result = run()
        _sync(device)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        del result
    walls.sort()
    cpus = sorted(c for c in cpus if c == c)
    return {
        "time_ms": 1e3 * walls[len(walls) // 2],
        "cpu_ms": 1e3 * cpus[len(cpus) // 2] if cpus and device == "cpu" else None,
        "time_min_ms": 1e3 * walls[0],
        "runs": len(walls),
        "peak_bytes": int(peak),
    }


def isolated(fn, *args, device: str = "cpu") -> dict:
    """CPU: ``fn(*args)`` in a forked child (fresh allocator state, honest peak RSS, and the parent
    never starts an OpenMP pool that a later fork could inherit half-initialised); errors come back
    as ``{"error": ...}``. CUDA: in-process (CUDA does not survive fork)."""
    if device != "cpu" or not hasattr(os, "fork"):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported as a skipped measurement
            return {"error": f"{type(exc).__name__}: {exc}"}
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        try:
            payload = json.dumps({"ok": fn(*args)})
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        with os.fdopen(write_fd, "w") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"child died (wait status {status}); out of memory?"}
    reply = json.loads(data)
    return reply["ok"] if "ok" in reply else {"error": reply["error"]}


def gemm_rate(device: str, size: int, reps: int = 3) -> dict:
    """fp32 ``size x size`` matmul: best and median GFLOP/s over ``reps`` timed runs (after one warm-up)."""
    import torch

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    _sync(device)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        walls.append(time.perf_counter() - t0)
    flops = 2.0 * size**3
    return {"size": size, "best_gflops": flops / min(walls) / 1e9, "median_gflops": flops / sorted(walls)[reps // 2] / 1e9}


# ------------------------------------------------------------------------------------------------
# the run


def predicted_seconds(rows, spec, gemm_gflops) -> float:
    """Quadratic (SDPA) or linear extrapolation from the largest measured N of this method/shape/mode."""
    done = [r for r in rows if all(r[key] == spec[key] for key in ("method", "shape", "mode")) and r.get("time_ms")]
    power = 2 if spec["method"] == "sdpa" else 1
    if done:
        last = max(done, key=lambda r: r["n"])
        return last["time_ms"] / 1e3 * (spec["n"] / last["n"]) ** power
    flops = useful_flops(spec["method"], spec["batch"], spec["heads"], spec["n"], spec["head_dim"])
    return flops * (3 if spec["mode"] == "fwdbwd" else 1) / (0.3 * gemm_gflops * 1e9)


def run_all(args) -> dict:
    import torch

    from mhla_diffusers import available_backends, choose_block_grid

    torch.set_num_threads(args.threads)
    info = machine_info(args, torch)
    methods = [m for m in args.methods if m != "mhla_triton" or ("triton" in available_backends() and args.device == "cuda")]
    print(f"# {info['cpu_model']} | {info['threads']} thread(s) | torch {info['torch']} | {args.device} {args.dtype}", flush=True)
    # The practical peak: the best fp32 GEMM rate seen at the start (and, below, at the end) of the run.
    gemm = {"size": args.gemm_size, "start": isolated(gemm_rate, args.device, args.gemm_size, device=args.device)}
    if "error" in gemm["start"]:
        raise RuntimeError(f"GEMM reference failed: {gemm['start']['error']}")
    gemm["gflops"] = gemm["start"]["best_gflops"]
    print(f"# fp32 GEMM {args.gemm_size}^2: {gemm['gflops']:.1f} GFLOP/s", flush=True)
    rows = []
    for shape in args.shapes:
        heads, head_dim, blocks, _ = SHAPES[shape]
        for n in args.sizes:
            side = math.isqrt(n)
            block_grid = (1, *blocks) if blocks and side >= max(blocks) else choose_block_grid((side, side))
            for mode in args.modes:
                for method in methods:
                    if method == "io_floor" and mode != "fwd":
                        continue
                    spec = dict(method=method, shape=shape, n=n, mode=mode, heads=heads, head_dim=head_dim,
                                block_grid=list(block_grid), num_blocks=math.prod(block_grid), batch=args.batch,
                                device=args.device, dtype=args.dtype, reps=args.reps, budget_seconds=args.budget_seconds)
                    row = {k: spec[k] for k in ("method", "shape", "n", "mode", "heads", "head_dim", "num_blocks", "block_grid", "batch")}
                    guess = predicted_seconds(rows, spec, gemm["gflops"])
                    if guess > args.max_seconds:
                        row["skipped"] = f"predicted {guess:.0f} s per call > --max-seconds {args.max_seconds:g}"
                    else:
                        result = isolated(measure, spec, device=args.device)
                        if "error" in result:
                            row["skipped"] = result["error"]
                        else:
                            row.update(result)
                            fl = useful_flops(method, args.batch, heads, n, head_dim)
                            if mode == "fwd" and method != "io_floor":
                                row["gflops"] = fl / (row["time_ms"] / 1e3) / 1e9
                                row["pct_of_gemm"] = 100 * row["gflops"] / gemm["gflops"]
                    rows.append(row)
                    print(_progress_line(row), flush=True)
    gemm["end"] = isolated(gemm_rate, args.device, args.gemm_size, device=args.device)
    if "best_gflops" in gemm["end"] and gemm["end"]["best_gflops"] > gemm["gflops"]:
        gemm["gflops"] = gemm["end"]["best_gflops"]
        for row in rows:  # percentages against the final (higher) peak
            if "gflops" in row:
                row["pct_of_gemm"] = 100 * row["gflops"] / gemm["gflops"]
    print(f"# fp32 GEMM {args.gemm_size}^2 at the end: {gemm['end'].get('best_gflops', float('nan')):.1f} GFLOP/s", flush=True)
    info["loadavg_end"] = list(os.getloadavg())
    return {"machine": info, "gemm": gemm, "results": rows, "summary": summarize(rows, args)}


def _progress_line(row) -> str:
    head = f"{row['shape']:>5} N={row['n']:>6} {row['mode']:>6} {row['method']:<11}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    extra = f"  {row['pct_of_gemm']:.0f}% of GEMM" if "pct_of_gemm" in row else ""
    cpu = f" (cpu {row['cpu_ms']:.1f})" if row.get("cpu_ms") is not None else ""
    return f"{head} {row['time_ms']:10.1f} ms{cpu}  peak {row['peak_bytes'] / 2**20:8.1f} MiB  x{row['runs']}{extra}"


def _get(rows, **key):
    for r in rows:
        if all(r[k] == v for k, v in key.items()) and "time_ms" in r:
            return r
    return None


def summarize(rows, args) -> dict:
    """Ratios per (shape, N, mode) and scaling per (shape, method, mode)."""
    ratios, scaling = [], []
    mhla = "mhla_torch" if "mhla_torch" in args.methods else None
    for shape in args.shapes:
        for n in args.sizes:
            for mode in args.modes:
                m = _get(rows, method=mhla, shape=shape, n=n, mode=mode) if mhla else None
                lin = _get(rows, method="linear", shape=shape, n=n, mode=mode)
                sdpa = _get(rows, method="sdpa", shape=shape, n=n, mode=mode)
                if not m:
                    continue
                entry = {"shape": shape, "n": n, "mode": mode}
                if lin:
                    entry["mhla_over_linear_time"] = m["time_ms"] / lin["time_ms"]
                    if m.get("cpu_ms") and lin.get("cpu_ms"):
                        entry["mhla_over_linear_cpu_time"] = m["cpu_ms"] / lin["cpu_ms"]
                    entry["mhla_over_linear_peak_mem"] = m["peak_bytes"] / max(lin["peak_bytes"], 1)
                if sdpa:
                    entry["sdpa_over_mhla_time"] = sdpa["time_ms"] / m["time_ms"]
                if "pct_of_gemm" in m:
                    entry["mhla_pct_of_gemm"] = m["pct_of_gemm"]
                    io = _get(rows, method="io_floor", shape=shape, n=n, mode="fwd")
                    if io and m["time_ms"] > io["time_ms"]:
                        entry["mhla_pct_of_gemm_beyond_io_floor"] = m["pct_of_gemm"] * m["time_ms"] / (m["time_ms"] - io["time_ms"])
                ratios.append(entry)
        # time(N=65,536) / time(N=4,096) when both were run, else largest over smallest N
        n_small = 4096 if 4096 in args.sizes else min(args.sizes)
        n_large = 65536 if 65536 in args.sizes else max(args.sizes)
        for method in args.methods:
            for mode in args.modes:
                small = _get(rows, method=method, shape=shape, n=n_small, mode=mode)
                large = _get(rows, method=method, shape=shape, n=n_large, mode=mode)
                if small and large and n_large > n_small:
                    entry = {"shape": shape, "method": method, "mode": mode, "n_small": n_small, "n_large": n_large,
                             "time_ratio": large["time_ms"] / small["time_ms"], "token_ratio": n_large / n_small}
                    if small.get("cpu_ms") and large.get("cpu_ms"):
                        entry["cpu_time_ratio"] = large["cpu_ms"] / small["cpu_ms"]
                    scaling.append(entry)
    return {"ratios": ratios, "scaling": scaling}


# ------------------------------------------------------------------------------------------------
# reports


def _fmt_ms(row) -> str:
    if row is None:
        return "-"
    if "skipped" in row:
        return "skipped"
    t = row["time_ms"]
    return f"{t / 1e3:.2f} s" if t >= 1e4 else f"{t:.1f}" if t >= 10 else f"{t:.2f}"


def markdown(report: dict, args) -> str:
    info, gemm, rows, summary = report["machine"], report["gemm"], report["results"], report["summary"]
    lines = [
        "# MHLA op benchmark",
        "",
        f"- date (UTC): {info['date_utc']}; host: {info['hostname']}; git: {info.get('git_commit')}",
        f"- machine: {info['cpu_model']} ({info['cpu_count']} cores), {info['threads']} thread(s), torch {info['torch']}, "
        f"device {info['device']}{' (' + info['gpu'] + ')' if info.get('gpu') else ''}, {info['dtype']}, batch {info['batch']}",
        f"- practical peak: fp32 GEMM {gemm['size']}^2 = **{gemm['gflops']:.1f} GFLOP/s** (best of 3 at the start and 3 at the end "
        f"of this run; medians {gemm['start']['median_gflops']:.1f} / {gemm['end'].get('median_gflops', float('nan')):.1f})",
        f"- load average start / end: {', '.join(f'{x:.2f}' for x in info['loadavg_start'])} / "
        f"{', '.join(f'{x:.2f}' for x in info['loadavg_end'])}; transparent hugepages: {info.get('transparent_hugepage')}",
        "- times: median wall-clock ms over the timed runs (one warm-up first); fwd = forward under no_grad, "
        "fwd+bwd = forward + backward to q, k, v. Peak: memory growth during one call (see docs/performance.md).",
        "",
    ]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    for shape in args.shapes:
        heads, head_dim, _, label = SHAPES[shape]
        lines += [f"## {label}", ""]
        header = ["N", "M"]
        for mode in args.modes:
            header += [f"{m} {'fwd' if mode == 'fwd' else 'fwd+bwd'}" for m in methods if m != "io_floor" or mode == "fwd"]
        header += ["MHLA / linear fwd", "MHLA / linear fwd+bwd", "SDPA / MHLA fwd", "MHLA GFLOP/s fwd (% GEMM)",
                   "% GEMM beyond I/O floor", "peak MiB linear / MHLA fwd (ratio)"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for n in args.sizes:
            cells = [str(n)]
            any_row = next((r for r in rows if r["shape"] == shape and r["n"] == n), None)
            cells.append(str(any_row["num_blocks"]) if any_row else "-")
            for mode in args.modes:
                for m in [m for m in methods if m != "io_floor" or mode == "fwd"]:
                    row = next((r for r in rows if (r["method"], r["shape"], r["n"], r["mode"]) == (m, shape, n, mode)), None)
                    cells.append(_fmt_ms(row))
            rat = {e["mode"]: e for e in summary["ratios"] if e["shape"] == shape and e["n"] == n}
            f = lambda mode, key, fmt="{:.2f}x": fmt.format(rat[mode][key]) if mode in rat and key in rat[mode] else "-"  # noqa: E731

            def with_cpu(mode):  # wall-clock ratio, and the CPU-time one (robust to a busy machine)
                wall, cpu = f(mode, "mhla_over_linear_time"), f(mode, "mhla_over_linear_cpu_time")
                return wall if cpu == "-" else f"{wall} (cpu {cpu})"

            cells += [with_cpu("fwd"), with_cpu("fwdbwd"), f("fwd", "sdpa_over_mhla_time", "{:.1f}x")]
            m_fwd = _get(rows, method="mhla_torch", shape=shape, n=n, mode="fwd")
            cells.append(f"{m_fwd['gflops']:.1f} ({m_fwd['pct_of_gemm']:.0f}%)" if m_fwd and "gflops" in m_fwd else "-")
            cells.append(f("fwd", "mhla_pct_of_gemm_beyond_io_floor", "{:.0f}%"))
            l_fwd = _get(rows, method="linear", shape=shape, n=n, mode="fwd")
            cells.append(
                f"{l_fwd['peak_bytes'] / 2**20:.0f} / {m_fwd['peak_bytes'] / 2**20:.0f} "
                f"({m_fwd['peak_bytes'] / max(l_fwd['peak_bytes'], 1):.2f})"
                if m_fwd and l_fwd else "-"
            )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for e in summary["scaling"]:
            if e["shape"] == shape:
                cpu = f" (CPU time {e['cpu_time_ratio']:.1f})" if "cpu_time_ratio" in e else ""
                lines.append(
                    f"- scaling {e['method']} {'fwd' if e['mode'] == 'fwd' else 'fwd+bwd'}: "
                    f"time(N={e['n_large']:,}) / time(N={e['n_small']:,}) "
                    f"= {e['time_ratio']:.1f}{cpu} ({e['token_ratio']:g}x the tokens)"
                )
        skipped = [r for r in rows if r["shape"] == shape and "skipped" in r]
        for r in skipped:
            lines.append(f"- skipped {r['method']} {r['mode']} N={r['n']}: {r['skipped']}")
        lines.append("")
    lines += [
        "Command: `" + " ".join(["python", "benchmarks/bench_ops.py", *sys_argv_for_report(args)]) + "`",
        "",
    ]
    return "\n".join(lines)


def sys_argv_for_report(args) -> list[str]:
    return list(getattr(args, "argv", []) or [])


def plot(report: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    shapes = args.shapes
    cols = min(2, len(shapes))
    nrows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 4.4 * nrows), squeeze=False)
    colors = {"sdpa": "tab:red", "linear": "tab:blue", "mhla_torch": "tab:green", "mhla_triton": "tab:purple", "io_floor": "tab:gray"}
    for ax, shape in zip(axes.flat, shapes):
        for method in METHODS:
            for mode, style in (("fwd", "-"), ("fwdbwd", "--")):
                pts = [(r["n"], r["time_ms"]) for r in rows
                       if (r["shape"], r["method"], r["mode"]) == (shape, method, mode) and "time_ms" in r]
                if pts:
                    xs, ys = zip(*sorted(pts))
                    ax.plot(xs, ys, style, marker="o", color=colors[method], label=f"{method} {'fwd' if mode == 'fwd' else 'fwd+bwd'}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("time (ms)")
        ax.set_title(SHAPES[shape][3])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    info = report["machine"]
    machine = info["cpu_model"] if args.device == "cpu" else info.get("gpu")
    fig.suptitle(f"{machine}, {info['threads']} thread(s), {args.dtype}, batch {args.batch}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_out(args, torch) -> Path:
    if args.device == "cpu":
        name = "cpu"
    else:
        name = "".join(ch if ch.isalnum() else "_" for ch in torch.cuda.get_device_name()).strip("_").lower() or socket.gethostname()
    return ROOT / "benchmarks" / "results" / name


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    out = args.out or default_out(args, torch)
    report = run_all(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_ops.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report, args)
    (out / "bench_ops.md").write_text(md)
    if not args.no_plot:
        plot(report, args, out / "bench_ops.png")
    print()
    print(md)
    print(f"wrote {out / 'bench_ops.json'}, {out / 'bench_ops.md'}{'' if args.no_plot else ', ' + str(out / 'bench_ops.png')}")
    return report


if __name__ == "__main__":
    main()
