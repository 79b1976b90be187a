"""Saving MHLA transformers and pipelines in the converted-checkpoint format (:mod:`~mhla_diffusers.checkpoint.format`):
the base model through diffusers' ``save_pretrained`` without any MHLA submodule, then ``mhla_config.json``
and ``mhla.safetensors`` in each transformer's folder, all written atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from torch import nn

import mhla_diffusers
from mhla_diffusers.checkpoint.io import atomic_directory
from mhla_diffusers.checkpoint.lora_guard import check_saveable, merged_adapters
from mhla_diffusers.checkpoint.marker import mark_config
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError
from mhla_diffusers.checkpoint.spec import (
    FORMAT_VERSION,
    METADATA_KEY,
    MHLA_CONFIG_NAME,
    MHLA_WEIGHTS_NAME,
    checked_settings,
    mhla_parameters,
    sha256,
)
from mhla_diffusers.families import pipeline_quirks, pipeline_transformers, self_attention_modules
from mhla_diffusers.models.installer import mhla_spec
from mhla_diffusers.models.lazy import materialize_mhla, pending_mhla_layers

__all__ = ["save_mhla_transformer", "save_mhla_pipeline"]


@contextlib.contextmanager
def _without_mixing(model: nn.Module) -> Iterator[dict[tuple[str, str], nn.Module]]:
    """Temporarily detach every layer's MHLA (``<attention>.mhla``) so that ``save_pretrained`` writes the base model."""
    detached = {}
    for name, module in list(model.named_modules()):
        if module._modules.get("mhla") is not None:
            detached[(name, "mhla")] = module._modules.pop("mhla")
    try:
        yield detached
    finally:
        for (name, child), sub in detached.items():
            model.get_submodule(name)._modules[child] = sub


def _prepare_for_saving(transformer: nn.Module) -> None:
    """Create the pending one-liner layers' matrices (:class:`MHLACheckpointError` if impossible)."""
    try:
        materialize_mhla(transformer)
    except (ValueError, TypeError, RuntimeError) as err:
        raise MHLACheckpointError(
            f"{type(transformer).__name__} runs MHLAProcessor on layers whose mixing matrices do not exist yet and "
            f"cannot be created here ({err}). Run one forward pass of the model first, or install MHLA with "
            "mhla_diffusers.apply_mhla(transformer), then save; nothing was written"
        ) from err


def _write_mhla_files(transformer: nn.Module, folder: Path) -> None:
    _prepare_for_saving(transformer)
    spec = mhla_spec(transformer)
    mark_config(folder, converted=spec is not None)
    if spec is None:
        return
    tensors = {key: t.detach().to("cpu", torch.float32).contiguous() for key, t in mhla_parameters(transformer).items()}
    names = [name for name, _ in self_attention_modules(transformer)]
    without = [names[i] for i in spec["layers"] if f"{names[i]}.mhla.mixing.weight" not in tensors]
    if without or pending_mhla_layers(transformer):  # never write a checkpoint that loads as another model
        raise MHLACheckpointError(
            f"the MHLA layers {without or pending_mhla_layers(transformer)} have no mixing matrix to save; run one forward "
            "pass of the model first, or install MHLA with mhla_diffusers.apply_mhla(transformer)"
        )
    config = {"format_version": FORMAT_VERSION, "mhla_diffusers_version": mhla_diffusers.__version__, **spec}
    metadata = {
        "format": "pt",
        "mhla_format_version": str(FORMAT_VERSION),
        METADATA_KEY: json.dumps(checked_settings(config), sort_keys=True),
    }
    save_file(tensors, str(folder / MHLA_WEIGHTS_NAME), metadata=metadata)
    config["weights_sha256"] = sha256(folder / MHLA_WEIGHTS_NAME)
    (folder / MHLA_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def save_mhla_transformer(
    transformer: nn.Module, out_dir: str | os.PathLike, *, overwrite: bool = False, merge_lora: bool = False, **save_kwargs
) -> Path:
    """Write ``transformer`` as a converted checkpoint folder (atomic; extra kwargs go to ``save_pretrained``).

    Missing mixing matrices of ``MHLAProcessor`` layers are created first; idle MHLA layers are written
    stock, with a warning. A model with peft adapters is refused unless ``merge_lora=True`` (written
    merged, the model left as it is). Without MHLA: a plain diffusers folder.

    Raises:
        MHLACheckpointError: matrices cannot be created; LoRA adapters without ``merge_lora`` (nothing written).
        ValueError: the MHLA layers disagree on settings.
    """
    check_saveable({"transformer": transformer}, merge_lora=merge_lora)
    _prepare_for_saving(transformer)
    with merged_adapters({"transformer": transformer}, merge_lora), atomic_directory(out_dir, overwrite) as tmp:
        with _without_mixing(transformer):
            transformer.save_pretrained(tmp, **save_kwargs)
        _write_mhla_files(transformer, tmp)
    return Path(out_dir)


def save_mhla_pipeline(
    pipe, out_dir: str | os.PathLike, *, overwrite: bool = False, merge_lora: bool = False, **save_kwargs
) -> Path:
    """Write a diffusers pipeline whose transformers may have MHLA (atomic); the MHLA files of each go into
    its own folder (``<out_dir>/transformer/``, and ``<out_dir>/transformer_2/`` for Wan 2.2's second expert,
    each with its own layers and settings). The pipeline's ``id2label`` (DiT class names), which
    diffusers' ``save_pretrained`` leaves out unless registered in ``pipe.config``, is written
    into ``model_index.json`` (see :class:`~mhla_diffusers.families.dit.DiTLabels`). A component with peft adapters
    (``pipe.load_lora_weights``, fused or not) is refused unless ``merge_lora=True``, as in
    :func:`save_mhla_transformer`, whose errors this raises."""
    transformers = pipeline_transformers(pipe)
    modules = {name: c for name, c in getattr(pipe, "components", {}).items() if isinstance(c, nn.Module)}
    check_saveable({**modules, **transformers}, pipe=pipe, merge_lora=merge_lora)
    for model in transformers.values():
        _prepare_for_saving(model)
    with merged_adapters({**modules, **transformers}, merge_lora), atomic_directory(out_dir, overwrite) as tmp:
        with contextlib.ExitStack() as stack:
            for model in transformers.values():
                stack.enter_context(_without_mixing(model))
            pipe.save_pretrained(tmp, **save_kwargs)
        for quirks in pipeline_quirks():  # DiT: the id2label diffusers left out of model_index.json
            quirks.after_save(pipe, tmp)
        for name, model in transformers.items():
            _write_mhla_files(model, tmp / name)
    return Path(out_dir)
