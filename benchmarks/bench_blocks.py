#!/usr/bin/env python
"""Block-level benchmark at real model widths and video token counts: stock vs MHLA vs plain linear attention.

For ONE transformer block of each family at its published width, random weights (no download):

    dit-xl       DiT-XL/2       1,152 wide (16 x 72), 28 blocks      token grids 16^2, 32^2, 64^2
    sana-1600m   SANA-1600M     2,240 wide (70 x 32), 20 blocks      32^2, 64^2, 96^2, 128^2 (4K px)
    wan-1.3b     Wan2.1-1.3B    1,536 wide (12 x 128), 30 blocks     1, 5, 11, 21 latent frames of 30 x 52
    wan-14b      Wan2.1-14B     5,120 wide (40 x 128), 40 blocks     (21 frames = 81 video frames at 480 x 832)
    sana-video   SANA-Video 2B  2,240 wide (20 x 112), 20 blocks     as Wan (its stock attention: linear, M = 1)

it times the block (self-attention, cross-attention, MLP, norms: what diffusers runs per layer) with

    stock    diffusers' own processor (DiT, Wan: softmax SDPA; SANA, SANA-Video: ReLU linear attention)
    mhla     apply_mhla(layers="all"), block grid choose_block_grid(token grid) (M ~ sqrt(N) / 2), torch backend
    linear   the same with one block, M = 1: plain linear attention (default only where stock is softmax)

forward (eval, ``torch.no_grad``) and forward + backward (gradients of the block's input and every
weight, as in training), and the memory one call adds at its peak (CPU, 1 thread: growth of resident
memory during an extra call in a forked child that maps every allocation >= 64 KiB afresh; CUDA:
``max_memory_allocated``). Repetitions are interleaved (rep 1 of
every variant and mode, then rep 2, ...) and min / median reported; a call predicted to take longer
than ``--max-seconds`` (from the previous grid: quadratic for softmax, linear otherwise) is skipped
and listed. Each (model, thread count) runs in its own process.

Whole transformer per denoising step, derived: the stock 1-layer model's forward (patch embedding,
timestep / text embedders, one block, output head) is timed once per grid, the rest
``R = T(1-layer model) - T(stock block)`` is what every variant shares, and
``step(variant) = R + L x T(block, variant)`` for the family's L blocks (forward only; the
training column is ``L x T(block fwd+bwd)``, embeddings excluded). The crossover is where
``step(stock) / step(mhla)`` passes 1: bracketed between measured grids, and from a fit
(``T_stock = a + b N + c N^2``, ``T_mhla = a' + b' N``) when MHLA already wins at every grid.

Usage:
    python benchmarks/bench_blocks.py                                      # everything, CPU, 1 and all threads
    python benchmarks/bench_blocks.py --models wan-1.3b --threads 1 --reps 2
    python benchmarks/bench_blocks.py --device cuda --dtype bfloat16      # GPU
    python benchmarks/bench_blocks.py --quick --out /tmp/blocks             # tiny widths, seconds
    python benchmarks/bench_blocks.py --render benchmarks/results/cpu/bench_blocks.json
    python benchmarks/bench_blocks.py --merge a/bench_blocks.json b/bench_blocks.json --out benchmarks/results/cpu
Writes bench_blocks.json, bench_blocks.md and bench_blocks.png into --out (default benchmarks/results/<cpu|cuda>).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_ops import _status_kib, _sync, isolated, machine_info  # noqa: E402  (machine description, device sync, fork)

from mhla_diffusers.models.configs import DIT_XL_2, SANA_1600M, SANA_VIDEO_2B, WAN_1_3B, WAN_14B  # noqa: E402

VARIANTS = ("stock", "mhla", "linear")
MODES = ("fwd", "fwdbwd")

_TINY_SANA = dict(num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2, cross_attention_head_dim=8,
                  cross_attention_dim=16, caption_channels=16, in_channels=4, out_channels=4)
_TINY_WAN = dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=32, freq_dim=16)
_TINY_SANA_VIDEO = dict(num_attention_heads=2, attention_head_dim=12, num_cross_attention_heads=2, cross_attention_head_dim=12,
                        cross_attention_dim=24, caption_channels=16, in_channels=4, out_channels=4)

# name: class, config, tiny overrides, label, stock attention, token grids (T, H, W), --quick grids, text tokens
MODELS = {
    "dit-xl": dict(cls="DiTTransformer2DModel", config=DIT_XL_2, tiny=dict(num_attention_heads=2, attention_head_dim=8),
                   label="DiT-XL/2", stock="softmax", grids=[(1, 16, 16), (1, 32, 32), (1, 64, 64)],
                   quick=[(1, 4, 4), (1, 8, 8)], text=0),
    "sana-1600m": dict(cls="SanaTransformer2DModel", config=SANA_1600M, tiny=_TINY_SANA, label="SANA-1600M",
                       stock="linear", grids=[(1, 32, 32), (1, 64, 64), (1, 96, 96), (1, 128, 128)],
                       quick=[(1, 4, 4), (1, 8, 8)], text=300),
    "wan-1.3b": dict(cls="WanTransformer3DModel", config=WAN_1_3B, tiny=_TINY_WAN, label="Wan2.1-1.3B", stock="softmax",
                     grids=[(1, 30, 52), (5, 30, 52), (11, 30, 52), (21, 30, 52)], quick=[(1, 4, 6), (3, 4, 6)], text=512),
    "wan-14b": dict(cls="WanTransformer3DModel", config=WAN_14B, tiny=_TINY_WAN, label="Wan2.1-14B", stock="softmax",
                    grids=[(1, 30, 52), (5, 30, 52), (11, 30, 52), (21, 30, 52)], quick=[(1, 4, 6)], text=512),
    "sana-video": dict(cls="SanaVideoTransformer3DModel", config=SANA_VIDEO_2B, tiny=_TINY_SANA_VIDEO,
                       label="SANA-Video 2B", stock="linear", grids=[(1, 30, 52), (5, 30, 52), (11, 30, 52), (21, 30, 52)],
                       quick=[(1, 4, 6), (3, 4, 6)], text=300),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="'linear' is left out where the stock attention already is linear (SANA)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--parts", nargs="+", choices=["blocks", "costs"], default=["blocks", "costs"],
                   help="blocks: the block timings; costs: the attention operator alone (the measured cost model) "
                   "beside the FLOP model's ratio")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, nargs="+", help="CPU thread counts, one process each (default: 1 and all cores)")
    p.add_argument("--grids", type=int, nargs="+", metavar="T H W",
                   help="token grids as T H W triples, for every model (default: each model's sweep)")
    p.add_argument("--reps", type=int, default=2, help="interleaved timed repetitions (default 2)")
    p.add_argument("--max-seconds", type=float, default=400.0, help="skip a call predicted to take longer (default 400)")
    p.add_argument("--slow-seconds", type=float, default=30.0,
                   help="a call predicted to take longer is timed once (on CPU at 1 thread: the memory call), not --reps times")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-memory", action="store_true",
                   help="skip the CPU peak-memory call (one extra call per cell, in a forked child, 1 thread only)")
    p.add_argument("--quick", action="store_true", help="tiny widths of the same classes, 1 rep (smoke test)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<cpu|cuda>)")
    p.add_argument("--render", type=Path, help="only rewrite the markdown and plot (next to it) from this bench_blocks.json")
    p.add_argument("--merge", type=Path, nargs="+", help="join the runs of these bench_blocks.json files into --out")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: one (model, threads) run, JSON spec file
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.threads = args.threads or ([1] if args.quick or args.device == "cuda" else sorted({1, os.cpu_count() or 1}))
    if args.grids is not None:
        if len(args.grids) % 3:
            p.error("--grids takes T H W triples")
        args.grids = [tuple(args.grids[i:i + 3]) for i in range(0, len(args.grids), 3)]
    if args.quick:
        args.reps = 1
    return args


def grids_for(name: str, args) -> list[tuple[int, int, int]]:
    return list(args.grids or (MODELS[name]["quick"] if args.quick else MODELS[name]["grids"]))


def variants_for(name: str, args) -> list[str]:
    return [v for v in args.variants if not (v == "linear" and MODELS[name]["stock"] == "linear")]


# ------------------------------------------------------------------------------------------------
# one model: build, inputs, the block's own inputs, variants


def build(name: str, args):
    """The family's model with ONE block at the published width (random weights, seed 0)."""
    import diffusers
    import torch

    spec = MODELS[name]
    config = dict(spec["config"], **(spec["tiny"] if args.quick else {}), num_layers=1)
    largest = max(g[1] for g in grids_for(name, args))
    if name == "dit-xl":
        config["sample_size"] = 2 * largest  # native grid = the largest grid (patch 2); blocks fit every grid
    elif name == "sana-1600m":
        config["sample_size"] = largest
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(diffusers, spec["cls"])(**config)
    model = model.eval().to(args.device)
    return model if args.dtype == "float32" else model.to(getattr(torch, args.dtype))


