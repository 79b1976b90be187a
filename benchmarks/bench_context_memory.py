#!/usr/bin/env python
"""What a context degree buys in training: per-rank peak memory of one Wan2.1-1.3B block, forward + backward.

A ``WanTransformer3DModel`` with ONE block at the published width (1,536 = 12 heads x 128, FFN 8,960; random weights,
seed 0), MHLA on its self-attention (the block grid ``choose_block_grid`` gives), at the 480 x 832, 81-frame latent
(21 x 30 x 52 = 32,760 tokens; ``--frames`` for fewer). Under ``torchrun --nproc_per_node P`` the model runs under
context parallelism over the P processes (``P = 1``: one process, no context parallelism) as the trainer runs it
(``parallel.context``: ``ring_degree: P``); each rank does one forward and backward of a loss on the gathered output.

Measured per rank: the growth of resident memory at its peak during the forward + backward, above the resident
memory before it (the peak-RSS mark reset through ``/proc/self/clear_refs``; allocations of 64 KiB and more mapped
afresh and unmapped when freed, so the heap cannot hide the peak), wall and CPU seconds, and the bytes MHLA's
exchange sent (``record_exchanges``: forward and backward). Beside them: what diffusers' ring and Ulysses attention
would send for the same layer's forward (``communication_bytes``, fp32 as here). Writes ``--out/context_memory_P.json``;
``--report`` joins them into ``context_memory.md``.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_context_memory.py --out benchmarks/results/cpu
    python benchmarks/bench_context_memory.py --report --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_ops import _status_kib, machine_info  # noqa: E402

LATENT = (30, 52)  # 480 x 832 px through Wan's VAE (8x) and patch (2x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "results" / "cpu"))
    p.add_argument("--frames", type=int, default=21, help="latent frames (21: 81 video frames, 32,760 tokens)")
    p.add_argument("--text", type=int, default=512, help="text tokens (Wan: 512)")
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 frames: the wiring only")
    p.add_argument("--report", action="store_true", help="join the context_memory_P.json in --out into context_memory.md")
    return p.parse_args(argv)


def build(args):
    """The one-block model with MHLA (every rank the same weights), its inputs, the token grid."""
    import diffusers
    import torch

    import mhla_diffusers
    from mhla_diffusers.models.configs import WAN_1_3B

    config = dict(WAN_1_3B, num_layers=1)
    if args.quick:
        config.update(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=32, freq_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = diffusers.WanTransformer3DModel(**config).train()
    frames, (h, w) = (2, (4, 4)) if args.quick else (args.frames, LATENT)
    grid = (frames, h, w)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=mhla_diffusers.choose_block_grid(grid), backend="torch")
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, config["in_channels"], frames, 2 * h, 2 * w, generator=g),
                  encoder_hidden_states=torch.randn(1, 8 if args.quick else args.text, config["text_dim"], generator=g),
                  timestep=torch.full((1,), 500.0), return_dict=False)
    return model, inputs, grid


def step(model, inputs) -> None:
    """One forward and backward (a loss on the whole, gathered output)."""
    out = model(**inputs)[0]
    out.float().pow(2).mean().backward()


def measure(model, inputs) -> dict:
    """Peak resident growth (bytes), wall and CPU seconds of one :func:`step`, and MHLA's exchanges in it."""
    from mhla_diffusers.models.parallel import record_exchanges

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large allocations mapped afresh, returned when freed
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark back to the current RSS (then read: peak >= base)
    base = _status_kib("VmRSS")
    c0, t0 = time.process_time(), time.perf_counter()
    with record_exchanges() as log:
        step(model, inputs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"peak_bytes": (_status_kib("VmHWM") - base) * 1024, "base_bytes": base * 1024, "wall_s": wall, "cpu_s": cpu,
            "exchange_bytes": {d: sum(e["bytes"] for e in log if e["direction"] == d) for d in ("forward", "backward")},
            "exchanges": len(log)}


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, inputs, grid = build(args)
    if world > 1:
        from mhla_diffusers.training.context import data_layout, enable_training_context

        dist.init_process_group("gloo")
        enable_training_context(model, data_layout({"ring_degree": world}, dist.get_rank(), world), torch.device("cpu"))
    result = measure(model, inputs)
    rank = dist.get_rank() if world > 1 else 0
    ranks = [None] * world
    if world > 1:
        dist.all_gather_object(ranks, result)
        dist.destroy_process_group()
    else:
        ranks = [result]
    if rank:
        return {}
    from mhla_diffusers.models.parallel import communication_bytes

    attn = model.blocks[0].attn1
    tokens, block_grid = math.prod(grid), tuple(attn.mhla.mixing.block_grid)
    formulas = communication_bytes(tokens, attn.heads, attn.inner_dim // attn.heads, math.prod(block_grid), world,
                                   activation_bytes=4) if world > 1 else {}
    machine = machine_info(SimpleNamespace(device="cpu", dtype="float32", batch=1), torch)
    report = {"model": "a tiny Wan (--quick: the wiring only)" if args.quick else "Wan2.1-1.3B", "degree": world,
              "tokens": tokens, "grid": grid, "block_grid": block_grid,
              "ranks": ranks, "formulas_forward_bytes": {k: formulas[k] for k in ("ring", "ulysses", "mhla") if k in formulas},
              "machine": machine, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"context_memory_{world}.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def markdown(reports: list[dict]) -> str:
    """The table of :func:`run`'s reports, by degree: peak per rank (and its share of one process's), wall time, what
    one rank sends for the block's self-attention forward (MHLA's all-reduce, diffusers' ring and Ulysses attention:
    ``communication_bytes``), and MHLA's all-reduce payload as recorded, forward and backward."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    by_degree = sorted(reports, key=lambda r: r["degree"])
    first, one = by_degree[0], max(by_degree[0]["ranks"], key=lambda x: x["peak_bytes"])["peak_bytes"]
    lines = [f"One {first['model']} block (random weights, MHLA block grid {tuple(first['block_grid'])}), forward + backward at "
             f"{first['tokens']:,} tokens {tuple(first['grid'])}, fp32, one thread per rank, gloo, on "
             f"{first['machine'].get('cpu_count', '?')} cores ({first['machine'].get('cpu_model', '')}), {first['date']}, "
             f"torch {first['torch']}.", "",
             "| context degree | peak memory per rank, GiB (of one process) | wall s, slowest rank | one rank sends, self-attention "
             "forward, MiB: MHLA / ring / Ulysses | MHLA all-reduce payload, fwd / bwd, MiB |", "|---|---|---|---|---|"]
    for r in by_degree:
        peak = max(x["peak_bytes"] for x in r["ranks"])
        wall = max(x["wall_s"] for x in r["ranks"])
        ex = max(r["ranks"], key=lambda x: x["exchange_bytes"]["forward"])["exchange_bytes"]
        f = r["formulas_forward_bytes"]
        sent = f"{mib(f['mhla'])} / {mib(f['ring'])} / {mib(f['ulysses'])}" if f else "-"
        share = f"{peak / one:.2f}" if one else "-"  # a tiny --quick block may add no resident memory at all
        lines.append(f"| {r['degree']} | {peak / 2**30:.2f} ({share}) | {wall:.1f} | {sent} | "
                     f"{mib(ex['forward'])} / {mib(ex['backward'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        reports = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("context_memory_*.json"))]
        if not reports:
            print(f"no context_memory_*.json in {args.out}: run the benchmark first", file=sys.stderr)
            return 2
        (Path(args.out) / "context_memory.md").write_text(markdown(reports))
        print(markdown(reports))
        return 0
    report = run(args)
    if report:
        print(json.dumps({k: report[k] for k in ("degree", "tokens", "ranks", "formulas_forward_bytes")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
