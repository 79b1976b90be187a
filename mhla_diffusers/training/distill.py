"""Distillation from the original model: output matching and attention transfer.

The teacher is the original transformer (softmax DiT / Wan, linear-attention SANA) kept frozen in
memory; the student is the same model with MHLA (possibly with LoRA). On the same noisy latent,
timestep and condition:

- output matching: ``MSE(student(x_t), teacher(x_t))`` over every output element;
- attention transfer: forward hooks record the output of each matched self-attention module
  (``to_out`` included, i.e. what the block adds to its residual stream) in both models;
  the loss is the mean over matched layers of ``MSE(student_l, teacher_l)``. Each model runs its
  own forward (the student's layer ``l`` sees the student's hidden states), as in the authors'
  optional Wan loss.

Neither needs captions or labels: the condition can be random class labels (DiT) or the
null label / empty caption (:data:`CONDITIONS`).
"""

from __future__ import annotations

import copy
import os
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.checkpoint.format import load_mhla_transformer
from mhla_diffusers.checkpoint.lora import has_lora, unload_lora_
from mhla_diffusers.families import self_attention_modules
from mhla_diffusers.models.install import is_mhla_model, remove_mhla

__all__ = [
    "CONDITIONS", "TRANSFER_LAYERS", "make_teacher", "load_teacher", "transfer_modules", "AttentionRecorder", "attention_transfer_loss",
    "output_matching_loss",
]

CONDITIONS = ("dataset", "random", "null")
TRANSFER_LAYERS = ("mhla", "all")


def make_teacher(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen copy of ``model`` as the original: MHLA removed (stock processors back), LoRA
    merged away if present, eval mode, ``requires_grad=False``, optionally cast to ``dtype``.

    Call it on the loaded model BEFORE fine-tuning changes its weights: a copy of a converted
    checkpoint is the original model only while its base weights are the original ones.
    """
    teacher = copy.deepcopy(model)
    if has_lora(teacher):
        unload_lora_(teacher)
    if is_mhla_model(teacher):
        remove_mhla(teacher)
    teacher.requires_grad_(False).eval()
    if dtype is not None:
        teacher.to(dtype)
    return teacher


def load_teacher(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformer of a pipeline or transformer folder (plain or converted), frozen, as a teacher.

    Raises:
        FileNotFoundError, MHLACheckpointError: from :func:`mhla_diffusers.load_mhla_transformer`.
    """
    teacher = load_mhla_transformer(path, torch_dtype=torch.float32)
    teacher.requires_grad_(False).eval()
    if dtype is not None:
        teacher.to(dtype)
    return teacher


def transfer_modules(model: nn.Module, which: str = "mhla") -> dict[str, nn.Module]:
    """The self-attention modules attention transfer matches, ``{name: module}`` in layer order:
    ``"mhla"`` those with MHLA installed (all of them if the model has none), ``"all"`` every one.

    Raises:
        ValueError: unknown ``which``.
    """
    if which not in TRANSFER_LAYERS:
        raise ValueError(f"attention-transfer layers must be one of {TRANSFER_LAYERS}; got {which!r}")
    modules = self_attention_modules(model)
    if which == "mhla":
        chosen = [(n, m) for n, m in modules if getattr(m, "mhla_mixing", None) is not None]
        modules = chosen or modules
    return dict(modules)


class AttentionRecorder:
    """Forward hooks keeping the latest output of each named module (with its autograd graph).

    Use as a context manager around one forward; ``outputs[name]`` is the module's last output.
    Calls made during the backward pass (activation-checkpoint recomputation) are ignored, so
    gradient checkpointing does not overwrite what the forward recorded.

    Args:
        modules: ``{name: module}``, e.g. from :func:`transfer_modules`.
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
    """``mean((student - teacher)^2)`` in fp32 (the teacher's output carries no gradient)."""
    return F.mse_loss(student.float(), teacher.detach().float(), reduction="mean")


def attention_transfer_loss(
    student: dict[str, torch.Tensor], teacher: dict[str, torch.Tensor], names: Iterable[str] | None = None
) -> torch.Tensor:
    """Mean over layers of the per-layer MSE between recorded attention outputs (fp32).

    Args:
        student, teacher: ``{layer name: output}`` from two :class:`AttentionRecorder` s.
        names: layers to match (default: the student's).

    Raises:
        KeyError: a layer was not recorded in both models.
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
