#!/usr/bin/env python
"""Generate images or videos from a (converted) checkpoint through the stock diffusers pipeline.

    python pipelines/generate.py --checkpoint dit-mhla --class-labels 1 2 3 4 --steps 25 --seed 0 --out grid.png
    python pipelines/generate.py --checkpoint sana-mhla --prompt "a cat on a red chair" --height 1024 --width 512 --out cat.png
    python pipelines/generate.py --checkpoint wan-mhla --prompt "a cat walking in the snow" --frames 81 --out clip.mp4
    python pipelines/generate.py --checkpoint wan-i2v-mhla --prompt "the cat turns its head" --image first_frame.png --out clip.mp4
    python pipelines/generate.py --checkpoint sana-video-mhla --prompt "a cat walking in the snow" --frames 81 --out clip.mp4
    python pipelines/generate.py --checkpoint wan-vace-mhla --prompt "a cat" --video source.mp4 --mask mask.mp4 --out clip.mp4
    torchrun --nproc_per_node 4 pipelines/generate.py --checkpoint wan-mhla --prompt "a cat" --context-parallel ring --out clip.mp4

--class-labels for class-conditional pipelines (DiT): integers or, when the pipeline knows them
(id2label), class names. --prompt for text-to-image pipelines (SANA): one image per prompt. Images
go into one grid, saved in the format the --out suffix names: .png, .jpg / .jpeg or .webp (any other
suffix, .mp4 included, is refused with exit code 2 before anything is generated). For text-to-video
pipelines (Wan, SANA-Video, Wan VACE, recognised from the checkpoint, or --frames given): one mp4 per prompt
(clip.mp4, or clip_0.mp4, clip_1.mp4, ... for several prompts). --image: image-to-video from that first frame
(Wan 2.1 I2V, Wan 2.2 I2V A14B, Wan 2.2 TI2V-5B, SANA-Video); a checkpoint that cannot take an image is refused
with exit code 2. --video / --mask / --reference-image: Wan VACE's control inputs (video editing, inpainting,
reference-to-video); other checkpoints refuse them with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _check_out_folder(out: str) -> None:
    """Raise ``GenerationError`` when ``out``'s folder cannot exist: a file stands where a folder of its path should be."""
    from mhla_diffusers.generation import GenerationError

    parent = Path(out).resolve().parent
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise GenerationError(f"cannot write {out}: {folder} is a file, not a folder")
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="pipeline folder (plain or MHLA-converted)")
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--class-labels", nargs="+", help="class ids or names, one image each (DiT)")
    kind.add_argument("--prompt", nargs="+", help="text prompts, one image each (SANA)")
    parser.add_argument("--negative-prompt", default="", help="--prompt only: negative prompt for guidance")
    parser.add_argument("--height", type=int, default=None, help="--prompt only: height in px (default: native; Wan 480)")
    parser.add_argument(
        "--width", type=int, default=None,
        help="--prompt only: width in px (default: native; Wan 832, the authors' imported MHLA model 800)",
    )
    parser.add_argument("--frames", type=int, default=None, help="video: number of frames, 4k+1 for Wan (default: native, 81)")
    parser.add_argument(
        "--image", default=None,
        help="video: the first frame (png, jpg, ...) for image-to-video checkpoints (Wan I2V, Wan 2.2 TI2V-5B)",
    )
    parser.add_argument(
        "--video", default=None,
        help="Wan VACE: the source / control video (an mp4, a gif or a folder of frame images), --frames frames",
    )
    parser.add_argument(
        "--mask", default=None, help="Wan VACE, with --video: a mask video or frame folder (white: generate, black: keep)"
    )
    parser.add_argument("--reference-image", nargs="+", default=None, help="Wan VACE: reference images (png, jpg, ...)")
    parser.add_argument(
        "--conditioning-scale", type=float, default=None, help="Wan VACE: strength of the control hints (default 1)"
    )
    parser.add_argument("--fps", type=int, default=16, help="video: frames per second of the mp4 (default 16, Wan's)")
    parser.add_argument(
        "--no-resolution-binning",
        action="store_true",
        help="--prompt only (SANA, SANA-Video): generate at exactly --height x --width instead of the nearest trained "
        "aspect ratio",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 25 DiT, 20 SANA, 50 Wan)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="classifier-free guidance, 1 = off (default: 4.0 DiT, 4.5 SANA, 5.0 Wan, 6.0 SANA-Video: the pipeline's)",
    )
    parser.add_argument(
        "--guidance-scale-2", type=float, default=None,
        help="Wan 2.2 A14B only: guidance of the low-noise expert (transformer_2; default: --guidance-scale)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=_positive_int, default=None, help="rows of the output grid (>= 1; default: 1)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument(
        "--context-parallel", choices=["ring", "ulysses"], default=None,
        help="split the transformer's tokens over the processes of torchrun --nproc_per_node P (one GPU each; "
        "gloo on CPUs); MHLA layers exchange block summaries, softmax layers use diffusers' ring / Ulysses attention",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output image grid (.png, .jpg / .jpeg or .webp: the suffix picks the format) or, for videos, an .mp4",
    )
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    finally:
        from mhla_diffusers.generation import close_distributed

        close_distributed()


def _generate(args) -> int:
    from mhla_diffusers.generation import (
        GenerationError,
        generate_class_images,
        generate_text_images,
        generate_videos,
        image_format,
        is_main_process,
        is_video_checkpoint,
        save_grid,
        save_video,
    )

    common = dict(seed=args.seed, dtype=args.dtype, device=args.device, context_parallel=args.context_parallel)
    if args.steps is not None:
        common["steps"] = args.steps
    if args.guidance_scale is not None:
        common["guidance_scale"] = args.guidance_scale
    try:
        _check_out_folder(args.out)  # before any compute: the file must be writable where it is asked for
        control = {"video": args.video, "mask": args.mask, "reference_images": args.reference_image,
                   "conditioning_scale": args.conditioning_scale}
        video_only = [f"--{k.replace('_', '-')}" for k, v in {"image": args.image, **control}.items() if v is not None]
        if video_only and args.prompt is None:
            raise GenerationError(f"{', '.join(video_only)} (video generation) need --prompt")
        video = args.frames is not None or bool(video_only) or is_video_checkpoint(args.checkpoint)
        if args.prompt is not None and video:
            if args.rows is not None:
                raise GenerationError("--rows only applies to image generation")
            if not args.out.lower().endswith(".mp4"):
                raise GenerationError(f"videos are written as mp4: --out must end in .mp4; got {args.out}")
            size = {k: v for k, v in (("height", args.height), ("width", args.width), ("frames", args.frames)) if v is not None}
            videos = generate_videos(
                args.checkpoint, args.prompt, negative_prompt=args.negative_prompt, image=args.image,
                guidance_scale_2=args.guidance_scale_2, use_resolution_binning=False if args.no_resolution_binning else None,
                **{k: v for k, v in control.items() if v is not None}, **size, **common,
            )
            if not is_main_process():  # context parallelism: every rank holds the same result, rank 0 writes it
                return 0
            outs = [args.out] if len(videos) == 1 else [f"{args.out[:-4]}_{i}.mp4" for i in range(len(videos))]
            for video, out in zip(videos, outs):
                save_video(video, out, fps=args.fps)
            print(f"wrote {len(videos)} video(s) of {len(videos[0])} frames: {', '.join(outs)}")
            return 0
        image_format(args.out)  # an image grid: refuse a suffix it cannot be saved as before generating
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
                "--frames": args.frames,
                "--guidance-scale-2": args.guidance_scale_2,
            }
            text_only = [flag for flag, value in given.items() if value]
            if text_only:
                raise GenerationError(f"{', '.join(text_only)} only apply to --prompt generation")
            images = generate_class_images(args.checkpoint, args.class_labels, **common)
    except (GenerationError, FileNotFoundError, ValueError) as err:
        print(f"generate.py: {err}", file=sys.stderr)
        return 2
    if not is_main_process():
        return 0
    save_grid(images, args.out, rows=args.rows)
    print(f"wrote {len(images)} image(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
