"""The MHLA operator; framework-free (nothing here imports diffusers).

:func:`mhla_attention` validates its inputs and dispatches to a backend of the registry
(:mod:`~mhla_diffusers.ops.backends`); :mod:`~mhla_diffusers.ops.naive` holds the oracles.
Math, backends, numerics: ``docs/operator.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from mhla_diffusers.ops import compiled
from mhla_diffusers.ops import triton_backend as _kernels_backend  # noqa: F401  (registers the GPU kernels)
from mhla_diffusers.ops.backends import (
    Backend,
    available_backends,
    get_backend,
    register_backend,
    registered_backends,
    resolve_backend,
    unregister_backend,
)
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.naive import implied_attention, mhla_attention_reference
from mhla_diffusers.ops.positional import DENOMINATORS, check_equal_blocks, positional_denominator
from mhla_diffusers.ops.rotary import InterleavedRotary
from mhla_diffusers.ops.torch_ops import compute_dtype

__all__ = [
    "mhla_attention", "mhla_attention_reference", "implied_attention", "available_backends", "resolve_backend",
    "InterleavedRotary", "Backend", "register_backend", "unregister_backend", "get_backend", "registered_backends",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    feature_power: float = 1.0,
    denominator: str = "paper",
) -> torch.Tensor:
    """Multi-Head Linear Attention over the blocks of ``layout`` (MHLA paper, Sec. 3.2).

    With ``S_b = phi(K_b)^T V_b``, ``z_b = sum_{t in b} phi(k_t)``, ``S~ = Mc S``, ``z~ = Mc z``, a query in
    block ``i`` gets ``phi(q) S~_i / (phi(q) . z~_i + eps)`` (the numerator alone if not ``normalize``);
    with ``rotary = R`` the numerator uses ``R phi(.)``. ``phi`` is ``ReLU(x) ** feature_power``
    (``feature_map="relu"``; the power map of the authors' code for ``feature_power != 1``) or the identity
    (``None``), plus ``feature_eps``. Accumulates in fp32 (fp64 for fp64 inputs). See
    ``docs/operator.md``.

    Args:
        q: ``[B, heads, N, d]``.
        k: ``[B, heads, N, d]``.
        v: ``[B, heads, N, d_v]``; q, k, v: fp16, bf16, fp32 or fp64, one device.
        mixing: ``[M, M]`` (rows = query blocks), used as given (no clamping).
        layout: :class:`~mhla_diffusers.BlockLayout` with ``N`` tokens.
        backend: ``"auto"`` or one of :func:`available_backends`.
        rotary: ``None``, an :class:`InterleavedRotary`, or a callable ``[B, heads, N, d] -> same``.
        feature_eps: a constant ``>= 0`` added to every feature.
        feature_power: ``p > 0`` of ``phi = ReLU(x) ** p`` (``feature_map="relu"`` only). Features with
            ``feature_eps`` or ``p != 1`` are computed here, in the accumulation dtype, and every backend gets
            them as ready features, so all backends support both.
        denominator: ``"paper"`` (``phi(q) . z~_i``) or ``"authors_dit"``: the normaliser of the authors' DiT
            layer, ``sum_j Mc[i, j] phi(q[j, l]) . z_j`` for the query at position ``l`` of block ``i``
            (:mod:`~mhla_diffusers.ops.positional`; blocks of equal size; computed in torch beside any backend's
            numerator).

    Returns:
        ``[B, heads, N, d_v]`` in ``q.dtype``, differentiable in q, k, v and ``mixing``.

    Raises:
        TypeError: ``layout`` is not a ``BlockLayout``; q, k, v or ``mixing`` not a tensor.
        ValueError: mismatched shapes, layout or mixing; non-float dtypes; mixed devices; ``eps < 0``;
            an unknown backend or feature map; a bad ``feature_eps`` or ``feature_power`` (or ``p != 1`` without
            ``feature_map="relu"``); a shape-changing ``rotary``; an unknown ``denominator``, ``"authors_dit"``
            without ``normalize`` or on blocks of unequal size; with ``feature_power != 1`` or ``feature_eps``, an
            output that is not finite though q, k, v and ``mixing`` are (the features or their products overflowed
            the accumulation dtype: the message names ``feature_power``, the dtype and the fix; not checked while
            ``torch.compile`` traces, where such an output is returned as computed).
    """
    _check_inputs(q, k, v, mixing, layout, eps, feature_map)
    _check_features(feature_eps, feature_power, feature_map)
    if denominator != "paper":
        return _authors_dit_attention(
            q, k, v, mixing, layout, feature_eps, feature_power, denominator,
            normalize=normalize, eps=eps, backend=backend, feature_map=feature_map, rotary=rotary,
        )
    if feature_eps or feature_power != 1:
        return _with_features(
            q, k, v, mixing, layout, feature_eps, feature_power,
            normalize=normalize, eps=eps, backend=backend, feature_map=feature_map, rotary=rotary,
        )
    name = resolve_backend(backend, q.device)
    impl = get_backend(name)
    fn = impl.forward
    if torch.compiler.is_compiling():  # one opaque graph node per call, not a graph break (ops/compiled.py)
        fn = functools.partial(compiled.attention, backend=name)
    if rotary is None:
        return fn(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map == "relu")
    if impl.fuses_rotary_tables and impl.fuses_rotary(rotary, q, v):
        rotary.check(q.shape)
        return fn(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map == "relu", rotary=rotary)
    return _rotary_attention(fn, q, k, v, mixing, layout, rotary, normalize=normalize, eps=eps, feature_map=feature_map)


def _check_inputs(q, k, v, mixing, layout, eps, feature_map) -> None:
    """The raises of :func:`mhla_attention` on its tensors, layout, ``eps`` and ``feature_map``."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a mhla_diffusers.BlockLayout; got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("mixing", mixing)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__} (mixing: e.g. MixingMatrix.clamped())")
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


