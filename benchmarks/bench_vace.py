#!/usr/bin/env python
"""Wan VACE: what MHLA on each kind of self-attention layer costs and changes (docs/families/wan-vace.md).

A ``WanVACETransformer3DModel`` has two kinds of self-attention layers: the main blocks' (``blocks.i.attn1``) and
the VACE blocks' (``vace_blocks.i.attn1``, one per ``vace_layers`` entry), both ``WanAttention`` over the same
token grid. Two parts, random weights (no download):

    cost         one main and one VACE self-attention layer (the whole ``attn1``: projections, q/k norms, RoPE,
                 attention, output projection) at the published width (Wan2.1-VACE-1.3B: 12 heads x 128), stock
                 vs MHLA, at the given token grids, batch 1, ``torch.no_grad``; the minimum of ``--reps`` calls.
                 From those per-layer times: the share of the model's self-attention time that
                 sits in VACE layers and what MHLA on the main layers only / the VACE layers only / both saves, at
                 the published layer counts (1.3B: 30 main + 15 VACE; 14B: 40 + 8), and the FLOP model's per-layer
                 prices (what ``layers="auto"`` with a budget sees).
    sensitivity  a small random-weight VACE model (6 main blocks, VACE blocks after main blocks 0, 2, 4, as the 1.3B
                 model's every second block): the relative L2 deviation of the output from the stock model with
                 MHLA on the main layers only, the VACE layers only and both, over seeds, on calibration inputs
                 (``calibration_inputs``: a whole-video control latent); and the per-layer scores of
                 ``layer_sensitivity`` (what ``layers="auto"`` ranks) for the first seed.

Usage:
    python benchmarks/bench_vace.py --out benchmarks/results/cpu             # both parts, 1,560 and 7,800 tokens
    python benchmarks/bench_vace.py --parts cost --grids 1 30 52 --reps 3
    python benchmarks/bench_vace.py --parts sensitivity --seeds 0 1 2 3
    python benchmarks/bench_vace.py --quick --out /tmp/vace                  # tiny widths, seconds
Writes bench_vace.json and bench_vace.md into --out (default benchmarks/results/<cpu|cuda>).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from bench_ops import _cpu_model  # noqa: E402  (the machine description bench_ops writes)

import mhla_diffusers  # noqa: E402
from mhla_diffusers.families import self_attention_modules  # noqa: E402
from mhla_diffusers.models.configs import WAN_VACE_1_3B, WAN_VACE_14B  # noqa: E402
from mhla_diffusers.selection.cost import cost_fraction, layer_attention_flops  # noqa: E402

PUBLISHED = {"Wan2.1-VACE-1.3B": WAN_VACE_1_3B, "Wan2.1-VACE-14B": WAN_VACE_14B}
# the tiny widths of --quick (the same class); the sensitivity model's sizes
_TINY = dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=32, freq_dim=16)
SMALL = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16, text_dim=32,
             freq_dim=32, ffn_dim=128, num_layers=6, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
             rope_max_seq_len=64, vace_layers=[0, 2, 4], vace_in_channels=96)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["cost", "sensitivity"], default=["cost", "sensitivity"])
    p.add_argument("--grids", type=int, nargs="+", metavar="T H W",
                   help="cost: token grids as T H W triples (default 1 30 52 and 5 30 52: 1,560 and 7,800 tokens)")
    p.add_argument("--reps", type=int, default=2, help="cost: timed calls per layer and variant (default 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="sensitivity: model and input seeds")
    p.add_argument("--fit-steps", type=int, default=20, help="sensitivity: layer_sensitivity's fit steps (default 20)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--quick", action="store_true", help="tiny widths and grids, 1 rep, 1 seed (smoke test)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<cpu|cuda>)")
    args = p.parse_args(argv)
    if args.grids is not None and len(args.grids) % 3:
        p.error("--grids takes T H W triples")
    grids = [tuple(args.grids[i:i + 3]) for i in range(0, len(args.grids), 3)] if args.grids else None
    args.grids = grids or ([(1, 4, 6), (2, 4, 6)] if args.quick else [(1, 30, 52), (5, 30, 52)])
    if args.quick:
        args.reps, args.seeds, args.fit_steps = 1, args.seeds[:1], 3
    args.out = args.out or HERE / "results" / args.device
    return args


def _model(config: dict, seed: int = 0, device: str = "cpu"):
    from diffusers import WanVACETransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanVACETransformer3DModel(**config)
    return model.eval().to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- cost ------------------------------------------------------------------------------------------
def time_layers(config: dict, grid, reps: int, device: str) -> dict:
    """Seconds of ``blocks.0.attn1`` and ``vace_blocks.0.attn1`` of a 1 + 1 block model of ``config``'s width, stock
    and MHLA (``choose_block_grid(grid)``, torch backend), on ``[1, N, dim]`` random states with the model's RoPE."""
    model = _model(dict(config, num_layers=1, vace_layers=[0]), device=device)
    layers = dict(self_attention_modules(model))  # blocks.0.attn1 (layer 0), vace_blocks.0.attn1 (layer 1)
    t, h, w = grid
    p_t, p_h, p_w = model.config.patch_size
    g = torch.Generator().manual_seed(0)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    hidden = torch.randn(1, t * h * w, dim, generator=g).to(device)
    rotary = model.rope(torch.zeros(1, model.config.in_channels, t * p_t, h * p_h, w * p_w, device=device))
    block_grid = mhla_diffusers.choose_block_grid(grid)
    seconds = {}
    for variant in ("stock", "mhla"):
        if variant == "mhla":
            mhla_diffusers.apply_mhla(model, layers="all", block_grid=block_grid, backend="torch")
        for name, attn in layers.items():
            best = math.inf
            with torch.no_grad(), mhla_diffusers.token_grid(grid):
                for _ in range(reps):
                    _sync(device)
                    t0 = time.perf_counter()
                    attn(hidden, None, None, rotary)
                    _sync(device)
                    best = min(best, time.perf_counter() - t0)
            seconds[f"{name.split('.')[0]}_{variant}"] = best
    return {"grid": list(grid), "n": t * h * w, "block_grid": list(block_grid), "m": math.prod(block_grid),
            "seconds": seconds}


