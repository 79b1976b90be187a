"""Distillation from the original model: output matching and attention transfer.

The teacher is the original transformer, frozen; the student the same model with MHLA. Both see
the same noisy latent, timestep and condition. See ``docs/training.md``, "The loss".
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.checkpoint.format import load_mhla_transformer
from mhla_diffusers.checkpoint.lora import has_lora, unload_lora_
from mhla_diffusers.families import self_attention_modules
from mhla_diffusers.models.installer import is_mhla_model, remove_mhla
from mhla_diffusers.models.provenance import is_hub_id

__all__ = [
    "CONDITIONS", "TRANSFER_LAYERS", "make_teacher", "load_teacher", "transfer_modules", "AttentionRecorder", "attention_transfer_loss",
    "output_matching_loss",
]

CONDITIONS = ("dataset", "random", "null")
TRANSFER_LAYERS = ("mhla", "all")


def make_teacher(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen copy of ``model`` without MHLA and LoRA; call it before fine-tuning changes the weights."""
    teacher = copy.deepcopy(model)
    if has_lora(teacher):
        unload_lora_(teacher)
    if is_mhla_model(teacher):
        remove_mhla(teacher)
    teacher.requires_grad_(False).eval()
    if dtype is not None:
        teacher.to(dtype)
    return teacher


def load_teacher(path: str | os.PathLike, dtype: torch.dtype | None = None, component: str = "transformer") -> nn.Module:
    """The frozen transformer of a pipeline or transformer folder, or of a Hub pipeline ``owner/name`` (its
    ``component`` fetched, or read from the local cache offline), as a teacher.

    Raises:
        FileNotFoundError: a Hub id neither reachable nor cached; ``load_mhla_transformer``'s errors.
    """
    if not Path(path).exists() and is_hub_id(str(path)):
        path = _hub_component(str(path), component)
    elif component != "transformer" and (Path(path) / "model_index.json").is_file():
        path = Path(path) / component
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"distill.teacher {path.parent} has no {component} (model.expert): give a pipeline with both experts")
    teacher = load_mhla_transformer(path, torch_dtype=torch.float32)
    teacher.requires_grad_(False).eval()
    if dtype is not None:
        teacher.to(dtype)
    return teacher


def _hub_component(repo: str, component: str) -> Path:
    """The local folder of ``component`` of the Hub pipeline ``repo`` (downloaded, or the cached copy offline)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, allow_patterns=["model_index.json", f"{component}/*"]))
    except Exception as err:  # offline without a cached copy, no such repository, no network
        raise FileNotFoundError(
            f"distill.teacher {repo!r}: not a local folder, and the Hub pipeline could not be fetched or found in the "
            f"local cache ({type(err).__name__}: {' '.join(str(err).split())[:200]}); pass the original's folder"
        ) from err
    if not (folder / component / "config.json").is_file():
        raise FileNotFoundError(f"distill.teacher {repo!r} has no {component} (model.expert)")
    return folder / component


def transfer_modules(model: nn.Module, which: str = "mhla") -> dict[str, nn.Module]:
    """``{name: module}`` for attention transfer: ``"mhla"`` (MHLA layers, or all) or ``"all"``; else ``ValueError``."""
    if which not in TRANSFER_LAYERS:
        raise ValueError(f"attention-transfer layers must be one of {TRANSFER_LAYERS}; got {which!r}")
    modules = self_attention_modules(model)
    if which == "mhla":
        chosen = [(n, m) for n, m in modules if getattr(m, "mhla", None) is not None]
        modules = chosen or modules
    return dict(modules)


class AttentionRecorder:
    """Forward hooks keeping the latest output of each named module (with its graph); a context manager.

    Calls during the backward pass (checkpoint recomputation) are ignored.
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = dict(modules)
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:  # recomputation inside backward
                return
            self.outputs[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def __enter__(self) -> "AttentionRecorder":
        self.outputs = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        return False


def output_matching_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``mean((student - teacher)^2)`` in fp32; the teacher carries no gradient."""
    return F.mse_loss(student.float(), teacher.detach().float(), reduction="mean")


def attention_transfer_loss(
    student: dict[str, torch.Tensor], teacher: dict[str, torch.Tensor], names: Iterable[str] | None = None
) -> torch.Tensor:
    """Mean over layers of the per-layer MSE between recorded attention outputs (fp32).

    Raises:
        KeyError: a layer not recorded in both models.
        ValueError: no layers.
    """
    names = list(student if names is None else names)
    if not names:
        raise ValueError("attention transfer needs at least one recorded layer")
    missing = [n for n in names if n not in student or n not in teacher]
    if missing:
        raise KeyError(f"attention outputs not recorded for {missing[:3]} (did the forward run inside the recorders?)")
    terms = [F.mse_loss(student[n].float(), teacher[n].detach().float(), reduction="mean") for n in names]
    return torch.stack(terms).mean()
