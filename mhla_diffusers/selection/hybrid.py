"""Layer selection rules ("all", the paper's hybrid, a list) and automatic selection from sensitivity scores; pure Python."""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

__all__ = ["select_layers", "attention_flops", "select_auto", "scores_list"]


def select_layers(num_layers: int, layers: str | Sequence[int] = "all") -> list[int]:
    """Sorted unique indices of the layers to convert: ``"all"``, ``"hybrid"``, ``"none"`` or a list.

    ``"hybrid"`` keeps softmax on layers 0, 3, 6, ... (the authors' Wan 2.1 hybrid); negative indices
    count from the end.

    Raises:
        ValueError: an unknown string, an index out of range or repeated.
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
    """FLOPs of one layer's attention (projections excluded, multiply-add = 2) at ``N`` tokens, head dim ``d``.

    ``softmax``: ``heads 4 N^2 d``; ``linear``: ``heads 4 N d^2``; ``mhla``: ``heads (4 N d^2 + 2 M^2 d^2)``
    (MHLA paper, Sec. 3).

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
    """Per-layer scores ``[s_0, ..., s_{L-1}]`` from a ``LayerSensitivity``, a mapping or a sequence.

    ``ValueError`` for a layer without a score, an index out of range, a non-finite score.
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
    """The layers to convert (sorted), the highest-scored kept stock: ``keep_softmax=K`` of them, or within ``max_attention_cost=F``.

    ``F`` is a fraction of the stock attention cost, computed from per-layer ``stock_costs`` and
    ``mhla_costs`` (:func:`attention_flops`).

    Raises:
        ValueError: both or neither option; ``K`` out of range; ``F`` outside ``(0, 1]``, unreachable, or
            converting nothing; MHLA not cheaper than the stock attention (SANA).
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
    """The MHLA layers of the longest prefix of ``ranking`` kept stock within ``budget``."""
    if not 0 < budget <= 1:
        raise ValueError(f"max_attention_cost is a fraction of the stock attention cost, 0 < F <= 1; got {budget!r}")
    if stock_costs is None or mhla_costs is None or len(stock_costs) != len(ranking) or len(mhla_costs) != len(ranking):
        raise ValueError("max_attention_cost needs stock_costs and mhla_costs, one per layer")
    if any(m >= s for s, m in zip(stock_costs, mhla_costs)):
        raise ValueError(
            "MHLA is not cheaper than the stock attention of this model under this cost model (its stock self-attention "
            "is already linear, e.g. SANA, or, measured, MHLA's operator is the slower one at this token grid), so an "
            "attention-cost budget selects nothing: use keep_softmax=K, or measure at the size you generate at"
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
