"""LoRA for MHLA fine-tuning: the adapter functions (``mhla_diffusers.checkpoint.adapter``: add, merge,
unload, save, load) and the loaders of a converted checkpoint together with its adapter.

:func:`load_mhla_pipeline_with_lora` / :func:`load_mhla_transformer_with_lora` load a checkpoint and
its adapter in one call (``load_mhla_pipeline`` / ``load_mhla_transformer`` apply an adapter found in
the default place ``transformer_lora/`` too; ``lora=False`` skips it).
"""

from __future__ import annotations

import os
from pathlib import Path

from mhla_diffusers.checkpoint.adapter import (
    DEFAULT_TARGET_MODULES,
    LORA_DIR_NAME,
    add_lora,
    has_lora,
    load_lora,
    lora_parameters,
    lora_state_dict,
    merge_lora_,
    mhla_parameters,
    save_lora,
    unload_lora_,
)
from mhla_diffusers.checkpoint.format import load_mhla_pipeline, load_mhla_transformer, transformer_folder

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LORA_DIR_NAME",
    "add_lora",
    "has_lora",
    "lora_parameters",
    "mhla_parameters",
    "merge_lora_",
    "unload_lora_",
    "lora_state_dict",
    "save_lora",
    "load_lora",
    "load_mhla_pipeline_with_lora",
    "load_mhla_transformer_with_lora",
]


def load_mhla_transformer_with_lora(path: str | os.PathLike, lora_dir: str | os.PathLike | None = None, **kwargs):
    """:func:`mhla_diffusers.load_mhla_transformer` plus the LoRA adapter saved beside it.

    Args:
        path: a pipeline or transformer folder.
        lora_dir: the adapter folder (default: ``<path>/transformer_lora`` for a pipeline folder,
            ``<path>/../transformer_lora`` for a transformer folder).
    """
    folder = transformer_folder(path)
    return load_mhla_transformer(path, lora=lora_dir or folder.parent / LORA_DIR_NAME, **kwargs)


def load_mhla_pipeline_with_lora(path: str | os.PathLike, lora_dir: str | os.PathLike | None = None, **kwargs):
    """:func:`mhla_diffusers.load_mhla_pipeline` plus the LoRA adapter saved beside it
    (``<path>/transformer_lora`` unless ``lora_dir`` is given)."""
    pipe = load_mhla_pipeline(path, lora=lora_dir or Path(path) / LORA_DIR_NAME, **kwargs)
    pipe.transformer.eval()
    return pipe