def make_inputs(name: str, model, grid, args) -> dict:
    """The transformer's forward keyword arguments for a latent of token grid ``grid``."""
    import torch

    cfg, b, dtype, dev = model.config, args.batch, getattr(torch, args.dtype), args.device
    g = torch.Generator().manual_seed(0)
    t, h, w = grid
    if name == "dit-xl":
        x = torch.randn(b, cfg.in_channels, 2 * h, 2 * w, generator=g)
        labels = torch.randint(0, cfg.num_embeds_ada_norm, (b,), generator=g).to(dev)
        return dict(hidden_states=x.to(dev, dtype), timestep=torch.full((b,), 500.0, device=dev), class_labels=labels,
                    return_dict=False)
    text_len = 8 if args.quick else MODELS[name]["text"]
    if name == "sana-1600m":
        x = torch.randn(b, cfg.in_channels, h, w, generator=g)
        text = torch.randn(b, text_len, cfg.caption_channels, generator=g)
        return dict(hidden_states=x.to(dev, dtype), encoder_hidden_states=text.to(dev, dtype),
                    timestep=torch.full((b,), 500.0, device=dev), return_dict=False)
    x = torch.randn(b, cfg.in_channels, t, 2 * h, 2 * w, generator=g)
    text = torch.randn(b, text_len, cfg.text_dim if name.startswith("wan") else cfg.caption_channels, generator=g)
    return dict(hidden_states=x.to(dev, dtype), encoder_hidden_states=text.to(dev, dtype),
                timestep=torch.full((b,), 500.0, device=dev), return_dict=False)


