"""Dense O(N^2) reference of MHLA: the oracle every fast path is tested against.

Builds the implied attention matrix explicitly (MHLA paper, Sec. 3.2, the "block selection x
intra-block reweighting" form):

    A[i, t] = Mc[b(i), b(t)] * phi(q_i) . phi(k_t)
    out_i   = (A V)_i / (rowsum(A)_i + eps)      (normalize=True)
    out_i   = (A V)_i                            (normalize=False)

with ``phi = ReLU`` (``feature_map="relu"``) or the identity (``feature_map=None``: q, k are
features already), plus ``feature_eps`` (``phi(x) = ReLU(x) + feature_eps``: the authors' Wan model
adds 1e-6 after the ReLU; 0 by default). With ``rotary`` (Wan's RoPE after the feature map,
DESIGN.md) the numerator uses rotated features and the denominator un-rotated ones:

    out_i = sum_t Mc[b(i), b(t)] (R phi(q_i)) . (R phi(k_t)) v_t / (sum_t Mc[b(i), b(t)] phi(q_i) . phi(k_t) + eps)

Memory is O(B * heads * N^2): tests and diagnostics only.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from mhla_diffusers.ops.layout import BlockLayout

__all__ = ["mhla_attention_reference", "implied_attention"]


def implied_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    dtype: torch.dtype | None = None,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """The unnormalised implied attention matrix ``A`` ``[B, heads, N, N]`` (see module doc).

    Args:
        q, k: ``[B, heads, N, d]``.
        mixing: ``[M, M]``, used as given (no clamping).
        layout: token grid with ``N`` tokens and ``M`` blocks.
        dtype: compute dtype (default: float64 for float64 inputs, float32 otherwise; pass
            ``torch.float64`` for an oracle).
        feature_map: ``"relu"`` (phi = ReLU) or ``None`` (q, k are features already).
        rotary: optional map applied to ``phi(q)``, ``phi(k)`` (``[B, heads, N, d]``, same shape
            out) before their products: the numerator matrix of the RoPE variant.
        feature_eps: added to every feature after the feature map (before ``rotary``).
    """
    dtype = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    idx = layout.block_index.to(q.device)
    phi_q, phi_k = _features(q, dtype, feature_map) + feature_eps, _features(k, dtype, feature_map) + feature_eps
    if rotary is not None:
        phi_q, phi_k = rotary(phi_q), rotary(phi_k)
    scores = phi_q @ phi_k.transpose(-1, -2)
    weights = mixing.to(dtype)[idx][:, idx]  # [N, N]: Mc[b(i), b(t)]
    return scores * weights


def mhla_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """Dense MHLA: ``[B, heads, N, d]`` output computed in ``dtype`` (float64 by default), returned in ``dtype``.

    ``feature_map``, ``feature_eps`` and ``rotary`` as in :func:`~mhla_diffusers.ops.mhla_attention` (module
    doc: rotated features in the numerator, un-rotated ones in the denominator).
    Differentiable (autograd) in q, k, v and mixing. Raises ``ValueError`` on shape mismatch.
    """
    _check(q, k, v, mixing, layout)
    attn = implied_attention(q, k, mixing, layout, dtype=dtype, feature_map=feature_map, rotary=rotary, feature_eps=feature_eps)
    out = attn @ v.to(dtype)
    if normalize:
        den_attn = attn if rotary is None else implied_attention(
            q, k, mixing, layout, dtype=dtype, feature_map=feature_map, feature_eps=feature_eps
        )
        out = out / (den_attn.sum(dim=-1, keepdim=True) + eps)
    return out


def _features(x: torch.Tensor, dtype: torch.dtype, feature_map: str | None) -> torch.Tensor:
    if feature_map not in ("relu", None):
        raise ValueError(f'feature_map must be "relu" or None; got {feature_map!r}')
    x = x.to(dtype)
    return torch.relu(x) if feature_map == "relu" else x


def _check(q, k, v, mixing, layout):
    if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q, k, v must be [B, heads, N, d] with equal shapes; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != layout.num_tokens:
        raise ValueError(f"q has {q.shape[2]} tokens but the layout {layout} has {layout.num_tokens}")
    m = layout.num_blocks
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")
