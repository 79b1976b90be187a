"""The data a training run reads: its dataset by ``data.kind`` (a latent cache over it if asked, or the teacher's
samples for ``kind: teacher``) and its held-out set (``eval``). ``docs/training.md``, "Datasets"."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from mhla_diffusers.data.build import build_dataset
from mhla_diffusers.training.cache import CachedDataset, build_cache, cache_key, module_fingerprint
from mhla_diffusers.training.teacher import teacher_dataset

__all__ = ["training_data", "heldout_data", "cost_line"]


def _cache_dir(config: Mapping) -> Path:
    d_cfg = config["data"]
    return Path(d_cfg["cache_dir"]) if d_cfg["cache_dir"] else Path(config["output_dir"]) / "latent_cache"


def _cached(parts, dataset, config: Mapping, accelerator, batch_size: int) -> CachedDataset:
    """Encode ``dataset`` once into ``<cache_dir>/<key>`` (all processes share the work); the cache."""
    encoders = [e if isinstance(e, Mapping) else module_fingerprint(e) for e in parts.recipe.encoders(parts)]
    key = cache_key(parts.family, dataset.fingerprint(), encoders)
    folder = build_cache(
        dataset, lambda batch: parts.recipe.cache_encode(parts, batch, accelerator.device), _cache_dir(config) / key,
        batch_size=batch_size, rank=accelerator.process_index, world_size=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone, progress=accelerator.is_local_main_process,
    )
    return CachedDataset(folder)


def training_data(parts, config: Mapping, accelerator) -> tuple[object, list]:
    """``(dataset, restore)``: the run's training items and the recipe's ``[(module, attribute, value)]`` to restore
    before export (:meth:`prepare`, which sees the dataset; for ``kind: teacher`` it runs first, the teacher's
    pipeline needing it). The training data's classes, if it has any, become ``parts.id2label``."""
    d_cfg = config["data"]
    if d_cfg["kind"] == "teacher":
        restore = parts.recipe.prepare(parts, None, config)
        dataset = teacher_dataset(parts, config, accelerator)
        accelerator.print(f"teacher store: {len(dataset)} {type(dataset).__name__} items; {cost_line(dataset.cost)}")
        return dataset, restore
    dataset = build_dataset(d_cfg)
    labels = getattr(dataset, "id2label", None)
    parts.id2label = labels if labels else parts.id2label  # the training data defines the classes
    restore = parts.recipe.prepare(parts, dataset, config)
    if d_cfg["cache"]:
        dataset = _cached(parts, dataset, config, accelerator, int(d_cfg["batch_size"]))
    return dataset, restore


def heldout_data(parts, config: Mapping, accelerator):
    """The held-out set: ``eval.data`` over the data section, else the training data's kind at ``eval.seed`` (a
    held-out store of the teacher for ``kind: teacher``; cached like the training data if it is)."""
    d_cfg, ev_cfg = config["data"], config["eval"]
    if ev_cfg["data"] is None and d_cfg["kind"] == "teacher":
        return teacher_dataset(parts, config, accelerator, heldout=True)
    dataset = build_dataset({**d_cfg, **(ev_cfg["data"] or {}), "seed": int(ev_cfg["seed"])})
    if d_cfg["cache"] and ev_cfg["data"] is None:
        dataset = _cached(parts, dataset, config, accelerator, int(ev_cfg["batch_size"]))
    return dataset


def cost_line(cost: Mapping) -> str:
    """A teacher store's cost in one line (:func:`~mhla_diffusers.data.store.store_cost`)."""
    return (f"{cost['trajectories']} trajectories x {cost['steps']} steps, {cost['transformer_calls']} teacher calls, "
            f"{cost['wall_s']} s wall / {cost['cpu_s']} s CPU to sample")