def first_block(model):
    return (model.blocks if hasattr(model, "blocks") else model.transformer_blocks)[0]


def block_inputs(model, inputs: dict, device: str) -> tuple[tuple, dict, float]:
    """``(args, kwargs, seconds)``: what the model's first block receives, and the time of that model forward."""
    import torch

    seen = {}

    def grab(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    handle = first_block(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            model(**inputs)
            _sync(device)
            seconds = time.perf_counter() - t0
    finally:
        handle.remove()
    detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else tuple(map(detach, x)) if isinstance(x, tuple) else x  # noqa: E731
    return tuple(map(detach, seen["args"])), {k: detach(v) for k, v in seen["kwargs"].items()}, seconds


def set_variant(model, variant: str, grid) -> int | None:
    """Put ``variant`` on the model (stock restored first); returns M (``None`` for stock)."""
    import mhla_diffusers

    if mhla_diffusers.is_mhla_model(model):
        mhla_diffusers.remove_mhla(model)
    if variant == "stock":
        return None
    block_grid = (1, 1, 1) if variant == "linear" else mhla_diffusers.choose_block_grid(grid)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=block_grid, backend="torch")
    return math.prod(block_grid)


def block_call(block, args: tuple, kwargs: dict, grid, mode: str, grad_out):
    """One call of the block under the token grid ``grid``: forward, or forward + backward."""
    import torch

    import mhla_diffusers

    with mhla_diffusers.token_grid(grid):
        if mode == "fwd":
            with torch.no_grad():
                return block(*args, **kwargs)
        hidden = args[0].clone().requires_grad_(True) if args else kwargs["hidden_states"].clone().requires_grad_(True)
        call_args, call_kwargs = ((hidden, *args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=hidden))
        out = block(*call_args, **call_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out)
        return hidden.grad


def timed(fn, device: str) -> dict:
    """Wall and process-CPU seconds of ``fn()`` (CUDA: and the memory it added at its peak)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del result
    out = {"wall": wall, "cpu": cpu}
    if device == "cuda":
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
    return out


def cpu_peak(fn) -> dict:
    """CPU: the growth of resident memory during one ``fn()``, in a forked child whose allocator maps every
    allocation of 64 KiB or more afresh and unmaps it when freed (``mallopt``), so that memory the parent's heap
    already holds cannot hide the peak. Runs only single-threaded (no OpenMP pool crosses the fork)."""
    def child():
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
        base = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark back to the current RSS
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = (_status_kib("VmHWM") - base) * 1024
        del result
        return {"peak_bytes": int(peak), "wall": wall, "cpu": cpu}

    return isolated(child)


# ------------------------------------------------------------------------------------------------
# the worker: one model at one thread count, every grid, interleaved repetitions


def predicted(rows: list, variant: str, mode: str, n: int, softmax: bool) -> float:
    """Seconds of a call, from the largest grid measured so far for this variant and mode (0 if none): linear in N,
    but for a softmax block the part above MHLA's time at that grid (the attention) grows as N^2."""
    done = [r for r in rows if r["variant"] == variant and r["mode"] == mode and r.get("walls")]
    if not done:
        return 0.0
    last = max(done, key=lambda r: r["n"])
    grow, t = n / last["n"], min(last["walls"])
    if not (softmax and variant == "stock"):
        return t * grow
    linear = next((r for r in rows if r["n"] == last["n"] and r["variant"] == "mhla" and r["mode"] == mode and r.get("walls")), None)
    base = min(min(linear["walls"]), t) if linear else 0.0
    return base * grow + (t - base) * grow**2


def run_worker(spec: dict) -> dict:
    import torch

    args = parse_args(spec["argv"])
    name, threads = spec["model"], spec["threads"]
    torch.set_num_threads(threads)
    info = machine_info(args, torch)
    model = build(name, args)
    softmax, layers = MODELS[name]["stock"] == "softmax", MODELS[name]["config"]["num_layers"]
    block, rows, extra, costs = first_block(model), [], [], []
    warm = make_inputs(name, model, grids_for(name, args)[0], args)
    block_inputs(model, warm, args.device)  # library initialisation, first touch of the weights
    for grid in grids_for(name, args):
        n, here = math.prod(grid), []
        if "blocks" in args.parts:
            args_, kwargs, _ = block_inputs(model, make_inputs(name, model, grid, args), args.device)
            model_seconds = block_inputs(model, make_inputs(name, model, grid, args), args.device)[2]
            extra.append({"grid": list(grid), "n": n, "model_1layer_seconds": model_seconds})
            hidden = args_[0] if args_ else kwargs["hidden_states"]
            grad_out = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(hidden)
            here = [dict(model=name, threads=threads, grid=list(grid), n=n, variant=v, mode=m, m=None, walls=[], cpus=[])
                    for v in variants_for(name, args) for m in args.modes]
        for rep in range(args.reps):
            for row in here:
                guess = predicted(rows, row["variant"], row["mode"], n, softmax)
                if rep == 0:
                    row["predicted_seconds"] = guess
                if row.get("skipped") or (rep == 0 and guess > args.max_seconds):
                    row.setdefault("skipped", f"predicted {guess:.0f} s per call > --max-seconds {args.max_seconds:g}")
                    continue
                slow = row["predicted_seconds"] > args.slow_seconds
                if rep > 0 and slow:
                    continue  # one timed call where one takes longer than --slow-seconds
                row["m"] = set_variant(model, row["variant"], grid)
                call = lambda: block_call(block, args_, kwargs, grid, row["mode"], grad_out)  # noqa: E731
                r = None
                if rep == 0 and args.device == "cpu" and threads == 1 and not args.no_memory:
                    peak = cpu_peak(call)  # before the timed calls: the first call's growth, workspaces included
                    row.update({"peak_bytes": peak["peak_bytes"]} if "error" not in peak else {"peak_error": peak["error"]})
                    if slow and "error" not in peak:
                        r, row["timed_in_child"] = peak, True  # allocations >= 64 KiB mapped afresh: as the default
                        # allocator does for the > 32 MiB tensors of such calls
                r = r or timed(call, args.device)
                block.zero_grad(set_to_none=True)
                row["walls"].append(r["wall"])
                row["cpus"].append(r["cpu"])
                if "peak_bytes" in r:
                    row.setdefault("peak_bytes", r["peak_bytes"])
                print(f"{name:10s} {threads}t {'x'.join(map(str, grid)):>9s} N={n:6d} {row['variant']:6s} {row['mode']:6s} "
                      f"rep {rep}: {r['wall']:8.2f} s  peak {_mib(row)} MiB", flush=True)
        set_variant(model, "stock", grid)
        rows.extend(here)
        if "costs" in args.parts:
            costs.append(price_attention(block.attn1, MODELS[name]["stock"], grid, costs, args))
    info["loadavg_end"] = list(os.getloadavg())
    return {"machine": info, "model": name, "threads": threads, "layers": layers, "rows": rows, "model_runs": extra,
            "costs": costs}


def price_attention(attn, stock: str, grid, earlier: list, args) -> dict:
    """The attention operator alone, as ``MeasuredCost`` times it (``time_attention``), beside the FLOP model."""
    import torch

    import mhla_diffusers
    from mhla_diffusers.selection.cost import time_attention

    heads = int(attn.heads)
    head_dim = attn.to_q.out_features // heads
    n, block_grid = math.prod(grid), mhla_diffusers.choose_block_grid(grid)
    m = math.prod(block_grid)
    entry = {"grid": list(grid), "n": n, "m": m, "heads": heads, "head_dim": head_dim,
             "flops_ratio": mhla_diffusers.attention_flops("mhla", n, head_dim, heads, m)
             / mhla_diffusers.attention_flops(stock, n, head_dim, heads)}
    for kind, key in ((stock, "stock_seconds"), ("mhla", "mhla_seconds")):
        last = next((e for e in reversed(earlier) if e.get(key)), None)
        guess = last[key] * (n / last["n"]) ** (2 if kind == "softmax" else 1) if last else 0.0
        if guess > args.max_seconds:
            entry[key + "_skipped"] = f"predicted {guess:.0f} s > --max-seconds {args.max_seconds:g}"
            continue
        entry[key] = time_attention(kind, heads, head_dim, grid, block_grid, device=args.device,
                                    dtype=getattr(torch, args.dtype), backend="torch", reps=1 if guess > args.slow_seconds else 2)
    if entry.get("stock_seconds") and entry.get("mhla_seconds"):
        entry["measured_ratio"] = entry["mhla_seconds"] / entry["stock_seconds"]
    print(f"attention alone {'x'.join(map(str, grid))}: {entry}", flush=True)
    return entry


# ------------------------------------------------------------------------------------------------
# derived numbers


def _best(row) -> float | None:
    return min(row["walls"]) if row and row.get("walls") else None


def _row(rows, **key):
    return next((r for r in rows if all(r[k] == v for k, v in key.items())), None)


def derive(run: dict) -> list[dict]:
    """Per grid: block times, ratios, per-token times, the derived whole-transformer step."""
    rows, out = run["rows"], []
    for extra in run["model_runs"]:
        n = extra["n"]
        get = lambda v, m: _best(_row(rows, n=n, variant=v, mode=m))  # noqa: E731
        stock = get("stock", "fwd")
        rest = max(extra["model_1layer_seconds"] - stock, 0.0) if stock else None
        entry = {"model": run["model"], "threads": run["threads"], "grid": extra["grid"], "n": n, "rest_seconds": rest}
        for v in ("stock", "mhla", "linear"):
            for m in MODES:
                t = get(v, m)
                entry[f"{v}_{m}"] = t
                if t is not None:
                    entry[f"{v}_{m}_us_per_token"] = 1e6 * t / n
            if rest is not None and entry.get(f"{v}_fwd") is not None:
                entry[f"{v}_step"] = rest + run["layers"] * entry[f"{v}_fwd"]
            if entry.get(f"{v}_fwdbwd") is not None:
                entry[f"{v}_train_step"] = run["layers"] * entry[f"{v}_fwdbwd"]
        for v in ("mhla", "linear"):
            for m in ("fwd", "fwdbwd", "step", "train_step"):
                a, b = entry.get(f"stock_{m}"), entry.get(f"{v}_{m}")
                if a and b:
                    entry[f"speedup_{v}_{m}"] = a / b
        entry["m"] = (_row(rows, n=n, variant="mhla", mode="fwd") or {}).get("m")
        out.append(entry)
    return out


def crossover(entries: list[dict]) -> dict:
    """Where ``step(stock) / step(mhla)`` passes 1: a bracket in measured N, or a fit below the sweep."""
    pts = [(e["n"], e["speedup_mhla_step"]) for e in entries if e.get("speedup_mhla_step")]
    if len(pts) < 2:
        return {"text": "-"}
    for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
        if (s0 - 1) * (s1 - 1) <= 0 and s0 != s1:
            x = math.log(n0) + (1 - s0) / (s1 - s0) * (math.log(n1) - math.log(n0))
            return {"n": math.exp(x), "text": f"~{math.exp(x):,.0f} tokens (between {n0:,} and {n1:,})"}
    if all(s < 1 for _, s in pts):
        return {"text": f"beyond {pts[-1][0]:,} tokens (MHLA slower at every measured grid)"}
    fit = _fitted_crossover(entries)
    return {"n": fit, "text": f"below {pts[0][0]:,} tokens" + (f" (fit: ~{fit:,.0f})" if fit else "")}


def _fitted_crossover(entries: list[dict]) -> float | None:
    import numpy as np

    e = [x for x in entries if x.get("stock_step") and x.get("mhla_step")]
    if len(e) < 3:
        return None
    n = np.array([x["n"] for x in e], dtype=float)
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), [x["stock_step"] for x in e], rcond=None)[0]
    a2, b2 = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), [x["mhla_step"] for x in e], rcond=None)[0]
    roots = [r.real for r in np.roots([c, b - b2, a - a2]) if abs(r.imag) < 1e-9 and 1 <= r.real <= n.min()]
    return max(roots) if roots else None


