"""How an attention processor learns the token grid ``(T, H, W)`` of the current forward.

No diffusers processor is told the grid, and ``N`` alone never determines it (a 2048 x 512 image
and a 1024 x 1024 one can give the same ``N``). The grid is known exactly where the latent enters
the transformer: the family's patch-embedding submodule (DiT ``pos_embed``) receives the latent
``[B, C, (F,) H, W]`` as its first positional argument. Hooks publish it:

* on the transformer: a forward pre-hook opens a frame, a forward hook (``always_call``) closes it;
* on its patch embedding: a forward pre-hook writes the grid into the open frame.

:func:`install_grid_hooks` puts these on one model (``apply_mhla``, ``set_attn_processor`` and
``materialize_mhla`` do) and marks it (:func:`has_grid_hooks`: the one record of which models are
hooked); :func:`remove_grid_hooks` (``remove_mhla``) takes all of it off again. The first
:class:`~mhla_diffusers.MHLAProcessor` created also registers one process-wide module pre-hook
that hooks a supported transformer the first time it runs with an ``MHLAProcessor`` on one of its
attention layers, so the bare one-liner ``pipe.transformer.set_attn_processor(MHLAProcessor())``
needs no extra code. A model without an ``MHLAProcessor`` is never touched (no hooks, no wrapper):
it runs, and compiles, exactly as stock.
Frames are thread-local and nest, so concurrent or nested models do not see each other's grid.
Every thread starts with an empty frame list (never created on first use: under torch.compile that
would recompile the second call). :func:`token_grid` publishes a grid by hand (for attention
modules called outside a transformer).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
from torch import nn

from mhla_diffusers.models.families import _family_of_type, family_of
from mhla_diffusers.ops.layout import normalize_grid

__all__ = [
    "GridReader",
    "install_grid_hooks",
    "remove_grid_hooks",
    "has_grid_hooks",
    "current_grid",
    "token_grid",
    "ensure_global_hook",
]

_global_handle = None


class GridReader:
    """Base class of the attention processors that read the token grid these hooks publish
    (:class:`~mhla_diffusers.MHLAProcessor`): a model runs MHLA, and gets hooked, when one of its
    attention layers holds one. Defined here so that this module needs no processor class."""


class _Frame:
    __slots__ = ("model", "grid")

    def __init__(self, model: nn.Module | None, grid: tuple[int, int, int] | None = None):
        self.model = model
        self.grid = grid


class _ThreadFrames(threading.local):
    """Per-thread stack of open frames. ``__init__`` runs once in every thread that touches it, so
    ``frames`` always exists: torch.compile guards on the attribute, and one created by the first
    traced call would make the second call recompile."""

    def __init__(self):
        self.frames: list[_Frame] = []


_local = _ThreadFrames()


def _frames() -> list[_Frame]:
    return _local.frames


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
    if not torch.compiler.is_compiling():  # traced, checkpointing needs no replay (see _ReplayGrid)
        _wrap_checkpointing(model)


def _wrap_checkpointing(model: nn.Module) -> None:
    """Wrap the model's ``_gradient_checkpointing_func`` (set by ``enable_gradient_checkpointing``, at
    any time) in :class:`_ReplayGrid`, once; :func:`remove_grid_hooks` unwraps it."""
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
    """Patch-embedding pre-hook (a plain object, so hooked models pickle and deep-copy). It writes the
    grid into the innermost frame when that frame is a transformer's of this family that has no grid
    yet (the first patch embedding its forward runs). No stored model and no identity check: module
    objects that share the hooks (torch.export's non-strict tracing runs the hooks and the forward on
    different clones of the model) publish to the frame of the forward that runs."""

    def __init__(self, family):
        self.family = family

    def __call__(self, module: nn.Module, args) -> None:
        frames = _frames()
        if not frames or not args or not isinstance(args[0], torch.Tensor):
            return
        frame = frames[-1]
        if frame.model is None or frame.grid is not None or _family_name(type(frame.model)) != self.family.name:
            return
        frame.grid = self.family.grid_from_latent(args[0], frame.model.config)


_MARK = "_mhla_grid_hooks"  # in a hooked model's __dict__; deepcopy / pickle copy it along with the hooks


def has_grid_hooks(model: nn.Module) -> bool:
    """Whether ``model`` carries the grid hooks (the one record of it: a mark in the model's
    ``__dict__`` set by :func:`install_grid_hooks` and dropped by :func:`remove_grid_hooks`; copies
    made by ``copy.deepcopy`` / pickling carry mark and hooks together). A plain attribute, so
    torch.compile guards on it cheaply."""
    return bool(getattr(model, _MARK, False))


def install_grid_hooks(model: nn.Module) -> bool:
    """Install the grid hooks on a supported transformer (idempotent). Returns ``True`` if newly installed.

    Raises:
        ValueError: if ``model`` is not a supported transformer.
    """
    family = family_of(model)
    if has_grid_hooks(model):
        return False
    patch = model.get_submodule(family.patch_embed)
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_exit, always_call=True)
    patch.register_forward_pre_hook(_PublishGrid(family))
    _wrap_checkpointing(model)
    model.__dict__[_MARK] = True
    return True


def remove_grid_hooks(model: nn.Module) -> None:
    """Take off everything :func:`install_grid_hooks` and the transformer's pre-hook put on ``model``:
    its two hooks, the patch embedding's hook, the mark, and the wrapper around
    ``_gradient_checkpointing_func`` (the original function object is put back). No-op if none."""
    model.__dict__.pop(_MARK, None)
    for hooks, ours in ((model._forward_pre_hooks, _enter), (model._forward_hooks, _exit)):
        for hook_id in [i for i, hook in hooks.items() if hook is ours]:
            del hooks[hook_id]
            model._forward_hooks_always_called.pop(hook_id, None)
    for module in model.modules():
        for hook_id in [i for i, hook in module._forward_pre_hooks.items() if isinstance(hook, _PublishGrid)]:
            del module._forward_pre_hooks[hook_id]
    func = model.__dict__.get("_gradient_checkpointing_func")
    if isinstance(func, _ReplayGrid):
        model._gradient_checkpointing_func = func.inner


@torch.compiler.assume_constant_result  # traced: a constant. A str, never the Family object: a constant
def _family_name(module_type: type) -> str | None:  # standing for it would break the tracing of its hooks
    """The name of the family whose transformer class ``module_type`` is, or ``None`` (one dict lookup
    after the first call)."""
    family = _family_of_type(module_type)
    return None if family is None else family.name


@torch.compiler.assume_constant_result  # traced: run once at trace time (guard: this model object)
def _runs_mhla(model: nn.Module) -> bool:
    """Whether an attention layer of ``model`` holds an :class:`~mhla_diffusers.MHLAProcessor`.

    Under torch.compile the answer is a constant of the graph: a later processor change is caught by
    the guards of the forward itself, which calls every processor."""
    return any(isinstance(getattr(module, "processor", None), GridReader) for module in model.modules())


# Under torch.compile: one graph break, on the one-liner's first call only; under fullgraph=True an error
# whose reason names the fix.
@torch.compiler.disable(
    reason="the bare one-liner (diffusers' own set_attn_processor(MHLAProcessor())) hooks the model and creates its "
    "MHLA mixing matrices at the first forward, outside the graph: call mhla_diffusers.materialize_mhla(transformer) "
    "after set_attn_processor and before torch.compile(fullgraph=True) or torch.export"
)
def _hook_first_forward(model: nn.Module, args) -> None:
    if install_grid_hooks(model):
        _enter(model, args)  # the model's own pre-hook was registered too late for this call


def _global_pre_hook(module: nn.Module, args) -> None:
    # Runs before every module call in the process, so the common case is one dict lookup: the type
    # check (a name or None, a trace-time constant under torch.compile: other modules stop here), then the
    # model's mark (a plain attribute: a hooked model stops here), then the scan for an MHLAProcessor (a
    # trace-time constant). A model without one is left untouched: a stock model compiles as stock.
    if _family_name(type(module)) is None or has_grid_hooks(module):
        return
    if _runs_mhla(module):
        _hook_first_forward(module, args)


def ensure_global_hook() -> None:
    """Register (once per process) the module pre-hook that hooks supported transformers on first use."""
    global _global_handle
    if _global_handle is None:
        _global_handle = nn.modules.module.register_module_forward_pre_hook(_global_pre_hook)
