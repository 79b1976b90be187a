"""The token grid ``(T, H, W)`` of the running forward, published by hooks that belong to the model.

The grid comes from the latent entering the family's patch embedding, never from ``N``.
:func:`install_grid_hooks` / :func:`remove_grid_hooks` put on and take off one model's hooks;
:func:`await_model` serves the bare one-liner; :func:`token_grid` publishes a grid by hand.
See ``docs/processor.md`` (Hooks).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn

from mhla_diffusers.families import family_name_of_type, family_of, supported_model_classes
from mhla_diffusers.ops.layout import normalize_grid

__all__ = [
    "GridReader",
    "install_grid_hooks",
    "remove_grid_hooks",
    "has_grid_hooks",
    "current_grid",
    "token_grid",
    "await_model",
    "grid_of_call",
    "close_frame",
    "waiting_layers",
]


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
    """Per-thread stack of open frames (``frames`` exists in every thread: torch.compile guards on it)."""

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


def grid_of_call(layer, num_tokens: int) -> tuple[int, int, int]:
    """The token grid of this self-attention call: the one published for the running forward, else (a
    layer recomputed in the backward pass outside diffusers' checkpointing) the one grid ``layer`` (the
    layer's MHLA) ran on with ``num_tokens`` tokens, if it saw only one. Records it in ``layer.seen_grids``.

    Raises:
        RuntimeError: no grid published, and none (or several) recorded for ``num_tokens``; never a guess.
    """
    grid = current_grid()
    if grid is None:
        in_backward = torch._C._current_graph_task_id() != -1
        grids = layer.seen_grids.get(num_tokens, ()) if in_backward else ()
        if len(grids) == 1:
            return next(iter(grids))
        if len(grids) > 1:
            raise RuntimeError(
                f"MHLA is recomputed in the backward pass without a token grid, and this layer has seen "
                f"{len(grids)} grids with {num_tokens} tokens ({sorted(grids)}): it does not guess which. Use "
                "diffusers' enable_gradient_checkpointing() (MHLA replays the grid there), or checkpoint the "
                "whole transformer forward."
            )
        raise RuntimeError(
            f"MHLA does not know the token grid of this call ({num_tokens} tokens) and never guesses it. "
            f"Run the layer inside the forward of a supported transformer ({supported_model_classes()}; "
            "apply_mhla / set_attn_processor install the hooks; another class is refused), or wrap the call in "
            "`with mhla_diffusers.token_grid((T, H, W)):`."
        )
    # Not while torch.compile traces: a traced dict update would make every call re-check it, and
    # there the grid is a constant of the graph.
    if not torch.compiler.is_compiling():
        layer.seen_grids.setdefault(num_tokens, set()).add(grid)
    return grid


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
    """Wraps ``_gradient_checkpointing_func`` so a recomputed block sees the grid of the forward that ran it."""

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
    close_frame(model)


def close_frame(model: nn.Module) -> None:
    """Close ``model``'s innermost open frame (what its always-called forward hook does; no-op without one)."""
    frames = _frames()
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].model is model:
            del frames[i]
            break


class _PublishGrid:
    """Patch-embedding pre-hook: writes the grid into the innermost open frame of this family that has none yet."""

    def __init__(self, family):
        self.family = family

    def __call__(self, module: nn.Module, args) -> None:
        frames = _frames()
        if not frames or not args or not isinstance(args[0], torch.Tensor):
            return
        frame = frames[-1]
        if frame.model is None or frame.grid is not None or family_name_of_type(type(frame.model)) != self.family.name:
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
        _model_found(model)
        return False
    patch = model.get_submodule(family.patch_embed)
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_exit, always_call=True)
    patch.register_forward_pre_hook(_PublishGrid(family))
    _wrap_checkpointing(model)
    model.__dict__[_MARK] = True
    _model_found(model)
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
    _model_found(model)


@torch.compiler.assume_constant_result  # traced: run once at trace time (guard: this model object)
def _runs_mhla(model: nn.Module) -> bool:
    """Whether an attention layer of ``model`` holds an :class:`~mhla_diffusers.MHLAProcessor` (under
    torch.compile a constant of the graph: a later processor change is caught by the forward's own guards)."""
    return any(isinstance(getattr(module, "processor", None), GridReader) for module in model.modules())


# -- the bare one-liner: layers waiting for their transformer ---------------------------------------
_waiting: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # layers given an MHLAProcessor, model not hooked yet
_finder = None  # the handle of the process-wide module pre-hook, registered only while a layer waits


def await_model(attn: nn.Module) -> None:
    """``attn`` was given an :class:`~mhla_diffusers.MHLAProcessor` (diffusers' ``set_processor``), or is a
    processor copied or unpickled with its model: until that model is found (its first forward hooks it),
    one process-wide module pre-hook looks for it."""
    global _finder
    _waiting.add(attn)
    if _finder is None:
        _finder = nn.modules.module.register_module_forward_pre_hook(_find_model)


def waiting_layers() -> int:
    """How many attention layers wait for their transformer to be found (the finder hook exists iff > 0)."""
    return len(_waiting)


def _model_found(model: nn.Module) -> None:
    """``model`` is hooked (or had MHLA removed): its layers wait no more, nor do layers that no longer
    hold an MHLAProcessor; the finder hook goes when none waits."""
    global _finder
    if not _waiting:
        return
    _waiting.difference_update(list(model.modules()))
    # a layer whose processor is no longer MHLA waits no more; a copied processor waits for its model
    for attn in [a for a in _waiting if not isinstance(a, GridReader) and not isinstance(getattr(a, "processor", None), GridReader)]:
        _waiting.discard(attn)
    if not _waiting and _finder is not None:
        _finder.remove()
        _finder = None


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


def _find_model(module: nn.Module, args) -> None:
    # Runs before every module call while a layer waits: the type check (a trace-time constant under
    # torch.compile: other modules stop here), then the model's mark, then the scan for an MHLAProcessor.
    if family_name_of_type(type(module)) is None:
        return
    if not has_grid_hooks(module) and _runs_mhla(module):
        _hook_first_forward(module, args)
    elif not torch.compiler.is_compiling():  # hooked already, or stock: its layers wait no more (eagerly:
        _model_found(module)  # a traced forward must not break its graph for this bookkeeping)
