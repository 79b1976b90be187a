"""The teacher store: a folder of safetensors shards of a teacher's own samples (``data.kind: teacher``).

Layout (``docs/training.md``, "Data-free retrofit")::

    <store>/store.json               format, key, the settings the key is made of, shard_size
    <store>/shards/00000.safetensors trajectories 0 .. shard_size - 1, always a whole shard
    <store>/shards/00001.safetensors ...

Shard ``j`` holds trajectories ``[j S, (j + 1) S)`` (``S`` = ``shard_size``), each tensor stacked over
them: ``latents`` ``[S, C, ...]`` (the clean latent the teacher generated), the condition
(``class_labels`` ``[S]`` or ``prompt_embeds`` ``[S, L, D]`` and its mask), and the trajectory:
``noisy`` ``[S, K, C, ...]`` (the latent the teacher saw at each of its ``K`` steps), ``timesteps``
``[S, K]`` (as the transformer took them), ``teacher_pred`` ``[S, K, C, ...]`` (its conditional
prediction) and, with classifier-free guidance, ``teacher_null_pred`` (its null-condition one).
A shard is written to a temporary name and renamed (a kill leaves no partial shard); its content is a
function of the key and ``j`` alone, so a resumed or multi-process build writes the same shards.

Nothing here knows diffusers: :mod:`mhla_diffusers.training.teacher` generates the shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from mhla_diffusers.checkpoint.io import atomic_write_json

__all__ = [
    "STORE_FORMAT", "TRAJECTORY_KEYS", "COST_DIR", "open_store", "shard_path", "missing_shards", "write_shard", "num_shards",
    "store_cost", "TeacherSamples", "TeacherPairs",
]

STORE_FORMAT = 1
_RECORD = "store.json"
#: per shard, what sampling it cost (``<store>/cost/NNNNN.json``: calls, wall and CPU seconds), apart from the shards
#: so that their bytes stay a function of the key
COST_DIR = "cost"
# per-step tensors of a trajectory: [S, K, ...] in a shard, [...] in a pair item
TRAJECTORY_KEYS = ("noisy", "timesteps", "teacher_pred", "teacher_null_pred")


def num_shards(trajectories: int, shard_size: int) -> int:
    """Shards holding the first ``trajectories`` (whole shards: ``ceil(trajectories / shard_size)``)."""
    return -(-int(trajectories) // int(shard_size))


def shard_path(folder: str | os.PathLike, index: int) -> Path:
    """The file of shard ``index``."""
    return Path(folder) / "shards" / f"{index:05d}.safetensors"


def _differences(stored: Mapping, wanted: Mapping, prefix: str = "") -> list[str]:
    """``"name: stored -> wanted"`` for every setting that differs (nested mappings by dotted name)."""
    out = []
    for name in sorted(set(stored) | set(wanted)):
        a, b = stored.get(name), wanted.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _differences(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"{prefix}{name}: {_short(a)} (store) vs {_short(b)} (this run)")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def open_store(folder: str | os.PathLike, key: str, settings: Mapping, shard_size: int, *, create: bool = True) -> Path:
    """The store at ``folder`` for ``key`` (made of ``settings``): checked if it exists, else started (``create``).

    Args:
        folder: the store folder. key: a digest of ``settings`` (the teacher's weights, scheduler, guidance,
            sampling settings). settings: a JSON-able mapping, recorded so that a refusal can name what changed.
        shard_size: trajectories per shard (part of the layout: recorded and checked like the key).

    The process that creates (``create``) also removes what a killed writer left: temporary shard files whose
    writing process is no longer running on this machine.

    Raises:
        ValueError: ``folder`` holds a store of another key or shard size (naming the settings that differ),
            or a ``store.json`` that is not a teacher store's.
        FileNotFoundError: no store at ``folder`` and ``create`` is false.
    """
    folder = Path(folder)
    record_path = folder / _RECORD
    wanted = {"format": STORE_FORMAT, "key": key, "shard_size": int(shard_size), "settings": json.loads(json.dumps(settings, default=str))}
    if not record_path.is_file():
        if not create:
            raise FileNotFoundError(f"{folder} holds no teacher store ({_RECORD} missing)")
        if folder.is_dir() and any(p for p in folder.iterdir() if p.name != "shards"):
            raise ValueError(f"{folder} is not empty and holds no teacher store: give data.teacher.store_dir an empty or new folder")
        (folder / "shards").mkdir(parents=True, exist_ok=True)
        atomic_write_json(record_path, wanted, sort_keys=True)
        return folder
    try:
        stored = json.loads(record_path.read_text())
        stored_format, stored_key = stored["format"], stored["key"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{record_path} is not a teacher store's record ({type(err).__name__}); use another data.teacher.store_dir"
        ) from None
    if stored_format != STORE_FORMAT:
        raise ValueError(f"{folder} holds a teacher store of format {stored_format}; this version reads {STORE_FORMAT}: "
                         "use a new store_dir")
    if create:  # the one process that opens first: what a killed writer left (a temporary shard) goes
        for stale in (folder / "shards").glob(".*.tmp-*"):
            if not _running(stale.name.rsplit("-", 1)[-1]):  # another run writing into the store keeps its file
                stale.unlink(missing_ok=True)
    if stored_key != key or int(stored.get("shard_size", -1)) != int(shard_size):
        changed = _differences({**stored.get("settings", {}), "shard_size": stored.get("shard_size")},
                               {**wanted["settings"], "shard_size": int(shard_size)})
        raise ValueError(
            f"{folder} holds the samples of another teacher or setting: " + ("; ".join(changed) or "the key differs")
            + ". Its shards cannot train this run: give data.teacher.store_dir a new folder (or set the settings back)"
        )
    return folder


def _running(pid: str) -> bool:
    """Whether ``pid`` is a live process of this machine (the writer of a temporary shard)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def missing_shards(folder: str | os.PathLike, count: int) -> list[int]:
    """The shards among the first ``count`` not yet written."""
    return [j for j in range(int(count)) if not shard_path(folder, j).is_file()]


