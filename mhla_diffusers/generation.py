"""Generation helpers over the stock diffusers pipelines: class-conditional (DiTPipeline) and
text-to-image (SanaPipeline)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["GenerationError", "resolve_class_labels", "generate_class_images", "generate_text_images", "save_grid"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GenerationError(ValueError):
    """Bad generation request (unknown label, wrong pipeline kind, ...)."""


def _prepare(checkpoint, pipe, steps: int, dtype: str, device: str | None):
    """Validate the common generation arguments; load the pipeline unless given. Returns ``(pipe, device)``."""
    from .checkpoint import load_mhla_pipeline

    if steps < 1:
        raise GenerationError(f"steps must be >= 1; got {steps}")
    if dtype not in _DTYPES:
        raise GenerationError(f"dtype must be one of {sorted(_DTYPES)}; got {dtype!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if pipe is None:
        pipe = load_mhla_pipeline(checkpoint, torch_dtype=_DTYPES[dtype])
    return pipe, device


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
):
    """Generate one image per class label with the checkpoint's own ``DiTPipeline``.

    Args:
        checkpoint: pipeline folder (plain or MHLA-converted); ignored when ``pipe`` is given.
        class_labels: ids or names.
        steps: denoising steps of the pipeline's scheduler. guidance_scale: CFG scale (1 = off).
        seed: seed of the ``torch.Generator`` (CPU generator: same images on every device).
        dtype: ``"fp32" | "bf16" | "fp16"``. device: default CUDA when available, else CPU.
        pipe: an already loaded pipeline (skips loading).

    Returns:
        A list of PIL images.

    Raises:
        GenerationError: not a class-conditional pipeline, bad labels or steps.
    """
    pipe, device = _prepare(checkpoint, pipe, steps, dtype, device)
    if type(pipe).__name__ != "DiTPipeline":
        hint = " (it takes prompts: --prompt)" if _takes_prompt(pipe) else ""
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}; class-label generation needs a DiTPipeline{hint}"
        )
    pipe = pipe.to(device)
    ids = resolve_class_labels(pipe, class_labels)
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        result = pipe(class_labels=ids, num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator)
    return result.images


def _takes_prompt(pipe) -> bool:
    import inspect

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
):
    """Generate one image per prompt with the checkpoint's own text-to-image pipeline (``SanaPipeline``).

    Args:
        checkpoint: pipeline folder (plain or MHLA-converted); ignored when ``pipe`` is given.
        prompts: one image each (generated as one batch, with one ``torch.Generator``).
        negative_prompt: the classifier-free guidance negative prompt.
        height, width: image size in pixels (multiples of 32 for SANA); ``None``: the model's native
            size, ``transformer.config.sample_size * vae_scale_factor`` (1024 for SANA-1024px).
        steps: denoising steps. guidance_scale: CFG scale (1 = off). seed: CPU generator seed.
        dtype: ``"fp32" | "bf16" | "fp16"``. device: default CUDA when available, else CPU.
        use_resolution_binning: SANA's own default: snap the size to the nearest trained aspect
            ratio, generate there, resize back (MHLA builds its blocks on the true latent grid).
        pipe: an already loaded pipeline (skips loading).

    Returns:
        A list of PIL images of size ``(width, height)``.

    Raises:
        GenerationError: not a text-to-image pipeline, no prompts, bad steps or dtype.
        ValueError: from the pipeline, e.g. a size SANA does not take (multiples of 32 px).
    """
    prompts = [str(p) for p in prompts]
    if not prompts:
        raise GenerationError("give at least one prompt")
    pipe, device = _prepare(checkpoint, pipe, steps, dtype, device)
    if not _takes_prompt(pipe) or not hasattr(pipe, "vae_scale_factor"):
        raise GenerationError(
            f"{checkpoint} holds a {type(pipe).__name__}; text-to-image generation needs a pipeline that takes a "
            "prompt (SanaPipeline). Class-conditional pipelines take class labels (--class-labels)."
        )
    native = int(pipe.transformer.config.sample_size) * int(pipe.vae_scale_factor)
    height, width = height or native, width or native
    pipe = pipe.to(device)
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        result = pipe(
            prompt=prompts,
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=generator,
            use_resolution_binning=use_resolution_binning,
        )
    return result.images


def save_grid(images, path: str | os.PathLike, rows: int | None = None) -> Path:
    """Save images as one grid PNG (``diffusers.utils.make_image_grid``), written atomically."""
    from diffusers.utils import make_image_grid

    rows = rows or 1
    cols = -(-len(images) // rows)
    blank = images[0].copy()
    blank.paste((255, 255, 255), (0, 0, *blank.size))
    padded = list(images) + [blank] * (rows * cols - len(images))
    grid = make_image_grid(padded, rows=rows, cols=cols)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    grid.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path
