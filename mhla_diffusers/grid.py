"""How an attention processor learns the token grid ``(T, H, W)`` of the current forward.

No diffusers processor is told the grid, and ``N`` alone never determines it (a 2048 x 512 image
and a 1024 x 1024 one can give the same ``N``). The grid is known exactly where the latent enters
the transformer: the family's patch-embedding submodule (DiT ``pos_embed``) receives the latent
``[B, C, (F,) H, W]`` as its first positional argument. Hooks publish it:

* on the transformer: a forward pre-hook opens a frame, a forward hook (``always_call``) closes it;
* on its patch embedding: a forward pre-hook writes the grid into the open frame.

:func:`install_grid_hooks` puts these on one model (``apply_mhla`` and ``set_attn_processor`` do);
the first :class:`~mhla_diffusers.MHLAProcessor` created also registers one process-wide
module pre-hook that installs them on any supported transformer the first time it runs, so the
bare one-liner ``pipe.transformer.set_attn_processor(MHLAProcessor())`` needs no extra code.
Frames are thread-local and nest, so concurrent or nested models do not see each other's grid.
:func:`token_grid` publishes a grid by hand (for attention modules called outside a transformer).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn

from .families import find_family
from .layout import normalize_grid

__all__ = ["install_grid_hooks", "remove_grid_hooks", "current_grid", "token_grid", "ensure_global_hook"]

_local = threading.local()
_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_global_handle = None


class _Frame:
    __slots__ = ("model", "grid")

    def __init__(self, model: nn.Module | None, grid: tuple[int, int, int] | None = None):
        self.model = model
        self.grid = grid


def _frames() -> list[_Frame]:
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def current_grid() -> tuple[int, int, int] | None:
    """The token grid published for the innermost running forward of this thread, or ``None``."""
    frames = _frames()
    return frames[-1].grid if frames else None


def current_model() -> nn.Module | None:
    """The innermost supported transformer running in this thread, or ``None``."""
    frames = _frames()
    return frames[-1].model if frames else None


@contextlib.contextmanager
def token_grid(grid: int | Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Publish ``grid`` (``(T, H, W)``, ``(H, W)`` or ``(N,)``) to MHLA processors run inside the block.

    For attention modules called directly, outside a supported transformer's forward.
    """
    frame = _Frame(None, normalize_grid(grid))
    _frames().append(frame)
    try:
        yield frame.grid
    finally:
        _frames().remove(frame)


def _enter(model: nn.Module, args) -> None:
    _frames().append(_Frame(model))
    func = getattr(model, "_gradient_checkpointing_func", None)
    if func is not None and not isinstance(func, _ReplayGrid):
        model._gradient_checkpointing_func = _ReplayGrid(func)


class _ReplayGrid:
    """Wraps a diffusers model's ``_gradient_checkpointing_func`` so a checkpointed block sees the
    grid of the forward that ran it, also when it is recomputed inside the backward pass (after the
    transformer's forward returned; several forwards of one N but different grids, e.g. aspect-ratio
    buckets, may be pending). Installed by the transformer's pre-hook; a plain object (pickles)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, module, *args, **kwargs):
        if torch.compiler.is_compiling():
            # traced: the checkpoint becomes part of the graph, its recomputation too, with this
            # forward's grid already in it (and state changes inside it would break the graph)
            return self.inner(module, *args, **kwargs)
        frames = _frames()
        frame = _Frame(frames[-1].model, frames[-1].grid) if frames else None
        return self.inner(_InFrame(module, frame), *args, **kwargs)


class _InFrame:
    """``module`` called inside ``frame`` (pushed for the call, popped after): what the checkpoint replays."""

    def __init__(self, module, frame):
        self.module, self.frame = module, frame

    def __call__(self, *args, **kwargs):
        if self.frame is None:
            return self.module(*args, **kwargs)
        frames = _frames()
        frames.append(self.frame)
        try:
            return self.module(*args, **kwargs)
        finally:
            for i in range(len(frames) - 1, -1, -1):
                if frames[i] is self.frame:
                    del frames[i]
                    break

    def __getattr__(self, name):  # a custom checkpointing function may look at the module
        return getattr(self.module, name)


def _exit(model: nn.Module, args, output) -> None:
    frames = _frames()
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].model is model:
            del frames[i]
            break


class _PublishGrid:
    """Patch-embedding pre-hook of one model (a plain object, so hooked models pickle and deep-copy)."""

    def __init__(self, model: nn.Module, family):
        self.model, self.family = model, family

    def __call__(self, module: nn.Module, args) -> None:
        frames = _frames()
        if not frames or frames[-1].model is not self.model or not args or not isinstance(args[0], torch.Tensor):
            return
        frames[-1].grid = self.family.grid_from_latent(args[0], self.model.config)


def install_grid_hooks(model: nn.Module) -> bool:
    """Install the grid hooks on a supported transformer (idempotent). Returns ``True`` if newly installed.

    Raises:
        ValueError: if ``model`` is not a supported transformer.
    """
    from .families import family_of

    if model in _HOOKED:
        return False
    family = family_of(model)
    _HOOKED.add(model)
    if _hooks_present(model) or any(hook is _enter for hook in model._forward_pre_hooks.values()):
        model.__dict__[_MARK] = True
        return False  # a copy (deepcopy / unpickling) of a hooked model carries its hooks along
    patch = model.get_submodule(family.patch_embed)
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_exit, always_call=True)
    patch.register_forward_pre_hook(_PublishGrid(model, family))
    model.__dict__[_MARK] = True
    return True


_MARK = "_mhla_grid_hooks"  # set in a hooked model's __dict__ (copies made by deepcopy / pickle carry it with the hooks)


def _hooks_present(model: nn.Module) -> bool:
    """Whether ``model`` carries the grid hooks: a plain attribute, cheap to guard under torch.compile
    (not the process-wide set, not its hook dict)."""
    return getattr(model, _MARK, False)


def remove_grid_hooks(model: nn.Module) -> None:
    """Remove the hooks installed by :func:`install_grid_hooks` (no-op if none)."""
    _HOOKED.discard(model)
    model.__dict__.pop(_MARK, None)
    for hooks, ours in ((model._forward_pre_hooks, _enter), (model._forward_hooks, _exit)):
        for hook_id in [i for i, hook in hooks.items() if hook is ours]:
            del hooks[hook_id]
            model._forward_hooks_always_called.pop(hook_id, None)
    for module in model.modules():
        for hook_id in [i for i, hook in module._forward_pre_hooks.items() if isinstance(hook, _PublishGrid)]:
            del module._forward_pre_hooks[hook_id]


def _global_pre_hook(module: nn.Module, args) -> None:
    # torch.compile traces this hook for every module: a plain attribute first (a hooked model stops
    # here), then find_family (a trace-time constant per type); never `module in _HOOKED`: a guard on
    # the WeakSet's size would recompile (or abort a trace) whenever another MHLA model comes or goes.
    if _hooks_present(module) or find_family(module) is None:
        return
    if install_grid_hooks(module):
        _enter(module, args)  # the model's own pre-hook was registered too late for this call


def ensure_global_hook() -> None:
    """Register (once per process) the module pre-hook that hooks supported transformers on first use."""
    global _global_handle
    if _global_handle is None:
        _global_handle = nn.modules.module.register_module_forward_pre_hook(_global_pre_hook)