def _check_features(feature_eps, feature_power, feature_map) -> None:
    """Raises ``ValueError``: a bad ``feature_eps`` or ``feature_power``, or ``feature_power != 1`` without ReLU."""
    if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not 0 <= feature_eps < float("inf"):
        raise ValueError(f"feature_eps must be a finite number >= 0; got {feature_eps!r}")
    if isinstance(feature_power, bool) or not isinstance(feature_power, (int, float)) or not 0 < feature_power < float("inf"):
        raise ValueError(f"feature_power must be a finite number > 0 (phi = ReLU(x) ** p); got {feature_power!r}")
    if feature_power != 1 and feature_map != "relu":
        raise ValueError(f'feature_power={feature_power} needs feature_map="relu" (phi = ReLU(x) ** p); got {feature_map!r}')


def _with_features(q, k, v, mixing, layout, feature_eps, feature_power, *, feature_map, **kwargs):
    """MHLA with ``phi(x) = ReLU(x) ** feature_power + feature_eps`` (identity for ``feature_map=None``), the
    features computed here in the accumulation dtype and handed to the backend as ready features."""
    phi_q, phi_k = _features(q, k, feature_map, feature_eps, feature_power)
    out = mhla_attention(phi_q, phi_k, v, mixing, layout, feature_map=None, **kwargs)
    _check_finite(out, (q, k, v, mixing), feature_eps, feature_power)
    return out.to(q.dtype)


def _check_finite(out, inputs, feature_eps, feature_power) -> None:
    """Raises ``ValueError`` when ``out`` (accumulation dtype) is not finite though every input is: the features
    ``ReLU(x) ** feature_power + feature_eps`` or their products overflowed. Skipped under ``torch.compile``
    (no sync, no graph break); non-finite inputs are left to the caller (not the feature map's doing)."""
    if torch.compiler.is_compiling() or bool(torch.isfinite(out).all()):
        return
    if not all(bool(torch.isfinite(t).all()) for t in inputs):
        return
    peak = max(float(inputs[0].detach().amax()), float(inputs[1].detach().amax()))
    itself = peak > 0 and feature_power * math.log(peak) > math.log(torch.finfo(out.dtype).max)
    what = "the features themselves" if itself else "their products"
    dtype = str(out.dtype).replace("torch.", "")
    raise ValueError(
        f"feature_power={feature_power} overflows {dtype}: phi = ReLU(x) ** {feature_power} + {feature_eps} of q, k "
        f"(largest x {peak:.3g}) leaves the {dtype} range in {what}, so MHLA's output is NaN / inf; lower feature_power, "
        f"scale q and k down, or compute in float64 (float64 q, k, v)"
    )


def _features(q, k, feature_map, feature_eps, feature_power):
    """``phi(q), phi(k)`` in the accumulation dtype: ``ReLU(x) ** feature_power + feature_eps`` (``x + eps`` without ReLU)."""
    acc = compute_dtype(q.dtype)
    phi_q, phi_k = q.to(acc), k.to(acc)
    if feature_map == "relu":
        phi_q, phi_k = torch.relu(phi_q), torch.relu(phi_k)
    if feature_power != 1:
        phi_q, phi_k = phi_q ** feature_power, phi_k ** feature_power
    if feature_eps:
        phi_q, phi_k = phi_q + feature_eps, phi_k + feature_eps
    return phi_q, phi_k


def _authors_dit_attention(q, k, v, mixing, layout, feature_eps, feature_power, denominator, *, normalize, eps, backend,
                           feature_map, rotary):
    """The paper's numerator over the backend divided by the authors' DiT normaliser (ops/positional.py)."""
    if denominator not in DENOMINATORS:
        raise ValueError(f"denominator must be one of {', '.join(map(repr, DENOMINATORS))}; got {denominator!r}")
    if not normalize:
        raise ValueError(f'denominator="{denominator}" is a normaliser: it needs normalize=True (normalize=False has none)')
    check_equal_blocks(layout)
    phi_q, phi_k = _features(q, k, feature_map, feature_eps, feature_power)
    num = mhla_attention(phi_q, phi_k, v, mixing, layout, normalize=False, eps=eps, backend=backend, feature_map=None,
                         rotary=rotary)
    den = positional_denominator(phi_q, phi_k, mixing, layout)
    out = num / (den + eps)
    if feature_eps or feature_power != 1:
        _check_finite(out, (q, k, v, mixing), feature_eps, feature_power)
    return out.to(q.dtype)


def _rotary_attention(fn, q, k, v, mixing, layout, rotary, *, normalize, eps, feature_map):
    """The composed RoPE variant: one backend call on rotated features, one for the un-rotated denominator."""
    acc = compute_dtype(q.dtype)
    phi_q, phi_k = _features(q, k, feature_map, 0.0, 1.0)
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
