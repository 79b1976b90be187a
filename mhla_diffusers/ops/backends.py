"""The backends of :func:`~mhla_diffusers.ops.mhla_attention`, by name: the registry that the eager
dispatch (``ops/__init__.py``) and the ``torch.compile`` operator (``ops/compiled.py``) both read.

Each backend takes ``(q, k, v, mixing, layout, *, normalize, eps, feature_map[, rotary])`` with
inputs already validated by ``mhla_attention`` and returns ``[B, heads, N, dv]`` in ``q``'s dtype.
"""

from __future__ import annotations

from mhla_diffusers.ops.torch_ops import mhla_attention_torch

__all__ = ["BACKENDS"]


def _triton_backend(q, k, v, mixing, layout, **kwargs):
    """The Triton kernels, imported on first use (importing mhla_diffusers never imports them; diffusers may import triton itself)."""
    # function-level import: triton is an optional dependency, and importing it costs seconds
    from mhla_diffusers.ops.triton_ops import mhla_attention_triton

    return mhla_attention_triton(q, k, v, mixing, layout, **kwargs)


# One dict, shared by reference (tests/ops/triton_interpret_check.py wraps an entry to count launches).
BACKENDS = {"torch": mhla_attention_torch, "triton": _triton_backend}