def write_shard(folder: str | os.PathLike, index: int, tensors: Mapping[str, torch.Tensor], key: str) -> Path:
    """Write shard ``index`` atomically (a temporary file renamed into place); tensors are stored contiguous on the CPU."""
    path = shard_path(folder, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
              # one metadata entry: safetensors writes several in no fixed order, and a shard's bytes must be reproducible
              metadata={"teacher_store": json.dumps({"format": STORE_FORMAT, "key": key, "shard": int(index)}, sort_keys=True)})
    os.replace(tmp, path)
    return path


def store_cost(folder: str | os.PathLike, trajectories: int) -> dict[str, Any]:
    """What the shards holding the first ``trajectories`` cost the teacher: shards, trajectories, steps, guidance,
    transformer calls, wall and CPU seconds (summed over the processes that generated them)."""
    record = json.loads((Path(folder) / _RECORD).read_text())
    count = num_shards(trajectories, int(record["shard_size"]))
    paths = [Path(folder) / COST_DIR / f"{j:05d}.json" for j in range(count)]
    costs = [json.loads(p.read_text()) for p in paths if p.is_file()]
    settings = record["settings"]
    return {"folder": str(folder), "shards": count, "trajectories": count * int(record["shard_size"]), "steps": settings.get("steps"),
            "guidance_scale": settings.get("guidance_scale"), "transformer_calls": sum(c["calls"] for c in costs),
            "wall_s": round(sum(c["wall_s"] for c in costs), 2), "cpu_s": round(sum(c["cpu_s"] for c in costs), 2)}


class _StoreView(Dataset):
    """Items of the first ``trajectories`` of a complete store, read one row at a time (memory bounded)."""

    def __init__(self, folder: str | os.PathLike, trajectories: int):
        self.folder = Path(folder)
        record = json.loads((self.folder / _RECORD).read_text())
        self.key, self.shard_size, self.trajectories = record["key"], int(record["shard_size"]), int(trajectories)
        missing = missing_shards(self.folder, num_shards(self.trajectories, self.shard_size))
        if missing:
            raise FileNotFoundError(f"teacher store {self.folder} lacks shards {missing[:5]}: build it first (train() does)")
        with safe_open(str(shard_path(self.folder, 0)), framework="pt") as f:
            self.names = list(f.keys())
            self.steps = int(f.get_slice("noisy").get_shape()[1]) if "noisy" in self.names else 0

    @property
    def cost(self) -> dict[str, Any]:
        """What sampling these trajectories cost the teacher (:func:`store_cost`)."""
        return store_cost(self.folder, self.trajectories)

    def set_epoch(self, epoch: int) -> None:
        """No-op: stored items are fixed."""

    def _read(self, trajectory: int, names, step: int | None = None) -> dict[str, torch.Tensor]:
        shard, row = divmod(int(trajectory), self.shard_size)
        with safe_open(str(shard_path(self.folder, shard)), framework="pt") as f:
            out = {}
            for name in names:
                part = f.get_slice(name)
                out[name] = part[row:row + 1][0] if step is None or name not in TRAJECTORY_KEYS else part[row:row + 1, step:step + 1][0, 0]
            return out

    def _index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} items of teacher store {self.folder}")
        return index % n


class TeacherSamples(_StoreView):
    """One item per trajectory: its clean ``latents`` and condition (trained with fresh noise, as a dataset's latents)."""

    def __len__(self) -> int:
        return self.trajectories

    def __getitem__(self, index: int) -> dict:
        names = [n for n in self.names if n not in TRAJECTORY_KEYS]
        return self._read(self._index(index), names)


class TeacherPairs(_StoreView):
    """One item per (trajectory, step): the step's ``noisy`` latent, ``timesteps``, the teacher's predictions, the
    trajectory's ``latents`` and condition; ``trajectories x K`` items (``K`` the teacher's steps)."""

    def __len__(self) -> int:
        return self.trajectories * self.steps

    def __getitem__(self, index: int) -> dict:
        trajectory, step = divmod(self._index(index), self.steps)
        return self._read(trajectory, self.names, step)
