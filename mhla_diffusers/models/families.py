"""Deprecated location of the model families: they live in :mod:`mhla_diffusers.families` (one module per
family, ``families/base.py`` the :class:`Family` entry and the registry). This module re-exports the same
objects under their old names."""

# ruff: noqa: F401  (re-exports: every public name the old module defined stays importable)

from mhla_diffusers.families import DIT, SANA, WAN, WanRotary, wan_native_video
from mhla_diffusers.families.base import (
    FAMILIES,
    GENERIC,
    Family,
    attention_family,
    attention_modules,
    block_grid_preset_names,
    family_name_of_type,
    family_of,
    find_family,
    get_family,
    self_attention_modules,
    stock_processor,
    supported_model_classes,
)
from mhla_diffusers.families.wan import (
    WAN22_TI2V_LATENT_CHANNELS,
    WAN22_TI2V_NATIVE_LATENT,
    WAN22_TI2V_NATIVE_VIDEO,
    WAN_NATIVE_LATENT,
    WAN_NATIVE_VIDEO,
)

__all__ = [
    "Family",
    "FAMILIES",
    "WanRotary",
    "wan_native_video",
    "attention_family",
    "attention_modules",
    "family_of",
    "find_family",
    "get_family",
    "self_attention_modules",
    "stock_processor",
]
