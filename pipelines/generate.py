#!/usr/bin/env python
"""Generate images from a (converted) checkpoint through the stock diffusers pipeline.

    python pipelines/generate.py --checkpoint dit-mhla --class-labels 1 2 3 4 --steps 25 --seed 0 --out grid.png

Class labels are integers or, when the pipeline knows them (id2label), class names.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="pipeline folder (plain or MHLA-converted)")
    parser.add_argument("--class-labels", nargs="+", required=True, help="class ids or names, one image each")
    parser.add_argument("--steps", type=int, default=25, help="denoising steps")
    parser.add_argument("--guidance-scale", type=float, default=4.0, help="classifier-free guidance (1 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=None, help="rows of the output grid (default: 1)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--out", required=True, help="output PNG (a grid of all images)")
    args = parser.parse_args(argv)

    from mhla_diffusers.generation import GenerationError, generate_class_images, save_grid

    try:
        images = generate_class_images(
            args.checkpoint,
            args.class_labels,
            steps=args.steps,
            guidance_scale=args.guidance_scale,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
        )
    except (GenerationError, FileNotFoundError, ValueError) as err:
        print(f"generate.py: {err}", file=sys.stderr)
        return 2
    save_grid(images, args.out, rows=args.rows)
    print(f"wrote {len(images)} image(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
