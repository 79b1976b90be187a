"""The launch's processes around :func:`~mhla_diffusers.training.train`: its trackers ended, its process group closed.

:func:`~mhla_diffusers.training.train` leaves the process group up, so that one ``accelerate launch`` can train
several times (:func:`~mhla_diffusers.training.retrofit`'s two phases); a script ends with :func:`end_processes`.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.state import PartialState

__all__ = ["end_processes", "end_trackers"]


def end_trackers(accelerator: Accelerator) -> None:
    """``accelerator.end_training()`` less its ``destroy_process_group``: the experiment trackers finished, the
    process group (the launch's) left up for a next :func:`~mhla_diffusers.training.train`."""
    for tracker in accelerator.trackers:
        tracker.finish()


def end_processes() -> None:
    """Close the launch's process group: a barrier, then ``torch.distributed.destroy_process_group``; nothing
    without one. What a training script calls last, on every process, after its last
    :func:`~mhla_diffusers.training.train`.

    The barrier comes first because gloo's worker thread may still be freeing an earlier collective's Python
    tensors, which takes the GIL, while a destroyed group's destructor waits for that thread with the GIL held: a
    deadlock at exit (seen on torch 2.13).
    """
    state = PartialState()
    if state.use_distributed and torch.distributed.is_initialized():
        state.wait_for_everyone()
        state.destroy_process_group()
