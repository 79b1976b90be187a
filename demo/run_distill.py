#!/usr/bin/env python
"""Distillation + fine-tuning on real photographs: MHLA (hybrid, all layers) and plain linear
attention against the softmax original.

Starting from the demo's pretrained softmax DiT (``demo/base_dit``, the teacher, kept frozen in
memory), for each student:

1. convert the base (MHLA hybrid: softmax kept on layers 0 and 3; MHLA on all 6 layers; plain
   linear attention = MHLA with one block, the control);
2. distil without labels: attention transfer (per-layer MSE between the student's and the
   teacher's self-attention outputs) + output matching, on the photo crops with RANDOM class
   labels (``distill.condition: random``, no data loss);
3. fine-tune: the data loss (DDPM epsilon MSE, real labels) + output matching against the teacher;
4. measure, after conversion and after each phase, the held-out epsilon MSE (the trainer's
   evaluator: 320 fixed crops, noise and timesteps, the same as ``make demo``) and the held-out
   MSE between the student's and the teacher's outputs on the same inputs.

Writes ``<out>/``: ``report.md``, ``report.json``, ``distill_curves.png`` (phase 2 terms),
``finetune_curves.png`` (phase 3 data loss), ``heldout.png`` (held-out losses per stage) and the
runs (``<out>/runs/<model>/{distill,finetune}``: configs, loss CSVs, final pipelines).

    python demo/run_distill.py --out distill_out          # ~8 min on 2 CPU cores (one thread)
    python demo/run_distill.py --out /tmp/d --quick       # the wiring only, in seconds
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
VARIANTS = {  # name -> conversion arguments
    "mhla_hybrid": {"layers": "hybrid"},
    "mhla_all": {"layers": "all"},
    "linear": {"layers": "all", "block_grid": (1, 1, 1)},
}
LABELS = {
    "mhla_hybrid": "MHLA hybrid (softmax on 0, 3)",
    "mhla_all": "MHLA, all 6 layers",
    "linear": "plain linear attention (M = 1)",
}
# The fine-tune-only results of `make demo` (docs/demo/report.json: 150 steps of the data loss, the
# same base, data, evaluator and held-out set), for comparison with distillation + fine-tuning.
COMMITTED_DEMO = ROOT / "docs" / "demo" / "report.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="distill_out", help="output folder (replaced if it exists)")
    p.add_argument("--base", default=str(ROOT / "demo" / "base_dit"), help="the pretrained softmax DiTPipeline folder (the teacher)")
    p.add_argument("--config", default=str(ROOT / "finetune" / "configs" / "dit_demo_finetune.yaml"),
                   help="the fine-tuning config both phases start from (data, lr, eval set)")
    p.add_argument("--distill-steps", type=int, default=50, help="phase 2: label-free distillation steps")
    p.add_argument("--finetune-steps", type=int, default=100, help="phase 3: data loss + output matching steps")
    p.add_argument("--attention-weight", type=float, default=5.0,
                   help="attention-transfer weight in phase 2 (5: its MSE starts ~5x below the output term here)")
    p.add_argument("--output-weight", type=float, default=1.0, help="output-matching weight in phases 2 and 3")
    p.add_argument("--num-blocks", type=int, default=16, help="MHLA blocks M (16 -> 4 x 4 blocks of 4 x 4 tokens)")
    p.add_argument("--val-samples", type=int, default=None, help="held-out crops (default: the config's, 320)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="2 + 2 steps, 16 held-out crops: wiring only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.distill_steps, args.finetune_steps, args.val_samples = 2, 2, 16
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))

    from mhla_diffusers import load_mhla_pipeline
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint
    from mhla_diffusers.training import (
        TrainingParts,
        build_dataset,
        evaluate_heldout,
        load_config,
        plot_loss_curves,
        read_loss_terms,
        train,
    )
    from mhla_diffusers.training.flow import Objective

    base = Path(args.base)
    if not (base / "model_index.json").is_file():
        print(f"run_distill.py: no pretrained base at {base} (see demo/base_dit/README.md)", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    (out / "checkpoints").mkdir(parents=True)
    t_start = time.perf_counter()
    common = [] if args.val_samples is None else [f"eval.samples={args.val_samples}"]
    config = load_config(args.config, common)

    # The teacher's own held-out loss: the reference every student is measured against.
    from diffusers import DDPMScheduler

    teacher_pipe = load_mhla_pipeline(base)
    sched = DDPMScheduler.from_config(teacher_pipe.scheduler.config)
    eval_set = build_dataset({**config["data"], "seed": int(config["eval"]["seed"])})
    e = config["eval"]
    teacher_parts = TrainingParts("dit", teacher_pipe.transformer, teacher_pipe.vae, sched, Objective("epsilon", sched))
    teacher_loss = evaluate_heldout(teacher_parts, teacher_pipe.transformer, eval_set, num_samples=int(e["samples"]),
                                    batch_size=int(e["batch_size"]), seed=int(e["seed"]))["loss"]
    print(f"[distill] softmax teacher: held-out loss {teacher_loss:.4f}", flush=True)

    results, distill_curves, finetune_curves = {}, {}, {}
    for name in args.variants:
        options = dict(VARIANTS[name])
        if "block_grid" not in options:
            options["num_blocks"] = args.num_blocks
        ckpt = out / "checkpoints" / name
        spec = convert_checkpoint(base, ckpt, family="dit", **options)
        runs = out / "runs" / name
        phase1 = load_config(args.config, common + [
            f"model.pretrained={ckpt}", f"output_dir={runs / 'distill'}", f"train.max_steps={args.distill_steps}",
            f"distill.teacher={base}", "distill.data_weight=0", f"distill.output_weight={args.output_weight}",
            f"distill.attention_weight={args.attention_weight}", "distill.condition=random",
        ])
        s1 = train(phase1)
        phase2 = load_config(args.config, common + [
            f"model.pretrained={s1['final_dir']}", f"output_dir={runs / 'finetune'}", f"train.max_steps={args.finetune_steps}",
            f"distill.teacher={base}", "distill.data_weight=1", f"distill.output_weight={args.output_weight}",
            "distill.attention_weight=0", "distill.condition=dataset",
        ])
        s2 = train(phase2)
        terms1 = read_loss_terms(runs / "distill" / "loss.csv")
        terms2 = read_loss_terms(runs / "finetune" / "loss.csv")
        for term, (steps, values) in terms1.items():
            distill_curves[f"{LABELS[name]}: {term}"] = (steps, values)
        finetune_curves[LABELS[name]] = terms2["data"]
        tail = terms2["data"][1][-max(1, len(terms2["data"][1]) // 5):]
        results[name] = {
            "label": LABELS[name],
            "mhla": spec,
            "heldout_loss": {"conversion": s1["eval_loss_start"], "distill": s1["eval_loss"], "finetune": s2["eval_loss"]},
            "heldout_teacher_mse": {"conversion": s1["eval_distill_start"], "distill": s1["eval_distill"], "finetune": s2["eval_distill"]},
            "train_data_loss_last_20pct": sum(tail) / len(tail),
            "steps": {"distill": s1["steps"], "finetune": s2["steps"]},
            "step_time_s": {"distill": s1["step_time_s"], "finetune": s2["step_time_s"]},
            "final_dir": s2["final_dir"],
        }
        print(f"[distill] {name}: held-out loss {s1['eval_loss_start']:.4f} -> {s1['eval_loss']:.4f} (distil) -> "
              f"{s2['eval_loss']:.4f} (fine-tune); teacher MSE {s1['eval_distill_start']:.4f} -> {s1['eval_distill']:.4f} "
              f"-> {s2['eval_distill']:.4f}", flush=True)

    committed = {}
    if COMMITTED_DEMO.is_file():
        raw = json.loads(COMMITTED_DEMO.read_text())
        if raw.get("settings", {}).get("val_samples") == int(e["samples"]):
            committed = {k: v["val_loss_after_finetune"] for k, v in raw["results"].items()}
    plot_loss_curves(distill_curves, out / "distill_curves.png", title="phase 2: label-free distillation (train terms)",
                     ylabel="MSE to the teacher")
    plot_loss_curves(finetune_curves, out / "finetune_curves.png", title="phase 3: fine-tuning, data term (train)",
                     ylabel="epsilon MSE")
    _plot_heldout(results, teacher_loss, committed, out / "heldout.png")
    report = {
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "settings": {"base": str(base), "config": str(args.config), "distill_steps": args.distill_steps,
                     "finetune_steps": args.finetune_steps, "attention_weight": args.attention_weight,
                     "output_weight": args.output_weight, "num_blocks": args.num_blocks, "val_samples": int(e["samples"]),
                     "quick": args.quick},
        "teacher_heldout_loss": teacher_loss,
        "finetune_only_committed": committed,
        "results": results,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    print((out / "report.md").read_text())
    return 0


def _plot_heldout(results: dict, teacher_loss: float, committed: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    stages = ["conversion", "distill", "finetune"]
    for i, (name, r) in enumerate(results.items()):
        ax.plot(range(3), [r["heldout_loss"][s] for s in stages], marker="o", color=f"C{i}", label=r["label"])
        if name in committed:
            ax.plot([2], [committed[name]], marker="x", markersize=9, color=f"C{i}", linestyle="none")
    ax.axhline(teacher_loss, color="black", linestyle="--", linewidth=1, label="softmax original (teacher)")
    ax.set_xticks(range(3), ["after conversion", "after distillation", "after fine-tuning"])
    ax.set_ylabel("held-out epsilon MSE")
    ax.set_title("held-out loss per stage (x: fine-tuning only, same total steps, make demo)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path.write_bytes(buf.getvalue())


def _markdown(report: dict) -> str:
    s = report["settings"]
    committed = report["finetune_only_committed"]
    lines = [
        "# Distillation + fine-tuning report",
        "",
        f"Teacher: `{s['base']}` (the softmax DiT trained on the photo crops), kept frozen in memory. Students: its "
        f"conversions (M = {s['num_blocks']} blocks for MHLA). Phase 2: {s['distill_steps']} steps of label-free "
        f"distillation (attention transfer x {s['attention_weight']} + output matching x {s['output_weight']}, random class "
        f"labels). Phase 3: {s['finetune_steps']} steps of the epsilon loss + output matching x {s['output_weight']}. "
        f"Held-out: {s['val_samples']} fixed crops, noise and timesteps (the `make demo` evaluator and set).",
        "",
        f"Wall time: {report['wall_time_s']} s on {report['machine']['platform']}, torch {report['machine']['torch']}, "
        f"{report['machine']['threads']} thread(s). Softmax teacher held-out loss: **{report['teacher_heldout_loss']:.4f}**.",
        "",
        "| student | held-out loss: converted | after distillation | after fine-tuning | fine-tuning only (make demo, same steps) "
        "| MSE to teacher: converted | distilled | fine-tuned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        h, d = r["heldout_loss"], r["heldout_teacher_mse"]
        only = f"{committed[name]:.4f}" if name in committed else "-"
        lines.append(
            f"| {r['label']} | {h['conversion']:.4f} | {h['distill']:.4f} | **{h['finetune']:.4f}** | {only} "
            f"| {d['conversion']:.4f} | {d['distill']:.4f} | {d['finetune']:.4f} |"
        )
    lines += ["", "Curves: `distill_curves.png` (phase 2 train terms), `finetune_curves.png` (phase 3 data term), "
              "`heldout.png` (held-out loss per stage).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
