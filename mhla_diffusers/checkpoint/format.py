"""The converted-checkpoint format: save and load MHLA transformers and pipelines.

A converted checkpoint is the base diffusers checkpoint plus, in each transformer folder,
``mhla_config.json`` (the MHLA settings, :func:`~mhla_diffusers.mhla_spec`, with ``weights_sha256``)
and ``mhla.safetensors`` (the MHLA parameters, float32, the settings repeated in its header). The
transformer's ``config.json`` carries the marker key ``mhla_checkpoint`` (:data:`CONFIG_MARKER_KEY`)
so that a stock ``from_pretrained`` of the folder warns. Loading is strict (a missing, unknown or
mis-shaped key is an error, never a re-initialisation); only safetensors is read; writes are atomic.
Models with peft adapters are refused on save unless ``merge_lora=True``.

This module re-exports (the same objects) :mod:`.spec`, :mod:`.marker`, :mod:`.lora_guard`,
:mod:`.saving` and :mod:`.loading`. The full format and its rules: ``docs/checkpoints.md``.
"""

# ruff: noqa: F401  (re-exports: every public name this module defined stays importable)

from mhla_diffusers.checkpoint.loading import (
    check_base_weights,
    check_loaded,
    check_pipeline_loaded,
    dtype_kwargs,
    import_named_components,
    load_mhla_pipeline,
    load_mhla_transformer,
    load_mhla_weights,
    transformer_class_of,
)
from mhla_diffusers.checkpoint.lora_guard import (
    check_saveable,
    load_saved_lora,
    merged_adapters,
)
from mhla_diffusers.checkpoint.marker import (
    CONFIG_MARKER_KEY,
    forget_marker,
    loading_converted,
    mark_config,
)
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError, read_safetensors_header
from mhla_diffusers.checkpoint.saving import (
    save_mhla_pipeline,
    save_mhla_transformer,
)
from mhla_diffusers.checkpoint.spec import (
    CHECKED_KEYS,
    FORMAT_VERSION,
    METADATA_KEY,
    MHLA_CONFIG_NAME,
    MHLA_WEIGHTS_NAME,
    READABLE_VERSIONS,
    TRANSFORMER_COMPONENTS,
    check_config_against_weights,
    checked_settings,
    mhla_parameters,
    read_mhla_config,
    sha256,
    transformer_folder,
)
from mhla_diffusers.families import expert_timestep_range, pipeline_transformers
from mhla_diffusers.models.provenance import converted_source, warn_if_stock_loaded

__all__ = [
    "MHLA_CONFIG_NAME",
    "MHLA_WEIGHTS_NAME",
    "FORMAT_VERSION",
    "MHLACheckpointError",
    "read_mhla_config",
    "read_safetensors_header",
    "save_mhla_transformer",
    "save_mhla_pipeline",
    "load_mhla_transformer",
    "load_mhla_pipeline",
    "load_mhla_weights",
    "pipeline_transformers",
    "expert_timestep_range",
    "TRANSFORMER_COMPONENTS",
    "transformer_folder",
    "check_loaded",
    "CONFIG_MARKER_KEY",
    "converted_source",
    "warn_if_stock_loaded",
]
