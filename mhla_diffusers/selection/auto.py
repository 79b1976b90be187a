"""``apply_mhla(layers="auto")``: the layers MHLA damages most keep their stock attention (``docs/selection.md``)."""

from __future__ import annotations

import warnings

from mhla_diffusers.families import family_of
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.selection.cost import cost_fraction, layer_attention_costs
from mhla_diffusers.selection.hybrid import scores_list, select_auto
from mhla_diffusers.selection.sensitivity import LayerSensitivity, layer_sensitivity

__all__ = ["auto_layers"]


def auto_layers(transformer, num_layers, num_blocks, block_grid, normalize, *, keep_softmax, max_attention_cost,
                calibration, sensitivity, cost="flops", backend="auto") -> tuple[list[int], dict]:
    """``(MHLA layer indices, selection record)`` of ``layers="auto"`` (arguments: :func:`~mhla_diffusers.apply_mhla`).

    Raises:
        ValueError: both or neither of ``calibration`` / ``sensitivity`` or of ``keep_softmax`` /
            ``max_attention_cost``; an unknown ``cost`` model; an unreachable budget (checked before measuring
            the sensitivity; the costs are priced first, under ``cost``: :func:`~mhla_diffusers.selection.cost.layer_attention_costs`).
    """
    if (calibration is None) == (sensitivity is None):
        raise ValueError(
            "layers='auto' needs calibration inputs (calibration=[{...forward kwargs...}, ...], e.g. from "
            "mhla_diffusers.calibration_inputs(pipe)) or precomputed scores (sensitivity=), exactly one of them"
        )
    if (keep_softmax is None) == (max_attention_cost is None):
        raise ValueError("layers='auto' needs exactly one of keep_softmax=K or max_attention_cost=F")
    stock, mhla, priced = layer_attention_costs(transformer, cost, num_blocks=num_blocks, block_grid=block_grid, backend=backend)
    budget = dict(keep_softmax=keep_softmax, max_attention_cost=max_attention_cost, stock_costs=stock, mhla_costs=mhla)
    if sensitivity is None:
        select_auto([0.0] * num_layers, **budget)  # a request no ranking can meet fails before the measurement
        sensitivity = layer_sensitivity(transformer, calibration, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize)
    else:
        _check_sensitivity_grid(transformer, sensitivity, num_blocks, block_grid)
    scores = scores_list(sensitivity, num_layers)
    chosen = select_auto(scores, **budget)
    record = {"method": "auto"}
    if keep_softmax is not None:
        record["keep_softmax"] = int(keep_softmax)
    else:
        record["max_attention_cost"] = float(max_attention_cost)
    record["attention_cost"] = cost_fraction(stock, mhla, chosen)
    record["cost_model"] = priced if priced["model"] == "flops" else dict(priced, stock_seconds=stock, mhla_seconds=mhla)
    record["softmax_layers"] = [i for i in range(num_layers) if i not in chosen]
    record["scores"] = scores
    if isinstance(sensitivity, LayerSensitivity):
        record["sensitivity"] = dict(sensitivity.settings)
    return chosen, record


def _check_sensitivity_grid(transformer, sensitivity, num_blocks, block_grid) -> None:
    """Warn when precomputed scores were measured at another block grid than the one installed."""
    measured = getattr(sensitivity, "settings", {}).get("block_grid")
    if measured is None:
        return
    family = family_of(transformer)
    grid = MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid).resolve_block_grid(family.reference_grid(transformer.config), family)
    if tuple(measured) != tuple(grid):
        warnings.warn(
            f"apply_mhla(layers='auto'): the sensitivity scores were measured with block grid {tuple(measured)} but this "
            f"call installs block grid {tuple(grid)}: the ranking may differ; measure again with the installed grid "
            f"(layer_sensitivity(..., num_blocks= / block_grid= as here)) or pass the grid the scores were measured at",
            UserWarning,
            stacklevel=3,
        )
