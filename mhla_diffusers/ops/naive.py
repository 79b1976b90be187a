"""Dense O(N^2) reference of MHLA: the oracle every fast path is tested against.

Builds the implied attention matrix explicitly (MHLA paper, Sec. 3.2, the "block selection x
intra-block reweighting" form):

    A[i, t] = Mc[b(i), b(t)] * phi(q_i) . phi(k_t)
    out_i   = (A V)_i / (rowsum(A)_i + eps)      (normalize=True)
    out_i   = (A V)_i                            (normalize=False)

with ``phi = ReLU`` (``feature_map="relu"``) or the identity (``feature_map=None``: q, k are
features already), plus ``feature_eps`` (``phi(x) = ReLU(x) + feature_eps``: the authors' Wan model
adds 1e-6 after the ReLU; 0 by default). With ``rotary`` (Wan's RoPE after the feature map,
as in the authors' video model) the numerator uses rotated features and the denominator un-rotated ones:

    out_i = sum_t Mc[b(i), b(t)] (R phi(q_i)) . (R phi(k_t)) v_t / (sum_t Mc[b(i), b(t)] phi(q_i) . phi(k_t) + eps)

Memory is O(B * heads * N^2): tests and diagnostics only.

The readable block-wise oracle (:func:`mhla_attention_blockwise`, :func:`blockwise_parts`) computes the
same result in O(N d^2) by an explicit loop over blocks with boolean masks (S_b = phi(K_b)^T V_b,
z_b = sum phi(K_b), mixed by Mc); it is the oracle where the dense matrix does not fit (N = 4096 and
beyond) and shares no code with the fast paths' gather / scatter. Used by tests/ops/test_ops.py,
tests/ops/triton_interpret_check.py and benchmarks/gpu_check.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mhla_diffusers.ops.layout import BlockLayout

__all__ = [
    "mhla_attention_reference",
    "implied_attention",
    "mhla_attention_blockwise",
    "blockwise_parts",
    "relative_error",
]


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


def blockwise_parts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    eps: float = 1e-6,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MHLA's numerator and denominator by an explicit loop over blocks, in the inputs' dtype and device.

    ``S_b = phi(K_b)^T V_b``, ``z_b = sum_t phi(k_t)`` over block ``b``, ``S~ = Mc S``, ``z~ = Mc z``;
    for a query in block ``i``: ``num = phi(q) S~_i`` ``[B, heads, N, dv]`` and
    ``den = phi(q) . z~_i + eps`` ``[B, heads, N, 1]``. With ``rotary`` the numerator uses rotated
    features (``rotary(phi(.))``), the denominator un-rotated ones (module doc). Cast the inputs to
    float64 first for an oracle; differentiable in q, k, v and mixing.

    Raises:
        ValueError: shapes that do not match each other or ``layout``; an unknown ``feature_map``.
    """
    _check(q, k, v, mixing, layout)
    idx = layout.block_index.to(q.device)
    pq, pk = _features(q, q.dtype, feature_map), _features(k, k.dtype, feature_map)
    if feature_eps:
        pq, pk = pq + feature_eps, pk + feature_eps
    rq, rk = (rotary(pq), rotary(pk)) if rotary is not None else (pq, pk)
    masks = [idx == b for b in range(layout.num_blocks)]
    s = torch.stack([rk[:, :, mask].transpose(-1, -2) @ v[:, :, mask] for mask in masks])  # [M, B, H, d, dv]
    z = torch.stack([pk[:, :, mask].sum(-2) for mask in masks])  # [M, B, H, d]
    s_mixed = torch.einsum("ib,bxhde->ixhde", mixing, s)
    z_mixed = torch.einsum("ib,bxhd->ixhd", mixing, z)
    num = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    den = torch.zeros(*q.shape[:3], 1, dtype=q.dtype, device=q.device)
    for i, mask in enumerate(masks):
        num[:, :, mask] = rq[:, :, mask] @ s_mixed[i]
        den[:, :, mask] = pq[:, :, mask] @ z_mixed[i].unsqueeze(-1) + eps
    return num, den


def mhla_attention_blockwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """MHLA ``[B, heads, N, dv]`` by :func:`blockwise_parts` (``num / den``, or ``num`` with
    ``normalize=False``), in the inputs' dtype: O(N d^2) memory, the oracle beyond the dense one's reach.

    Raises:
        ValueError: as :func:`blockwise_parts`.
    """
    num, den = blockwise_parts(q, k, v, mixing, layout, eps=eps, feature_map=feature_map, rotary=rotary,
                               feature_eps=feature_eps)
    return num / den if normalize else num


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


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """The error measure of every comparison with these oracles (tests, interpreter check, gpu_check).

    ``max |actual - expected| / max(max |expected|, scale)``, computed in float64; ``0.0`` for empty
    tensors; the absolute error where the denominator is 0.
    """
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.double(), expected.double()
    denom = max(expected.abs().max().item(), scale or 0.0)
    err = (actual - expected).abs().max().item()
    return err / denom if denom > 0 else err
