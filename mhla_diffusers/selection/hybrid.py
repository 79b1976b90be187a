"""Which transformer layers get MHLA: fixed rules ("all", the paper's hybrid, an explicit list) and
automatic selection from per-layer sensitivity scores (keep the K most sensitive layers stock, or the
most sensitive ones within an attention-cost budget). Pure Python: the scores come from
:func:`mhla_diffusers.layer_sensitivity`, the per-layer costs from :func:`attention_flops`."""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

__all__ = ["select_layers", "attention_flops", "select_auto", "scores_list"]


def select_layers(num_layers: int, layers: str | Sequence[int] = "all") -> list[int]:
    """Indices (sorted, unique) of the self-attention layers to convert.

    Args:
        num_layers: number of self-attention layers in the model.
        layers: ``"all"``; ``"hybrid"`` — softmax kept on layers 0, 3, 6, ... (every third from 0),
            MHLA on the other two thirds (the authors' Wan2.1 hybrid: 20 of 30 layers MHLA);
            ``"none"``; or an explicit list of indices (negative indices count from the end).
            (``"auto"`` is resolved by :func:`~mhla_diffusers.apply_mhla` with :func:`select_auto`.)

    Raises:
        ValueError: for an unknown string, an index out of range, or a repeated index.
    """
    if isinstance(layers, str):
        if layers == "all":
            return list(range(num_layers))
        if layers == "hybrid":
            return [i for i in range(num_layers) if i % 3 != 0]
        if layers == "none":
            return []
        raise ValueError(f"layers must be 'all', 'hybrid', 'auto', 'none' or a list of layer indices; got {layers!r}")
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"layer indices must be integers; got {i!r} in {list(layers)}")
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f"layer index {i} is out of range for a model with {num_layers} self-attention layers")
        if j in out:
            raise ValueError(f"layer index {i} is given twice in {list(layers)}")
        out.append(j)
    return sorted(out)


def attention_flops(kind: str, num_tokens: int, head_dim: int, heads: int = 1, num_blocks: int = 1) -> int:
    """Floating-point operations of one attention layer's attention (projections excluded: they are the
    same for every kind), counting a multiply-add as 2, at ``N = num_tokens`` tokens, ``d = head_dim``:

    * ``"softmax"``: ``heads * 4 N^2 d`` (``Q K^T`` and ``A V``, each ``2 N^2 d``);
    * ``"linear"`` (plain ReLU linear attention, SANA's stock layer): ``heads * 4 N d^2``
      (``phi(K)^T V`` and ``phi(Q) S``, each ``2 N d^2``);
    * ``"mhla"``: ``heads * (4 N d^2 + 2 M^2 d^2)`` with ``M = num_blocks``: the block summaries
      ``S_b = phi(K_b)^T V_b`` (``2 N d^2`` over all blocks), the mixing ``S~ = Mc S`` (``2 M^2 d^2``)
      and ``phi(Q) S~_b(q)`` (``2 N d^2``) (MHLA paper, Sec. 3: ``O(N d^2 + M^2 d^2)``).

    Lower-order terms (the softmax's ``N^2`` exponentials, the normalisers' ``O(N d + M^2 d)``) are left
    out. Returns an int.

    Raises:
        ValueError: unknown ``kind`` or a non-positive size.
    """
    if min(num_tokens, head_dim, heads, num_blocks) < 1:
        raise ValueError(f"sizes must be positive; got N={num_tokens}, d={head_dim}, heads={heads}, M={num_blocks}")
    n, d, m = int(num_tokens), int(head_dim), int(num_blocks)
    per_head = {"softmax": 4 * n * n * d, "linear": 4 * n * d * d, "mhla": 4 * n * d * d + 2 * m * m * d * d}
    if kind not in per_head:
        raise ValueError(f"kind must be 'softmax', 'linear' or 'mhla'; got {kind!r}")
    return int(heads) * per_head[kind]


def scores_list(sensitivity, num_layers: int) -> list[float]:
    """``[score of layer 0, ..., score of layer L-1]`` from a :class:`~mhla_diffusers.LayerSensitivity`, a
    mapping ``{layer index: score}`` or a sequence of ``L`` scores.

    Raises:
        ValueError: a layer without a score, an index out of range, a non-finite score.
    """
    if isinstance(sensitivity, Mapping):
        keys = sorted(int(k) for k in sensitivity)
        if keys != list(range(num_layers)):
            raise ValueError(
                f"sensitivity must score every self-attention layer 0..{num_layers - 1} exactly once; it has {keys}"
            )
        scores = [float(sensitivity[k] if k in sensitivity else sensitivity[str(k)]) for k in range(num_layers)]
    else:
        scores = [float(s) for s in sensitivity]
        if len(scores) != num_layers:
            raise ValueError(f"sensitivity has {len(scores)} scores; the model has {num_layers} self-attention layers")
    if not all(math.isfinite(s) for s in scores):
        raise ValueError(f"sensitivity scores must be finite; got {scores}")
    return scores


