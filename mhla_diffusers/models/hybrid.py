"""Moved to :mod:`mhla_diffusers.selection.hybrid`; this path keeps working (a re-export)."""

from mhla_diffusers.selection.hybrid import (
    attention_flops,
    scores_list,
    select_auto,
    select_layers,
)

__all__ = ["select_layers", "attention_flops", "select_auto", "scores_list"]
