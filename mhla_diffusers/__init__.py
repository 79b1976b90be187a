"""mhla_diffusers: Multi-Head Linear Attention (MHLA, arXiv 2601.07832, ICLR 2026) for diffusers."""

import os as _os

# Triton decides at import time whether its own functions run in the CPU interpreter, and diffusers
# (imported below) imports triton: remember whether TRITON_INTERPRET was on at this point so that
# the Triton backend can say clearly when it was switched on too late.
_TRITON_INTERPRET_AT_IMPORT = _os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")

from .autoencoder import SpaceToDepthAutoencoder
from .layout import BlockLayout, choose_block_grid, default_num_blocks
from .mixing import MixingMatrix, clamp_mixing_, mixing_init, mixing_parameters
from .ops import InterleavedRotary, available_backends, mhla_attention, mhla_attention_reference
from .grid import token_grid
from .hybrid import select_layers
from .processor import MHLAProcessor
from .apply import apply_mhla, attention_modules, is_mhla_model, materialize_mhla, mhla_spec, remove_mhla, set_attn_processor
from .checkpoint import (
    MHLACheckpointError,
    load_mhla_pipeline,
    load_mhla_transformer,
    read_mhla_config,
    save_mhla_pipeline,
    save_mhla_transformer,
)
from .authors import import_authors_wan, load_authors_wan

__version__ = "0.1.0"

__all__ = [
    "BlockLayout",
    "choose_block_grid",
    "default_num_blocks",
    "MixingMatrix",
    "clamp_mixing_",
    "mixing_init",
    "mixing_parameters",
    "mhla_attention",
    "mhla_attention_reference",
    "InterleavedRotary",
    "available_backends",
    "SpaceToDepthAutoencoder",
    "token_grid",
    "select_layers",
    "MHLAProcessor",
    "apply_mhla",
    "materialize_mhla",
    "remove_mhla",
    "set_attn_processor",
    "attention_modules",
    "is_mhla_model",
    "mhla_spec",
    "MHLACheckpointError",
    "load_mhla_pipeline",
    "load_mhla_transformer",
    "read_mhla_config",
    "save_mhla_pipeline",
    "save_mhla_transformer",
    "import_authors_wan",
    "load_authors_wan",
]
