"""Which transformer layers get MHLA ("all", the paper's hybrid, or an explicit list)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["select_layers"]


def select_layers(num_layers: int, layers: str | Sequence[int] = "all") -> list[int]:
    """Indices (sorted, unique) of the self-attention layers to convert.

    Args:
        num_layers: number of self-attention layers in the model.
        layers: ``"all"``; ``"hybrid"`` — softmax kept on layers 0, 3, 6, ... (every third from 0),
            MHLA on the other two thirds (the authors' Wan2.1 hybrid: 20 of 30 layers MHLA);
            ``"none"``; or an explicit list of indices (negative indices count from the end).

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
        raise ValueError(f"layers must be 'all', 'hybrid', 'none' or a list of layer indices; got {layers!r}")
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