def shares(seconds: dict, config: dict) -> dict:
    """At ``config``'s layer counts: the VACE layers' share of the self-attention time (stock), and the fraction of it
    left with MHLA on the main layers only, the VACE layers only, and both."""
    mains, vaces = int(config["num_layers"]), len(config["vace_layers"])
    stock = mains * seconds["blocks_stock"] + vaces * seconds["vace_blocks_stock"]
    left = {
        "main_only": (mains * seconds["blocks_mhla"] + vaces * seconds["vace_blocks_stock"]) / stock,
        "vace_only": (mains * seconds["blocks_stock"] + vaces * seconds["vace_blocks_mhla"]) / stock,
        "all": (mains * seconds["blocks_mhla"] + vaces * seconds["vace_blocks_mhla"]) / stock,
    }
    return {"main_layers": mains, "vace_layers": vaces, "vace_share": vaces * seconds["vace_blocks_stock"] / stock,
            "time_left": left}


def flop_prices(config: dict) -> dict:
    """The FLOP model's per-layer prices on a meta-device model of ``config`` (no memory): what ``layers="auto"``
    with ``max_attention_cost`` sees, main layers first, then the VACE ones."""
    with torch.device("meta"):
        model = _model(config, device="meta")
    stock, mhla = layer_attention_flops(model)
    mains = int(config["num_layers"])
    every = list(range(len(stock)))
    return {"layers": len(stock), "stock_main": stock[0], "stock_vace": stock[mains], "mhla_main": mhla[0],
            "mhla_vace": mhla[mains], "all_mhla_cost": cost_fraction(stock, mhla, every),
            "main_only_cost": cost_fraction(stock, mhla, every[:mains]), "vace_only_cost": cost_fraction(stock, mhla, every[mains:])}


# -- sensitivity -----------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double())).item()


def deviations(config: dict, seeds, fit_steps: int, grid=(3, 8, 12), device: str = "cpu") -> dict:
    """Per seed: the output's relative L2 deviation from stock with MHLA on main / VACE / all layers (default block
    grid, over 4 calibration inputs); for the first seed the per-layer ``layer_sensitivity`` scores."""
    import warnings

    latent = (grid[0], 2 * grid[1], 2 * grid[2])
    rows, scores = [], None
    for seed in seeds:
        model = _model(config, seed=seed, device=device)
        g = torch.Generator().manual_seed(seed)
        text = {"encoder_hidden_states": torch.randn(4, 6, model.config.text_dim, generator=g)}
        calibration = mhla_diffusers.calibration_inputs(model, num_samples=4, seed=seed, embeddings=text, latent_size=latent)
        mains = int(model.config.num_layers)
        total = len(self_attention_modules(model))
        block_grid = mhla_diffusers.choose_block_grid(grid)

        def outputs(m):
            with torch.no_grad():
                return torch.cat([m(**x).sample for x in calibration])

        stock = outputs(model)
        row = {"seed": seed}
        for name, layers in (("main_only", list(range(mains))), ("vace_only", list(range(mains, total))), ("all", "all")):
            mhla_diffusers.apply_mhla(model, layers=layers, block_grid=block_grid)
            row[name] = _rel(outputs(model), stock)
            mhla_diffusers.remove_mhla(model)
        rows.append(row)
        if scores is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a short fit may be reported as not converged
                found = mhla_diffusers.layer_sensitivity(model, calibration, block_grid=block_grid, fit_steps=fit_steps,
                                                        progress=False)
            names = [n for n, _ in self_attention_modules(model)]
            scores = [{"layer": i, "module": names[i], "score": found[i]} for i in range(total)]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("main_only", "vace_only", "all")}
    return {"grid": list(grid), "block_grid": list(mhla_diffusers.choose_block_grid(grid)), "per_seed": rows, "mean": mean,
            "scores": scores}


