"""The final model as a complete pipeline in the converted-checkpoint format, written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from mhla_diffusers.checkpoint.format import save_mhla_pipeline
from mhla_diffusers.checkpoint.io import atomic_directory
from mhla_diffusers.checkpoint.lora import LORA_DIR_NAME, has_lora, merge_lora_, save_lora, unload_lora_
from mhla_diffusers.families.dit import build_dit_pipeline

if TYPE_CHECKING:  # annotations only
    from mhla_diffusers.training.recipes import TrainingParts

__all__ = ["export_pipeline", "export_model"]


# -- export ----------------------------------------------------------------------------------------
def export_pipeline(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    out_dir: str | os.PathLike,
    *,
    sampler: str = "dpm",
    id2label: Mapping[int, str] | None = None,
    overwrite: bool = True,
) -> Path:
    """Write a complete ``DiTPipeline`` folder (sampler ``"dpm"``, ``"ddim"`` or ``"ddpm"``; labels in ``model_index.json``).

    Raises:
        ValueError: unknown ``sampler``.
        FileExistsError: ``out_dir`` not empty and not ``overwrite``.
    """
    pipe = build_dit_pipeline(transformer, vae, noise_scheduler, sampler=sampler, id2label=id2label)
    return save_mhla_pipeline(pipe, out_dir, overwrite=overwrite)


def export_model(
    parts: TrainingParts,
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    sampler: str = "dpm",
    id2label: Mapping[int, str] | None = None,
    lora_export: str = "merge",
) -> Path:
    """Write the trained model as the family's pipeline, atomically (an existing ``out_dir`` is replaced).

    LoRA adapters are merged in place (``"merge"``) or written to ``transformer_lora/`` (``"separate"``).

    Raises:
        ValueError: unknown ``lora_export``.
    """
    if lora_export not in ("merge", "separate"):
        raise ValueError(f"lora_export must be 'merge' or 'separate'; got {lora_export!r}")
    out = Path(out_dir)
    with atomic_directory(out, overwrite=True) as staging, tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.lora-") as tmp:
        separate = has_lora(model) and lora_export == "separate"
        if separate:
            save_lora(model, Path(tmp) / LORA_DIR_NAME)
            unload_lora_(model)
        elif has_lora(model):
            merge_lora_(model)
        parts.recipe.write(model, parts, staging, sampler=sampler, id2label=id2label)
        if separate:
            shutil.move(str(Path(tmp) / LORA_DIR_NAME), str(staging / LORA_DIR_NAME))
    return out
