"""The implied attention matrices of softmax, plain linear attention and MHLA, their rank and row
entropy, and the paper's rank bounds (MHLA paper, Sec. 3.2, 4.3, Fig. 3)."""

from __future__ import annotations

import math

import torch

from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.naive import implied_attention

KINDS: tuple[str, ...] = ("softmax", "linear", "mhla")
"""The attention kinds compared: softmax, plain ReLU linear attention, MHLA."""

MAX_TOKENS = 4096
"""Largest ``N`` the dense diagnostics accept (one float64 ``N x N`` matrix is 128 MiB at 4096)."""

CHUNK_ELEMENTS = 1 << 25
"""float64 elements of the ``[.., N, N]`` matrices built at once (256 MiB); capture.py chunks by it too."""


# -- the matrices ---------------------------------------------------------------------------------
def check_tokens(num_tokens: int, max_tokens: int) -> None:
    """Raise ``ValueError`` (naming the memory an ``N x N`` float64 matrix needs) when ``num_tokens > max_tokens``."""
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
    check_tokens(n, max_tokens)
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
