#!/usr/bin/env python
"""The retrofit study (issue 13): softmax, MHLA and plain linear attention at 256 and 1,024 tokens.

For each token count, starting from the demo's pretrained softmax DiT at that size
(``demo/base_dit``: 32-px crops, 16 x 16 = 256 tokens; ``demo/base_dit_64``: 64-px crops,
32 x 32 = 1,024 tokens; both trained here on the photos shipped in the scikit-image / scikit-learn
wheels), every student gets the same budget and the same recipe
(:func:`mhla_diffusers.training.retrofit`: label-free distillation, then fine-tuning with the data
loss + output matching against the original):

- ``softmax``: the control, the original itself run through the recipe (its distillation phase is
  the identity and is skipped);
- ``mhla_all``: MHLA on all 6 layers; ``mhla_hybrid``: softmax kept on every third layer (0, 3);
- ``mhla_auto``: softmax kept on the same number of layers, chosen by
  :func:`mhla_diffusers.layer_sensitivity` on noised photo crops (``layers="auto"``);
- ``linear``: plain linear attention (MHLA with one block, M = 1).

Measured: the held-out epsilon MSE after conversion, distillation and fine-tuning (fixed crops,
noise and timesteps); the fraction of the linear-to-softmax gap each student closes; per-layer rank
and entropy of the attention matrices (paper Fig. 3, :func:`mhla_diffusers.diagnostics.diagnose_pipeline`)
of the final models; one sample per class; wall times. Writes ``<out>/report.md``, ``report.json``,
``heldout.png``, ``rank_entropy_<size>_<model>.png``, ``samples_<size>_<model>.png``.

    python demo/run_study.py --out study_out                     # the committed run (docs/study/)
    python demo/run_study.py --out /tmp/s --quick --sizes 256    # the wiring only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "finetune" / "configs" / "dit_demo_finetune.yaml"
# the data-free recipe (issue 34): the same settings, trained on the original's own samples, held out on photo crops
DATAFREE_CONFIG = ROOT / "finetune" / "configs" / "dit_demo_datafree.yaml"
SIZES = {  # tokens -> the base, MHLA's block count and the data / eval settings at that size
    "256": {"base": ROOT / "demo" / "base_dit", "num_blocks": 16, "overrides": []},
    "1024": {"base": ROOT / "demo" / "base_dit_64", "num_blocks": 30,
             "overrides": ["data.resolution=64", "data.short_side=80", "data.batch_size=8", "eval.batch_size=16"]},
}
VARIANTS = {  # name -> conversion arguments (None: the softmax control)
    "softmax": None,
    "mhla_all": {"layers": "all"},
    "mhla_hybrid": {"layers": "hybrid"},
    "mhla_auto": {"layers": "auto"},
    "linear": {"layers": "all", "block_grid": (1, 1, 1)},
    "mhla_auto1": {"layers": "auto", "keep_softmax": 1},  # the automatic hybrid keeping ONE softmax layer
    # the options of the authors' code, MHLA on every layer (issue 22); LePE and the gate start neutral
    "mhla_lepe": {"layers": "all", "lepe": True},
    "mhla_gate": {"layers": "all", "gate": "neutral"},
    "mhla_lepe_gate": {"layers": "all", "lepe": True, "gate": "neutral"},
    # the authors' Wan start: mixing matrix and output RMSNorm weight at 1e-6, the branch outputs ~0
    "mhla_authors": {"layers": "all", "init": "authors_constant", "output_norm": True},
    # LePE with the power feature map phi = ReLU(x)^2 (a sharper kernel; not a neutral start)
    "mhla_lepe_power2": {"layers": "all", "lepe": True, "feature_power": 2.0},
    "mhla_lepe_power3": {"layers": "all", "lepe": True, "feature_power": 3.0},
    "mhla_auto1_lepe": {"layers": "auto", "keep_softmax": 1, "lepe": True},  # the auto hybrid, its MHLA layers with LePE
    # data-free (issue 34): no photo seen in training; "teacher": the data.teacher settings over the data-free config
    # (samples = the original's trajectories in the store), "retrofit": retrofit() options of the variant
    "mhla_lepe_datafree": {"layers": "all", "lepe": True, "teacher": {"samples": 64}},
    "mhla_auto1_datafree": {"layers": "auto", "keep_softmax": 1, "teacher": {"samples": 64}},
    "mhla_lepe_datafree_s16": {"layers": "all", "lepe": True, "teacher": {"samples": 16}},
    "mhla_lepe_datafree_s256": {"layers": "all", "lepe": True, "teacher": {"samples": 256}},
    # the store sampled with the pipeline's own guidance (DiTPipeline: 4.0) instead of the config's 1.5
    "mhla_lepe_datafree_g4": {"layers": "all", "lepe": True, "teacher": {"samples": 64, "guidance_scale": 4.0}},
}
DEFAULT_VARIANTS = ["softmax", "mhla_all", "mhla_hybrid", "mhla_auto", "linear"]
LABELS = {
    "softmax": "softmax (control)",
    "mhla_all": "MHLA, all layers",
    "mhla_hybrid": "MHLA hybrid, softmax on 0, 3",
    "mhla_auto": "MHLA hybrid, auto",
    "linear": "plain linear (M = 1)",
    "mhla_auto1": "MHLA hybrid, auto, 1 softmax layer",
    "mhla_lepe": "MHLA, all layers, + LePE",
    "mhla_gate": "MHLA, all layers, + gate",
    "mhla_lepe_gate": "MHLA, all layers, + LePE + gate",
    "mhla_authors": "MHLA, all layers, authors' constant start",
    "mhla_lepe_power2": "MHLA, all layers, + LePE, phi = ReLU^2",
    "mhla_lepe_power3": "MHLA, all layers, + LePE, phi = ReLU^3",
    "mhla_auto1_lepe": "MHLA hybrid, auto, 1 softmax layer, + LePE",
    "mhla_lepe_datafree": "MHLA, all layers, + LePE, data-free (64 teacher trajectories)",
    "mhla_auto1_datafree": "MHLA hybrid, auto, 1 softmax layer, data-free (64 teacher trajectories)",
    "mhla_lepe_datafree_s16": "MHLA, all layers, + LePE, data-free (16 teacher trajectories)",
    "mhla_lepe_datafree_s256": "MHLA, all layers, + LePE, data-free (256 teacher trajectories)",
    "mhla_lepe_datafree_g4": "MHLA, all layers, + LePE, data-free (64 trajectories at guidance 4)",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="study_out", help="output folder (replaced if it exists)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="token counts to study")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="training seeds (noise, timesteps, dropout, crops); the held-out set is the same for all. "
                        "Seed 0 is the config's own seeds; the report gives mean, std and range over seeds")
    p.add_argument("--config", default=str(CONFIG), help="the fine-tuning config (recipe, data, held-out set)")
    p.add_argument("--distill-steps", type=int, default=30, help="label-free distillation steps per student")
    p.add_argument("--distill-lr", type=float, default=2e-4, help="distillation learning rate (fine-tuning: the config's)")
    p.add_argument("--finetune-steps", type=int, default=60, help="fine-tuning steps per student (data + output matching)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="MHLA blocks M at every size (default: 16 at 256 tokens, 30 at 1,024: the largest M <= sqrt(N) "
                        "the 32 x 32 grid gives, 5 x 6 blocks)")
    p.add_argument("--keep-softmax", type=int, default=2, help="softmax layers kept by the hybrids (every third of 6 = 2)")
    p.add_argument("--calibration-samples", type=int, default=8, help="noised photo crops x 3 timesteps for layer_sensitivity")
    p.add_argument("--val-samples", type=int, default=128, help="held-out crops (fixed crops, noise, timesteps)")
    p.add_argument("--sample-steps", type=int, default=20, help="DPM-Solver steps for the sample grids")
    p.add_argument("--resume", action="store_true",
                   help="keep <out> and reuse every finished (size, model) result in <out>/results/ (same settings only)")
    p.add_argument("--quick", action="store_true", help="2 + 2 steps, 8 held-out crops, no diagnostics: wiring only")
    p.add_argument("--report-only", action="store_true",
                   help="with --resume: write the report from the results in <out>/results/ alone, training nothing "
                        "(requested runs without a result are left out, and named)")
    return p.parse_args(argv)


def calibration_batches(pipe, num_samples: int, batch_size: int = 8, seed: int = 4321) -> list[dict]:
    """Noised photo crops at timesteps 100, 500, 900 (:func:`diagnostics.diagnostic_inputs`), as forward kwargs."""
    from mhla_diffusers.diagnostics import diagnostic_inputs

    inputs = diagnostic_inputs(pipe, num_samples=num_samples, timesteps=(100, 500, 900), seed=seed)["model_inputs"]
    total = inputs["hidden_states"].shape[0]
    return [{k: v[i:i + batch_size] for k, v in inputs.items()} for i in range(0, total, batch_size)]


def convert_variant(name: str, size: dict, out: Path, args) -> tuple[Path, dict | None, float]:
    """The student's starting checkpoint: the base itself (control) or its conversion."""
    from mhla_diffusers import load_mhla_pipeline
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    t0 = time.perf_counter()
    if VARIANTS[name] is None:
        return size["base"], None, 0.0
    options = {k: v for k, v in VARIANTS[name].items() if k not in ("teacher", "retrofit")}
    if "block_grid" not in options:
        options["num_blocks"] = args.num_blocks or size["num_blocks"]
    if options["layers"] == "auto":
        pipe = load_mhla_pipeline(size["base"])
        options.setdefault("keep_softmax", args.keep_softmax)
        options.update(calibration=calibration_batches(pipe, args.calibration_samples))
    spec = convert_checkpoint(size["base"], out, family="dit", **options)
    return out, spec, time.perf_counter() - t0


