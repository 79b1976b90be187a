"""The Triton kernels (``ops/triton_ops.py``) as the ``"triton"`` backend; registered on import.

Imports triton only at the first call. Runs on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``
(tests). ``"auto"`` picks it only with ``MHLA_AUTO_TRITON=1`` and a working driver: the kernels
have not yet run on a GPU here (``docs/triton.md``). See ``docs/operator.md``, "The Triton backend".
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from mhla_diffusers import env
from mhla_diffusers.ops.backends import Backend, register_backend
from mhla_diffusers.ops.rotary import InterleavedRotary

__all__ = ["TritonBackend", "INTERPRET_VARIABLE", "AUTO_VARIABLE"]

INTERPRET_VARIABLE = "TRITON_INTERPRET"  # Triton's own switch (also read by triton_ops, which defines the kernels)
AUTO_VARIABLE = "MHLA_AUTO_TRITON"  # lets "auto" pick the kernels for CUDA tensors
_NOT_INSTALLED = "triton is not installed (pip install 'mhla_diffusers[triton]')"


@torch.compiler.assume_constant_result
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # under torch.compile: called while tracing, never traced
def _gpu_problem() -> str | None:
    """Why Triton cannot launch GPU kernels here, or ``None``; checked once per process."""
    if not _installed():
        return _NOT_INSTALLED
    try:
        import triton  # function-level import: triton is optional, and importing it costs seconds

        triton.runtime.driver.active.get_current_target()
    except Exception as err:  # e.g. "0 active drivers" on a machine without a GPU driver
        return f"Triton found no working GPU driver ({type(err).__name__}: {err})"
    return None


@torch.compiler.assume_constant_result
def _interpreter_on() -> bool:
    return env.flag(INTERPRET_VARIABLE)


@torch.compiler.assume_constant_result
def _auto_opt_in() -> bool:
    return env.flag(AUTO_VARIABLE)


class TritonBackend(Backend):
    """``backend="triton"``."""

    name = "triton"
    fuses_rotary_tables = True

    def is_available(self) -> bool:
        return _installed()

    def unsupported_reason(self, device: torch.device) -> str | None:
        if device.type == "cuda":
            return _gpu_problem()
        if device.type != "cpu":
            return f"the Triton backend runs on CUDA tensors, not {device.type}"
        if not _installed():
            return _NOT_INSTALLED
        if not _interpreter_on():
            return (
                "the Triton backend runs on CUDA tensors and these are on the CPU (TRITON_INTERPRET=1 runs "
                "the kernels in Triton's CPU interpreter, for tests only)"
            )
        return None

    def preferred_for_auto(self, device: torch.device) -> bool:
        return device.type == "cuda" and _auto_opt_in() and _gpu_problem() is None

    def fuses_rotary(self, rotary, q: torch.Tensor, v: torch.Tensor) -> bool:
        """An ``InterleavedRotary`` without table gradients, on inputs the kernels take."""
        if not isinstance(rotary, InterleavedRotary) or rotary.requires_grad:
            return False
        # function-level import: the kernels module imports triton (optional, seconds to import)
        from mhla_diffusers.ops.triton_ops import torch_fallback_reason

        return torch_fallback_reason(q, v) is None

    def kept_on_load(self) -> bool:
        """Only where CUDA is available."""
        return torch.cuda.is_available()

    def forward(self, q, k, v, mixing, layout, **kwargs) -> torch.Tensor:
        # function-level import: triton is optional (importing mhla_diffusers never imports it)
        from mhla_diffusers.ops.triton_ops import mhla_attention_triton

        return mhla_attention_triton(q, k, v, mixing, layout, **kwargs)


register_backend(TritonBackend())
