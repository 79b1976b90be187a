"""Generation helpers over the stock diffusers pipelines: class-conditional (DiTPipeline),
text-to-image (SanaPipeline), text-to-video (WanPipeline: Wan 2.1, Wan 2.2 A14B with its two experts,
TI2V-5B; SanaVideoPipeline), image-to-video (WanImageToVideoPipeline: Wan 2.1 I2V, Wan 2.2 I2V A14B, and
TI2V-5B given a first frame; SanaImageToVideoPipeline) and control-video generation (WanVACEPipeline: a
source video, its mask, reference images); images and videos are read and written by :mod:`~mhla_diffusers.media`
(its functions are re-exported here)."""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path
from typing import Sequence

import diffusers
import torch
import torch.distributed as dist

from mhla_diffusers.checkpoint import format as checkpoint_format
from mhla_diffusers.families import FAMILIES, GenerationError, find_family, wan_native_video
from mhla_diffusers.families.base import call_default
from mhla_diffusers.media import IMAGE_FORMATS, image_format, load_first_frame, load_frames, save_grid, save_video  # noqa: F401

__all__ = [
    "GenerationError",
    "check_device",
    "resolve_class_labels",
    "generate_class_images",
    "generate_text_images",
    "generate_videos",
    "enable_pipeline_context_parallel",
    "is_main_process",
    "close_distributed",
    "is_video_pipeline",
    "is_video_checkpoint",
    "native_video_size",
    "image_to_video_pipeline",
    "load_first_frame",
    "load_frames",
    "image_format",
    "save_grid",
    "save_video",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _prepare(checkpoint, pipe, steps: int, dtype: str, device: str | None, context_parallel: str | None = None):
    """Validate the common generation arguments; load the pipeline unless given; put its transformer under
    context parallelism if asked. Returns ``(pipe, device)``."""
    if steps < 1:
        raise GenerationError(f"steps must be >= 1; got {steps}")
    if dtype not in _DTYPES:
        raise GenerationError(f"dtype must be one of {sorted(_DTYPES)}; got {dtype!r}")
    if context_parallel not in (None, "ring", "ulysses"):
        raise GenerationError(f"context_parallel must be 'ring', 'ulysses' or None; got {context_parallel!r}")
    device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if context_parallel is not None and not (dist.is_initialized() or "WORLD_SIZE" in os.environ):
        raise GenerationError("context parallelism runs one process per device: launch with torchrun --nproc_per_node P")
    if pipe is None:
        # through the module: tests replace checkpoint_format.load_mhla_pipeline to prove nothing is loaded
        pipe = checkpoint_format.load_mhla_pipeline(checkpoint, torch_dtype=_DTYPES[dtype])
    else:  # a pipeline the caller loaded: diffusers' own from_pretrained of a converted folder has no MHLA
        checkpoint_format.warn_if_stock_loaded(pipe, "this pipeline generates with the stock attention")
    if context_parallel is not None:
        device = enable_pipeline_context_parallel(pipe, context_parallel, device)
    return pipe, device


def enable_pipeline_context_parallel(pipe, mode: str, device: str) -> str:
    """Put the pipeline's transformer(s) under diffusers' context parallelism over all ``torchrun`` processes.

    Initialises ``torch.distributed`` if needed (one rank per GPU), then
    :func:`~mhla_diffusers.enable_context_parallel` in ``mode`` ``"ring"`` or ``"ulysses"``.

    Returns:
        This rank's device.

    Raises:
        GenerationError: fewer than 2 processes, an unknown mode.
        ValueError: from :func:`~mhla_diffusers.enable_context_parallel`.
    """
    # function-level imports: only context-parallel runs need them
    from diffusers import ContextParallelConfig

    from mhla_diffusers.models.parallel import enable_context_parallel

    if mode not in ("ring", "ulysses"):
        raise GenerationError(f"context parallelism mode must be 'ring' or 'ulysses'; got {mode!r}")
    cuda = torch.device(device).type == "cuda"
    if cuda:  # one GPU per rank, set before NCCL starts
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        _started_group.append(dist.group.WORLD)
    world = dist.get_world_size()
    if world < 2:
        raise GenerationError(f"context parallelism needs >= 2 processes (torchrun --nproc_per_node P); got {world}")
    config = ContextParallelConfig(ring_degree=world) if mode == "ring" else ContextParallelConfig(ulysses_degree=world)
    for model in checkpoint_format.pipeline_transformers(pipe).values():
        enable_context_parallel(model, config)
    return device


def is_main_process() -> bool:
    """Whether this process writes the outputs: rank 0 under ``torch.distributed``, else always."""
    return not dist.is_initialized() or dist.get_rank() == 0


_started_group: list = []  # the process group enable_pipeline_context_parallel started, if it did


def close_distributed() -> None:
    """End the ``torch.distributed`` process group :func:`enable_pipeline_context_parallel` started (after
    generating); a group the caller started is left alone. A barrier first: gloo's worker thread may still be
    freeing the last collective's tensors (it takes the GIL), and a group destroyed meanwhile deadlocks at exit."""
    if _started_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _started_group.clear()


def check_device(device: str) -> str:
    """Return ``device`` (e.g. ``"cpu"``, ``"cuda"``, ``"cuda:1"``) if this torch can run on it.

    Raises:
        GenerationError: an unknown device string, CUDA asked of a torch without CUDA (a CPU-only
            build, or no GPU found), a CUDA index past the GPUs there are, another device that
            cannot hold a tensor here. Checked before anything is loaded.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise GenerationError(f"unknown device {device!r} ({err}); use cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU was found"
            raise GenerationError(f"device {device!r}: CUDA is not available ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise GenerationError(f"device {device!r}: there are {count} CUDA device(s), 0 to {count - 1}")
        return device
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as err:
        raise GenerationError(f"device {device!r} is not available here ({err}); use --device cpu") from None
    return device


def resolve_class_labels(pipe, labels: Sequence[int | str]) -> list[int]:
    """Class ids from ints, digit strings or class names (names need the pipeline's ``id2label``).

    Raises:
        GenerationError: unknown name, a name without ``id2label``, or an id outside the model's classes.
    """
    num_classes = pipe.transformer.config.get("num_embeds_ada_norm") or 0
    known = getattr(pipe, "labels", None) or {}
    ids = []
    for label in labels:
        if isinstance(label, int) or str(label).lstrip("-").isdigit():
            ids.append(int(label))
        elif label in known:
            ids.append(int(known[label]))
        else:
            hint = f"known names: {sorted(known)[:20]}" if known else "this pipeline has no class names; pass integer ids"
            raise GenerationError(f"unknown class label {label!r}; {hint}")
    bad = [i for i in ids if not 0 <= i < num_classes]
    if bad:
        raise GenerationError(f"class ids {bad} are outside [0, {num_classes}) for this model")
    return ids


def generate_class_images(
    checkpoint: str | os.PathLike,
    class_labels: Sequence[int | str],
    *,
    steps: int = 25,
    guidance_scale: float = 4.0,
    seed: int = 0,
    dtype: str = "fp32",
    device: str | None = None,
    pipe=None,
    context_parallel: str | None = None,
):
    """Generate one image per class label (ids or names) with the checkpoint's own ``DiTPipeline``.

    Args:
        checkpoint: pipeline folder (plain or converted); ignored when ``pipe`` is given.
        steps, guidance_scale (1 = off), seed (CPU generator), dtype (``"fp32" | "bf16" | "fp16"``), device.
        context_parallel: ``"ring"`` / ``"ulysses"`` over ``torchrun``'s processes; ``None``: one process.

    Returns:
        A list of PIL images.

    Raises:
        GenerationError: not a class-conditional pipeline, bad labels or steps.
    """
    pipe, device = _prepare(checkpoint, pipe, steps, dtype, device, context_parallel)
    classes = [c for f in FAMILIES.values() if f.conditioning == "class" for c in f.pipeline_classes]
    if type(pipe).__name__ not in classes:
        hint = " (it takes prompts: --prompt)" if _takes_prompt(pipe) else ""
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}; class-label generation needs a {' or '.join(classes)}{hint}"
        )
    ids = resolve_class_labels(pipe, class_labels)
    return _run(pipe, device, seed, class_labels=ids, num_inference_steps=steps, guidance_scale=guidance_scale).images


def _run(pipe, device, seed: int, **call_kwargs):
    """Move ``pipe`` to ``device`` and call it under inference mode with a CPU generator seeded ``seed``."""
    pipe = pipe.to(device)
    with torch.inference_mode():
        return pipe(generator=torch.Generator("cpu").manual_seed(seed), **call_kwargs)


def _prompt_list(prompts) -> list[str]:
    """``prompts`` as a list of strings: one string is one prompt (not one per character).

    Raises:
        GenerationError: no prompt.
    """
    prompts = [prompts] if isinstance(prompts, str) else [str(p) for p in prompts]
    if not prompts:
        raise GenerationError("give at least one prompt")
    return prompts


def _takes_prompt(pipe) -> bool:
    return "prompt" in inspect.signature(pipe.__call__).parameters


def generate_text_images(
    checkpoint: str | os.PathLike,
    prompts: Sequence[str],
    *,
    negative_prompt: str = "",
    height: int | None = None,
    width: int | None = None,
    steps: int = 20,
    guidance_scale: float = 4.5,
    seed: int = 0,
    dtype: str = "fp32",
    device: str | None = None,
    use_resolution_binning: bool = True,
    pipe=None,
    context_parallel: str | None = None,
):
    """Generate one image per prompt (one batch) with the checkpoint's own text-to-image pipeline (``SanaPipeline``).

    Args:
        checkpoint: pipeline folder (plain or converted); ignored when ``pipe`` is given.
        height, width: pixels, multiples of 32 for SANA; ``None``: the native size.
        use_resolution_binning: SANA's own snapping to a trained aspect ratio.
        negative_prompt: the classifier-free guidance negative prompt.
        steps, guidance_scale, seed, dtype, device, context_parallel: as :func:`generate_class_images`.

    Returns:
        A list of PIL images of size ``(width, height)``.

    Raises:
        GenerationError: not a text-to-image pipeline, no prompts, bad steps or dtype.
        ValueError: from the pipeline, e.g. a size SANA does not take.
    """
    prompts = _prompt_list(prompts)
    pipe, device = _prepare(checkpoint, pipe, steps, dtype, device, context_parallel)
    if is_video_pipeline(pipe):
        raise GenerationError(f"{checkpoint} holds a {type(pipe).__name__}, a video pipeline: generate videos (--frames)")
    if not _takes_prompt(pipe) or not hasattr(pipe, "vae_scale_factor"):
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}; text-to-image generation needs a pipeline that takes a "
            "prompt (SanaPipeline). Class-conditional pipelines take class labels (--class-labels)."
        )
    native = int(pipe.transformer.config.sample_size) * int(pipe.vae_scale_factor)
    height, width = height or native, width or native
    result = _run(
        pipe, device, seed,
        prompt=prompts,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        use_resolution_binning=use_resolution_binning,
    )
    return result.images


# The frame-count argument of video pipelines' __call__: Wan's, then SANA-Video's.
_FRAMES_ARGUMENTS = ("num_frames", "frames")
# Control-video inputs (WanVACEPipeline), by generate_videos keyword.
_CONTROL_INPUTS = ("video", "mask", "reference_images", "conditioning_scale")


def _call_parameters(pipe) -> dict:
    call = pipe.__call__ if isinstance(pipe, type) else type(pipe).__call__
    return inspect.signature(call).parameters


def _frames_argument(pipe) -> str | None:
    """The name of the frame count in the pipeline's ``__call__`` (``num_frames``, ``frames``), ``None`` for images."""
    return next((name for name in _FRAMES_ARGUMENTS if name in _call_parameters(pipe)), None)


def is_video_pipeline(pipe) -> bool:
    """Whether ``pipe`` (a pipeline object or class) generates videos (its call takes ``num_frames`` or ``frames``)."""
    return _frames_argument(pipe) is not None


def is_video_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether the pipeline folder ``checkpoint`` holds a video pipeline (read from ``model_index.json``,
    nothing loaded). ``False`` when the folder or its pipeline class is unknown."""

    index = Path(checkpoint) / "model_index.json"
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError):
        return False
    cls = getattr(diffusers, str(name), None)
    return cls is not None and is_video_pipeline(cls)


def generate_videos(
    checkpoint: str | os.PathLike,
    prompts: Sequence[str],
    *,
    negative_prompt: str = "",
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    steps: int = 50,
    guidance_scale: float | None = None,
    seed: int = 0,
    dtype: str = "fp32",
    device: str | None = None,
    pipe=None,
    image=None,
    guidance_scale_2: float | None = None,
    context_parallel: str | None = None,
    video=None,
    mask=None,
    reference_images=None,
    conditioning_scale: float | None = None,
    use_resolution_binning: bool | None = None,
):
    """Generate one video per prompt with the checkpoint's own video pipeline: text-to-video, image-to-video (``image``)
    or from a control video (``video`` / ``mask`` / ``reference_images``, Wan VACE).

    Args:
        checkpoint: pipeline folder (plain or converted); ignored when ``pipe`` is given.
        height, width: pixels, multiples of 16 for Wan; default :func:`native_video_size`.
        frames: ``4k + 1`` for Wan and SANA-Video (default 81); other counts raise instead of being rounded.
        image: the first frame (a path or ``PIL.Image``), required by I2V checkpoints, refused by T2V-only ones.
        guidance_scale_2: Wan 2.2 A14B's low-noise expert CFG scale (``None``: ``guidance_scale``).
        video: Wan VACE's source / control video, ``frames`` frames (a video file, a folder of frame images, or
            a list of paths / ``PIL.Image``; :func:`load_frames`), resized by the pipeline to ``height x width``.
        mask: with ``video``: which pixels to generate (white) and which to keep (black), one frame per video frame.
        reference_images: Wan VACE's reference images (paths or ``PIL.Image``), with or without ``video``.
        conditioning_scale: Wan VACE's hint strength (``None``: the pipeline's, 1). Wan VACE runs one prompt per
            call (diffusers' pipeline takes no list), prompt ``i`` with seed ``seed + i``.
        use_resolution_binning: SANA-Video's snapping to a trained aspect ratio (``None``: the pipeline's, on).
        negative_prompt: the classifier-free guidance negative prompt.
        guidance_scale: classifier-free guidance (``None``: the pipeline's own default, Wan 5.0, SANA-Video 6.0).
        steps, seed, dtype, device, context_parallel: as :func:`generate_class_images`.

    Returns:
        One float32 array ``[frames, height, width, 3]`` in ``[0, 1]`` per prompt.

    Raises:
        GenerationError: not a video pipeline; an input the pipeline does not take (an image for a text-to-video-only
            model, a control video for one that is not VACE, ``guidance_scale_2`` with one denoising model,
            binning for a pipeline without it) or that cannot be read; a mask without a video or of another
            length; no prompts, a bad frame count, steps or dtype.
        ValueError: from the pipeline, e.g. a size Wan does not take.

    Sizes and family details: ``docs/generation.md``.
    """
    prompts = _prompt_list(prompts)
    pipe, device = _prepare(checkpoint, pipe, steps, dtype, device, context_parallel)
    if not is_video_pipeline(pipe) or not _takes_prompt(pipe):
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}, not a text-to-video pipeline; --frames, --image and --video are "
            "for video checkpoints (Wan, SANA-Video, Wan VACE)"
        )
    native = native_video_size(pipe)
    height = native["height"] if height is None else height
    width = native["width"] if width is None else width
    frames = native["frames"] if frames is None else frames
    control = dict(video=video, mask=mask, reference_images=reference_images, conditioning_scale=conditioning_scale)
    pipe, extra = _video_inputs(pipe, checkpoint, image, guidance_scale_2, use_resolution_binning, control, frames)
    _check_frame_count(pipe, frames)
    if guidance_scale is None:
        guidance_scale = call_default(pipe, "guidance_scale")
    call = dict(negative_prompt=negative_prompt, height=height, width=width, num_inference_steps=steps,
                guidance_scale=guidance_scale, output_type="np", **{_frames_argument(pipe): frames}, **extra)
    if "video" in _call_parameters(pipe):  # WanVACEPipeline takes one prompt per call: prompt i with seed + i
        return [_run(pipe, device, seed + i, prompt=prompt, **call).frames[0] for i, prompt in enumerate(prompts)]
    return [video for video in _run(pipe, device, seed, prompt=prompts, **call).frames]


def _video_inputs(pipe, checkpoint, image, guidance_scale_2, use_resolution_binning, control: dict, frames: int):
    """``(pipe, call keywords)``: the optional inputs of :func:`generate_videos`, read and checked against what the
    pipeline's ``__call__`` takes before anything runs (a bad path costs no compute); ``image`` turns the pipeline
    into its image-to-video form."""
    extra = {}
    if image is not None:
        first_frame = load_first_frame(image)
        pipe = image_to_video_pipeline(pipe, checkpoint)
        extra["image"] = first_frame
    elif _needs_image(pipe):
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}, an image-to-video model: give the first frame (--image first_frame.png)"
        )
    if guidance_scale_2 is not None:
        if getattr(pipe, "config", {}).get("boundary_ratio") is None:
            raise GenerationError(
                f"{checkpoint} holds one denoising model: --guidance-scale-2 is for Wan 2.2 A14B's second expert (transformer_2)"
            )
        extra["guidance_scale_2"] = guidance_scale_2
    if use_resolution_binning is not None:
        if "use_resolution_binning" not in _call_parameters(pipe):
            raise GenerationError(f"{type(pipe).__name__} has no resolution binning (--no-resolution-binning is SANA's)")
        extra["use_resolution_binning"] = bool(use_resolution_binning)
    return pipe, {**extra, **_control_inputs(pipe, checkpoint, control, frames)}


def _control_inputs(pipe, checkpoint, control: dict, frames: int) -> dict:
    """Wan VACE's ``video`` / ``mask`` (frames) and ``reference_images`` (images), read; refused by other pipelines."""
    given = {k: v for k, v in control.items() if v is not None}
    if not given:
        return {}
    missing = [k for k in given if k not in _call_parameters(pipe)]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-").replace("reference-images", "reference-image") for k in missing)
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}, which takes no {', '.join(missing)}: {flags} "
            f"{'is' if len(missing) == 1 else 'are'} for Wan VACE (WanVACEPipeline) checkpoints"
        )
    out = {}
    if "mask" in given and "video" not in given:
        raise GenerationError("--mask marks which pixels of --video to generate: give the video too")
    for name in ("video", "mask"):
        if name in given:
            out[name] = load_frames(given[name], f"--{name}")
            count, factor = len(out[name]), _temporal_factor(pipe)
            if count != frames:
                low, high = _nearest_frame_counts(count, factor)
                fix = (f"give --frames {count}, or a {name} of {frames} frames" if (count - 1) % factor == 0 else
                       f"{type(pipe).__name__} takes {factor}k + 1 frames: give a {name} of {frames} frames, or one of "
                       f"{low} or {high} frames with --frames to match")
                raise GenerationError(f"--{name} has {count} frames and the request {frames}: {fix}")
    if "reference_images" in given:
        images = given["reference_images"]
        images = [images] if isinstance(images, (str, os.PathLike)) or not isinstance(images, Sequence) else images
        if not images:
            raise GenerationError("--reference-image: an empty list; give one or more images, or leave it out")
        out["reference_images"] = [load_first_frame(i, "--reference-image") for i in images]
    if "conditioning_scale" in given:
        scale = float(given["conditioning_scale"])
        if not math.isfinite(scale):
            raise GenerationError(f"--conditioning-scale must be a finite number (1: the trained strength); got {scale}")
        out["conditioning_scale"] = scale
    return out


