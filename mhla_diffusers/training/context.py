"""Context parallelism in the trainer (``parallel.context``): one sample's tokens over the ranks of a context group.

The processes form a two-dimensional layout, ``data x context``: rank ``r`` is data rank ``r // P`` and context
rank ``r % P`` for a context degree ``P`` (``ring_degree x ulysses_degree``). The ``P`` ranks of a context group
load the same samples and draw the same noise, timesteps and condition dropout (the draws are made for the data
ranks only); the transformer runs under diffusers' context parallelism with MHLA's summary exchange
(:func:`mhla_diffusers.enable_context_parallel`), each rank holding ``1 / P`` of the tokens, and its output is
gathered, so every rank of a group computes the group's whole loss.

Gradients: a rank's backward reaches only the paths of its own tokens, so a parameter's gradient in a group is the
SUM of its ranks' gradients. DDP and FSDP2 average over all ``D x P`` processes; the trainer multiplies the loss it
back-propagates by ``P`` (:func:`context_loss_scale`), which turns that average into the mean over data ranks of
the per-group sums: the gradient of one process on the data rank's batch. FSDP2 shards the parameters over all
``D x P`` processes (accelerate's one-dimensional mesh), as sequence-parallel trainers shard over data x context.

Details and measurements: ``docs/training.md`` ("Context parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["CONTEXT_KEYS", "DataLayout", "check_context_section", "data_layout", "context_loss_scale",
           "enable_training_context"]

# the keys of parallel.context: diffusers' ContextParallelConfig arguments a trainer sets
CONTEXT_KEYS = ("ring_degree", "ulysses_degree", "ring_anything", "ulysses_anything")


@dataclass(frozen=True)
class DataLayout:
    """How the ``world`` processes share the work.

    Attributes:
        data_rank, data_world: this process's data-parallel index and the number of data-parallel replicas ``D``
            (what the sampler and the step's random draws split over).
        context_degree: ``P``, the ranks holding one sample's tokens (1: no context parallelism).
        context: the ``parallel.context`` mapping (``None`` without context parallelism).
    """

    data_rank: int
    data_world: int
    context_degree: int = 1
    context: Mapping[str, Any] | None = None


def check_context_section(section: Any) -> None:
    """``ValueError`` unless ``parallel.context`` is null or a mapping of :data:`CONTEXT_KEYS` that diffusers'
    ``ContextParallelConfig`` accepts (a degree above 1, positive integers, the uneven-shard flags as it allows)."""
    if section is None:
        return
    if not isinstance(section, Mapping) or not section or set(section) - set(CONTEXT_KEYS):
        raise ValueError(
            f"parallel.context must be null or a mapping of {list(CONTEXT_KEYS)}, e.g. {{ring_degree: 2}} or "
            f"{{ulysses_degree: 2}}; got {section!r}"
        )
    for key in ("ring_degree", "ulysses_degree"):
        value = section.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.context.{key} must be an integer >= 1; got {value!r}")
    for key in ("ring_anything", "ulysses_anything"):
        if not isinstance(section.get(key, False), bool):
            raise ValueError(f"parallel.context.{key} must be true or false; got {section[key]!r}")
    try:
        _diffusers_config(section)
    except ValueError as e:
        raise ValueError(f"parallel.context {dict(section)}: {e}") from None


def _diffusers_config(section: Mapping[str, Any], mesh=None):
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(**{k: section[k] for k in CONTEXT_KEYS if k in section}, mesh=mesh)


def _degree(section: Mapping[str, Any] | None) -> int:
    return 1 if section is None else int(section.get("ring_degree", 1)) * int(section.get("ulysses_degree", 1))


def data_layout(section: Mapping[str, Any] | None, rank: int, world: int) -> DataLayout:
    """The layout of ``world`` processes for ``parallel.context`` = ``section`` (checked).

    Raises:
        ValueError: a context degree that does not divide the number of processes.
    """
    degree = _degree(section)
    if world % degree:
        raise ValueError(
            f"parallel.context asks for {degree} ranks per sample, which does not divide the {world} launched "
            f"process(es): launch a multiple of {degree} (accelerate launch --num_processes {degree * max(1, world // degree)}) "
            "or change the degree"
        )
    return DataLayout(data_rank=rank // degree, data_world=world // degree, context_degree=degree, context=section)


def context_loss_scale(layout: DataLayout) -> float:
    """The factor on the back-propagated loss that makes the processes' gradient average the one-process gradient
    (``P``: the ranks of a context group hold parts of one sample's gradient, which sum; see the module docstring)."""
    return float(layout.context_degree)


def enable_training_context(model: nn.Module, layout: DataLayout, device: torch.device) -> None:
    """Put the transformer under context parallelism over the ``data x ring x ulysses`` device mesh.

    A no-op without ``parallel.context``. Call it on every process, after MHLA is installed and before
    ``accelerator.prepare``.

    Raises:
        ValueError: a family without a training plan (SANA, SANA-Video); what
            :func:`mhla_diffusers.enable_context_parallel` refuses (LePE, the authors' DiT normaliser, a DiT hybrid,
            a hybrid's softmax layers in ring mode without a log-sum-exp backend), prefixed ``parallel.context:``.
    """
    if layout.context is None:
        return
    from torch.distributed.device_mesh import init_device_mesh

    from mhla_diffusers.families import family_of
    from mhla_diffusers.models.parallel import check_context_parallel, enable_context_parallel

    family = family_of(model)
    if family.context_parallel in (None, "layers"):
        raise ValueError(
            f"parallel.context: {type(model).__name__} has no context-parallel training plan (SANA's and SANA-Video's "
            "shard each MHLA layer alone, for inference: every rank would run the rest of the model on all tokens). "
            "Wan and DiT models train under it; set parallel.context: null"
        )
    try:
        check_context_parallel(model)
    except ValueError as e:
        raise ValueError(f"parallel.context: {e}") from None
    ring, ulysses = int(layout.context.get("ring_degree", 1)), int(layout.context.get("ulysses_degree", 1))
    mesh = init_device_mesh(device.type, (layout.data_world, ring, ulysses), mesh_dim_names=("data", "ring", "ulysses"))
    try:  # diffusers takes the context group from the mesh's ring x ulysses dimensions
        enable_context_parallel(model, _diffusers_config(layout.context, mesh=mesh))
    except ValueError as e:
        hint = (" In the trainer: launch with DIFFUSERS_ATTN_BACKEND=_native_cudnn (or flash) in the environment, or set "
                "parallel.context: {ulysses_degree: P}") if "log-sum-exp" in str(e) else ""
        raise ValueError(f"parallel.context: {e}.{hint}") from None
