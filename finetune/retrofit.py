#!/usr/bin/env python
"""Retrofit a converted checkpoint: distil it against the original, then fine-tune it (both phases of
mhla_diffusers.training.retrofit, each a train() run into <output_dir>/distill and <output_dir>/finetune).

With a data-free config (data.kind: teacher) nothing but the pretrained pipeline is needed: the original
samples a store of its own trajectories, which both phases train on.

    python conversion/convert.py --family dit --src facebook/DiT-XL-2-256 --out dit-mhla --layers auto --keep-softmax 2
    accelerate launch --config_file finetune/accelerate/single_gpu.yaml finetune/retrofit.py \\
        --config finetune/configs/dit_datafree.yaml --pretrained dit-mhla --teacher facebook/DiT-XL-2-256 \\
        --output_dir runs/dit_datafree --distill-steps 2000 --finetune-steps 8000

--set KEY=VALUE overrides a config key in both phases (repeatable; VALUE is YAML). Prints the held-out
losses after conversion, distillation and fine-tuning, and what the teacher's samples cost.
"""

import argparse
import json
import os
import sys

from mhla_diffusers.training import end_processes, retrofit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the YAML both phases start from (finetune/configs/*_datafree.yaml, ...)")
    p.add_argument("--pretrained", required=True, help="the converted checkpoint (conversion/convert.py)")
    p.add_argument("--teacher", required=True, help="the original pipeline folder (or hub id): distils and, data-free, samples")
    p.add_argument("--output_dir", required=True, help="<output_dir>/distill, <output_dir>/finetune (and the store)")
    p.add_argument("--distill-steps", type=int, required=True, help="distillation steps (0: none)")
    p.add_argument("--finetune-steps", type=int, required=True, help="fine-tuning steps (>= 1)")
    p.add_argument("--distill-lr", type=float, default=None, help="a constant distillation rate (default: the config's schedule)")
    p.add_argument("--attention-weight", type=float, default=5.0, help="attention transfer weight while distilling")
    p.add_argument("--output-weight", type=float, default=1.0, help="output matching weight in both phases")
    p.add_argument("--finetune-data-weight", type=float, default=1.0, help="data loss weight while fine-tuning (0: output matching alone)")
    p.add_argument("--finetune-attention-weight", type=float, default=0.0, help="attention transfer weight while fine-tuning")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the recipe; 0, or 2 after a one-line message for a bad config or setting."""
    args = parse_args(argv)
    try:
        result = retrofit(args.config, args.pretrained, args.teacher, args.output_dir, distill_steps=args.distill_steps,
                          finetune_steps=args.finetune_steps, distill_lr=args.distill_lr, attention_weight=args.attention_weight,
                          output_weight=args.output_weight, finetune_data_weight=args.finetune_data_weight,
                          finetune_attention_weight=args.finetune_attention_weight,
                          overrides=args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"retrofit.py: {err}", file=sys.stderr)
        return 2
    if result.get("final_dir") and os.environ.get("RANK", "0") == "0":  # every process returns the result: the first one says it
        print("held-out loss: " + json.dumps(result["heldout_loss"]))
        if result.get("teacher_store"):
            print("teacher store: " + json.dumps(result["teacher_store"]))
        print(f"done -> {result['final_dir']}")
    end_processes()
    return 0


if __name__ == "__main__":
    sys.exit(main())