def _check_frame_count(pipe, frames: int) -> None:
    """Refuse a frame count the VAE cannot encode (``k * temporal factor + 1``), naming the nearest valid ones."""
    factor = _temporal_factor(pipe)
    if frames < 1 or (frames - 1) % factor:
        low, high = _nearest_frame_counts(frames, factor)
        raise GenerationError(
            f"{type(pipe).__name__} generates {factor}k + 1 frames (1, {1 + factor}, {1 + 2 * factor}, ...); got {frames}. "
            f"Nearest valid counts: {low} or {high}"
        )


def _temporal_factor(pipe) -> int:
    """How many frames the pipeline's VAE folds into one latent frame (``vae_scale_factor_temporal``; 1 for images)."""
    return int(getattr(pipe, "vae_scale_factor_temporal", 1))


def _nearest_frame_counts(count: int, factor: int) -> tuple[int, int]:
    """The ``k * factor + 1`` frame counts around ``count``: ``(at or below, above)``."""
    low = max(1, (count - 1) // factor * factor + 1)
    return low, low + factor


def _needs_image(pipe) -> bool:
    image = inspect.signature(type(pipe).__call__).parameters.get("image")
    return image is not None and image.default is inspect.Parameter.empty


def _video_family(pipe):
    """The family that answers for a video pipeline: its first transformer's when that family has video
    hooks (:attr:`~mhla_diffusers.families.Family.native_video`), else the first registered family with them."""
    transformers = checkpoint_format.pipeline_transformers(pipe) if hasattr(pipe, "components") else {}
    transformer = next(iter(transformers.values()), getattr(pipe, "transformer", None))
    family = find_family(transformer) if transformer is not None else None
    if family is None or family.native_video is None:
        family = next(f for f in FAMILIES.values() if f.native_video is not None)
    return family, transformer


def image_to_video_pipeline(pipe, checkpoint="the pipeline"):
    """The image-to-video form of a video pipeline, sharing its components (:attr:`~mhla_diffusers.families.Family.image_to_video`).

    Raises:
        GenerationError: a text-to-video-only pipeline, or an I2V one missing what its transformer needs.
    """
    family, _ = _video_family(pipe)
    if family.image_to_video is None:
        raise GenerationError(f"{checkpoint} holds a {type(pipe).__name__}, which cannot take a first frame (--image)")
    return family.image_to_video(pipe, checkpoint)


def native_video_size(pipe) -> dict:
    """``{"height", "width", "frames"}`` the pipeline's transformer was trained at (recorded ``_mhla_native_size``, else the family's).

    Raises:
        GenerationError: a recorded size that is not three positive integers.
    """
    family, transformer = _video_family(pipe)
    return family.native_video_size(getattr(transformer, "config", None))


# Deprecated: Wan 2.1's native size (the sizes are the families' now: Family.native_video).
WAN_NATIVE_SIZE = wan_native_video({})
