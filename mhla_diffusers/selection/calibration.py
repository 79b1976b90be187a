"""Calibration inputs for :func:`~mhla_diffusers.layer_sensitivity`, made offline from a pipeline or a
transformer: smooth random latents noised by the family's training process, with a class label or
prompt states. See ``docs/selection.md``, "Calibration inputs".
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.families import family_of

__all__ = ["GENERIC_PROMPTS", "calibration_inputs", "clip_timestep_range", "encode_calibration_prompts", "load_calibration_embeddings"]

GENERIC_PROMPTS = (
    "a photograph of a cat sitting on a wooden windowsill in the afternoon sun",
    "a mountain lake at sunrise with pine trees and mist over the water",
    "a busy city street at night with neon signs and people walking in the rain",
    "a close-up portrait of an old man with a grey beard, studio lighting",
    "a bowl of fresh fruit on a kitchen table, oranges, apples and grapes",
    "a red sports car driving along a coastal road, aerial view",
    "an astronaut floating inside a space station, looking out of a window at the earth",
    "a golden retriever running through a field of tall grass",
)


def _transformer_of(source) -> tuple[nn.Module, object | None]:
    transformer = getattr(source, "transformer", None)
    if isinstance(transformer, nn.Module):
        return transformer, source
    if isinstance(source, nn.Module):
        return source, None
    raise ValueError(f"calibration_inputs takes a diffusers pipeline or its transformer; got {type(source).__name__}")


def encode_calibration_prompts(pipe, prompts: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Text-encoder states of ``prompts`` (default :data:`GENERIC_PROMPTS`) as ``{forward keyword: tensor}`` on the CPU.

    SANA: ``encoder_hidden_states`` ``[P, L, D]``, ``encoder_attention_mask`` ``[P, L]``; Wan: the former.

    Raises:
        ValueError: a class-conditional family, no text encoder / tokenizer, no prompts.
    """
    transformer, pipe = _transformer_of(pipe)
    family = family_of(transformer)
    if family.encode_prompts is None:
        raise ValueError(f"the {family.name} family is not text-conditioned: its calibration needs no prompts")
    if pipe is None or getattr(pipe, "text_encoder", None) is None or getattr(pipe, "tokenizer", None) is None:
        raise ValueError(
            f"cannot encode calibration prompts for a {family.name} model without its pipeline's text encoder and "
            "tokenizer: load the whole pipeline, or pass cached embeddings (a file written from "
            "mhla_diffusers.encode_calibration_prompts(pipe), --calibration-embeddings on the command line)"
        )
    prompts = list(GENERIC_PROMPTS if prompts is None else prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings; got {prompts!r}")
    device = next(pipe.text_encoder.parameters()).device
    with torch.no_grad():
        encoded = family.encode_prompts(pipe, prompts, device)
    return {key: value.detach().cpu().contiguous() for key, value in encoded.items()}


def load_calibration_embeddings(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The safetensors file of :func:`encode_calibration_prompts` (never unpickled).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not safetensors, or without ``encoder_hidden_states``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibration embeddings {path} do not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a safetensors file of calibration embeddings: {err}") from err
    if "encoder_hidden_states" not in tensors:
        raise ValueError(
            f"{path} holds {sorted(tensors)}, not 'encoder_hidden_states' [P, L, D] (and, for SANA, "
            "'encoder_attention_mask' [P, L]); write it with mhla_diffusers.encode_calibration_prompts"
        )
    return tensors


def _smooth_latent(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """``[1, C, *spatial]`` noise 4x coarser per axis, upsampled and standardised."""
    channels, spatial = shape[0], tuple(shape[1:])
    coarse = torch.randn(1, channels, *(max(1, math.ceil(n / 4)) for n in spatial), generator=generator)
    mode = "bilinear" if len(spatial) == 2 else "trilinear"
    x0 = F.interpolate(coarse, size=spatial, mode=mode, align_corners=False)
    return (x0 - x0.mean()) / x0.std().clamp_min(1e-6)


def _noised(family, pipe, x0: torch.Tensor, frac: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, timestep [1])`` at timestep fraction ``frac`` of the family's noise process."""
    eps = torch.randn(x0.shape, generator=generator)
    if family.noise == "flow":
        return (1 - frac) * x0 + frac * eps, torch.tensor([1000.0 * frac])
    alphas = getattr(getattr(pipe, "scheduler", None), "alphas_cumprod", None)
    if alphas is None:
        alphas = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float32), 0)  # as DDPMScheduler builds it
    t = min(int(frac * len(alphas)), len(alphas) - 1)
    a = float(alphas[t])
    return math.sqrt(a) * x0 + math.sqrt(1 - a) * eps, torch.tensor([t])


def _condition(family, transformer, pipe, embeddings, prompts, num_samples, generator) -> list[dict]:
    if family.conditioning == "class":
        if embeddings is not None or prompts is not None:
            raise ValueError(f"the {family.name} family is class-conditional: embeddings / prompts do not apply")
        classes = int(transformer.config.get("num_embeds_ada_norm") or 1000)
        labels = torch.randint(0, classes, (num_samples,), generator=generator)
        return [{"class_labels": labels[i: i + 1]} for i in range(num_samples)]
    if isinstance(embeddings, (str, os.PathLike)):
        embeddings = load_calibration_embeddings(embeddings)
    if embeddings is None:
        embeddings = encode_calibration_prompts(pipe if pipe is not None else transformer, prompts)
    elif prompts is not None:
        raise ValueError("give prompts or cached embeddings, not both")
    rows = embeddings["encoder_hidden_states"].shape[0]
    if any(t.shape[0] != rows for t in embeddings.values()) or rows < 1:
        shapes = [tuple(t.shape) for t in embeddings.values()]
        raise ValueError(f"calibration embeddings must share their first (prompt) dimension; got {shapes}")
    return [{key: t[i % rows: i % rows + 1] for key, t in embeddings.items()} for i in range(num_samples)]


_TIMESTEPS = 1000  # the timestep scale of every family's forward (DDPM t in 0..999, flow 1000 sigma)


def clip_timestep_range(timestep_range: Sequence[float] | None) -> tuple[float, float]:
    """``timestep_range`` (``None``: all) clipped to ``[0, 1000]``; ``ValueError`` unless two numbers with ``low < high``."""
    if timestep_range is None:
        return 0.0, float(_TIMESTEPS)
    try:
        low, high = (float(v) for v in timestep_range)
    except (TypeError, ValueError):
        raise ValueError(f"timestep_range must be (low, high), two numbers; got {timestep_range!r}") from None
    low, high = max(low, 0.0), min(high, float(_TIMESTEPS))
    if not low < high:  # NaN fails here too
        raise ValueError(f"timestep_range {tuple(timestep_range)} holds no timestep of 0..{_TIMESTEPS}: give low < high")
    return low, high


def _latent_patch(config, ndim: int) -> tuple[int, ...]:
    patch = config.get("patch_size", 1) or 1
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1,) * (ndim - 2) + (int(patch),) * 2
    return patch[-ndim:]


