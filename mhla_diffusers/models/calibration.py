"""Moved to :mod:`mhla_diffusers.selection.calibration`; this path keeps working (a re-export)."""

from mhla_diffusers.selection.calibration import (
    GENERIC_PROMPTS,
    calibration_inputs,
    clip_timestep_range,
    encode_calibration_prompts,
    load_calibration_embeddings,
)

__all__ = ["GENERIC_PROMPTS", "calibration_inputs", "clip_timestep_range", "encode_calibration_prompts", "load_calibration_embeddings"]
