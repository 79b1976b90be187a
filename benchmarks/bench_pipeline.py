#!/usr/bin/env python
"""Transformer-level benchmark: forward latency of a whole diffusers transformer, stock vs MHLA.

For DiT-XL/2 (``DiTTransformer2DModel``: 28 layers, 16 heads x 72, in 4 / out 8 channels, patch 2,
sample_size 32, 1000 classes) and SANA-600M (``SanaTransformer2DModel`` with the config of
Efficient-Large-Model/Sana_600M_1024px_diffusers: 28 layers, 36 heads x 32, cross-attention
16 heads x 72 over 1152, caption channels 2304, in/out 32 channels, patch 1, sample_size 32, no
q/k norm), built with random weights (no download), it times one forward (eval mode,
``torch.no_grad``) of:

    stock         the model as diffusers builds it (DiT: softmax SDPA; SANA: ReLU linear attention)
    mhla_all      apply_mhla(model, layers="all", num_blocks=M)
    mhla_hybrid   apply_mhla(model, layers="hybrid", num_blocks=M)  (stock kept on layers 0, 3, 6, ...)

at several latent sizes: median wall-clock ms over --reps runs after one warm-up, and the ratio
MHLA / stock. N is the number of image tokens, M the number of MHLA blocks (default 16, fixed on
the model's native token grid; at other resolutions the blocks stretch with the image). SANA gets
a random caption of --text-len tokens. One model is built at a time and freed before the next.

Defaults: --device cpu: fp32, DiT latents 32 and 64 (256 / 512 px), SANA latents 16 and 32
(512 / 1024 px, the latter at the native grid); --device cuda: bf16, DiT latent 64 (512 px) and
SANA latent 32 (1024 px), the paper's resolutions.

Usage:
    python benchmarks/bench_pipeline.py                       # CPU, ~10-15 min on one thread
    python benchmarks/bench_pipeline.py --device cuda         # GPU, bf16
    python benchmarks/bench_pipeline.py --batch 2             # CFG-like batch
    python benchmarks/bench_pipeline.py --quick --out /tmp/b  # tiny configs, seconds
    python benchmarks/bench_pipeline.py --render benchmarks/results/cpu/bench_pipeline.json  # markdown only
Writes bench_pipeline.json and bench_pipeline.md into --out (default benchmarks/results/<cpu|cuda>).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_ops import _sync, machine_info  # noqa: E402  (machine description, device sync)

VARIANTS = ("stock", "mhla_all", "mhla_hybrid")

from mhla_diffusers.models.configs import DIT_XL_2, SANA_600M  # noqa: E402  (published architectures)

# --quick: the same classes, tiny
DIT_TINY = dict(DIT_XL_2, num_layers=3, num_attention_heads=2, attention_head_dim=8, sample_size=8, num_embeds_ada_norm=10)
SANA_TINY = dict(
    SANA_600M, num_layers=3, num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2,
    cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16, in_channels=4, out_channels=4, sample_size=8,
)

MODELS = {
    # name: (diffusers class, config, quick config, label, latent sizes cpu, latent sizes cuda, quick latents)
    "dit": ("DiTTransformer2DModel", DIT_XL_2, DIT_TINY, "DiT-XL/2", (32, 64), (64,), (8, 16)),
    "sana": ("SanaTransformer2DModel", SANA_600M, SANA_TINY, "SANA-600M", (16, 32), (32,), (8, 16)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--dit-latents", type=int, nargs="+", help="DiT latent sides (pixels / 8)")
    p.add_argument("--sana-latents", type=int, nargs="+", help="SANA latent sides (pixels / 32)")
    p.add_argument("--batch", type=int, default=1, help="batch size (2: classifier-free-guidance-like)")
    p.add_argument("--text-len", type=int, default=32, help="SANA caption tokens (random embeddings)")
    p.add_argument("--num-blocks", type=int, default=16, help="MHLA blocks M on the model's native token grid")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; default 1)")
    p.add_argument("--reps", type=int, help="timed forwards after one warm-up (default 3 on CPU, 10 on CUDA)")
    p.add_argument("--quick", action="store_true", help="tiny configs of the same classes, 1 rep (smoke test)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<cpu|cuda>)")
    p.add_argument("--render", type=Path, help="only rewrite the markdown (next to it) from this bench_pipeline.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.reps = args.reps or (1 if args.quick else 3 if args.device == "cpu" else 10)
    if args.quick:
        args.num_blocks = min(args.num_blocks, 4)
    return args


def latents_for(name: str, args) -> list[int]:
    _, _, _, _, cpu, cuda, quick = MODELS[name]
    given = args.dit_latents if name == "dit" else args.sana_latents
    return list(given or (quick if args.quick else cpu if args.device == "cpu" else cuda))


# ------------------------------------------------------------------------------------------------
# models and inputs


def build_model(name: str, args):
    import diffusers
    import torch

    cls_name, config, tiny, *_ = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(diffusers, cls_name)(**(tiny if args.quick else config))
    model = model.eval().to(args.device)
    return model if args.dtype == "float32" else model.to(getattr(torch, args.dtype))


def make_inputs(name: str, model, latent: int, args) -> dict:
    import torch

    cfg, b, dtype = model.config, args.batch, getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, cfg.in_channels, latent, latent, generator=g).to(args.device, dtype)
    t = (torch.rand(b, generator=g) * 1000).to(args.device)
    if name == "dit":
        labels = torch.randint(0, cfg.num_embeds_ada_norm, (b,), generator=g).to(args.device)
        return dict(hidden_states=x, timestep=t, class_labels=labels, return_dict=False)
    text = torch.randn(b, args.text_len, cfg.caption_channels, generator=g).to(args.device, dtype)
    mask = torch.ones(b, args.text_len, dtype=torch.long, device=args.device)
    return dict(hidden_states=x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask, return_dict=False)


def tokens(name: str, model, latent: int) -> int:
    p = model.config.patch_size
    return (latent // p) ** 2


def install(model, variant: str, args) -> int | None:
    """Put ``variant`` on the (stock) model; returns M (None for stock)."""
    import mhla_diffusers

    if variant == "stock":
        return None
    mhla_diffusers.apply_mhla(model, layers=variant.split("_", 1)[1], num_blocks=args.num_blocks)
    return mhla_diffusers.mhla_spec(model)["num_blocks"]


def time_forward(model, inputs: dict, args) -> dict:
    import torch

    walls, cpus = [], []
    with torch.no_grad():
        out = model(**inputs)[0]  # warm-up
        _sync(args.device)
        finite = bool(torch.isfinite(out).all())
        shape = list(out.shape)
        del out
        for _ in range(args.reps):
            c0, t0 = time.process_time(), time.perf_counter()
            out = model(**inputs)[0]
            _sync(args.device)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            del out
    walls.sort()
    cpus.sort()
    return {
        "time_ms": 1e3 * walls[len(walls) // 2],
        "time_min_ms": 1e3 * walls[0],
        "cpu_ms": 1e3 * cpus[len(cpus) // 2] if args.device == "cpu" else None,
        "runs": len(walls),
        "output_shape": shape,
        "finite": finite,
    }


# ------------------------------------------------------------------------------------------------
# the run


def run_all(args) -> dict:
    import torch

    import mhla_diffusers

    torch.set_num_threads(args.threads)
    info = machine_info(args, torch)
    print(f"# {info.get('gpu') or info['cpu_model']} | {info['threads']} thread(s) | torch {info['torch']} | "
          f"{args.device} {args.dtype} | batch {args.batch}", flush=True)
    rows = []
    for name in args.models:
        label = MODELS[name][3] + (" (tiny)" if args.quick else "")
        model = build_model(name, args)
        params = sum(p.numel() for p in model.parameters())
        print(f"## {label}: {params / 1e6:.0f}M parameters", flush=True)
        for variant in args.variants:
            m = install(model, variant, args)
            for latent in latents_for(name, args):
                inputs = make_inputs(name, model, latent, args)
                r = time_forward(model, inputs, args)
                del inputs
                row = {
                    "model": name,
                    "label": label,
                    "params": params,
                    "variant": variant,
                    "latent": latent,
                    "pixels": latent * (8 if name == "dit" else 32),
                    "n": tokens(name, model, latent),
                    "m": m,
                    "text_len": args.text_len if name == "sana" else None,
                    **r,
                }
                rows.append(row)
                print(f"{label:10s} {variant:12s} latent {latent:3d} N={row['n']:5d} M={m or '-'}: {r['time_ms']:9.1f} ms", flush=True)
            mhla_diffusers.remove_mhla(model)
        del model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    info["loadavg_end"] = list(os.getloadavg())
    ratios = []
    for r in rows:
        if r["variant"] == "stock":
            continue
        base = next((s for s in rows if s["variant"] == "stock" and s["model"] == r["model"] and s["latent"] == r["latent"]), None)
        if base:
            ratios.append(
                {k: r[k] for k in ("model", "variant", "latent", "n", "m")}
                | {"ratio": r["time_ms"] / base["time_ms"],
                   "cpu_ratio": r["cpu_ms"] / base["cpu_ms"] if r["cpu_ms"] and base["cpu_ms"] else None}
            )
    return {"machine": info, "settings": settings(args), "results": rows, "ratios": ratios}


def settings(args) -> dict:
    return {
        "models": {n: dict(MODELS[n][2] if args.quick else MODELS[n][1]) for n in args.models},
        "variants": list(args.variants),
        "latents": {n: latents_for(n, args) for n in args.models},
        "reps": args.reps,
        "warmup": 1,
        "num_blocks": args.num_blocks,
        "text_len": args.text_len,
        "quick": args.quick,
        "argv": list(getattr(args, "argv", [])),
    }


def markdown(report: dict, args) -> str:
    info = report["machine"]
    where = info.get("gpu") or f"{info['cpu_model']}, {info['threads']} thread(s)"
    lines = [
        "# Transformer forward latency: stock vs MHLA" + (" (--quick: tiny configs)" if args.quick else ""),
        "",
        f"{where}; torch {info['torch']}; {args.device} {args.dtype}; batch {args.batch}; {info['date_utc']} UTC; "
        f"commit {info['git_commit']}; load average {info['loadavg_start'][0]:.2f} at start, {info['loadavg_end'][0]:.2f} at end.",
        f"Random weights, eval mode, `torch.no_grad`; median of {args.reps} forward(s) after one warm-up. "
        f"M = MHLA blocks (fixed on the native token grid); SANA caption {args.text_len} tokens.",
        "",
        "| model | px | latent | N | M | stock ms | MHLA all ms | MHLA hybrid ms | all / stock | hybrid / stock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpu = args.device == "cpu"
    rows = report["results"]

    def get(model, variant, latent):
        return next((r for r in rows if r["model"] == model and r["variant"] == variant and r["latent"] == latent), None)

    def ms(r):
        if not r:
            return "-"
        return f"{r['time_ms']:,.0f} ({r['cpu_ms']:,.0f})" if cpu and r.get("cpu_ms") else f"{r['time_ms']:,.1f}"

    def ratio(r, s):
        if not (r and s):
            return "-"
        text = f"{r['time_ms'] / s['time_ms']:.2f}"
        return text + (f" ({r['cpu_ms'] / s['cpu_ms']:.2f})" if cpu and r.get("cpu_ms") and s.get("cpu_ms") else "")

    for name in args.models:
        for latent in latents_for(name, args):
            s, a, h = (get(name, v, latent) for v in VARIANTS)
            any_row = s or a or h
            m = (a or h or {}).get("m")
            ra, rh = ratio(a, s), ratio(h, s)
            lines.append(
                f"| {MODELS[name][3]}{' (tiny)' if args.quick else ''} | {any_row['pixels']} | {latent} x {latent} | "
                f"{any_row['n']:,} | {m or '-'} | "
                f"{ms(s)} | {ms(a)} | {ms(h)} | {ra} | {rh} |"
            )
    if cpu:
        lines += [
            "",
            "CPU: wall-clock ms, in brackets the process CPU time (ms) of the same forwards; ratios both ways. On a shared "
            "machine the CPU time is the robust one (wall > CPU time means the process waited for a core).",
        ]
    lines += ["", "Command: `" + " ".join(["python", "benchmarks/bench_pipeline.py", *report["settings"]["argv"]]) + "`", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.render:  # the markdown of an earlier run, with that run's settings
        path = args.render
        report = json.loads(path.read_text())
        args = parse_args(report["settings"]["argv"])
        args.argv = report["settings"]["argv"]
        for q in report["ratios"]:  # reports written before cpu_ratio existed
            if "cpu_ratio" not in q:
                get = lambda v: next(  # noqa: E731
                    r for r in report["results"] if (r["model"], r["variant"], r["latent"]) == (q["model"], v, q["latent"])
                )
                a, b = get(q["variant"]), get("stock")
                q["cpu_ratio"] = a["cpu_ms"] / b["cpu_ms"] if a["cpu_ms"] and b["cpu_ms"] else None
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        md = markdown(report, args)
        (path.parent / "bench_pipeline.md").write_text(md)
        print(md)
        return report
    out = args.out or ROOT / "benchmarks" / "results" / args.device
    report = run_all(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_pipeline.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report, args)
    (out / "bench_pipeline.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out / 'bench_pipeline.json'}, {out / 'bench_pipeline.md'}")
    return report


if __name__ == "__main__":
    main()
