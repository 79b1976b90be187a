"""Retrofit a pretrained diffusers checkpoint with MHLA and write it in the converted format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .apply import apply_mhla
from .checkpoint import (
    MHLACheckpointError,
    read_mhla_config,
    save_mhla_pipeline,
    save_mhla_transformer,
    transformer_folder,
)
from .families import FAMILIES, family_of

__all__ = ["convert_checkpoint", "AlreadyConvertedError"]


class AlreadyConvertedError(MHLACheckpointError):
    """The source checkpoint already has MHLA; conversion starts from the original model."""


def _load_source(src: str, torch_dtype: torch.dtype | None):
    """(pipeline or None, transformer) from a local pipeline/transformer folder or a Hub id."""
    from diffusers import DiffusionPipeline

    from .checkpoint import _dtype_kwargs, _transformer_class

    path = Path(src)
    if path.exists():
        folder = transformer_folder(path)
        config = read_mhla_config(folder)
        if config is not None:
            raise AlreadyConvertedError(
                f"{src} is already an MHLA checkpoint (layers {config['layers']}, block grid {config['block_grid']}); "
                "nothing was written. Convert from the original checkpoint to change settings, or load this one "
                "with mhla_diffusers.load_mhla_pipeline / load_mhla_transformer."
            )
        if (path / "model_index.json").is_file():
            return DiffusionPipeline.from_pretrained(path, **_dtype_kwargs(torch_dtype)), None
        return None, _transformer_class(folder).from_pretrained(folder, **_dtype_kwargs(torch_dtype))
    if src.startswith((".", "/", "~")) or src.count("/") != 1:
        raise FileNotFoundError(f"{src} does not exist (and does not look like a Hub id 'owner/name')")
    try:
        return DiffusionPipeline.from_pretrained(src, **_dtype_kwargs(torch_dtype)), None
    except OSError as err:
        raise OSError(
            f"could not load {src!r} from the Hugging Face Hub or its local cache ({err}). Offline "
            "(HF_HUB_OFFLINE=1) only cached repositories load; pass a local folder instead."
        ) from err


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    family: str | None = None,
    layers: str | Sequence[int] = "all",
    num_blocks: int | None = None,
    block_grid: Sequence[int] | None = None,
    normalize: bool = True,
    eps: float | None = None,
    torch_dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> dict:
    """Load a pretrained checkpoint, install MHLA, write it as a converted checkpoint.

    Args:
        src: a Hub id (``facebook/DiT-XL-2-256``), a local diffusers pipeline folder or a local
            transformer folder. A pipeline is written whole, a transformer folder alone.
        out: output folder (written atomically; must not exist or be empty unless ``overwrite``).
        family: expected model family (``"dit"``); checked against the loaded model when given.
        layers, num_blocks, block_grid, normalize, eps: see :func:`~mhla_diffusers.apply_mhla`.
        torch_dtype: dtype to load (and save) the base weights in; ``None`` keeps the stored dtype.

    Returns:
        The MHLA spec written to ``mhla_config.json`` plus ``"out"``.

    Raises:
        AlreadyConvertedError: ``src`` already has MHLA (C15): nothing is written.
        ValueError: unknown family, family mismatch, bad layer or block options.
        FileNotFoundError / OSError: ``src`` cannot be found or loaded.
    """
    from .apply import mhla_spec

    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    pipe, transformer = _load_source(str(src), torch_dtype)
    model = pipe.transformer if pipe is not None else transformer
    found = family_of(model)
    if family is not None and found.name != family:
        raise ValueError(f"--family {family} was given but {src} holds a {type(model).__name__} ({found.name})")
    apply_mhla(model, layers, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize, eps=eps)
    if pipe is not None:
        save_mhla_pipeline(pipe, out, overwrite=overwrite)
    else:
        save_mhla_transformer(model, out, overwrite=overwrite)
    return {**mhla_spec(model), "out": str(out)}
