"""Diagnostics of "global context collapse": rank and entropy of implied attention matrices.

The MHLA paper (arXiv 2601.07832, Sec. 3.2 and Fig. 3) diagnoses plain linear attention by two
numbers of its attention matrix ``A`` (``[N, N]``, one per head, rows = queries):

* **rank** — ``A_lin = phi(Q) phi(K)^T`` has ``rank(A_lin) <= min(rank(phi(Q)), rank(phi(K))) <= d``
  (Sec. 3.2, "rank collapse"); MHLA's ``A[i, t] = Mc[b(i), b(t)] phi(q_i) . phi(k_t)`` stacks
  per-query-block products ``phi(Q_b) Y_b`` and reaches
  ``rank(A_MHLA) <= min(N, sum_b min(N_b, d))`` (Sec. 4.3); softmax attention is not bounded
  below ``N``.
* **entropy** — the mean Shannon entropy of the rows of the row-normalised ``A`` (Fig. 3(a)):
  linear attention spreads each query's mass almost uniformly (high entropy), softmax and MHLA
  concentrate it (lower entropy).

This module measures both for softmax, plain (ReLU) linear attention and MHLA on the very q, k a
diffusers transformer computes on real inputs, and draws mixing matrices on their block grid:

* :func:`attention_matrix` — the three row-normalised ``[B, heads, N, N]`` matrices (float64);
* :func:`matrix_rank`, :func:`row_entropy`, :func:`rank_bound` — the numbers and the paper's bounds;
* :func:`capture_query_key`, :func:`qk_statistics`, :func:`layer_statistics` — q, k captured in a
  real forward, then rank / entropy per head for the three kinds;
* :func:`diagnostic_inputs`, :func:`diagnose_pipeline`, :func:`write_report` — what
  ``benchmarks/diagnose.py`` runs on a (converted) DiT pipeline folder;
* :func:`plot_mixing_matrix`, :func:`plot_rank_entropy` — PNG pictures (matplotlib, Agg canvas).

Everything here is dense ``O(N^2)`` per head and meant for diagnosis: at most
:data:`MAX_TOKENS` tokens (a 64 x 64 token grid).
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from diffusers import DDPMScheduler

from mhla_diffusers.checkpoint.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from mhla_diffusers.models.families import family_of, self_attention_modules
from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid, normalize_grid
from mhla_diffusers.ops.mixing import mixing_init
from mhla_diffusers.ops.naive import implied_attention

__all__ = [
    "KINDS",
    "MAX_TOKENS",
    "attention_matrix",
    "matrix_rank",
    "default_rtol",
    "row_entropy",
    "rank_bound",
    "QueryKey",
    "capture_query_key",
    "qk_statistics",
    "layer_statistics",
    "diagnostic_inputs",
    "diagnose_pipeline",
    "write_report",
    "markdown_report",
    "plot_mixing_matrix",
    "plot_rank_entropy",
]

KINDS: tuple[str, ...] = ("softmax", "linear", "mhla")
"""The attention kinds compared: softmax, plain ReLU linear attention, MHLA."""

MAX_TOKENS = 4096
"""Largest ``N`` the dense diagnostics accept (one float64 ``N x N`` matrix is 128 MiB at 4096)."""

_CHUNK_ELEMENTS = 1 << 25  # float64 elements of the [.., N, N] matrices built at once (256 MiB)


# -- the matrices ---------------------------------------------------------------------------------
def _check_tokens(num_tokens: int, max_tokens: int) -> None:
    if num_tokens > max_tokens:
        gib = num_tokens * num_tokens * 8 / 2**30
        raise ValueError(
            f"{num_tokens} tokens: the dense diagnostics build N x N float64 matrices ({gib:.2f} GiB per head "
            f"and sample) and accept at most {max_tokens} tokens; use a lower resolution (fewer latent pixels "
            f"or a larger patch)"
        )


def _row_normalise(scores: torch.Tensor) -> torch.Tensor:
    """Divide each row by its sum; rows summing to 0 (queries whose ReLU features are all 0) stay 0."""
    total = scores.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, scores / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(scores))


def attention_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    kind: str,
    *,
    mixing: torch.Tensor | None = None,
    layout: BlockLayout | None = None,
    scale: float | None = None,
    max_tokens: int = MAX_TOKENS,
) -> torch.Tensor:
    """The row-normalised attention matrix of one attention kind, dense.

    With ``phi = ReLU`` (this project's feature map, applied after the model's q/k norms):

    * ``"softmax"``: ``A = softmax(q k^T * scale)``, ``scale`` default ``1 / sqrt(d)``;
    * ``"linear"``: plain linear attention, ``A[i, t] = phi(q_i) . phi(k_t) / sum_s phi(q_i) . phi(k_s)``
      (MHLA paper Sec. 3.2: ``A_lin = phi(Q) phi(K)^T``, rank ``<= d``);
    * ``"mhla"``: the implied MHLA matrix ``A[i, t] = Mc[b(i), b(t)] phi(q_i) . phi(k_t)``
      (:func:`mhla_diffusers.ops.naive.implied_attention`; paper Sec. 3.2, "block selection x
      intra-block reweighting"), rows normalised: exactly the weights MHLA's output
      ``phi(q) S~ / phi(q) . z~`` applies to the values (with ``eps = 0``).

    A query whose linear / MHLA scores are all zero (``phi(q_i) = 0``, or only zero-weight blocks)
    has no attention distribution: its row is returned as zeros (such "empty" rows are skipped by
    :func:`row_entropy` and do not count towards the rank).

    Args:
        q, k: ``[B, heads, N, d]``, any floating dtype, same shape (the layer's q and k after its
            projections and q/k norms).
        kind: ``"softmax"``, ``"linear"`` or ``"mhla"``.
        mixing: ``[M, M]`` mixing matrix (``"mhla"`` only), used as given, entries in ``[0, 1]``
            expected: pass ``MixingMatrix.clamped()``, what the processor uses.
        layout: the :class:`~mhla_diffusers.BlockLayout` of the ``N`` tokens (``"mhla"`` only).
        scale: softmax temperature (``"softmax"`` only); ``None``: ``1 / sqrt(d)``.
        max_tokens: refuse larger ``N`` (dense ``N x N`` float64 per head and sample).

    Returns:
        ``[B, heads, N, N]`` float64 on ``q``'s device; every non-empty row sums to 1.

    Raises:
        ValueError: unknown ``kind``; q, k not ``[B, heads, N, d]`` of equal shape; ``"mhla"``
            without ``mixing`` or ``layout``, a layout with another ``N``, a mixing matrix that is
            not ``[M, M]`` or has negative entries; ``N > max_tokens``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {list(KINDS)}")
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, heads, N, d] with equal shapes; got {tuple(q.shape)} and {tuple(k.shape)}")
    n, d = q.shape[-2], q.shape[-1]
    _check_tokens(n, max_tokens)
    q64, k64 = q.detach().to(torch.float64), k.detach().to(torch.float64)
    if kind == "softmax":
        s = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return torch.softmax((q64 @ k64.transpose(-1, -2)) * s, dim=-1)
    if kind == "linear":
        return _row_normalise(torch.relu(q64) @ torch.relu(k64).transpose(-1, -2))
    if mixing is None or layout is None:
        missing = " and ".join(name for name, x in (("mixing", mixing), ("layout", layout)) if x is None)
        raise ValueError(
            f"kind='mhla' needs the {missing}: mixing=[M, M] (e.g. attn.mhla_mixing.clamped() or "
            f"mhla_diffusers.mixing_init(layout)) and layout=BlockLayout(grid, block_grid)"
        )
    if layout.num_tokens != n:
        raise ValueError(f"q has {n} tokens but the layout {layout} has {layout.num_tokens}")
    m = layout.num_blocks
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for {layout}; got {tuple(mixing.shape)}")
    if bool((mixing < 0).any()):
        raise ValueError(
            "the mixing matrix has negative entries, which give no attention distribution; pass the "
            "matrix the operator uses, clamped to [0, 1] (MixingMatrix.clamped())"
        )
    scores = implied_attention(q64, k64, mixing.detach().to(q64.device), layout, dtype=torch.float64)
    return _row_normalise(scores)


