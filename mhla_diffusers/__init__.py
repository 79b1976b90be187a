"""mhla_diffusers: Multi-Head Linear Attention (MHLA, arXiv 2601.07832, ICLR 2026) for diffusers."""

from .autoencoder import SpaceToDepthAutoencoder
from .layout import BlockLayout, choose_block_grid, default_num_blocks
from .mixing import MixingMatrix, clamp_mixing_, mixing_init, mixing_parameters
from .ops import available_backends, mhla_attention, mhla_attention_reference

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
    "available_backends",
    "SpaceToDepthAutoencoder",
]
