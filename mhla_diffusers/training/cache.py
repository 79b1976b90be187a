"""On-disk cache of encoded training inputs (latents, text embeddings), one safetensors file per item.

Keyed by the dataset's and the encoders' fingerprints, so a change gets a fresh folder; items are
the crops of epoch 0. See ``docs/training.md``, "Latent cache".
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from mhla_diffusers.checkpoint.safetensors_file import load_safetensors

__all__ = ["module_fingerprint", "cache_key", "build_cache", "CachedDataset", "is_complete"]

_DONE = "cache_complete.json"


def module_fingerprint(module: nn.Module | None) -> dict:
    """A cheap identity of an encoder: class, config, parameter shapes, a strided sample of its weights."""
    if module is None:
        return {"class": None}
    digest = hashlib.sha256()
    shapes = []
    for name, p in sorted(module.state_dict().items()):
        shapes.append([name, list(p.shape), str(p.dtype)])
        flat = p.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // 64)
            digest.update(flat[::step][:64].to("cpu", torch.float32).numpy().tobytes())
    config = getattr(module, "config", None)
    if config is not None:
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers / diffusers configs
        config = json.loads(json.dumps(raw, sort_keys=True, default=str))
    return {"class": type(module).__name__, "config": config, "shapes": shapes, "weights": digest.hexdigest()}


def cache_key(*parts: Any) -> str:
    """The first 16 hex digits of the sha256 of the JSON of ``parts``."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a finished cache."""
    return (Path(folder) / _DONE).is_file()


def _item_path(folder: Path, index: int) -> Path:
    return folder / "items" / f"{index:08d}.safetensors"


def build_cache(
    dataset: Dataset,
    encode: Callable[[dict], Mapping[str, torch.Tensor]],
    folder: str | os.PathLike,
    *,
    batch_size: int = 16,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    progress: bool = False,
) -> Path:
    """Encode every item of ``dataset`` (epoch 0) into ``folder`` unless complete; returns ``folder``.

    ``encode`` maps a batch to ``{name: tensor [B, ...]}`` (run without grad; stored per item on the
    CPU); item ``i`` is encoded on rank ``i % world_size``, and ``barrier`` brackets the completion marker.
    """
    folder = Path(folder)
    if is_complete(folder):
        return folder
    (folder / "items").mkdir(parents=True, exist_ok=True)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(0)
    mine = [i for i in range(rank, len(dataset), world_size) if not _item_path(folder, i).is_file()]
    loader = DataLoader(torch.utils.data.Subset(dataset, mine), batch_size=batch_size, shuffle=False)
    done = 0
    iterator = loader
    if progress:
        iterator = tqdm(loader, desc="cache", dynamic_ncols=True)
    for batch in iterator:
        with torch.no_grad():
            encoded = {k: v.detach().to("cpu") for k, v in encode(batch).items()}
        for j in range(len(next(iter(encoded.values())))):
            path = _item_path(folder, mine[done + j])
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            save_file({k: v[j].contiguous() for k, v in encoded.items()}, str(tmp))
            os.replace(tmp, path)
        done += len(next(iter(encoded.values())))
    if barrier is not None:
        barrier()
    if rank == 0:
        missing = [i for i in range(len(dataset)) if not _item_path(folder, i).is_file()]
        if missing:
            raise RuntimeError(f"latent cache {folder} lacks items {missing[:5]} after encoding")
        (folder / _DONE).write_text(json.dumps({"items": len(dataset)}) + "\n")
    if barrier is not None:
        barrier()
    return folder


class CachedDataset(Dataset):
    """The items of a :func:`build_cache` folder, plus ``extra(index)``; ``FileNotFoundError`` if incomplete."""

    def __init__(self, folder: str | os.PathLike, extra: Callable[[int], dict] | None = None):
        self.folder = Path(folder)
        if not is_complete(self.folder):
            raise FileNotFoundError(f"{self.folder} holds no complete latent cache (build_cache writes it)")
        self.length = int(json.loads((self.folder / _DONE).read_text())["items"])
        self.extra = extra

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """No-op: cached items are fixed."""

    def __getitem__(self, index: int) -> dict:
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} out of range for a cache of {self.length} items")
        index %= self.length
        item: dict = dict(load_safetensors(_item_path(self.folder, index), "cached training item"))
        if self.extra is not None:
            item.update(self.extra(index))
        return item