def select_auto(
    scores: Sequence[float],
    *,
    keep_softmax: int | None = None,
    max_attention_cost: float | None = None,
    stock_costs: Sequence[float] | None = None,
    mhla_costs: Sequence[float] | None = None,
) -> list[int]:
    """The layers to convert to MHLA (sorted), keeping the most sensitive layers stock.

    Layers are ranked by score, highest first (ties: lower index first). ``keep_softmax=K`` keeps the
    first ``K`` stock. ``max_attention_cost=F`` keeps the longest prefix of that ranking whose attention
    cost ``(sum of stock_costs over kept layers + sum of mhla_costs over the others) /
    sum(stock_costs)`` is ``<= F``: the next layer of the ranking would exceed the budget.

    Args:
        scores: one per self-attention layer, higher = more damage when the layer becomes MHLA.
        keep_softmax: ``0 <= K < L`` (``0``: every layer MHLA, as ``layers="all"``).
        max_attention_cost: ``0 < F <= 1``, a fraction of the stock model's attention cost.
        stock_costs, mhla_costs: per-layer attention FLOPs (:func:`attention_flops`); needed with
            ``max_attention_cost``.

    Raises:
        ValueError: both or neither of ``keep_softmax`` / ``max_attention_cost``; ``K`` out of range;
            ``F`` outside ``(0, 1]``, below the all-MHLA cost (no selection can meet it), or so large that
            every layer stays stock (nothing to convert); MHLA not cheaper than the stock attention
            (SANA's linear attention: use ``keep_softmax``).
    """
    num_layers = len(scores)
    if (keep_softmax is None) == (max_attention_cost is None):
        raise ValueError("layers='auto' needs exactly one of keep_softmax=K or max_attention_cost=F")
    ranking = sorted(range(num_layers), key=lambda i: (-scores[i], i))
    if keep_softmax is not None:
        whole = isinstance(keep_softmax, numbers.Real) and not isinstance(keep_softmax, bool) and math.isfinite(keep_softmax)
        if not whole or int(keep_softmax) != keep_softmax or not 0 <= keep_softmax < num_layers:
            raise ValueError(
                f"keep_softmax must be an integer in 0..{num_layers - 1} (the model has {num_layers} self-attention layers; "
                f"keeping all of them converts nothing); got {keep_softmax!r}"
            )
        return sorted(ranking[int(keep_softmax):])
    return _within_budget(ranking, float(max_attention_cost), stock_costs, mhla_costs)


def _within_budget(ranking: list[int], budget: float, stock_costs, mhla_costs) -> list[int]:
    """:func:`select_auto` with ``max_attention_cost``: the MHLA layers of the longest kept prefix of ``ranking``."""
    if not 0 < budget <= 1:
        raise ValueError(f"max_attention_cost is a fraction of the stock attention cost, 0 < F <= 1; got {budget!r}")
    if stock_costs is None or mhla_costs is None or len(stock_costs) != len(ranking) or len(mhla_costs) != len(ranking):
        raise ValueError("max_attention_cost needs stock_costs and mhla_costs, one per layer")
    if any(m >= s for s, m in zip(stock_costs, mhla_costs)):
        raise ValueError(
            "MHLA is not cheaper than the stock attention of this model (its stock self-attention is already linear, "
            "e.g. SANA), so an attention-cost budget selects nothing: use keep_softmax=K"
        )
    total = float(sum(stock_costs))
    cost = float(sum(mhla_costs))
    if cost > budget * total:
        raise ValueError(
            f"max_attention_cost={budget} is below the cost of MHLA on every layer ({cost / total:.4f} of the stock "
            f"attention cost at the native resolution): give at least {cost / total:.4f}"
        )
    kept = 0
    for i in ranking:
        step = stock_costs[i] - mhla_costs[i]
        if cost + step > budget * total:
            break
        cost += step
        kept += 1
    if kept == len(ranking):
        raise ValueError(
            f"max_attention_cost={budget} lets every layer keep its stock attention: nothing would be converted; give a "
            "smaller budget"
        )
    return sorted(ranking[kept:])
