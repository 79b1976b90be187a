"""MHLA as ``torch.library`` custom operators, for code traced by ``torch.compile``.

In eager mode :func:`~mhla_diffusers.ops.mhla_attention` calls a backend directly (each backend is
a ``torch.autograd.Function``, hidden from the compiler by ``torch.compiler.disable``: inside a
compiled region that would split the graph at every MHLA layer). While ``torch.compile`` traces
(``torch.compiler.is_compiling()``), it calls :func:`attention` instead: one opaque node
``mhla_diffusers::attention`` in the graph, whose fake (meta) implementation gives the output's
shape, dtype and strides, so the rest of the model compiles around it in one graph.

Gradients under ``torch.compile``: the node's backward is a second operator,
``mhla_diffusers::attention_backward``, which re-runs the backend's forward on the saved inputs
and takes its gradients (activation-checkpointing style: one extra MHLA forward per backward, no
intermediate state kept between the compiled forward and backward). Eager training does not pay
this: it never goes through these operators.

The layout travels as its ``grid`` and ``block_grid`` (every :class:`BlockLayout` is determined by
them); a fused rotation (:class:`InterleavedRotary`, backends with ``fuses_rotary_tables``) as its
``cos`` / ``sin`` tables. A composed rotation stays outside the operator, in the traced code,
around plain calls. Outputs and gradients are returned in the memory layout the fake implementations promise (the
backends' own rule, ``torch_ops.empty_like_layout``), so compiled code can rely on the strides.
"""

from __future__ import annotations

import torch

from mhla_diffusers.ops.backends import get_backend, registered_backends
from mhla_diffusers.ops.layout import BlockLayout, get_layout
from mhla_diffusers.ops.rotary import InterleavedRotary
from mhla_diffusers.ops.torch_ops import empty_like_layout

__all__ = ["attention"]


def _call_backend(q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend, cos, sin):
    impl, layout = get_backend(backend), get_layout(tuple(grid), tuple(block_grid))
    if cos is None:
        return impl.forward(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map)
    if not impl.fuses_rotary_tables:
        # Only some backends fuse a rotation; mhla_attention composes it around the operator otherwise
        # (inside this operator's impl autograd would not record a composition: it runs below autograd).
        fusing = " or ".join(repr(name) for name in registered_backends() if get_backend(name).fuses_rotary_tables)
        raise ValueError(f"rotary tables are fused by the {fusing or 'no'} backend only; got backend {backend!r}")
    return impl.forward(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map,
                        rotary=InterleavedRotary(cos, sin))


def _in_layout(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``result`` in the strides of ``like`` (a copy only when they differ)."""
    if result.stride() == like.stride():
        return result
    return like.copy_(result)


@torch.library.custom_op("mhla_diffusers::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor,
    grid: list[int], block_grid: list[int], normalize: bool, eps: float, feature_map: bool, backend: str,
    cos: torch.Tensor | None, sin: torch.Tensor | None,
) -> torch.Tensor:
    with torch.no_grad():
        out = _call_backend(q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend, cos, sin)
    return _in_layout(out, empty_like_layout(q, v.shape[-1], q.dtype))


@_attention_op.register_fake
def _(q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend, cos, sin):
    return empty_like_layout(q, v.shape[-1], q.dtype)


@torch.library.custom_op("mhla_diffusers::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor,
    grid: list[int], block_grid: list[int], normalize: bool, eps: float, feature_map: bool, backend: str,
    cos: torch.Tensor | None, sin: torch.Tensor | None, needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v, mixing), needs)]
    with torch.enable_grad():
        out = _call_backend(*leaves, grid, block_grid, normalize, eps, feature_map, backend, cos, sin)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True)) if wanted else iter(())
    grads = []
    for need, like in zip(needs, _grad_likes(q, k, v, mixing, needs)):
        g = next(got) if need else None
        if g is None:
            grads.append(like.zero_() if need else like)
        else:
            grads.append(_in_layout(g, like))
    return tuple(grads)


def _grad_likes(q, k, v, mixing, needs):
    """Empty tensors in the layouts of dq, dk, dv, dmixing (size 0 where no gradient is needed)."""
    likes = (
        empty_like_layout(q, q.shape[-1], q.dtype),
        empty_like_layout(k, k.shape[-1], k.dtype),
        empty_like_layout(v, v.shape[-1], v.dtype),
        mixing.new_empty(mixing.shape),
    )
    return [like if need else like.new_empty(0) for like, need in zip(likes, needs)]


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend, cos, sin, needs):
    return tuple(_grad_likes(q, k, v, mixing, needs))


def _setup_context(ctx, inputs, output):
    q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend, cos, sin = inputs
    ctx.save_for_backward(q, k, v, mixing, cos, sin)
    ctx.args = (grid, block_grid, normalize, eps, feature_map, backend)


def _backward(ctx, grad_out):
    q, k, v, mixing, cos, sin = ctx.saved_tensors
    grid, block_grid, normalize, eps, feature_map, backend = ctx.args
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    grads = _attention_backward_op(grad_out, q, k, v, mixing, grid, block_grid, normalize, eps, feature_map, backend,
                                   cos, sin, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, mixing, layout: BlockLayout, *, normalize: bool, eps: float, feature_map: bool, backend: str,
              rotary: InterleavedRotary | None = None) -> torch.Tensor:
    """One backend call as the ``mhla_diffusers::attention`` operator (module docstring); arguments as the
    backends take them (already validated by :func:`~mhla_diffusers.ops.mhla_attention`); ``rotary`` only
    for a fused rotation (its tables in the accumulation dtype are passed, and get no gradient)."""
    cos = sin = None
    if rotary is not None:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = (t.detach().to(device=q.device, dtype=acc) for t in (rotary.cos, rotary.sin))
    return _attention_op(q, k, v, mixing, list(layout.grid), list(layout.block_grid), bool(normalize), float(eps),
                         bool(feature_map), backend, cos, sin)
