#!/usr/bin/env python
"""Fine-tune DiT, SANA, Wan (2.1; 2.2 one expert per run, model.expert) or SANA-Video with or without MHLA on
accelerate (or train a DiT from scratch).

    accelerate launch --config_file finetune/accelerate/single_gpu.yaml \\
        finetune/train.py --config finetune/configs/sana_hybrid.yaml
    accelerate launch --config_file finetune/accelerate/single_cpu.yaml \\
        finetune/train.py --config finetune/configs/dit_demo_hybrid.yaml

Objectives: DDPM epsilon (DiT), flow matching (SANA, Wan); distillation from the original model
(distill section: output matching, attention transfer); trainable sets full / lora / attention /
mixing (train.trainable, lora section); EMA (ema section); bf16 / fp16 with fp32 trainable
parameters; gradient checkpointing; latent caching (data.cache).

Every option lives in the YAML config (see mhla_diffusers.training.config.DEFAULT_CONFIG for all keys
and their defaults); any key can be overridden on the command line with --set (repeatable), the
value parsed as YAML:

    --set train.max_steps=10 --set train.lr=3e-4 --set mhla.layers=hybrid --set mhla=null

The shortcuts --output_dir, --max_steps, --pretrained and --resume do the same for those keys.
Writes output_dir/{config.yaml, loss.csv, loss.png, checkpoints/, final/, train_summary.json};
final/ is the family's complete pipeline in the converted-checkpoint format: load it with
mhla_diffusers.load_mhla_pipeline (with lora.export=separate it applies the adapter in
final/transformer_lora/ too; lora=False loads the base alone).
Processes: finetune/accelerate/*.yaml (multi_cpu.yaml: DDP on CPU processes; fsdp.yaml: FSDP2 on GPUs).
"""

import argparse
import os
import sys

from mhla_diffusers.training import end_processes, load_config, train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True,
                   help="YAML config file (sections model, mhla, objective, distill, lora, ema, data, train, eval, export; output_dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. train.max_steps=10 (repeatable; VALUE is YAML)")
    p.add_argument("--output_dir", help="shortcut for --set output_dir=...")
    p.add_argument("--max_steps", type=int, help="shortcut for --set train.max_steps=...")
    p.add_argument("--pretrained", help="shortcut for --set model.pretrained=... (a pipeline folder)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in output_dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the trainer; returns the exit code: 0, or 2 after a one-line message for a bad config
    (or a run the config cannot continue: resume problems, a dataset smaller than one step, ...)."""
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.output_dir is not None:
        overrides.append(f"output_dir={args.output_dir}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.pretrained is not None:
        overrides += [f"model.pretrained={args.pretrained}", "model.init=null"]
    if args.resume:
        overrides.append("train.resume=true")
    try:
        summary = train(load_config(args.config, overrides))
    except (ValueError, FileNotFoundError) as err:
        print(f"train.py: {err}", file=sys.stderr)
        return 2
    if summary and os.environ.get("RANK", "0") == "0":  # every process returns the summary: the first one says it
        speed = f"{summary['step_time_s']} s/step" if summary.get("step_time_s") is not None else "no step trained in this call"
        print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, {speed} -> {summary['final_dir']}")
    end_processes()
    return 0


if __name__ == "__main__":
    sys.exit(main())
