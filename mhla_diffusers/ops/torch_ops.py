"""MHLA in plain PyTorch: batched GEMMs over a padded block-major view of the tokens.

Cost O(N d^2 + M^2 d^2) per head, memory O(N d + M d^2): no ``N x N`` tensor and no per-token
``d x d`` tensor. Works on any device; gradients come from autograd.

Steps (MHLA paper, Sec. 3.2), per batch element and head, accumulating in fp32 (fp64 stays fp64):
    1. gather tokens into blocks:  Q_b, K_b, V_b  ``[M, L, d]`` (L = largest block; padded keys = 0)
    2. summaries:  S_b = phi(K_b)^T V_b  ``[M, d, d]``,  z_b = sum phi(K_b)  ``[M, d]``
    3. mixing:     S~ = Mc S,  z~ = Mc z           (one GEMM over the block axis)
    4. output:     o = phi(Q_b) S~_b / (phi(Q_b) . z~_b + eps), scattered back to token order.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout

__all__ = ["mhla_attention_torch", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_blocks(x: torch.Tensor, gather: torch.Tensor, identity: bool, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, N, d]`` -> ``[B, H, M, L, d]`` in ``dtype`` (a view when tokens are already block-major)."""
    b, h, _, d = x.shape
    if identity:
        blocks = x.to(dtype)
    else:
        blocks = x.index_select(2, gather)
        blocks = blocks.to(dtype)
    # Explicit block length (not -1): a reshape with -1 fails on empty batches (B = 0 or heads = 0).
    return blocks.reshape(b, h, num_blocks, blocks.shape[2] // num_blocks, d)


def mhla_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """MHLA forward in PyTorch (see module doc). Inputs are validated by :func:`mhla_attention`.

    Args:
        q, k: ``[B, heads, N, d]``; v: ``[B, heads, N, d_v]``; fp16, bf16, fp32 or fp64.
        mixing: ``[M, M]`` used as given.
        layout: the :class:`BlockLayout` of the ``N`` tokens.
        normalize: divide by ``phi(q) . z~ + eps`` (True) or return the numerator (False).
        eps: added to the denominator, in the accumulation dtype.

    Returns:
        ``[B, heads, N, d_v]`` in the dtype of ``q``.
    """
    acc = compute_dtype(q.dtype)
    m = layout.num_blocks
    gather, scatter, valid, identity = layout.gather_tensors(q.device)

    phi_q = torch.relu(_to_blocks(q, gather, identity, m, acc))  # [B, H, M, L, d]
    phi_k = torch.relu(_to_blocks(k, gather, identity, m, acc))
    v_b = _to_blocks(v, gather, identity, m, acc)
    if valid is not None:  # padded slots must not contribute to any summary
        phi_k = phi_k * valid[:, :, None].to(acc)

    mix = mixing.to(device=q.device, dtype=acc)
    summaries = phi_k.transpose(-1, -2) @ v_b  # [B, H, M, d, d_v]
    b, h, _, d, dv = summaries.shape
    mixed = (mix @ summaries.reshape(b, h, m, d * dv)).reshape(b, h, m, d, dv)  # S~ = Mc S
    out = phi_q @ mixed  # [B, H, M, L, d_v]
    if normalize:
        z = phi_k.sum(dim=-2)  # [B, H, M, d]
        z_mixed = mix @ z  # z~ = Mc z
        den = (phi_q @ z_mixed.unsqueeze(-1)).squeeze(-1)  # [B, H, M, L]
        out = out / (den.unsqueeze(-1) + eps)

    out = out.reshape(b, h, m * out.shape[3], dv)
    if not identity:
        out = out.index_select(2, scatter)
    return out.to(q.dtype)
