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
        query, key, value: ``[B, heads, N, d]`` (the layer's projections, q/k after its norms), on the
            model's device and in its dtype, detached.
        grid: the token grid ``(T, H, W)`` of that forward (``T * H * W = N``).
        scale: the layer's softmax scale (``attn.scale``; ``1 / sqrt(d)`` for DiT).
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
    """Run one forward of ``transformer`` and capture the q, k, v of the named self-attention layers.

    A forward pre-hook on each named attention module recomputes the layer's own ``to_q`` /
    ``to_k`` / ``to_v`` and q/k norms on its input, where the model family's stock processor
    applies them (DiT: per head after the split; SANA: over all heads before it), exactly as
    :class:`~mhla_diffusers.MHLAProcessor` does; a pre-hook on the family's patch embedding reads
    the token grid from the latent. The forward itself runs unchanged (MHLA layers run MHLA), so
    the captured q, k are those of the checkpoint as it is. Only each layer's first call is kept.

    Args:
        transformer: a supported diffusers transformer (``DiTTransformer2DModel``, ``SanaTransformer2DModel``).
        attn_names: module name(s) from ``named_modules()``, e.g. ``"transformer_blocks.2.attn1"``.
        model_inputs: keyword arguments of ``transformer(**model_inputs)``; DiT:
            ``{"hidden_states": latent [B, C, H, W], "timestep": [B] long, "class_labels": [B] long}``.

    Returns:
        ``{name: QueryKey}`` in the order of ``attn_names``.

    Raises:
        ValueError: unsupported transformer, a name that is no attention module, a cross-attention
            call (``encoder_hidden_states`` given).
        RuntimeError: a named layer or the patch embedding was not called during the forward.
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
    """``values [B, heads]`` -> per-head means over samples, and their mean / min / max over heads."""
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
    """Rank and entropy of the softmax, linear and MHLA attention matrices on captured q, k (paper Fig. 3).

    For every sample ``b`` and head ``h``: :func:`attention_matrix` of each kind (softmax with the
    layer's own scale), its :func:`matrix_rank` and :func:`row_entropy` (nats and / ``log N``).
    Summaries are per head (mean over the samples), then mean / min / max over heads.

    Args:
        qk: from :func:`capture_query_key`.
        mixing: the layer's ``[M, M]`` mixing matrix as the operator uses it (clamped); ``None``:
            the paper's locality init on ``block_grid``.
        block_grid: the block grid of ``mixing`` (required with it); without ``mixing``: the block
            grid of the locality init, default ``choose_block_grid(grid, num_blocks)``.
        num_blocks: target ``M`` of the locality init when neither is given (16: the paper's DiT
            setting; capped at ``sqrt(N)`` by :func:`~mhla_diffusers.choose_block_grid`).
        rtol: tolerance of :func:`matrix_rank` (``None``: ``N * eps(float64)``).
        max_tokens: refuse larger ``N``.

    Returns:
        ``{"num_tokens", "grid", "heads", "head_dim", "num_samples", "block_grid", "num_blocks",
        "mixing_source" ("layer" | "locality_init"), "rtol", "rank_bound": {kind: int},
        "kinds": {kind: {"rank", "entropy", "normalized_entropy": {"mean", "min", "max",
        "per_head"}, "empty_rows": fraction of rows without a distribution}},
        "per_sample": {kind: {"rank", "entropy": [B][heads] lists}}}``; entropies in nats.

    Raises:
        ValueError: ``N > max_tokens``; ``mixing`` without ``block_grid`` or of the wrong size; see
            :func:`attention_matrix`.
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
    """``(clamped mixing matrix [M, M] float64, block grid)`` of an MHLA attention layer; ``(None, None)`` without one."""
    mixing = getattr(attn, "mhla_mixing", None)
    if mixing is None:
        return None, None
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
    """Rank and entropy of one layer's softmax / linear / MHLA attention on real inputs (paper Fig. 3).

    Runs ``transformer(**model_inputs)`` once (:func:`capture_query_key`), then
    :func:`qk_statistics` on the layer's q, k: MHLA with the layer's own mixing matrix (clamped to
    ``[0, 1]``, as the processor uses it) when it has one, else the paper's locality init on
    ``block_grid`` (default ``choose_block_grid(grid, num_blocks)``). "softmax" and "linear" are
    what softmax / plain linear attention would compute on the same q, k, whatever the layer runs.

    Args:
        transformer: a supported diffusers transformer (in eval mode for meaningful numbers).
        attn_name: e.g. ``"transformer_blocks.0.attn1"``.
        model_inputs: keyword arguments of the transformer's forward (see :func:`capture_query_key`).
        num_blocks, block_grid, rtol, max_tokens: see :func:`qk_statistics`.

    Returns:
        The :func:`qk_statistics` dict plus ``"layer": attn_name``.

    Raises:
        ValueError: see :func:`capture_query_key` and :func:`qk_statistics` (``N > 4096`` included).
        RuntimeError: the layer was not called.
    """
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
