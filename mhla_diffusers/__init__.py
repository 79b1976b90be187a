"""mhla_diffusers: Multi-Head Linear Attention (MHLA, arXiv 2601.07832, ICLR 2026) for diffusers.

The public API, re-exported from the sub-packages and imported on first use, so that
``import mhla_diffusers`` (and ``import mhla_diffusers.ops``, the framework-free operator) stays
cheap and never imports diffusers until a name that needs it is used:

- ``ops``: the operator (torch, optional triton): ``mhla_attention``, ``BlockLayout``, ``mixing_init``.
- ``models``: the diffusers integration: ``MHLAProcessor``, ``apply_mhla``, ``remove_mhla``.
- ``checkpoint``: converted checkpoints, conversion, LoRA files, the authors' weights.
- ``training``: fine-tuning (accelerate / peft / yaml are needed only there).
"""

import importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

# Imported first: it remembers the environment as it was at this import (a backend can then say
# clearly when a setting its library fixes at import was switched on too late).
from mhla_diffusers import env as _env  # noqa: F401

__version__ = "0.1.0"

# public name -> the module that defines it (one line each: the API at a glance)
_EXPORTS = {
    "BlockLayout": "mhla_diffusers.ops.layout",
    "choose_block_grid": "mhla_diffusers.ops.layout",
    "default_num_blocks": "mhla_diffusers.ops.layout",
    "MixingMatrix": "mhla_diffusers.ops.mixing",
    "clamp_mixing_": "mhla_diffusers.ops.mixing",
    "mixing_init": "mhla_diffusers.ops.mixing",
    "mixing_parameters": "mhla_diffusers.ops.mixing",
    "mhla_attention": "mhla_diffusers.ops",
    "mhla_attention_reference": "mhla_diffusers.ops",
    "InterleavedRotary": "mhla_diffusers.ops",
    "available_backends": "mhla_diffusers.ops",
    "token_grid": "mhla_diffusers.models.grid",
    "select_layers": "mhla_diffusers.selection.hybrid",
    "select_auto": "mhla_diffusers.selection.hybrid",
    "attention_flops": "mhla_diffusers.selection.hybrid",
    "layer_sensitivity": "mhla_diffusers.selection.sensitivity",
    "LayerSensitivity": "mhla_diffusers.selection.sensitivity",
    "calibration_inputs": "mhla_diffusers.selection.calibration",
    "encode_calibration_prompts": "mhla_diffusers.selection.calibration",
    "MHLAProcessor": "mhla_diffusers.models.processor",
    "apply_mhla": "mhla_diffusers.apply",
    "attention_cost": "mhla_diffusers.selection.cost",
    "MeasuredCost": "mhla_diffusers.selection.cost",
    "materialize_mhla": "mhla_diffusers.models.lazy",
    "remove_mhla": "mhla_diffusers.models.installer",
    "set_attn_processor": "mhla_diffusers.models.installer",
    "attention_modules": "mhla_diffusers.families.base",
    "is_mhla_model": "mhla_diffusers.models.installer",
    "mhla_spec": "mhla_diffusers.models.installer",
    "context_parallel_plan": "mhla_diffusers.models.parallel",
    "enable_context_parallel": "mhla_diffusers.models.parallel",
    "MHLACheckpointError": "mhla_diffusers.checkpoint.format",
    "load_mhla_pipeline": "mhla_diffusers.checkpoint.format",
    "load_mhla_transformer": "mhla_diffusers.checkpoint.format",
    "load_mhla_weights": "mhla_diffusers.checkpoint.format",
    "read_mhla_config": "mhla_diffusers.checkpoint.format",
    "save_mhla_pipeline": "mhla_diffusers.checkpoint.format",
    "save_mhla_transformer": "mhla_diffusers.checkpoint.format",
    "import_authors_wan": "mhla_diffusers.checkpoint.authors",
    "load_authors_wan": "mhla_diffusers.checkpoint.authors",
    "import_authors_dit": "mhla_diffusers.checkpoint.authors_dit",
    "load_authors_dit": "mhla_diffusers.checkpoint.authors_dit",
    # the demo's parameter-free autoencoder: a demo / training helper, kept at its module path
    # because saved pipelines name it there (model_index.json: ["mhla_diffusers.autoencoder", ...])
    "SpaceToDepthAutoencoder": "mhla_diffusers.autoencoder",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import the module that defines a public name on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mhla_diffusers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if _TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from mhla_diffusers.apply import apply_mhla
    from mhla_diffusers.autoencoder import SpaceToDepthAutoencoder
    from mhla_diffusers.checkpoint.authors import import_authors_wan, load_authors_wan
    from mhla_diffusers.checkpoint.authors_dit import import_authors_dit, load_authors_dit
    from mhla_diffusers.checkpoint.format import (
        MHLACheckpointError,
        load_mhla_pipeline,
        load_mhla_transformer,
        load_mhla_weights,
        read_mhla_config,
        save_mhla_pipeline,
        save_mhla_transformer,
    )
    from mhla_diffusers.families.base import attention_modules
    from mhla_diffusers.models.grid import token_grid
    from mhla_diffusers.models.installer import is_mhla_model, mhla_spec, remove_mhla, set_attn_processor
    from mhla_diffusers.models.lazy import materialize_mhla
    from mhla_diffusers.models.parallel import context_parallel_plan, enable_context_parallel
    from mhla_diffusers.models.processor import MHLAProcessor
    from mhla_diffusers.ops import InterleavedRotary, available_backends, mhla_attention, mhla_attention_reference
    from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid, default_num_blocks
    from mhla_diffusers.ops.mixing import MixingMatrix, clamp_mixing_, mixing_init, mixing_parameters
    from mhla_diffusers.selection.calibration import calibration_inputs, encode_calibration_prompts
    from mhla_diffusers.selection.cost import attention_cost
    from mhla_diffusers.selection.hybrid import attention_flops, select_auto, select_layers
    from mhla_diffusers.selection.sensitivity import LayerSensitivity, layer_sensitivity
