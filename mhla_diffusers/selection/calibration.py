"""Calibration inputs for :func:`~mhla_diffusers.layer_sensitivity`, made offline from a pipeline (or a
transformer), asking the model family (:mod:`mhla_diffusers.models.families`) what its forward needs.

Sample ``i`` of ``n`` is one forward's keyword arguments (batch 1):

* the latent: a smooth random "clean" latent ``x0`` (standard normal noise on a grid 4x coarser per
  axis, upsampled (bi/trilinear) to the native latent size and standardised: spatially correlated like
  an image latent, without data), noised at the spread timestep fraction ``s = (i + 0.5) / n`` (spread over
  ``timestep_range / 1000`` when given) with the family's training process: DiT
  ``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps`` at ``t = floor(1000 s)``
  (the pipeline scheduler's ``alphas_cumprod``, else DDPM's linear betas 1e-4..0.02), timestep ``t``;
  SANA / Wan (flow matching) ``x_t = (1 - s) x0 + s eps``, timestep ``1000 s``;
* the condition: DiT a random class label in ``[0, num_embeds_ada_norm)`` (never the null label);
  SANA / Wan the text-encoder states of a prompt (prompt ``i mod P``) through the pipeline's own
  ``encode_prompt`` as its ``__call__`` encodes them (:data:`GENERIC_PROMPTS` by default), or rows of
  cached embeddings (:func:`encode_calibration_prompts` writes them; a transformer folder without a
  text encoder needs them).

Synthetic latents are the offline default; calibration on real data is a list of dicts you build
(e.g. :func:`~mhla_diffusers.diagnostics.diagnostic_inputs` for DiT photo crops).
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

from mhla_diffusers.models.families import family_of

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
    """Text-encoder states of ``prompts`` (default :data:`GENERIC_PROMPTS`) through the pipeline's own
    ``encode_prompt``, as ``{forward keyword: tensor}``: SANA ``encoder_hidden_states`` ``[P, L, D]`` and
    ``encoder_attention_mask`` ``[P, L]``, Wan ``encoder_hidden_states`` ``[P, L, D]``; on the CPU, contiguous,
    ready for ``safetensors.torch.save_file`` (the file ``--calibration-embeddings`` reads).

    Raises:
        ValueError: a class-conditional family (DiT), a pipeline without text encoder / tokenizer, no prompts.
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
    """The embeddings file of :func:`encode_calibration_prompts` (safetensors; never unpickled).

    Raises:
        FileNotFoundError: no such file. ValueError: not safetensors, or without ``encoder_hidden_states``.
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
    """``[1, C, *spatial]`` standard-normal noise 4x coarser per axis, upsampled and standardised."""
    channels, spatial = shape[0], tuple(shape[1:])
    coarse = torch.randn(1, channels, *(max(1, math.ceil(n / 4)) for n in spatial), generator=generator)
    mode = "bilinear" if len(spatial) == 2 else "trilinear"
    x0 = F.interpolate(coarse, size=spatial, mode=mode, align_corners=False)
    return (x0 - x0.mean()) / x0.std().clamp_min(1e-6)


def _noised(family, pipe, x0: torch.Tensor, frac: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, timestep [1])`` at the timestep fraction ``frac`` of the family's noise process."""
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
    """Per sample, the forward's condition keywords (class label or text states)."""
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
    """``timestep_range`` (``(low, high)``, ``None``: the whole process) clipped to ``[0, 1000]``, as
    :func:`calibration_inputs` spreads its timesteps over it (and a selection record stores it).

    Raises:
        ValueError: not two numbers, or ``low >= high`` once clipped (no timestep in range).
    """
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
    """The patch size on each of the ``ndim`` latent axes (``(H, W)`` or ``(F, H, W)``)."""
    patch = config.get("patch_size", 1) or 1
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1,) * (ndim - 2) + (int(patch),) * 2
    return patch[-ndim:]


def _within_grid_bound(family, transformer, size: tuple[int, ...], patch: tuple[int, ...], given: bool) -> tuple[int, ...]:
    """``size`` (latent axes) if its token grid fits the largest one the model's forward takes
    (:attr:`~mhla_diffusers.models.families.Family.max_grid`; Wan: ``rope_max_seq_len`` per axis); else, for the
    native size (``given=False``), the largest latent within it on each axis, with a warning saying so.

    Raises:
        ValueError: a ``given`` (``latent_size``) size beyond the bound, naming the largest one allowed.
    """
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
    """Calibration inputs for :func:`~mhla_diffusers.layer_sensitivity` (see the module docstring).

    Args:
        source: a diffusers pipeline (``DiTPipeline``, ``SanaPipeline``, ``WanPipeline``) or its transformer
            (enough for DiT; SANA / Wan then need ``embeddings``).
        num_samples: how many forwards (batch 1 each), timesteps spread evenly over the noise process.
        seed: of every random draw (a private generator: the global RNG is untouched).
        prompts: SANA / Wan: prompts to encode instead of :data:`GENERIC_PROMPTS`.
        embeddings: SANA / Wan: cached text states (``{forward keyword: [P, ...]}`` or a safetensors file
            from :func:`encode_calibration_prompts`) instead of the text encoder.
        latent_size: the latent's spatial size ``(H, W)`` or, for video, ``(F, H, W)`` (latent frames);
            default the model's native size (Wan: 21 x 60 x 104; give a smaller one on a CPU), cut on each axis
            to what the model's forward takes when its RoPE table is shorter (a Wan whose ``rope_max_seq_len`` is
            below the native token grid), with a warning.
        timestep_range: ``(low, high)``: only timesteps ``low <= t < high`` (the transformer's ``timestep`` scale,
            0..1000; clipped to it, infinite ends allowed), spread evenly over that range instead of the whole
            process: a Wan 2.2 A14B expert runs only on its own range
            (:func:`~mhla_diffusers.checkpoint.format.expert_timestep_range`); see :func:`clip_timestep_range`.

    Returns:
        ``[{"hidden_states": [1, C, (F,) H, W], "timestep": [1], "class_labels" [1] | "encoder_hidden_states"
        [1, L, D] (, "encoder_attention_mask" [1, L])}, ...]`` on the transformer's device, floating tensors
        in its dtype.

    Raises:
        ValueError: unsupported model, ``num_samples < 1``, a ``timestep_range`` holding no timestep of 0..1000,
            a bad ``latent_size`` (not integers, not a multiple of the patch size on every axis, or larger than
            the model's RoPE table takes on an axis), a text-conditioned model
            without text encoder and without ``embeddings``, prompts / embeddings for a class-conditional one.
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
        out.append({
            k: v.to(parameter.device, parameter.dtype if v.is_floating_point() and k != "timestep" else v.dtype)
            for k, v in entry.items()
        })
    return out