def study_size(tokens: str, args, out: Path) -> dict:
    """Every variant at one token count: convert, retrofit, diagnose, sample."""
    from mhla_diffusers import load_mhla_pipeline
    from mhla_diffusers.checkpoint.io import atomic_write_json
    from mhla_diffusers.diagnostics import diagnose_pipeline, plot_rank_entropy
    from mhla_diffusers.generation import generate_class_images, save_grid
    from mhla_diffusers.training import retrofit

    size = SIZES[tokens]
    results = {}
    for seed, name in [(seed, name) for seed in args.seeds for name in args.variants]:
        key = name if seed == 0 else f"{name}_seed{seed}"
        done = out / "results" / f"{tokens}_{key}.json"
        overrides = size["overrides"] + [f"eval.samples={args.val_samples}"] + seed_overrides(seed)
        if done.is_file():
            results[key] = json.loads(done.read_text())
            print(f"[study] {tokens} tokens: {key}: reusing {done}", flush=True)
            continue
        if args.report_only:
            print(f"[study] {tokens} tokens: {key}: no result in {done.parent}, left out of the report", flush=True)
            continue
        print(f"[study] {tokens} tokens: {key}", flush=True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        start, spec, t_convert = convert_variant(name, size, out / "checkpoints" / f"{tokens}_{key}", args)
        config, overrides, options = recipe_of(name, tokens, out, args, overrides)
        r = retrofit(config, start, size["base"], out / "runs" / f"{tokens}_{key}", distill_steps=args.distill_steps, **options,
                     distill_lr=args.distill_lr,
                     finetune_steps=args.distill_steps + args.finetune_steps if spec is None else args.finetune_steps,
                     overrides=overrides)
        pipe = load_mhla_pipeline(r["final_dir"])
        diag = None
        if not args.quick:
            diag = diagnose_pipeline(pipe, num_samples=1, timesteps=(500,), num_blocks=args.num_blocks or size["num_blocks"])
            plot_rank_entropy(diag["layers"], out / f"rank_entropy_{tokens}_{key}.png")
        t1 = time.perf_counter()
        images = generate_class_images(r["final_dir"], list(range(10)), steps=args.sample_steps, guidance_scale=4.0, seed=0, pipe=pipe)
        save_grid(images, out / f"samples_{tokens}_{key}.png", rows=2)
        layers = None if spec is None else spec["layers"]
        results[key] = {"label": LABELS[name] + ("" if seed == 0 else f", seed {seed}"), "variant": name, "seed": seed,
                        "mhla_layers": layers, "selection": None if spec is None else spec.get("selection"),
                         "convert_s": round(t_convert, 1), "generate_s": round(time.perf_counter() - t1, 1), **r,
                         "diagnostics": None if diag is None else _layer_summary(diag),
                         "total_wall_s": round(time.perf_counter() - wall0, 1), "total_cpu_s": round(time.process_time() - cpu0, 1)}
        atomic_write_json(done, results[key])
        del pipe
    return results


def recipe_of(name: str, tokens: str, out: Path, args, overrides: list[str]) -> tuple[str, list[str], dict]:
    """The config, overrides and retrofit options of a variant: the data recipe, or the data-free one with its store
    (one per size and store setting: a smaller store is the first trajectories of a larger one, the same shards)."""
    teacher = (VARIANTS[name] or {}).get("teacher")
    if not teacher:
        return args.config, overrides, {}
    settings = {k: v for k, v in teacher.items() if k != "samples"}
    store = out / ("teacher_store_" + "_".join([tokens] + [f"{k}{v}" for k, v in sorted(settings.items())]))
    data = [f"data.teacher.{k}={v}" for k, v in teacher.items()] + [f"data.teacher.store_dir={store}"]
    return str(DATAFREE_CONFIG), overrides + data, dict(VARIANTS[name].get("retrofit", {}))


def seed_overrides(seed: int) -> list[str]:
    """Seed 0: the config as it is (the committed single-seed study); seed s: other training draws and crops."""
    return [] if seed == 0 else [f"train.seed={seed}", f"data.seed={seed + 1}"]


def _layer_summary(diag: dict) -> list[dict]:
    """Per layer: kind, and mean rank / entropy of softmax, linear and MHLA attention on its q, k."""
    return [{"index": s["index"], "layer_kind": s["layer_kind"],
             **{f"{kind}_{m}": round(float(s["kinds"][kind][m]["mean"]), 3) for kind in s["kinds"] for m in ("rank", "entropy")}}
            for s in diag["layers"]]


def gap_closed(results: dict) -> dict:
    """Fraction of the plain-linear-to-softmax gap each model closes, on the final held-out loss, against the
    control and plain linear attention of the same seed."""
    gaps = {}
    for key, r in results.items():
        suffix = "" if r.get("seed", 0) == 0 else f"_seed{r['seed']}"
        control, linear = results.get("softmax" + suffix), results.get("linear" + suffix)
        if control is None or linear is None:
            continue
        lo, hi = control["heldout_loss"]["finetune"], linear["heldout_loss"]["finetune"]
        if lo is not None and hi is not None and hi != lo:
            gaps[key] = round((hi - r["heldout_loss"]["finetune"]) / (hi - lo), 3)
    return gaps


def over_seeds(results: dict, gaps: dict) -> dict:
    """Per variant: the fine-tuned held-out loss and the gap closed over seeds (mean, std, min, max, n)."""
    import statistics

    def stats(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "min": min(values), "max": max(values), "n": len(values)}

    variants = dict.fromkeys(r.get("variant", key) for key, r in results.items())  # results of older runs: key = name
    return {name: {"label": LABELS.get(name, name),
                   "loss": stats([r["heldout_loss"]["finetune"] for k, r in results.items() if r.get("variant", k) == name]),
                   "gap": stats([gaps.get(k) for k, r in results.items() if r.get("variant", k) == name])}
            for name in variants}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.distill_steps, args.finetune_steps, args.val_samples, args.sample_steps, args.calibration_samples = 2, 2, 8, 2, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from mhla_diffusers.checkpoint.io import atomic_write_json

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    missing = [t for t in args.sizes if not (SIZES[t]["base"] / "model_index.json").is_file()]
    if missing:
        print(f"run_study.py: no pretrained base for {missing} tokens (see demo/base_dit*/README.md)", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.report_only and not args.resume:
        print("run_study.py: --report-only reads the results of an earlier run: give --resume too", file=sys.stderr)
        return 2
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resume", "sizes", "variants", "seeds", "report_only")}
    if args.resume and (out / "settings.json").is_file() and json.loads((out / "settings.json").read_text()) != settings:
        print(f"run_study.py: --resume with other settings than {out / 'settings.json'}; use a new --out", file=sys.stderr)
        return 2
    if out.exists() and not args.resume:
        shutil.rmtree(out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "settings.json", settings)
    t_start = time.perf_counter()
    sizes = {}
    for tokens in args.sizes:
        results = study_size(tokens, args, out)
        wall = sum(r.get("total_wall_s", 0.0) for r in results.values())  # of the runs that made them (--resume)
        gaps = gap_closed(results)
        sizes[tokens] = {"results": results, "gap_closed": gaps, "over_seeds": over_seeds(results, gaps),
                         "wall_time_s": round(wall, 1)}
    report = {
        "wall_time_s": round(sum(s["wall_time_s"] for s in sizes.values()), 1),
        "this_run_wall_time_s": round(time.perf_counter() - t_start, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "report_only")},
        "sizes": sizes,
    }
    atomic_write_json(out / "report.json", report)
    _plot_heldout(sizes, out / "heldout.png")
    (out / "report.md").write_text(markdown(report))
    print((out / "report.md").read_text())
    return 0


def _plot_heldout(sizes: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    stages = ["conversion", "distill", "finetune"]
    fig = Figure(figsize=(5.5 * len(sizes), 4.2), dpi=110)
    for k, (tokens, s) in enumerate(sizes.items()):
        ax = fig.add_subplot(1, len(sizes), k + 1)
        for i, r in enumerate(s["results"].values()):
            ax.plot(range(3), [r["heldout_loss"][st] for st in stages], marker="o", color=f"C{i}", label=r["label"])
        ax.set_xticks(range(3), ["converted", "distilled", "fine-tuned"])
        ax.set_yscale("log")
        ax.set_ylabel("held-out epsilon MSE")
        ax.set_title(f"{tokens} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), format="png")


def markdown(report: dict) -> str:
    """The report's tables: held-out loss per stage, gap closed, layers kept, per-layer rank / entropy."""
    s = report["settings"]
    lines = [
        "# Retrofit study: softmax, MHLA and plain linear attention at 256 and 1,024 tokens", "",
        f"Recipe (`mhla_diffusers.training.retrofit`, config `{Path(s['config']).name}`): {s['distill_steps']} steps of label-free "
        f"distillation (attention transfer x 5 + output matching, random class labels), then {s['finetune_steps']} steps of "
        "the epsilon loss + output matching against the original; the softmax control gets the same total steps of the "
        f"second phase. Held-out: {s['val_samples']} fixed crops, noise and timesteps per size. Auto hybrid: "
        f"`layer_sensitivity` on {s['calibration_samples']} noised crops x 3 timesteps, softmax kept on the {s['keep_softmax']} "
        "most sensitive layers.", "",
        f"Wall time {report['wall_time_s']} s on {report['machine']['platform']}, torch {report['machine']['torch']}, "
        f"{report['machine']['threads']} thread(s).", "",
    ]
    for tokens, block in report["sizes"].items():
        gap = block["gap_closed"]
        cpu = sum(r.get("total_cpu_s", 0.0) for r in block["results"].values())
        lines += [f"## {tokens} tokens ({block['wall_time_s']} s wall, {cpu:.0f} s of CPU for the models)", "",
                  "| model | softmax layers | held-out: converted | distilled | fine-tuned | gap closed | CPU s (wall s) |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in block["results"].items():
            if r.get("seed", 0) != 0:  # other seeds: in the over-seeds table below
                continue
            h = r["heldout_loss"]
            kept = "all" if r["mhla_layers"] is None else ", ".join(str(i) for i in range(6) if i not in r["mhla_layers"]) or "none"
            lines.append(f"| {r['label']} | {kept} | {h['conversion']:.4f} | {h['distill']:.4f} | **{h['finetune']:.4f}** | "
                         f"{gap.get(name, float('nan')):.0%} | {r.get('total_cpu_s', '-')} ({r.get('total_wall_s', '-')}) |")
        lines.append("")
        lines += _seeds_table(block.get("over_seeds", {}), report["settings"].get("seeds", [0]))
        lines += _datafree_table(block["results"], gap)
        lines += _diagnostics_table(block["results"])
    return "\n".join(lines) + "\n"


def _seeds_table(summary: dict, seeds: list[int]) -> list[str]:
    """Mean ± std (range) over the seeds each model ran with; a model with one run shows its value alone."""
    if len(seeds) < 2 or max((s["loss"] or {}).get("n", 0) for s in summary.values()) < 2:
        return []
    out = [f"Over training seeds (of {', '.join(map(str, seeds))}; mean ± std, range in brackets):", "",
           "| model | runs | fine-tuned held-out loss | gap closed |", "|---|---|---|---|"]

    def cell(stats, fmt):
        if stats["n"] == 1:
            return fmt.format(stats["mean"])
        return f"{fmt.format(stats['mean'])} ± {fmt.format(stats['std'])} ({fmt.format(stats['min'])} to {fmt.format(stats['max'])})"

    for s in summary.values():
        loss, gap = s["loss"], s["gap"]
        if loss is None:
            continue
        out.append(f"| {s['label']} | {loss['n']} | {cell(loss, '{:.4f}')} | {'-' if gap is None else cell(gap, '{:.1%}')} |")
    return out + [""]


def _datafree_table(results: dict, gap: dict) -> list[str]:
    """The data-free runs: the store each trained on (trajectories, teacher steps and calls, its CPU seconds) beside
    the fine-tuned held-out loss on photo crops (never seen in training) and the gap closed."""
    rows = [(k, r) for k, r in results.items() if r.get("teacher_store")]
    if not rows:
        return []
    out = ["Data-free runs (trained on the original's samples; held out on the same photo crops): the teacher store, "
           "its sampling cost (the CPU seconds of the shards this run's store holds), the result.", "",
           "| model | trajectories x steps | teacher calls | teacher CPU s | converted | distilled | fine-tuned | gap closed |",
           "|---|---|---|---|---|---|---|---|"]
    for key, r in rows:
        t, h = r["teacher_store"], r["heldout_loss"]
        out.append(f"| {r['label']} | {t['trajectories']} x {t['steps']} | {t['transformer_calls']} | {t['cpu_s']:.0f} | "
                   f"{h['conversion']:.4f} | {h['distill']:.4f} | **{h['finetune']:.4f}** | {gap.get(key, float('nan')):.1%} |")
    return out + [""]


def _diagnostics_table(results: dict) -> list[str]:
    rows = [(r["label"], d) for r in results.values() if r.get("diagnostics") for d in r["diagnostics"]]
    if not rows:
        return []
    out = ["Per layer, final models (paper Fig. 3; timestep 500, one crop; rank at N eps; entropy in nats): "
           "the layer's kind, then what softmax / linear / MHLA attention gives on its q, k.", "",
           "| model | layer | kind | rank softmax / linear / MHLA | entropy softmax / linear / MHLA |", "|---|---|---|---|---|"]
    for label, d in rows:
        out.append(f"| {label} | {d['index']} | {d['layer_kind']} | {d['softmax_rank']:.0f} / {d['linear_rank']:.0f} / "
                   f"{d['mhla_rank']:.0f} | {d['softmax_entropy']:.2f} / {d['linear_entropy']:.2f} / {d['mhla_entropy']:.2f} |")
    return out + [""]


if __name__ == "__main__":
    sys.exit(main())