def default_rtol(num_tokens: int) -> float:
    """The default relative tolerance of :func:`matrix_rank`: ``N * eps(float64)`` (about 5.7e-14 at ``N = 256``).

    The convention of ``numpy.linalg.matrix_rank`` / ``torch.linalg.matrix_rank``: a singular value
    counts when it exceeds what float64 rounding of an ``N x N`` matrix can produce, so ranks that
    are exact in exact arithmetic (linear attention's ``<= d``) are measured exactly.
    """
    return num_tokens * torch.finfo(torch.float64).eps


def matrix_rank(A: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Numerical rank of each ``N x N`` (or ``N x K``) matrix in ``A``.

    ``rank = #{ i : sigma_i > rtol * sigma_max }`` with the singular values computed in float64
    (``torch.linalg.svdvals``). The paper's Fig. 3(b) compares this number for softmax, linear
    attention and MHLA; its bounds are ``<= d`` for linear attention and
    ``<= min(N, sum_b min(N_b, d))`` for MHLA (see :func:`rank_bound`). Row normalisation does not
    change the rank (a diagonal scaling), except that all-zero rows add nothing.

    Args:
        A: ``[..., N, K]`` floating tensor (e.g. the ``[B, heads, N, N]`` of :func:`attention_matrix`).
        rtol: relative tolerance; ``None``: :func:`default_rtol` of ``max(N, K)`` (numpy's
            convention). Looser values (``1e-6``, ``1e-3``) count only the "significant" directions.

    Returns:
        ``[...]`` int64 tensor (CPU or ``A``'s device). An all-zero matrix has rank 0.

    Raises:
        ValueError: ``A`` has fewer than 2 dimensions, or ``rtol`` is negative.
    """
    if A.ndim < 2:
        raise ValueError(f"A must be [..., N, K]; got shape {tuple(A.shape)}")
    tol = default_rtol(max(A.shape[-2:])) if rtol is None else float(rtol)
    if not tol >= 0:
        raise ValueError(f"rtol must be >= 0; got {rtol}")
    s = torch.linalg.svdvals(A.detach().to(torch.float64))
    top = s.amax(dim=-1, keepdim=True)
    return ((s > tol * top) & (s > 0)).sum(dim=-1)


def row_entropy(A: torch.Tensor, *, normalized: bool = False, atol: float = 1e-6) -> torch.Tensor:
    """Mean Shannon entropy of the rows of row-stochastic matrices (paper Fig. 3(a), "attention entropy").

    ``H(row i) = - sum_t A[i, t] log A[i, t]`` in nats (``0 log 0 = 0``), averaged over the non-empty
    rows of each matrix (all-zero rows, queries without a distribution, are skipped). ``H`` ranges
    from 0 (one-hot rows: fully selective) to ``log K`` (uniform rows: no selectivity); the paper's
    "elevated entropy" of linear attention is this number near ``log K``.

    Args:
        A: ``[..., N, K]``, non-negative, every non-empty row summing to 1 (within ``atol``).
        normalized: divide by ``log K`` (so 1 = uniform); ``K = 1`` gives 0.
        atol: tolerance of the row-sum check.

    Returns:
        ``[...]`` float64 tensor: mean row entropy in nats (or normalised); NaN where every row is empty.

    Raises:
        ValueError: ``A`` has fewer than 2 dimensions, negative entries, or a non-empty row not
            summing to 1.
    """
    if A.ndim < 2:
        raise ValueError(f"A must be [..., N, K]; got shape {tuple(A.shape)}")
    p = A.detach().to(torch.float64)
    if bool((p < 0).any()):
        raise ValueError("A has negative entries; row_entropy needs attention distributions (non-negative rows)")
    sums = p.sum(dim=-1)
    nonempty = sums > 0
    if bool(((sums - 1).abs() > atol)[nonempty].any()):
        worst = float((sums - 1).abs()[nonempty].max())
        raise ValueError(f"rows of A must sum to 1 (or be all zero); the largest deviation is {worst:.3g}")
    h = -torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p)).sum(dim=-1)
    count = nonempty.sum(dim=-1)
    mean = torch.where(nonempty, h, torch.zeros_like(h)).sum(dim=-1) / count.clamp(min=1)
    mean = torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
    if normalized:
        k = A.shape[-1]
        mean = mean / math.log(k) if k > 1 else torch.where(count > 0, torch.zeros_like(mean), mean)
    return mean


def rank_bound(layout: BlockLayout, head_dim: int, kind: str = "mhla") -> int:
    """The largest rank an attention matrix of ``kind`` can have on ``layout``'s ``N`` tokens.

    * ``"mhla"``: ``min(N, sum_b min(N_b, d))`` — MHLA paper Sec. 4.3: each query block's rows
      ``phi(Q_b) Y_b`` have rank ``<= min(N_b, d)`` and ranks add at most under stacking
      (attainable for generic q, k when the block row spaces are independent); for ``M`` blocks
      of ``>= d`` tokens this is ``min(N, M d)``. Holds for any mixing matrix (with all-ones
      mixing MHLA is plain linear attention, rank ``<= d``).
    * ``"linear"``: ``min(N, d)`` — Sec. 3.2: ``rank(phi(Q) phi(K)^T) <= d`` whatever ``N``.
    * ``"softmax"``: ``N`` (no bound below full rank).

    Args:
        layout: token grid and block grid (only ``N`` matters for ``"linear"`` / ``"softmax"``).
        head_dim: ``d``, the per-head q/k dimension (>= 1).
        kind: ``"mhla"`` (default), ``"linear"`` or ``"softmax"``.

    Returns:
        The bound (int).

    Raises:
        ValueError: unknown ``kind`` or ``head_dim < 1``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {list(KINDS)}")
    d = int(head_dim)
    if d < 1:
        raise ValueError(f"head_dim must be >= 1; got {head_dim}")
    n = layout.num_tokens
    if kind == "softmax":
        return n
    if kind == "linear":
        return min(n, d)
    return min(n, int(torch.clamp(layout.block_sizes, max=d).sum()))


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
    _check_tokens(n, max_tokens)
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
    step = max(1, _CHUNK_ELEMENTS // (n * n))
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


def _layer_mixing(attn) -> tuple[torch.Tensor | None, tuple[int, int, int] | None]:
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
    mixing, grid = _layer_mixing(transformer.get_submodule(attn_name))
    stats = qk_statistics(
        qk,
        mixing=mixing,
        block_grid=grid if mixing is not None else block_grid,
        num_blocks=num_blocks,
        rtol=rtol,
        max_tokens=max_tokens,
    )
    return {"layer": attn_name, **stats}


# -- a pipeline, end to end -----------------------------------------------------------------------
@torch.no_grad()
def diagnostic_inputs(
    pipe,
    *,
    num_samples: int = 4,
    timesteps: Sequence[int] = (100, 500, 900),
    seed: int = 1234,
    short_side: int | None = None,
) -> dict[str, Any]:
    """Real model inputs for a class-conditional DiT pipeline: photo crops, encoded and noised.

    ``num_samples`` crops of the photographs shipped in the scikit-image / scikit-learn wheels
    (:class:`~mhla_diffusers.training.data.PhotoCrops`, seed ``seed``) at the checkpoint's resolution
    (``transformer.config.sample_size * vae factor`` pixels), encoded by ``pipe.vae``
    (``latent_dist.mode() * scaling_factor``) and noised with a ``DDPMScheduler`` built from
    ``pipe.scheduler.config`` at every timestep of ``timesteps``; sample ``(i, j)`` (crop ``i``,
    timestep ``j``) is batch row ``i * len(timesteps) + j``. Class labels: the photo's class in
    the pipeline's ``id2label`` when it names the shipped photos (the demo's), else the photo's
    index in ``PHOTO_NAMES``.

    Returns:
        ``{"model_inputs": {"hidden_states" [B, C, h, w], "timestep" [B] long, "class_labels" [B] long},
        "timesteps": [B] list, "labels": [B] list of names, "resolution": pixels}`` with
        ``B = num_samples * len(timesteps)``, tensors on the transformer's device and dtype.

    Raises:
        ValueError: non-positive ``num_samples``, empty ``timesteps`` or one outside
            ``[0, num_train_timesteps)``, a transformer without ``sample_size``.
    """
    # function-level import: the photo dataset and the VAE's factor live with training, which imports
    # accelerate and the training recipes; only real-image inputs need them, not `import diagnostics`
    from mhla_diffusers.training.data import PHOTO_NAMES, PhotoCrops
    from mhla_diffusers.training.recipes import vae_scale_factor

    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer; got {num_samples!r}")
    timesteps = [int(t) for t in timesteps]
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    total = scheduler.config.num_train_timesteps
    if not timesteps or any(not 0 <= t < total for t in timesteps):
        raise ValueError(f"timesteps must be a non-empty list in [0, {total}); got {timesteps}")
    transformer, vae = pipe.transformer, pipe.vae
    size = transformer.config.get("sample_size")
    if size is None:
        raise ValueError("the transformer's config has no sample_size: cannot tell the checkpoint's resolution")
    resolution = int(size if isinstance(size, int) else size[0]) * vae_scale_factor(vae)
    raw = dict(pipe.config.get("id2label") or {}) if hasattr(pipe, "config") else {}
    id2label = {int(key): str(v) for key, v in raw.items()}
    if id2label and sorted(id2label) == list(range(len(id2label))) and all(v in PHOTO_NAMES for v in id2label.values()):
        photos = [id2label[i] for i in range(len(id2label))]
    else:
        photos = list(PHOTO_NAMES)
    classes = int(transformer.config.get("num_embeds_ada_norm") or 1000)
    per_photo = max(1, -(-num_samples // len(photos)))
    data = PhotoCrops(resolution=resolution, short_side=short_side, crops_per_photo=per_photo, seed=seed, hflip=False, photos=photos)
    items = [data[i] for i in range(num_samples)]
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    pixels = torch.stack([it["pixel_values"] for it in items]).to(device, vae.dtype)
    labels = torch.stack([it["class_labels"] for it in items]) % classes
    latents = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor
    reps = len(timesteps)
    latents = latents.repeat_interleave(reps, dim=0)
    t = torch.tensor(timesteps * num_samples, dtype=torch.long)
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(device, latents.dtype)
    noisy = scheduler.add_noise(latents, noise, t.to(device))
    labels = labels.repeat_interleave(reps)
    return {
        "model_inputs": {"hidden_states": noisy.to(dtype), "timestep": t.to(device), "class_labels": labels.to(device)},
        "timesteps": t.tolist(),
        "labels": [photos[int(i)] if int(i) < len(photos) else str(int(i)) for i in labels],
        "resolution": resolution,
    }


def diagnose_pipeline(
    pipe,
    *,
    layers: Sequence[int] | None = None,
    num_samples: int = 4,
    timesteps: Sequence[int] = (100, 500, 900),
    num_blocks: int = 16,
    rtol: float | None = None,
    seed: int = 1234,
    short_side: int | None = None,
) -> dict[str, Any]:
    """Rank / entropy of softmax, linear and MHLA attention on every (or the chosen) self-attention
    layer of a DiT pipeline, on real inputs (:func:`diagnostic_inputs`), from one forward.

    Args:
        pipe: a ``DiTPipeline`` (plain or from :func:`mhla_diffusers.load_mhla_pipeline`).
        layers: self-attention layer indices (``None``: all).
        num_samples, timesteps, seed, short_side: see :func:`diagnostic_inputs`.
        num_blocks, rtol: see :func:`qk_statistics` (``num_blocks`` only for layers without MHLA).

    Returns:
        ``{"model", "resolution", "timesteps", "labels", "layers": [layer_statistics dicts, each with
        "index"]}``.

    Raises:
        ValueError: a layer index out of range; see :func:`diagnostic_inputs` and :func:`qk_statistics`.
    """
    transformer = pipe.transformer
    modules = self_attention_modules(transformer, family_of(transformer))
    chosen = list(range(len(modules))) if layers is None else [int(i) for i in layers]
    bad = [i for i in chosen if not 0 <= i < len(modules)]
    if bad or not chosen:
        raise ValueError(
            f"layer indices {bad or chosen} out of range: the model has {len(modules)} self-attention layers (0..{len(modules) - 1})"
        )
    inputs = diagnostic_inputs(pipe, num_samples=num_samples, timesteps=timesteps, seed=seed, short_side=short_side)
    was_training = transformer.training
    transformer.eval()
    try:
        captured = capture_query_key(transformer, [modules[i][0] for i in chosen], inputs["model_inputs"])
    finally:
        transformer.train(was_training)
    results = []
    for i in chosen:
        name, attn = modules[i]
        mixing, grid = _layer_mixing(attn)
        stats = qk_statistics(captured[name], mixing=mixing, block_grid=grid, num_blocks=num_blocks, rtol=rtol)
        results.append({"layer": name, "index": i, "layer_kind": "mhla" if mixing is not None else "stock", **stats})
    return {
        "model": type(transformer).__name__,
        "resolution": inputs["resolution"],
        "timesteps": inputs["timesteps"],
        "labels": inputs["labels"],
        "layers": results,
    }


def _fmt(summary: Mapping[str, Any], digits: int) -> str:
    return f"{summary['mean']:.{digits}f} ({summary['min']:.{digits}f}-{summary['max']:.{digits}f})"


def markdown_report(result: Mapping[str, Any]) -> str:
    """A markdown summary of :func:`diagnose_pipeline`'s result: one table row per layer and kind,
    then the means over layers at each timestep."""
    layers = result["layers"]
    lines = [
        "# Attention rank and entropy (MHLA paper, Fig. 3)",
        "",
        f"{result['model']}, {result['resolution']} px inputs, {len(result['timesteps'])} samples "
        f"(timesteps {sorted(set(result['timesteps']))}). Per head: mean over samples; table: mean over "
        "heads (min-max over heads). Rank: numerical rank of the row-normalised N x N matrix "
        f"(rtol = {layers[0]['rtol']:.2g}); bound: softmax N, linear min(N, d), MHLA min(N, sum_b min(N_b, d)). "
        "Entropy: mean row entropy in nats (log N = uniform rows).",
        "",
        "| layer | runs | N | d | blocks (mixing) | kind | rank | bound | entropy (nats) | entropy / log N | empty rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in layers:
        blocks = f"{'x'.join(str(x) for x in s['block_grid'])} ({s['mixing_source'].replace('_', ' ')})"
        for kind in KINDS:
            k = s["kinds"][kind]
            lines.append(
                f"| {s.get('index', s['layer'])} | {s.get('layer_kind', '')} | {s['num_tokens']} | {s['head_dim']} | {blocks} | {kind} | "
                f"{_fmt(k['rank'], 1)} | {s['rank_bound'][kind]} | {_fmt(k['entropy'], 3)} | "
                f"{k['normalized_entropy']['mean']:.3f} | {k['empty_rows']:.3f} |"
            )
    timesteps = result["timesteps"]
    unique = sorted(set(timesteps))
    if len(unique) > 1:
        lines += ["", "Means over layers, heads and samples, per timestep:", "",
                  "| timestep | " + " | ".join(f"rank {k}" for k in KINDS) + " | " + " | ".join(f"entropy {k}" for k in KINDS) + " |",
                  "|---|" + "---|" * (2 * len(KINDS))]
        for t in unique:
            rows = [i for i, x in enumerate(timesteps) if x == t]
            cells = []
            for metric in ("rank", "entropy"):
                for kind in KINDS:
                    vals = torch.tensor([s["per_sample"][kind][metric][i] for s in layers for i in rows], dtype=torch.float64)
                    cells.append(f"{float(vals.nanmean()):.{1 if metric == 'rank' else 3}f}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: Mapping[str, Any], out_dir: str | os.PathLike, pipe=None) -> dict[str, Path]:
    """Write :func:`diagnose_pipeline`'s result into ``out_dir`` (each file atomically).

    Files: ``diagnostics.json`` (everything), ``diagnostics.md`` (:func:`markdown_report`),
    ``rank_entropy.png`` (:func:`plot_rank_entropy`), and the mixing matrices:
    ``mixing_layer<i>.png`` for every diagnosed layer with MHLA (``pipe`` given), or
    ``mixing_locality_init.png`` for the locality init used where layers have none.

    Returns:
        ``{name: path}`` of the written files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "json": atomic_write_json(out / "diagnostics.json", result, indent=1),
        "markdown": atomic_write_text(out / "diagnostics.md", markdown_report(result)),
        "rank_entropy": plot_rank_entropy(result["layers"], out / "rank_entropy.png"),
    }
    init_done = False
    for s in result["layers"]:
        if s["mixing_source"] == "layer" and pipe is not None:
            mixing, grid = _layer_mixing(pipe.transformer.get_submodule(s["layer"]))
            files[f"mixing_layer{s['index']}"] = plot_mixing_matrix(
                mixing, grid, out / f"mixing_layer{s['index']}.png", title=f"{s['layer']}: mixing matrix (clamped)"
            )
        elif s["mixing_source"] == "locality_init" and not init_done:
            grid = tuple(s["block_grid"])
            files["mixing_locality_init"] = plot_mixing_matrix(
                mixing_init(grid), grid, out / "mixing_locality_init.png", title=f"locality init, block grid {grid}"
            )
            init_done = True
    return files


# -- pictures -------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    try:  # function-level import: matplotlib is optional (the dev / demo extras), needed only for pictures
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the diagnostics pictures need matplotlib: pip install matplotlib") from err
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def plot_mixing_matrix(
    mixing: torch.Tensor,
    block_grid: Sequence[int],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    time_slice: int | None = None,
) -> Path:
    """Draw a mixing matrix as one small panel per query block, each row shown on the block grid.

    Row ``i`` of ``Mc`` (how much query block ``i`` reads each block's summary, paper Sec. 3.2)
    is reshaped to the block grid ``(bh, bw)`` and drawn as an image in the panel at block ``i``'s
    own position on the block grid; the query block itself is outlined. All panels share one colour
    scale (``[0, max Mc]``, one colour bar), so a locality-biased matrix shows bright neighbourhoods
    moving across the grid.

    3D block grids (``bt > 1``, video): only the query blocks of one time slice are drawn
    (``time_slice``, default the middle one ``bt // 2``), still on the ``bh x bw`` panel grid; each
    panel is a strip of ``bt`` images, the row's key blocks of time slices ``0 .. bt - 1`` from
    left to right, separated by a blank column.

    Args:
        mixing: ``[M, M]`` with ``M = bt * bh * bw`` (rows = query blocks, block ids row-major).
        block_grid: ``(bt, bh, bw)`` or ``(bh, bw)``.
        path: the PNG to write (atomically: a temporary file renamed into place).
        title: figure title.
        time_slice: the query time slice of a 3D grid.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: ``mixing`` not ``[M, M]`` for the block grid, or ``time_slice`` out of range.
        ImportError: matplotlib missing.
    """
    bt, bh, bw = normalize_grid(tuple(block_grid), "block_grid")
    m = bt * bh * bw
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for block grid {(bt, bh, bw)}; got {tuple(mixing.shape)}")
    ts = bt // 2 if time_slice is None else int(time_slice)
    if not 0 <= ts < bt:
        raise ValueError(f"time_slice must be in [0, {bt}); got {time_slice}")
    mc = mixing.detach().to("cpu", torch.float64)
    vmax = float(mc.max()) if float(mc.max()) > 0 else 1.0
    vmin = min(0.0, float(mc.min()))
    strip_w = bt * bw + (bt - 1)
    # panel sizes in inches: each panel shows bh x strip_w cells; the whole grid at most ~10 in wide
    pw = min(1.5 * max(1.0, strip_w / max(bh, bw)), 10.0 / bw)
    ph = pw * bh / strip_w
    gap, top, right = 0.08, (0.45 if title else 0.1), 1.0
    width, height = bw * pw * (1 + gap) + 0.2 + right, bh * ph * (1 + gap) + 0.2 + top
    fig = _figure(width, height)
    grid = fig.add_gridspec(
        bh, bw, left=0.1 / width, right=1 - right / width, bottom=0.1 / height, top=1 - top / height, wspace=gap, hspace=gap
    )
    image = None
    for ih in range(bh):
        for iw in range(bw):
            i = (ts * bh + ih) * bw + iw
            row = mc[i].reshape(bt, bh, bw).numpy()
            strip = np.full((bh, strip_w), np.nan)
            for t in range(bt):
                strip[:, t * (bw + 1) : t * (bw + 1) + bw] = row[t]
            ax = fig.add_subplot(grid[ih, iw])
            image = ax.imshow(strip, vmin=vmin, vmax=vmax, cmap="viridis", interpolation="nearest")
            x0 = ts * (bw + 1) + iw
            ax.add_patch(_rectangle((x0 - 0.5, ih - 0.5), 1, 1))
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=9)
    cax = fig.add_axes([1 - (right - 0.15) / width, 0.1 / height, 0.15 / width, 1 - (top + 0.1) / height])
    fig.colorbar(image, cax=cax)
    return _save_png(fig, path)


def _rectangle(xy, w, h):
    from matplotlib.patches import Rectangle  # optional dependency (see _figure), loaded once _figure succeeded

    return Rectangle(xy, w, h, fill=False, edgecolor="red", linewidth=1.0)


def plot_rank_entropy(stats: Mapping[str, Any] | Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Bar charts of rank and entropy per attention kind (softmax / linear / MHLA), like paper Fig. 3.

    Left: numerical rank (mean over heads, error bars min-max over heads) with the bounds ``d``
    (linear) and ``N`` dashed; right: mean row entropy in nats with ``log N`` (uniform rows) dashed.
    One group of bars per layer when ``stats`` holds several layers.

    Args:
        stats: one :func:`layer_statistics` / :func:`qk_statistics` dict, or a list of them.
        path: the PNG to write (atomically).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: empty ``stats``. ImportError: matplotlib missing.
    """
    layers = [stats] if isinstance(stats, Mapping) else list(stats)
    if not layers:
        raise ValueError("stats is empty: nothing to plot")
    colours = {"softmax": "tab:blue", "linear": "tab:orange", "mhla": "tab:green"}
    n_layers = len(layers)
    fig = _figure(min(16.0, 4.0 + 1.1 * n_layers) * 1.6, 3.6)
    axes = [fig.add_subplot(1, 2, j + 1) for j in range(2)]
    width = 0.8 / len(KINDS)
    x = np.arange(n_layers)
    names = [str(s.get("index", s.get("layer", i))) for i, s in enumerate(layers)]
    for ax, metric, label in ((axes[0], "rank", "numerical rank"), (axes[1], "entropy", "row entropy (nats)")):
        for j, kind in enumerate(KINDS):
            mean = np.array([s["kinds"][kind][metric]["mean"] for s in layers])
            lo = np.array([s["kinds"][kind][metric]["min"] for s in layers])
            hi = np.array([s["kinds"][kind][metric]["max"] for s in layers])
            pos = x + (j - 1) * width
            ax.bar(pos, mean, width, color=colours[kind], label=kind)
            for p, m, a, b in zip(pos, mean, lo, hi):  # min-max over heads
                ax.errorbar([float(p)], [float(m)], yerr=[[float(m - a)], [float(b - m)]], color="black", capsize=2, linewidth=1)
        ax.set_xticks(x)
        ax.set_xticklabels(names if n_layers > 1 else [layers[0].get("layer", "")], fontsize=8)
        ax.set_xlabel("layer" if n_layers > 1 else "")
        ax.set_ylabel(label)
    first = layers[0]
    axes[0].axhline(first["rank_bound"]["linear"], color="tab:orange", linestyle="--", linewidth=1, label=f"d = {first['head_dim']}")
    axes[0].axhline(first["num_tokens"], color="grey", linestyle="--", linewidth=1, label=f"N = {first['num_tokens']}")
    if first["rank_bound"]["mhla"] < first["num_tokens"]:
        axes[0].axhline(first["rank_bound"]["mhla"], color="tab:green", linestyle="--", linewidth=1, label="MHLA bound")
    axes[1].axhline(math.log(first["num_tokens"]), color="grey", linestyle="--", linewidth=1, label="log N (uniform)")
    for ax in axes:  # room above the bars for the legend
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    axes[0].set_title("rank of the attention matrix", fontsize=9)
    axes[1].set_title("attention entropy", fontsize=9)
    fig.tight_layout()
    return _save_png(fig, path)
