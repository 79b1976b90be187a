"""Oracles of MHLA that every fast path is tested against (``docs/operator.md``, "The oracles").

The dense form builds the implied matrix ``A[i, t] = Mc[b(i), b(t)] phi(q_i) . phi(k_t)`` and returns
``(A V) / (rowsum(A) + eps)`` (MHLA paper, Sec. 3.2); memory O(B heads N^2), tests and diagnostics
only. The block-wise form loops over blocks with boolean masks in O(N d^2) and shares no code with
the fast paths; it is the oracle where the dense matrix does not fit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mhla_diffusers.ops.layout import BlockLayout

__all__ = [
    "mhla_attention_reference",
    "positional_denominator_reference",
    "implied_attention",
    "mhla_attention_blockwise",
    "blockwise_parts",
    "relative_error",
    "plain_linear_attention",
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
    feature_power: float = 1.0,
) -> torch.Tensor:
    """The unnormalised implied attention matrix ``A`` ``[B, heads, N, N]`` of q, k ``[B, heads, N, d]``.

    Computed in ``dtype`` (default fp64 for fp64 inputs, else fp32); ``mixing`` used as given; with
    ``rotary``, the RoPE numerator's matrix.
    """
    dtype = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    idx = layout.block_index.to(q.device)
    phi_q = _features(q, dtype, feature_map, feature_power) + feature_eps
    phi_k = _features(k, dtype, feature_map, feature_power) + feature_eps
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
    feature_power: float = 1.0,
    denominator: str = "paper",
) -> torch.Tensor:
    """Dense MHLA ``[B, heads, N, d_v]``, computed and returned in ``dtype`` (fp64 by default).

    Arguments as :func:`~mhla_diffusers.ops.mhla_attention`; differentiable in q, k, v and mixing.
    ``denominator="authors_dit"``: :func:`positional_denominator_reference`.

    Raises:
        ValueError: on shape mismatch; blocks of unequal size for ``"authors_dit"``.
    """
    _check(q, k, v, mixing, layout)
    features = dict(feature_map=feature_map, feature_eps=feature_eps, feature_power=feature_power)
    attn = implied_attention(q, k, mixing, layout, dtype=dtype, rotary=rotary, **features)
    out = attn @ v.to(dtype)
    if normalize and denominator == "authors_dit":
        return out / (positional_denominator_reference(q, k, mixing, layout, dtype=dtype, **features) + eps)
    if normalize:
        den_attn = attn if rotary is None else implied_attention(q, k, mixing, layout, dtype=dtype, **features)
        out = out / (den_attn.sum(dim=-1, keepdim=True) + eps)
    return out


def positional_denominator_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    dtype: torch.dtype = torch.float64,
    feature_map: str | None = "relu",
    feature_eps: float = 0.0,
    feature_power: float = 1.0,
) -> torch.Tensor:
    """The authors' DiT normaliser ``[B, heads, N, 1]`` without eps, by tables built token by token.

    For token ``i`` at position ``l`` (in token order) of block ``b``: ``sum_j Mc[b, j] phi(q[j-th block's token
    l]) . z_j``, ``z_j`` the block's feature sum (ops/positional.py). Shares no code with the fast form.

    Raises:
        ValueError: blocks of unequal size.
    """
    members: list[list[int]] = [[] for _ in range(layout.num_blocks)]
    position = []
    for token, block in enumerate(layout.block_index.tolist()):
        position.append(len(members[block]))
        members[block].append(token)
    if len({len(m) for m in members}) != 1:
        raise ValueError(f"the authors' DiT normaliser needs blocks of equal size; {layout} has unequal ones")
    block_of = layout.block_index.tolist()
    # partner[i, j]: the token at i's position in block j
    partner = torch.tensor([[members[j][position[i]] for j in range(layout.num_blocks)] for i in range(layout.num_tokens)])
    phi_q = _features(q, dtype, feature_map, feature_power) + feature_eps
    phi_k = _features(k, dtype, feature_map, feature_power) + feature_eps
    one_hot = torch.zeros(layout.num_tokens, layout.num_blocks, dtype=dtype)
    one_hot[torch.arange(layout.num_tokens), torch.tensor(block_of)] = 1.0
    z = torch.einsum("tm,bhtd->bhmd", one_hot, phi_k)  # [B, heads, M, d]
    weights = mixing.to(dtype)[torch.tensor(block_of)]  # [N, M]: Mc[b(i), j]
    products = torch.einsum("bhijd,bhjd->bhij", phi_q[:, :, partner], z)  # phi(q[partner(i, j)]) . z_j
    return (products * weights).sum(dim=-1, keepdim=True)


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
    feature_power: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MHLA's numerator ``[B, heads, N, d_v]`` and denominator ``phi(q) . z~_i + eps`` ``[B, heads, N, 1]``.

    By an explicit loop over blocks, in the inputs' dtype and device (cast to fp64 for an oracle);
    differentiable in q, k, v and mixing. With ``rotary`` the numerator uses rotated features.

    Raises:
        ValueError: shapes that do not match each other or ``layout``; an unknown ``feature_map``.
    """
    _check(q, k, v, mixing, layout)
    idx = layout.block_index.to(q.device)
    pq, pk = _features(q, q.dtype, feature_map, feature_power), _features(k, k.dtype, feature_map, feature_power)
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
    feature_power: float = 1.0,
) -> torch.Tensor:
    """MHLA ``[B, heads, N, d_v]`` as ``num / den`` of :func:`blockwise_parts` (``num`` if not ``normalize``); raises as it does."""
    num, den = blockwise_parts(q, k, v, mixing, layout, eps=eps, feature_map=feature_map, rotary=rotary,
                               feature_eps=feature_eps, feature_power=feature_power)
    return num / den if normalize else num