def _within_grid_bound(family, transformer, size: tuple[int, ...], patch: tuple[int, ...], given: bool) -> tuple[int, ...]:
    """``size`` cut to the largest token grid the forward takes (Wan's RoPE table); ``ValueError`` if ``given``."""
    if family.max_grid is None:
        return size
    bound = tuple(family.max_grid(transformer.config))[-len(size):]
    limit = tuple(b * p for b, p in zip(bound, patch))
    if all(n <= m for n, m in zip(size, limit)):
        return size
    what = (f"the {type(transformer).__name__}'s forward takes at most {bound} tokens per axis (its rotary table: "
            f"config rope_max_seq_len), i.e. a latent of at most {limit}")
    if given:
        raise ValueError(f"latent_size {size} is too large: {what}; give a smaller latent_size (--calibration-latent-size)")
    fitted = tuple(min(n, m) for n, m in zip(size, limit))
    warnings.warn(
        f"calibration at the native latent {size} cannot run: {what}. Calibrating at {fitted}; give latent_size= "
        "(--calibration-latent-size) to choose another size", UserWarning, stacklevel=3,
    )
    return fitted


def calibration_inputs(
    source,
    *,
    num_samples: int = 8,
    seed: int = 0,
    prompts: Sequence[str] | None = None,
    embeddings: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
    latent_size: Sequence[int] | None = None,
    timestep_range: Sequence[float] | None = None,
) -> list[dict]:
    """Calibration inputs, one batch-1 forward each, for :func:`~mhla_diffusers.layer_sensitivity`.

    ``source``: a DiT / SANA / Wan pipeline, or its transformer (SANA / Wan then need ``embeddings``,
    a mapping or safetensors file); ``latent_size``: ``(H, W)`` or ``(F, H, W)`` (default native);
    ``timestep_range``: ``(low, high)`` on the 0..1000 scale. Returns ``[{"hidden_states", "timestep",
    "class_labels" | "encoder_hidden_states" (, "encoder_attention_mask")} + the family's
    ``calibration_extras`` (Wan VACE: ``control_hidden_states``)]`` on the transformer's device.

    Raises:
        ValueError: unsupported model, ``num_samples < 1``, an empty ``timestep_range``, a bad ``latent_size``,
            missing text states, or prompts for a class-conditional model.
        FileNotFoundError: an embeddings file that does not exist.
    """
    transformer, pipe = _transformer_of(source)
    family = family_of(transformer)
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer; got {num_samples!r}")
    shape = family.native_latent_shape(transformer.config)
    patch = _latent_patch(transformer.config, len(shape) - 1)
    if latent_size is not None:
        size = tuple(latent_size)
        if (len(size) != len(shape) - 1 or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in size)
                or min(size) < 1):
            raise ValueError(f"latent_size must be {len(shape) - 1} positive integers for a {family.name} model; got {latent_size!r}")
        size = tuple(int(n) for n in size)
        if any(n % p for n, p in zip(size, patch)):
            # the patch embedding would drop the remainder: the forward would not run at the size asked for
            raise ValueError(
                f"latent_size {size} is not a multiple of the {family.name} model's patch size {patch} on every axis"
            )
        shape = (shape[0], *_within_grid_bound(family, transformer, size, patch, given=True))
    else:
        shape = (shape[0], *_within_grid_bound(family, transformer, tuple(shape[1:]), patch, given=False))
    low, high = clip_timestep_range(timestep_range)
    generator = torch.Generator().manual_seed(int(seed))
    conditions = _condition(family, transformer, pipe, embeddings, prompts, int(num_samples), generator)
    parameter = next(transformer.parameters())
    out = []
    for i, condition in enumerate(conditions):
        frac = (low + (i + 0.5) / num_samples * (high - low)) / _TIMESTEPS
        latent, timestep = _noised(family, pipe, _smooth_latent(shape, generator), frac, generator)
        entry = {"hidden_states": latent, "timestep": timestep, **condition}
        if family.calibration_extras is not None:  # e.g. Wan VACE's control latent
            entry.update(family.calibration_extras(transformer.config, latent, lambda shape: _smooth_latent(shape, generator)))
        out.append({
            k: v.to(parameter.device, parameter.dtype if v.is_floating_point() and k != "timestep" else v.dtype)
            for k, v in entry.items()
        })
    return out