# ------------------------------------------------------------------------------------------------
# the report


def _s(x, digits=2) -> str:
    if x is None:
        return "-"
    if x < 0.01:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e3:,.0f} ms" if x < 1 else f"{x:,.{digits}f} s"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mib(row) -> str:
    return "-" if not row or "peak_bytes" not in row else f"{row['peak_bytes'] / 2**20:,.0f}"


def markdown(report: dict) -> str:
    lines = ["# One transformer block at real width: stock vs MHLA vs plain linear attention", ""]
    for run in report["runs"]:
        info, label = run["machine"], MODELS[run["model"]]["label"]
        where = info.get("gpu") or f"{info['cpu_model']}, {run['threads']} thread(s)"
        lines += [f"## {label}, {where}", "",
                  f"{info['date_utc']} UTC; torch {info['torch']}; {info['device']} {info['dtype']}; batch {info['batch']}; "
                  f"commit {info['git_commit']}; load average {info['loadavg_start'][0]:.2f} at start, "
                  f"{info['loadavg_end'][0]:.2f} at end; {run['layers']} blocks in the full model.", "",
                  "| grid T x H x W | N | M | stock fwd | MHLA fwd | linear fwd | stock / MHLA fwd | stock fwd+bwd | "
                  "MHLA fwd+bwd | linear fwd+bwd | stock / MHLA fwd+bwd | peak MiB fwd stock / MHLA | "
                  "peak MiB fwd+bwd stock / MHLA | MHLA us/token fwd | step stock | step MHLA | step stock / MHLA |",
                  "|" + "---|" * 17]
        entries = derive(run)
        for e in entries:
            rows = run["rows"]
            pk = lambda v, m: _mib(_row(rows, n=e["n"], variant=v, mode=m))  # noqa: E731
            us = e.get("mhla_fwd_us_per_token")
            lines.append(
                f"| {' x '.join(map(str, e['grid']))} | {e['n']:,} | {e['m'] or '-'} | {_s(e['stock_fwd'])} | "
                f"{_s(e['mhla_fwd'])} | {_s(e['linear_fwd'])} | {_x(e.get('speedup_mhla_fwd'))} | {_s(e['stock_fwdbwd'])} | "
                f"{_s(e['mhla_fwdbwd'])} | {_s(e['linear_fwdbwd'])} | {_x(e.get('speedup_mhla_fwdbwd'))} | "
                f"{pk('stock', 'fwd')} / {pk('mhla', 'fwd')} | {pk('stock', 'fwdbwd')} / {pk('mhla', 'fwdbwd')} | "
                f"{'-' if us is None else f'{us:,.0f}'} | {_s(e.get('stock_step'), 1)} | {_s(e.get('mhla_step'), 1)} | "
                f"{_x(e.get('speedup_mhla_step'))} |")
        lines += _costs_table(run)
        skipped = [r for r in run["rows"] if r.get("skipped")]
        lines += ["", f"Crossover (whole-transformer forward step): {crossover(entries)['text']}."]
        if skipped:
            lines.append("Skipped: " + "; ".join(f"{r['variant']} {r['mode']} N={r['n']:,} ({r['skipped']})" for r in skipped) + ".")
        lines.append("")
    settings = report["settings"]
    lines += [
        "Times: the minimum over the interleaved repetitions (all runs in the JSON). Peak: growth of resident memory "
        "(CUDA: allocated memory) during the first call. Step: `R + L x block fwd`, R = the stock 1-layer model's "
        "forward minus its block (embeddings and head, shared by every variant); see docs/performance.md.",
        "",
        "Command" + ("s" if settings.get("merged") else "") + ": " + ", ".join(
            "`" + " ".join(["python", "benchmarks/bench_blocks.py", *argv]) + "`" for argv in settings.get("merged", [settings["argv"]])),
        ""]
    return "\n".join(lines)


