"""The MHLA operator (framework-free: nothing here imports diffusers).

``mhla_attention`` validates its inputs and dispatches to a backend; ``naive`` holds the oracles (dense
O(N^2) and block-wise). A new backend is one file in this package plus one entry in ``backends.BACKENDS``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from mhla_diffusers.ops import compiled
from mhla_diffusers.ops.backends import BACKENDS as _BACKENDS
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.naive import implied_attention, mhla_attention_reference
from mhla_diffusers.ops.rotary import InterleavedRotary
from mhla_diffusers.ops.torch_ops import compute_dtype

__all__ = [
    "mhla_attention", "mhla_attention_reference", "implied_attention", "available_backends", "resolve_backend",
    "InterleavedRotary",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.compiler.assume_constant_result
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # under torch.compile: called while tracing, never traced
def _triton_gpu_problem() -> str | None:
    """Why Triton cannot launch GPU kernels here (``None`` when it can); checked once per process."""
    if not _triton_installed():
        return "triton is not installed (pip install 'mhla_diffusers[triton]')"
    try:
        import triton  # function-level import: triton is optional, and importing it costs seconds

        triton.runtime.driver.active.get_current_target()
    except Exception as err:  # e.g. "0 active drivers" on a machine without a GPU driver
        return f"Triton found no working GPU driver ({type(err).__name__}: {err})"
    return None


@torch.compiler.assume_constant_result
def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@torch.compiler.assume_constant_result
def _auto_picks_triton() -> bool:
    """Whether ``"auto"`` may pick the Triton kernels for CUDA tensors (``MHLA_AUTO_TRITON=1``)."""
    return os.environ.get("MHLA_AUTO_TRITON", "0").lower() in ("1", "true", "yes", "on")


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` besides ``"auto"``: ``"torch"``, and ``"triton"`` when the
    ``triton`` package is installed (it then runs on CUDA tensors; see :func:`resolve_backend`)."""
    return sorted(name for name in _BACKENDS if name != "triton" or _triton_installed())


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for tensors on ``device``; validate explicit names.

    ``"auto"``: ``"torch"``, or ``"triton"`` for CUDA tensors when ``MHLA_AUTO_TRITON=1`` is set
    and triton is installed with a working GPU driver (never the Triton interpreter). The kernels
    pass the interpreter and sm_90 compilation tests but have not yet been run on a GPU in this
    project (benchmarks/TRITON.md), so "auto" opts in only on request until they have. ``"triton"`` explicitly: CUDA
    tensors, or CPU tensors when ``TRITON_INTERPRET=1`` is set (the interpreter: slow, for tests).

    Raises:
        ValueError: for an unknown backend name, or ``"triton"`` where it cannot run (not
            installed, no GPU driver, CPU tensors without the interpreter, other devices).
    """
    device = torch.device(device)
    if backend == "auto":
        use_triton = device.type == "cuda" and _auto_picks_triton() and _triton_gpu_problem() is None
        return "triton" if use_triton else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"unknown MHLA backend {backend!r}; choose one of {['auto', *available_backends()]}")
    if backend == "triton":
        if device.type == "cuda":
            problem = _triton_gpu_problem()
        elif device.type != "cpu":
            problem = f"the Triton backend runs on CUDA tensors, not {device.type}"
        elif not _triton_installed():
            problem = "triton is not installed (pip install 'mhla_diffusers[triton]')"
        elif not _interpreter_on():
            problem = (
                "the Triton backend runs on CUDA tensors and these are on the CPU (TRITON_INTERPRET=1 runs "
                "the kernels in Triton's CPU interpreter, for tests only)"
            )
        else:
            problem = None
        if problem is not None:
            raise ValueError(f"MHLA backend 'triton' is not usable here: {problem}. Use backend='torch' or 'auto'")
    return backend


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    backend: str = "auto",
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """Multi-Head Linear Attention over the blocks of ``layout`` (MHLA paper, Sec. 3.2).

    With ``phi = ReLU``, ``S_b = phi(K_b)^T V_b`` and ``z_b = sum_{t in b} phi(k_t)`` per block,
    ``S~ = Mc S`` and ``z~ = Mc z``, a query ``q`` in block ``i`` gets::

        out = phi(q) S~_i / (phi(q) . z~_i + eps)     if normalize
        out = phi(q) S~_i                             otherwise

    With ``rotary = R`` (Wan 2.1's RoPE after the feature map, as the authors' video model and
    DESIGN.md do) the numerator uses rotated features and the denominator un-rotated ones::

        S_b = (R phi(K_b))^T V_b,   out = (R phi(q)) S~_i / (phi(q) . z~_i + eps)

    The Triton backend applies an :class:`InterleavedRotary` (e.g. Wan's
    :class:`~mhla_diffusers.models.families.WanRotary`) inside its kernels: one pass, numerator and
    denominator fused, the tables treated as constants. Any other ``rotary`` callable (and any
    rotary on the torch backend) is composed: one numerator call of the backend on the rotated
    features (``feature_map`` off) plus a second call for the denominator (a value of ones), both
    in the accumulation dtype; gradients then also flow into the callable's own tensors.

    Summaries, normaliser and mixing are accumulated in fp32 (fp64 for fp64 inputs) whatever the
    input dtype; the output has the dtype of ``q``. Cost O(N d^2 + M^2 d^2); gradients for q, k,
    v and ``mixing`` flow through autograd.

    Args:
        q, k: ``[B, heads, N, d]``. v: ``[B, heads, N, d_v]``. Same device; float16, bfloat16,
            float32 or float64 (dtypes may differ: each is cast to the accumulation dtype of ``q``).
        mixing: ``[M, M]`` mixing matrix ``Mc`` (rows = query blocks), used as given: clamp it
            to ``[0, 1]`` beforehand if desired (:class:`~mhla_diffusers.MixingMatrix` does).
        layout: :class:`~mhla_diffusers.BlockLayout` with ``layout.num_tokens == N``.
        normalize: apply the denominator (default) or return the numerator only.
        eps: added to the denominator (in the accumulation dtype).
        backend: ``"auto"`` or one of :func:`available_backends`.
        feature_map: ``"relu"`` (phi = ReLU, the paper's) or ``None``: q and k are features
            already (e.g. computed by the caller); with ``normalize`` they should then be
            non-negative, or the denominator may vanish.
        rotary: ``None``, an :class:`InterleavedRotary`, or any function mapping a ``[B, heads, N, d]``
            feature tensor (float32 / float64, possibly a non-contiguous view) to its rotated
            version of the same shape.
        feature_eps: a constant added to every feature after the feature map, before ``rotary``
            (``phi(x) = ReLU(x) + feature_eps``; the authors' Wan model uses 1e-6). ``0`` (default):
            none. When set, the features are computed here in the accumulation dtype and every
            backend receives them as features (``feature_map`` off).

    Returns:
        ``[B, heads, N, d_v]`` tensor in ``q.dtype``.

    Raises:
        ValueError: on shapes that do not match each other, the layout or the mixing matrix, a
            head dim of 0, on non-floating dtypes, on tensors on different devices, on an unknown backend or
            feature map, a negative or non-finite ``feature_eps``, or when ``rotary`` changes the shape of its input.
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a mhla_diffusers.BlockLayout; got {type(layout).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, heads, tokens, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q and k must have equal shapes and v the same [batch, heads, tokens]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("mixing", mixing)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64; got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move all inputs to one device")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k need a head dim >= 1 (phi(q) . phi(k) over no channel is undefined); got {tuple(q.shape)}")
    if q.shape[2] != layout.num_tokens:
        raise ValueError(
            f"q has {q.shape[2]} tokens but the layout's grid {layout.grid} has {layout.num_tokens}; "
            f"build the BlockLayout on the true token grid of this input"
        )
    m = layout.num_blocks
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if feature_map not in ("relu", None):
        raise ValueError(f'feature_map must be "relu" (phi = ReLU) or None (q, k are features already); got {feature_map!r}')
    if feature_eps:
        return _with_feature_eps(
            q, k, v, mixing, layout, feature_eps,
            normalize=normalize, eps=eps, backend=backend, feature_map=feature_map, rotary=rotary,
        )
    name = resolve_backend(backend, q.device)
    fn = _BACKENDS[name]
    if torch.compiler.is_compiling():  # one opaque graph node per call, not a graph break (ops/compiled.py)
        fn = functools.partial(compiled.attention, backend=name)
    if rotary is None:
        return fn(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map == "relu")
    if name == "triton" and _fused_rotary(rotary, q, v):
        rotary.check(q.shape)
        return fn(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map == "relu", rotary=rotary)
    return _rotary_attention(fn, q, k, v, mixing, layout, rotary, normalize=normalize, eps=eps, feature_map=feature_map)


def _with_feature_eps(q, k, v, mixing, layout, feature_eps, *, feature_map, **kwargs):
    """MHLA with ``phi(x) = feature_map(x) + feature_eps``: the features are computed here, in the
    accumulation dtype, and passed on as features; the output has ``q``'s dtype."""
    if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not 0 <= feature_eps < float("inf"):
        raise ValueError(f"feature_eps must be a finite number >= 0; got {feature_eps!r}")
    acc = compute_dtype(q.dtype)
    phi_q, phi_k = q.to(acc), k.to(acc)
    if feature_map == "relu":
        phi_q, phi_k = torch.relu(phi_q), torch.relu(phi_k)
    out = mhla_attention(phi_q + feature_eps, phi_k + feature_eps, v, mixing, layout, feature_map=None, **kwargs)
    return out.to(q.dtype)


def _fused_rotary(rotary, q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Triton kernels apply ``rotary`` themselves: an :class:`InterleavedRotary` whose
    tables need no gradient, on inputs the kernels take (not sent to the torch fallback)."""
    if not isinstance(rotary, InterleavedRotary) or rotary.requires_grad:
        return False
    # function-level import: the kernels module imports triton (optional, seconds to import)
    from mhla_diffusers.ops.triton_ops import torch_fallback_reason

    return torch_fallback_reason(q, v) is None


def _rotary_attention(fn, q, k, v, mixing, layout, rotary, *, normalize, eps, feature_map):
    """The RoPE variant (see :func:`mhla_attention`): rotated features in the numerator only."""
    acc = compute_dtype(q.dtype)
    phi_q, phi_k = q.to(acc), k.to(acc)
    if feature_map == "relu":
        phi_q, phi_k = torch.relu(phi_q), torch.relu(phi_k)
    rot_q, rot_k = rotary(phi_q), rotary(phi_k)
    for name, rot in (("q", rot_q), ("k", rot_k)):
        if not isinstance(rot, torch.Tensor) or rot.shape != q.shape:
            got = tuple(rot.shape) if isinstance(rot, torch.Tensor) else type(rot).__name__
            raise ValueError(f"rotary must return a tensor of the shape of its input {tuple(q.shape)}; got {got} for {name}")
    # The backend's output has the dtype of its q: the accumulation dtype here, so the numerator
    # is divided before any rounding to a 16-bit input dtype.
    num = fn(rot_q.to(acc), rot_k.to(acc), v, mixing, layout, normalize=False, eps=eps, feature_map=False)
    if normalize:
        # phi(q) . z~ with un-rotated features: the backend's numerator with a value of ones.
        ones = phi_q.new_ones(1, 1, 1, 1).expand(*q.shape[:3], 1)
        den = fn(phi_q, phi_k, ones, mixing, layout, normalize=False, eps=eps, feature_map=False)
        num = num / (den + eps)
    return num.to(q.dtype)
