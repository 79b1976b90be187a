"""Moved to :mod:`mhla_diffusers.selection.sensitivity`; this path keeps working (a re-export)."""

from mhla_diffusers.selection.sensitivity import (
    LayerSensitivity,
    check_calibration,
    layer_sensitivity,
)

__all__ = ["LayerSensitivity", "layer_sensitivity", "check_calibration"]
