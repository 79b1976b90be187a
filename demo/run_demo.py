#!/usr/bin/env python
"""The main job, end to end on real photographs (``make demo``).

Starting from the demo's pretrained softmax DiT (``demo/base_dit``, trained by this project on the
photos that ship inside the scikit-image / scikit-learn wheels), it:

1. converts it with ``conversion/convert.py``'s library call: MHLA on all layers, the hybrid
   (softmax kept on layers 0, 3, ...), and plain linear attention (MHLA with one block, M = 1)
   as the control; the softmax original is kept as the reference;
2. fine-tunes each for the same number of steps with the accelerate recipe
   (``finetune/train.py``'s ``train``, config ``finetune/configs/dit_demo_finetune.yaml``), which
   also measures the held-out loss (fixed crops, noise and timesteps) before and after;
3. generates one image per class through the stock ``DiTPipeline``;
5. writes ``<out>/``: ``samples_<model>.png``, ``real_crops.png``, ``loss_curves.png``,
   ``report.md`` and ``report.json``, and the checkpoints under ``<out>/checkpoints``.

    python demo/run_demo.py --out demo_out            # the full demo (<= 10 min on 2 CPU cores)
    python demo/run_demo.py --out /tmp/d --quick      # the wiring only, in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> conversion arguments (None: the softmax original, not converted)
    "softmax": None,
    "mhla_all": {"layers": "all"},
    "mhla_hybrid": {"layers": "hybrid"},
    "linear": {"layers": "all", "block_grid": (1, 1, 1)},
}
LABELS = {
    "softmax": "softmax (original)",
    "mhla_all": "MHLA, all layers",
    "mhla_hybrid": "MHLA hybrid (softmax on 0, 3)",
    "linear": "plain linear attention (M = 1)",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo_out", help="output folder (replaced if it exists)")
    p.add_argument("--base", default=str(ROOT / "demo" / "base_dit"), help="the pretrained softmax DiTPipeline folder")
    p.add_argument("--config", default=str(ROOT / "finetune" / "configs" / "dit_demo_finetune.yaml"))
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps per model (default: the config's)")
    p.add_argument("--num-blocks", type=int, default=16, help="MHLA blocks M (16 -> 4 x 4 blocks of 4 x 4 tokens)")
    p.add_argument("--sample-steps", type=int, default=25, help="DPM-Solver steps when generating")
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--val-samples", type=int, default=None, help="held-out crops for the loss (default: the config's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="2 steps, 16 validation crops, 2 sampling steps: wiring only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.steps, args.val_samples, args.sample_steps = 2, 16, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))

    from mhla_diffusers import load_mhla_pipeline
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint
    from mhla_diffusers.generation import generate_class_images, save_grid
    from mhla_diffusers.training import load_config, plot_loss_curves, read_loss_csv, train
    from mhla_diffusers.training.data import PHOTO_NAMES, PhotoCrops

    base = Path(args.base)
    if not (base / "model_index.json").is_file():
        print(
            f"run_demo.py: no pretrained base at {base}. Reproduce it with:\n  accelerate launch "
            "finetune/train.py --config finetune/configs/dit_demo_base.yaml --set output_dir=runs/dit_demo_base\n"
            "and copy runs/dit_demo_base/final to demo/base_dit",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    (out / "checkpoints").mkdir(parents=True)
    t_start = time.perf_counter()
    overrides = [] if args.steps is None else [f"train.max_steps={args.steps}"]
    if args.val_samples is not None:
        overrides.append(f"eval.samples={args.val_samples}")
    base_config = load_config(args.config, overrides)
    data = base_config["data"]
    crops = PhotoCrops(resolution=data["resolution"], short_side=data["short_side"], crops_per_photo=1, seed=10_000)
    save_grid([_to_pil(crops[i]["pixel_values"]) for i in range(len(PHOTO_NAMES))], out / "real_crops.png")
    class_ids = list(range(len(PHOTO_NAMES)))
    results, curves = {}, {}

    for name in args.variants:
        t0 = time.perf_counter()
        ckpt = out / "checkpoints" / name
        spec = None
        if VARIANTS[name] is None:
            ckpt = base
        else:
            options = dict(VARIANTS[name])
            if "block_grid" not in options:
                options["num_blocks"] = args.num_blocks
            spec = convert_checkpoint(base, ckpt, family="dit", **options)
        t_convert = time.perf_counter() - t0

        config = load_config(args.config, overrides + [f"model.pretrained={ckpt}", f"output_dir={out / 'runs' / name}"])
        summary = train(config)
        final = Path(summary["final_dir"])
        pipe = load_mhla_pipeline(final)
        t1 = time.perf_counter()
        images = generate_class_images(final, class_ids, steps=args.sample_steps, guidance_scale=args.guidance_scale,
                                       seed=0, pipe=pipe)
        t_generate = time.perf_counter() - t1
        save_grid(images, out / f"samples_{name}.png", rows=2)
        rows = read_loss_csv(Path(config["output_dir"]) / "loss.csv")
        curves[LABELS[name]] = ([r[0] for r in rows], [r[1] for r in rows])
        tail = [r[1] for r in rows[-max(1, len(rows) // 5):]]
        results[name] = {
            "label": LABELS[name],
            "mhla": spec,
            "val_loss_after_conversion": summary["eval_loss_start"],
            "val_loss_after_finetune": summary["eval_loss"],
            "train_loss_last_20pct": sum(tail) / len(tail),
            "steps": summary["steps"],
            "step_time_s": summary["step_time_s"],
            "convert_s": round(t_convert, 1),
            "train_s": summary["wall_time_s"],
            "generate_s": round(t_generate, 1),
            "checkpoint": str(final),
        }
        print(f"[demo] {name}: held-out loss {summary['eval_loss_start']:.4f} -> {summary['eval_loss']:.4f}", flush=True)
        del pipe

    plot_loss_curves(curves, out / "loss_curves.png", title="fine-tuning from the softmax DiT")
    report = {
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "settings": {"steps": base_config["train"]["max_steps"] if args.steps is None else args.steps,
                     "num_blocks": args.num_blocks, "val_samples": base_config["eval"]["samples"], "sample_steps": args.sample_steps,
                     "guidance_scale": args.guidance_scale, "quick": args.quick, "base": str(base)},
        "results": results,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    print((out / "report.md").read_text())
    return 0


def _to_pil(pixels):
    from PIL import Image

    array = ((pixels.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(array)


def _markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# MHLA demo report",
        "",
        f"Base: `{s['base']}` (softmax DiT trained on photo crops). Fine-tuning: {s['steps']} steps per model. "
        f"MHLA: M = {s['num_blocks']} blocks. Held-out loss: epsilon MSE on {s['val_samples']} fixed crops at evenly "
        f"spaced timesteps, same noise for every model. Sampling: {s['sample_steps']} DPM-Solver steps, guidance {s['guidance_scale']}.",
        "",
        f"Wall time: {report['wall_time_s']} s on {report['machine']['platform']}, torch {report['machine']['torch']}, "
        f"{report['machine']['threads']} thread(s).",
        "",
        "| model | held-out loss after conversion | after fine-tuning | train loss, last 20% | s/step |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"].values():
        lines.append(
            f"| {r['label']} | {r['val_loss_after_conversion']:.4f} | {r['val_loss_after_finetune']:.4f} | "
            f"{r['train_loss_last_20pct']:.4f} | {r['step_time_s']} |"
        )
    lines += ["", "Samples: `samples_<model>.png` (one image per photo class); real crops: `real_crops.png`; "
              "loss curves: `loss_curves.png`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
