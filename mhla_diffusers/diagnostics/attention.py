"""Implied attention matrices of softmax, linear attention and MHLA, their rank and row entropy, and the paper's rank bounds."""

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
    """Raise ``ValueError`` (naming the memory needed) when ``num_tokens > max_tokens``."""
    if num_tokens > max_tokens:
        gib = num_tokens * num_tokens * 8 / 2**30
        raise ValueError(
            f"{num_tokens} tokens: the dense diagnostics build N x N float64 matrices ({gib:.2f} GiB per head "
            f"and sample) and accept at most {max_tokens} tokens; use a lower resolution (fewer latent pixels "
            f"or a larger patch)"
        )


def _row_normalise(scores: torch.Tensor) -> torch.Tensor:
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
    """The row-normalised dense attention matrix ``[B, heads, N, N]`` (fp64) of ``kind`` on q, k ``[B, heads, N, d]``.

    ``"softmax"`` (``scale`` default ``1 / sqrt(d)``), ``"linear"`` (ReLU features) or ``"mhla"``:
    ``A[i, t] = Mc[b(i), b(t)] phi(q_i) . phi(k_t)`` (paper Sec. 3.2), which needs ``mixing`` ``[M, M]``
    in ``[0, 1]`` (``MixingMatrix.clamped()``) and ``layout``. Queries without a distribution get
    all-zero rows. See ``docs/diagnostics.md``.

    Raises:
        ValueError: unknown ``kind``, bad shapes, ``"mhla"`` without a fitting non-negative ``mixing``
            or ``layout``, ``N > max_tokens``.
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
            f"kind='mhla' needs the {missing}: mixing=[M, M] (e.g. attn.mhla.mixing.clamped() or "
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
    """The default tolerance of :func:`matrix_rank`: ``N * eps(float64)`` (numpy's convention)."""
    return num_tokens * torch.finfo(torch.float64).eps


def matrix_rank(A: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Numerical rank ``#{i : sigma_i > rtol * sigma_max}`` (fp64 SVD) of each matrix in ``A`` ``[..., N, K]``, int64 ``[...]``.

    ``rtol`` default: :func:`default_rtol` of ``max(N, K)``.

    Raises:
        ValueError: ``A`` has fewer than 2 dimensions, or ``rtol < 0``.
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
    """Mean Shannon entropy in nats of the non-empty rows of row-stochastic ``A`` ``[..., N, K]`` (paper Fig. 3(a)).

    ``normalized`` divides by ``log K``. Returns ``[...]`` float64, NaN where every row is empty.

    Raises:
        ValueError: fewer than 2 dimensions, negative entries, or a non-empty row not summing to 1.
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
    """The largest rank of a ``kind`` attention matrix on ``layout``'s tokens (paper Sec. 3.2, 4.3).

    ``"mhla"``: ``min(N, sum_b min(N_b, d))``; ``"linear"``: ``min(N, d)``; ``"softmax"``: ``N``.

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