def _features(x: torch.Tensor, dtype: torch.dtype, feature_map: str | None, power: float = 1.0) -> torch.Tensor:
    """``ReLU(x) ** power`` (``"relu"``) or ``x`` (``None``) in ``dtype``."""
    if feature_map not in ("relu", None):
        raise ValueError(f'feature_map must be "relu" or None; got {feature_map!r}')
    if power != 1 and feature_map != "relu":
        raise ValueError(f'feature_power={power} needs feature_map="relu"; got {feature_map!r}')
    x = x.to(dtype)
    if feature_map != "relu":
        return x
    return torch.relu(x) if power == 1 else torch.relu(x) ** power


def _check(q, k, v, mixing, layout):
    if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q, k, v must be [B, heads, N, d] with equal shapes; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != layout.num_tokens:
        raise ValueError(f"q has {q.shape[2]} tokens but the layout {layout} has {layout.num_tokens}")
    m = layout.num_blocks
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """``max |actual - expected| / max(max |expected|, scale)`` in fp64: the measure of every oracle comparison.

    ``0.0`` for empty tensors; the absolute error where the denominator is 0.
    """
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.double(), expected.double()
    denom = max(expected.abs().max().item(), scale or 0.0)
    err = (actual - expected).abs().max().item()
    return err / denom if denom > 0 else err


def plain_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain ReLU linear attention ``relu(Q) (relu(K)^T V) / (relu(Q) . sum_t relu(k_t) + eps)``, ``[B, heads, N, d_v]``.

    Written the way one writes it in torch (what SANA's stock processor computes, one block, no mixing): the
    baseline MHLA's speed is measured against (benchmarks, ``MeasuredCost``), not an oracle. Inputs
    ``[B, heads, N, d]``, any float dtype, computed in it.
    """
    pq, pk = q.relu(), k.relu()
    numerator = pq @ (pk.transpose(-1, -2) @ v)
    return numerator / (pq @ pk.sum(-2).unsqueeze(-1) + eps)