# -- report ----------------------------------------------------------------------------------------
def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Wan VACE: MHLA per kind of layer ({m['device']}, {m['threads']} thread(s))", "",
             f"{m.get('date_utc', '')} UTC, torch {m['torch']}, load average {m['loadavg_start'][0]:.2f} at the start, "
             f"{m.get('loadavg_end', [0.0])[0]:.2f} at the end; random weights; {report.get('seconds', 0):.0f} s in all.", ""]
    if "cost" in report:
        lines += ["## One self-attention layer (attn1), seconds", "",
                  "| tokens | block grid | main stock | VACE stock | main MHLA | VACE MHLA |", "|---|---|---|---|---|---|"]
        for r in report["cost"]["layers"]:
            s = r["seconds"]
            lines.append(f"| {r['n']:,} ({' x '.join(map(str, r['grid']))}) | {tuple(r['block_grid'])} | {s['blocks_stock']:.3g} | "
                         f"{s['vace_blocks_stock']:.3g} | {s['blocks_mhla']:.3g} | {s['vace_blocks_mhla']:.3g} |")
        lines += ["", "## Self-attention time at the published layer counts (fraction of stock left)", "",
                  "| model | tokens | VACE share | MHLA main only | MHLA VACE only | MHLA both |", "|---|---|---|---|---|---|"]
        for name, per_grid in report["cost"]["shares"].items():
            for n, s in per_grid.items():
                left = s["time_left"]
                lines.append(f"| {name} ({s['main_layers']} + {s['vace_layers']}) | {n} | {s['vace_share']:.3f} | "
                             f"{left['main_only']:.3f} | {left['vace_only']:.3f} | {left['all']:.3f} |")
        lines += ["", "FLOP model (native grid, what `layers=\"auto\"` with a budget prices):", ""]
        for name, f in report["cost"]["flops"].items():
            lines.append(f"- {name}: {f['layers']} layers, stock {f['stock_main']:.3g} FLOPs per main and {f['stock_vace']:.3g} per "
                         f"VACE layer; cost left: main only {f['main_only_cost']:.3f}, VACE only {f['vace_only_cost']:.3f}, "
                         f"all {f['all_mhla_cost']:.3f}")
    if "sensitivity" in report:
        s = report["sensitivity"]
        lines += ["", f"## Output deviation from stock (relative L2; random weights, grid {tuple(s['grid'])}, "
                  f"block grid {tuple(s['block_grid'])})", "", "| seed | MHLA main only | MHLA VACE only | MHLA both |",
                  "|---|---|---|---|"]
        for r in s["per_seed"] + [dict(s["mean"], seed="mean")]:
            lines.append(f"| {r['seed']} | {r['main_only']:.3f} | {r['vace_only']:.3f} | {r['all']:.3f} |")
        lines += ["", "Per-layer sensitivity (layer_sensitivity, first seed):", "", "| layer | module | score |", "|---|---|---|"]
        lines += [f"| {x['layer']} | `{x['module']}` | {x['score']:.4f} |" for x in s["scores"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = {"machine": {"device": torch.cuda.get_device_name() if args.device == "cuda" else _cpu_model(),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu_count": os.cpu_count(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
                          "loadavg_start": list(os.getloadavg())}, "quick": args.quick}
    if "cost" in args.parts:
        width = dict(WAN_VACE_1_3B, **(_TINY if args.quick else {}))
        layers = [time_layers(width, grid, args.reps, args.device) for grid in args.grids]
        report["cost"] = {
            "width": {k: width[k] for k in ("num_attention_heads", "attention_head_dim")},
            "layers": layers,
            "shares": {name: {f"{r['n']:,}": shares(r["seconds"], config) for r in layers} for name, config in PUBLISHED.items()},
            "flops": {name: flop_prices(config) for name, config in PUBLISHED.items()},
        }
    if "sensitivity" in args.parts:
        config = dict(SMALL, num_layers=3, vace_layers=[0, 2], **_TINY) if args.quick else SMALL
        report["sensitivity"] = deviations(config, args.seeds, args.fit_steps, grid=(2, 4, 6) if args.quick else (3, 8, 12),
                                           device=args.device)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    report["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_vace.json").write_text(json.dumps(report, indent=1))
    (args.out / "bench_vace.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
