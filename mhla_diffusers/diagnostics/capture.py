"""q, k of a layer captured in a real forward, and rank / entropy per head of the three attention kinds on them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from mhla_diffusers.diagnostics.attention import (
    CHUNK_ELEMENTS,
    KINDS,
    MAX_TOKENS,
    attention_matrix,
    check_tokens,
    default_rtol,
    matrix_rank,
    rank_bound,
    row_entropy,
)
from mhla_diffusers.families import family_of
from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid
from mhla_diffusers.ops.mixing import mixing_init


# -- q, k of a real forward -----------------------------------------------------------------------
@dataclass
class QueryKey:
    """What one self-attention layer computed in a forward, before attention.

    Attributes:
        query, key, value: ``[B, heads, N, d]``, detached, in the model's device and dtype.
        grid: the token grid ``(T, H, W)`` of that forward.
        scale: the layer's softmax scale.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grid: tuple[int, int, int]
    scale: float

    @property
    def num_tokens(self) -> int:
        return self.query.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[-1]


def _project(attn, hidden_states: torch.Tensor, across_heads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[B, heads, N, d]`` as the stock processors (and MHLAProcessor) compute them."""
    if getattr(attn, "spatial_norm", None) is not None:
        raise ValueError("attention layers with a spatial_norm are not supported by the diagnostics")
    h = hidden_states
    if h.ndim == 4:
        b, c, hh, ww = h.shape
        h = h.view(b, c, hh * ww).transpose(1, 2)
    if getattr(attn, "group_norm", None) is not None:
        h = attn.group_norm(h.transpose(1, 2)).transpose(1, 2)
    batch = h.shape[0]
    query, key, value = attn.to_q(h), attn.to_k(h), attn.to_v(h)
    norm_q, norm_k = getattr(attn, "norm_q", None), getattr(attn, "norm_k", None)
    if across_heads:
        query = query if norm_q is None else norm_q(query)
        key = key if norm_k is None else norm_k(key)
    head_dim = key.shape[-1] // attn.heads
    query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
    key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
    value = value.view(batch, -1, attn.heads, value.shape[-1] // attn.heads).transpose(1, 2)
    if not across_heads:
        query = query if norm_q is None else norm_q(query)
        key = key if norm_k is None else norm_k(key)
    return query.detach(), key.detach(), value.detach()


@torch.no_grad()
def capture_query_key(
    transformer: torch.nn.Module, attn_names: str | Sequence[str], model_inputs: Mapping[str, Any]
) -> dict[str, QueryKey]:
    """``{name: QueryKey}`` of the named self-attention layers in one unchanged forward ``transformer(**model_inputs)``.

    Hooks recompute each layer's projections and q/k norms as its stock processor applies them.

    Raises:
        ValueError: unsupported transformer, a name that is no attention module, a cross-attention call.
        RuntimeError: a named layer or the patch embedding was not called.
    """
    family = family_of(transformer)
    names = [attn_names] if isinstance(attn_names, str) else list(attn_names)
    modules = dict(transformer.named_modules())
    for name in names:
        module = modules.get(name)
        if module is None or not all(hasattr(module, a) for a in ("to_q", "to_k", "to_v", "heads")):
            attn = [n for n, m in modules.items() if re.search(family.self_attention, n)]
            raise ValueError(f"{name!r} is not an attention module of this {type(transformer).__name__}; e.g. {attn[:3]}")
    captured: dict[str, tuple] = {}
    grids: list[tuple[int, int, int]] = []

    def grid_hook(module, args):
        if args and isinstance(args[0], torch.Tensor) and not grids:
            grids.append(family.grid_from_latent(args[0], transformer.config))

    def make_hook(name):
        def hook(module, args, kwargs):
            if name in captured:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            encoder = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
            if encoder is not None:
                raise ValueError(f"{name} was called as cross-attention (encoder_hidden_states given); diagnose self-attention layers")
            captured[name] = _project(module, hidden, family.qk_norm_across_heads)

        return hook

    handles = [transformer.get_submodule(family.patch_embed).register_forward_pre_hook(grid_hook)]
    try:
        for name in names:
            handles.append(modules[name].register_forward_pre_hook(make_hook(name), with_kwargs=True))
        transformer(**model_inputs)
    finally:
        for handle in handles:
            handle.remove()
    if not grids:
        raise RuntimeError(f"the patch embedding {family.patch_embed!r} was not called: the token grid is unknown")
    missing = [n for n in names if n not in captured]
    if missing:
        raise RuntimeError(f"the attention layers {missing} were not called during the forward")
    grid = grids[0]
    out = {}
    for name in names:
        q, k, v = captured[name]
        if q.shape[-2] != grid[0] * grid[1] * grid[2]:
            raise RuntimeError(f"{name} saw {q.shape[-2]} tokens, but the token grid {grid} has {grid[0] * grid[1] * grid[2]}")
        scale = getattr(modules[name], "scale", None)
        out[name] = QueryKey(q, k, v, grid, float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return out


def _summary(values: torch.Tensor) -> dict[str, Any]:
    per_head = values.to(torch.float64).nanmean(dim=0)
    finite = per_head[~torch.isnan(per_head)]
    if finite.numel() == 0:
        finite = torch.full((1,), float("nan"), dtype=torch.float64)
    return {
        "mean": float(finite.mean()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "per_head": [float(x) for x in per_head],
    }


def qk_statistics(
    qk: QueryKey,
    *,
    mixing: torch.Tensor | None = None,
    block_grid: Sequence[int] | None = None,
    num_blocks: int = 16,
    rtol: float | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """Rank and entropy of the softmax, linear and MHLA matrices on captured q, k, per head (paper Fig. 3).

    MHLA uses ``mixing`` (clamped, with its ``block_grid``), else the locality init on ``block_grid``
    (default ``choose_block_grid(grid, num_blocks)``). Returns sizes, block grid, ``mixing_source``,
    ``rank_bound`` and per-kind summaries (``docs/diagnostics.md``).

    Raises:
        ValueError: ``N > max_tokens``; ``mixing`` without ``block_grid`` or of the wrong size.
    """
    q, k = qk.query, qk.key
    batch, heads, n, d = q.shape
    check_tokens(n, max_tokens)
    if mixing is not None:
        if block_grid is None:
            raise ValueError("pass the block_grid the mixing matrix belongs to (MixingMatrix.block_grid)")
        layout = BlockLayout(qk.grid, block_grid)
        mixing_source = "layer"
    else:
        layout = BlockLayout(qk.grid, block_grid if block_grid is not None else choose_block_grid(qk.grid, num_blocks))
        mixing = mixing_init(layout, dtype=torch.float64)
        mixing_source = "locality_init"
    tol = default_rtol(n) if rtol is None else float(rtol)
    ranks = {kind: torch.zeros(batch, heads, dtype=torch.float64) for kind in KINDS}
    entropy = {kind: torch.zeros(batch, heads, dtype=torch.float64) for kind in KINDS}
    empty = {kind: 0 for kind in KINDS}
    step = max(1, CHUNK_ELEMENTS // (n * n))
    for b in range(batch):
        for h0 in range(0, heads, step):
            sl = (slice(b, b + 1), slice(h0, h0 + step))
            for kind in KINDS:
                A = attention_matrix(
                    q[sl], k[sl], kind, mixing=mixing, layout=layout, scale=qk.scale, max_tokens=max_tokens
                )
                ranks[kind][sl] = matrix_rank(A, rtol=tol).to("cpu", torch.float64)
                entropy[kind][sl] = row_entropy(A).cpu()
                empty[kind] += int((A.sum(dim=-1) == 0).sum())
                del A
    log_n = math.log(n) if n > 1 else 1.0
    kinds = {}
    for kind in KINDS:
        kinds[kind] = {
            "rank": _summary(ranks[kind]),
            "entropy": _summary(entropy[kind]),
            "normalized_entropy": _summary(entropy[kind] / log_n if n > 1 else entropy[kind] * 0),
            "empty_rows": empty[kind] / (batch * heads * n),
        }
    return {
        "num_tokens": n,
        "grid": list(qk.grid),
        "heads": heads,
        "head_dim": d,
        "num_samples": batch,
        "block_grid": list(layout.block_grid),
        "num_blocks": layout.num_blocks,
        "mixing_source": mixing_source,
        "rtol": tol,
        "log_num_tokens": math.log(n),
        "rank_bound": {kind: rank_bound(layout, d, kind) for kind in KINDS},
        "kinds": kinds,
        "per_sample": {
            kind: {"rank": ranks[kind].tolist(), "entropy": entropy[kind].tolist()} for kind in KINDS
        },
    }


def layer_mixing(attn) -> tuple[torch.Tensor | None, tuple[int, int, int] | None]:
    """``(clamped mixing [M, M] float64, block grid)`` of an MHLA layer, or ``(None, None)``."""
    layer = getattr(attn, "mhla", None)
    if layer is None:
        return None, None
    mixing = layer.mixing
    return mixing.clamped().detach().to(torch.float64), tuple(mixing.block_grid)


def layer_statistics(
    transformer: torch.nn.Module,
    attn_name: str,
    model_inputs: Mapping[str, Any],
    *,
    num_blocks: int = 16,
    block_grid: Sequence[int] | None = None,
    rtol: float | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """:func:`qk_statistics` of one layer on real inputs (its own mixing if MHLA), plus ``"layer"``; raises as both."""
    qk = capture_query_key(transformer, attn_name, model_inputs)[attn_name]
    mixing, grid = layer_mixing(transformer.get_submodule(attn_name))
    stats = qk_statistics(
        qk,
        mixing=mixing,
        block_grid=grid if mixing is not None else block_grid,
        num_blocks=num_blocks,
        rtol=rtol,
        max_tokens=max_tokens,
    )
    return {"layer": attn_name, **stats}