def _costs_table(run: dict) -> list[str]:
    """The attention operator alone: measured MHLA / stock time beside the FLOP model's ratio."""
    costs = run.get("costs") or []
    if not costs:
        return []
    out = ["", "Attention operator alone (what `cost=\"measured\"` times), against the FLOP model:", "",
           "| grid | N | M | stock op | MHLA op | MHLA / stock measured | MHLA / stock FLOPs | measured / FLOPs |",
           "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        ratio = c.get("measured_ratio")
        measured = "-" if ratio is None else f"{ratio:.3g}"
        off = "-" if ratio is None else f"{ratio / c['flops_ratio']:.2f}"
        out.append(f"| {' x '.join(map(str, c['grid']))} | {c['n']:,} | {c['m']} | {_s(c.get('stock_seconds'))} | "
                   f"{_s(c.get('mhla_seconds'))} | {measured} | {c['flops_ratio']:.3g} | {off} |")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = False
    for run in report["runs"]:
        entries = derive(run)
        label = f"{MODELS[run['model']]['label']}, {run['threads']}t"
        pts = [(e["n"], e["speedup_mhla_step"]) for e in entries if e.get("speedup_mhla_step")]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=label)
            drawn = True
        for v, style in (("stock", "--"), ("mhla", "-")):
            pts = [(e["n"], e[f"{v}_fwd_us_per_token"]) for e in entries if e.get(f"{v}_fwd_us_per_token")]
            if pts and run["threads"] == min(r["threads"] for r in report["runs"]):
                ax2.plot(*zip(*pts), style, marker="o", label=f"{MODELS[run['model']]['label']} {v}")
                drawn = True
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set(xscale="log", xlabel="tokens N", ylabel="stock / MHLA, transformer step (fwd)", title="speed-up of MHLA")
    ax2.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="block forward, us per token", title="time per token")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# the run


