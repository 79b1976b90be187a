"""MHLA over a contiguous shard of the tokens, for context parallelism.

A block's summary is a sum over its tokens, so the whole sequence's summaries are the sum over
shards of :func:`shard_summaries`; :func:`shard_attention` then computes the shard's outputs.
Packed summaries: ``[B, heads, M, d, d_v + 1]`` (S, then z as the last column) with ``normalize``,
``[B, heads, M, d, d_v]`` without. Framework-free; see ``docs/operator.md``, "Context parallelism".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.torch_ops import compute_dtype

__all__ = ["ShardBlocks", "shard_blocks", "shard_summaries", "shard_attention"]


@dataclass(frozen=True)
class ShardBlocks:
    """Tokens ``[offset, offset + length)`` of a layout in a padded block-major ``[m, L]`` arrangement.

    Attributes:
        blocks: ``[m]`` int64 ids of the touched blocks, ascending.
        slots: ``[length]`` int64 place ``i * L + j`` of each local token.
        length: ``L``, the most tokens the shard has in one block.
    """

    blocks: torch.Tensor
    slots: torch.Tensor
    length: int


@lru_cache(maxsize=256)
@torch.inference_mode(False)  # cached across calls: never inference tensors
def shard_blocks(layout: BlockLayout, offset: int, length: int) -> ShardBlocks:
    """The cached :class:`ShardBlocks` (CPU) of tokens ``[offset, offset + length)``; ``ValueError`` if empty or outside ``layout``."""
    if not (0 <= offset and 1 <= length and offset + length <= layout.num_tokens):
        raise ValueError(
            f"a shard of {length} tokens at offset {offset} does not fit the {layout.num_tokens} tokens of {layout}"
        )
    index = layout.block_index[offset : offset + length]
    blocks, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)  # inverse: token -> i
    order = torch.argsort(inverse, stable=True)  # the tokens block by block, each block's in token order
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(length) - starts[inverse[order]]  # j: the token's place within its block
    longest = int(counts.max())
    return ShardBlocks(blocks, inverse * longest + rank, longest)


def _blocked(x: torch.Tensor, sb: ShardBlocks) -> torch.Tensor:
    b, h, _, w = x.shape
    m = sb.blocks.numel()
    out = x.new_zeros(b, h, m * sb.length, w).index_copy(2, sb.slots.to(x.device), x)
    return out.view(b, h, m, sb.length, w)


def _features(x: torch.Tensor, dtype: torch.dtype, feature_map: str | None, feature_eps: float) -> torch.Tensor:
    if feature_map not in ("relu", None):
        raise ValueError(f'feature_map must be "relu" (phi = ReLU) or None (q, k are features already); got {feature_map!r}')
    x = x.to(dtype)
    x = torch.relu(x) if feature_map == "relu" else x
    return x + feature_eps if feature_eps else x


def _check_shard(x: torch.Tensor, layout: BlockLayout, offset: int, name: str) -> ShardBlocks:
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D [batch, heads, tokens, head_dim]; got {tuple(x.shape)}")
    return shard_blocks(layout, int(offset), x.shape[2])


def shard_summaries(
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    offset: int = 0,
    normalize: bool = True,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """One shard's packed partial summaries ``S_b = (R phi(K_b))^T V_b``, ``z_b = sum phi(K_b)``.

    k ``[B, heads, n, d]`` and v ``[B, heads, n, d_v]`` are tokens ``[offset, offset + n)`` of ``layout``
    (the whole sequence's); ``rotary`` covers this shard's tokens. Returns ``[B, heads, M, d, d_v + 1]``
    (``normalize``; else ``d_v``), fp32 (fp64 for fp64 ``k``), zero for untouched blocks.

    Raises:
        ValueError: k and v of different ``[B, heads, n]``, a shard outside the layout, an unknown feature map.
    """
    sb = _check_shard(k, layout, offset, "k")
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, heads, n, dv] with k's [B, heads, n] {tuple(k.shape[:3])}; got {tuple(v.shape)}")
    acc = compute_dtype(k.dtype)
    phi_k = _features(k, acc, feature_map, feature_eps)
    blocked_k = _blocked(phi_k, sb)  # [B, heads, m, L, d]
    rot_k = blocked_k if rotary is None else _blocked(rotary(phi_k), sb)
    touched = rot_k.transpose(-1, -2) @ _blocked(v.to(acc), sb)  # S_b: [B, heads, m, d, dv]
    if normalize:
        touched = torch.cat((touched, blocked_k.sum(3)[..., None]), dim=-1)  # z_b as the last column
    shape = (*touched.shape[:2], layout.num_blocks, *touched.shape[3:])
    return touched.new_zeros(shape).index_copy(2, sb.blocks.to(k.device), touched)


def shard_attention(
    q: torch.Tensor,
    summaries: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    offset: int = 0,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_map: str | None = "relu",
    rotary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    feature_eps: float = 0.0,
) -> torch.Tensor:
    """The MHLA output ``[B, heads, n, d_v]`` (``q.dtype``) of one shard's queries from the summed summaries.

    q ``[B, heads, n, d]``: tokens ``[offset, offset + n)``; ``summaries``: the sum over shards of
    :func:`shard_summaries` (same ``normalize``); ``mixing`` ``[M, M]`` used as given.

    Raises:
        ValueError: summaries or mixing of the wrong shape; a shard outside the layout.
    """
    sb = _check_shard(q, layout, offset, "q")
    m = layout.num_blocks
    if summaries.ndim != 5 or summaries.shape[:3] != (*q.shape[:2], m) or summaries.shape[3] != q.shape[-1]:
        raise ValueError(
            f"summaries must be [B, heads, M, d, w] = [{q.shape[0]}, {q.shape[1]}, {m}, {q.shape[-1]}, w] for q "
            f"{tuple(q.shape)} and {layout}; got {tuple(summaries.shape)}"
        )
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")
    acc = compute_dtype(q.dtype)
    dv = summaries.shape[-1] - 1 if normalize else summaries.shape[-1]
    rows = mixing.to(device=q.device, dtype=acc).index_select(0, sb.blocks.to(q.device))  # [m, M]: the shard's query blocks
    mixed = torch.einsum("im,bhmdw->bhidw", rows, summaries.to(acc))  # [B, heads, m, d, w]
    phi_q = _features(q, acc, feature_map, feature_eps)
    rot_q = _blocked(phi_q if rotary is None else rotary(phi_q), sb)  # [B, heads, m, L, d]
    out = rot_q @ mixed[..., :dv]  # [B, heads, m, L, dv]
    if normalize:  # padded places: 0 / eps = 0, dropped below
        den = (rot_q if rotary is None else _blocked(phi_q, sb)) @ mixed[..., dv:]
        out = out / (den + eps)
    return out.flatten(2, 3).index_select(2, sb.slots.to(q.device)).to(q.dtype)
