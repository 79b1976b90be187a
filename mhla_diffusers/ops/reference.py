"""Dense O(N^2) reference of MHLA: the oracle every fast path is tested against.

Builds the implied attention matrix explicitly (MHLA paper, Sec. 3.2, the "block selection x
intra-block reweighting" form):

    A[i, t] = Mc[b(i), b(t)] * phi(q_i) . phi(k_t)
    out_i   = (A V)_i / (rowsum(A)_i + eps)      (normalize=True)
    out_i   = (A V)_i                            (normalize=False)

with ``phi = ReLU``. Memory is O(B * heads * N^2): tests and diagnostics only.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout

__all__ = ["mhla_attention_reference", "implied_attention"]


def implied_attention(
    q: torch.Tensor, k: torch.Tensor, mixing: torch.Tensor, layout: BlockLayout, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The unnormalised implied attention matrix ``A`` ``[B, heads, N, N]`` (see module doc).

    Args:
        q, k: ``[B, heads, N, d]``.
        mixing: ``[M, M]``, used as given (no clamping).
        layout: token grid with ``N`` tokens and ``M`` blocks.
        dtype: compute dtype (default: float64 for float64 inputs, float32 otherwise; pass
            ``torch.float64`` for an oracle).
    """
    dtype = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    idx = layout.block_index.to(q.device)
    phi_q = torch.relu(q.to(dtype))
    phi_k = torch.relu(k.to(dtype))
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
) -> torch.Tensor:
    """Dense MHLA: ``[B, heads, N, d]`` output computed in ``dtype`` (float64 by default), returned in ``dtype``.

    Differentiable (autograd) in q, k, v and mixing. Raises ``ValueError`` on shape mismatch.
    """
    _check(q, k, v, mixing, layout)
    attn = implied_attention(q, k, mixing, layout, dtype=dtype)
    out = attn @ v.to(dtype)
    if normalize:
        out = out / (attn.sum(dim=-1, keepdim=True) + eps)
    return out


def _check(q, k, v, mixing, layout):
    if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q, k, v must be [B, heads, N, d] with equal shapes; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != layout.num_tokens:
        raise ValueError(f"q has {q.shape[2]} tokens but the layout {layout} has {layout.num_tokens}")
    m = layout.num_blocks
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")
