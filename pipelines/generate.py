#!/usr/bin/env python
"""Generate images from a (converted) checkpoint through the stock diffusers pipeline.

    python pipelines/generate.py --checkpoint dit-mhla --class-labels 1 2 3 4 --steps 25 --seed 0 --out grid.png
    python pipelines/generate.py --checkpoint sana-mhla --prompt "a cat on a red chair" --height 1024 --width 512 --out cat.png

--class-labels for class-conditional pipelines (DiT): integers or, when the pipeline knows them
(id2label), class names. --prompt for text-to-image pipelines (SANA): one image per prompt.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="pipeline folder (plain or MHLA-converted)")
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--class-labels", nargs="+", help="class ids or names, one image each (DiT)")
    kind.add_argument("--prompt", nargs="+", help="text prompts, one image each (SANA)")
    parser.add_argument("--negative-prompt", default="", help="--prompt only: negative prompt for guidance")
    parser.add_argument("--height", type=int, default=None, help="--prompt only: image height in px (default: native)")
    parser.add_argument("--width", type=int, default=None, help="--prompt only: image width in px (default: native)")
    parser.add_argument(
        "--no-resolution-binning",
        action="store_true",
        help="--prompt only: generate at exactly --height x --width instead of the nearest trained aspect ratio",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 25 DiT, 20 SANA)")
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="classifier-free guidance, 1 = off (default: 4.0 DiT, 4.5 SANA)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=None, help="rows of the output grid (default: 1)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--out", required=True, help="output PNG (a grid of all images)")
    args = parser.parse_args(argv)

    from mhla_diffusers.generation import GenerationError, generate_class_images, generate_text_images, save_grid

    common = dict(seed=args.seed, dtype=args.dtype, device=args.device)
    if args.steps is not None:
        common["steps"] = args.steps
    if args.guidance_scale is not None:
        common["guidance_scale"] = args.guidance_scale
    try:
        if args.prompt is not None:
            images = generate_text_images(
                args.checkpoint,
                args.prompt,
                negative_prompt=args.negative_prompt,
                height=args.height,
                width=args.width,
                use_resolution_binning=not args.no_resolution_binning,
                **common,
            )
        else:
            given = {
                "--height": args.height,
                "--width": args.width,
                "--negative-prompt": args.negative_prompt,
                "--no-resolution-binning": args.no_resolution_binning,
            }
            text_only = [flag for flag, value in given.items() if value]
            if text_only:
                raise GenerationError(f"{', '.join(text_only)} only apply to --prompt generation")
            images = generate_class_images(args.checkpoint, args.class_labels, **common)
    except (GenerationError, FileNotFoundError, ValueError) as err:
        print(f"generate.py: {err}", file=sys.stderr)
        return 2
    save_grid(images, args.out, rows=args.rows)
    print(f"wrote {len(images)} image(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