def run_all(args) -> dict:
    runs = []
    for name in args.models:
        for threads in args.threads:
            with tempfile.TemporaryDirectory() as tmp:
                spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
                spec_path.write_text(json.dumps({"model": name, "threads": threads, "argv": args.argv, "out": str(out_path)}))
                env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
                done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)], env=env)
                if done.returncode != 0 or not out_path.exists():
                    raise RuntimeError(f"the {name} run at {threads} thread(s) failed (exit status {done.returncode})")
                runs.append(json.loads(out_path.read_text()))
    return {"settings": {"argv": list(args.argv), "reps": args.reps, "max_seconds": args.max_seconds,
                         "models": {n: dict(MODELS[n]["config"]) for n in args.models}}, "runs": runs}


def _joined(runs: list[dict]) -> list[dict]:
    """The runs, a costs-only run (``--parts costs``) folded into the block run of the same model and threads."""
    out = []
    for run in runs:
        twin = next((r for r in out if (r["model"], r["threads"]) == (run["model"], run["threads"])), None)
        if twin is not None and not (twin.get("costs") and run.get("costs")) and not (twin["rows"] and run["rows"]):
            blocks, costs = (twin, run) if twin["rows"] else (run, twin)
            out[out.index(twin)] = dict(blocks, costs=blocks.get("costs") or costs.get("costs") or [])
        else:
            out.append(run)
    return out


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_blocks.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "bench_blocks.md").write_text(markdown(report))
    plot(report, out / "bench_blocks.png")


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        spec = json.loads(args.worker.read_text())
        result = run_worker(spec)
        Path(spec["out"]).write_text(json.dumps(result, default=str))
        return result
    if args.merge:
        reports = [json.loads(path.read_text()) for path in args.merge]
        commands = [argv for r in reports for argv in r["settings"].get("merged", [r["settings"]["argv"]])]  # merged files keep theirs
        report = {"settings": dict(reports[0]["settings"], merged=commands),
                  "runs": _joined([run for r in reports for run in r["runs"]])}
        write(report, args.out or args.merge[0].parent)
        return report
    if args.render:
        report = json.loads(args.render.read_text())
        write(report, args.render.parent)
        return report
    report = run_all(args)
    out = args.out or ROOT / "benchmarks" / "results" / args.device
    write(report, out)
    print(markdown(report))
    print(f"wrote {out / 'bench_blocks.json'}, {out / 'bench_blocks.md'}, {out / 'bench_blocks.png'}")
    return report


if __name__ == "__main__":
    main()
