"""The converted-checkpoint format: save and load MHLA transformers and pipelines.

A converted checkpoint is the base diffusers checkpoint (``save_pretrained``, without any MHLA
keys; its ``config.json`` carries one extra key, see below) plus, in the transformer's folder (in a
Wan 2.2 A14B pipeline, in each expert's folder, ``transformer/`` and ``transformer_2/``, each with its
own settings):

* ``mhla_config.json`` — ``format_version``, family, model class, layers, block grid, normalize,
  eps, backend (see :func:`~mhla_diffusers.mhla_spec`); for layers chosen by ``layers="auto"`` also
  ``selection`` (method, K or budget, the sensitivity scores and how they were measured): a record of
  how the layers were chosen, not a setting of the weights (not repeated in the weights' header);
  folders without it load as before;
* ``mhla.safetensors`` — the MHLA parameters, fp32: the mixing matrices, keyed
  ``<attention path>.mhla_mixing.weight``, and any other per-layer MHLA submodule's parameters
  (Wan's per-head output RMSNorm: ``<attention path>.mhla_output_norm.weight``). Its header
  metadata ``mhla_config`` repeats the settings that give the weights their meaning (family,
  model class, layers, block grid, number of blocks, normalize, eps, output norm, feature epsilon,
  mixing clamp) and the config's
  ``weights_sha256`` covers the whole file, header included: an edit of any of these settings in
  ``mhla_config.json`` no longer matches and is refused on load. (``backend`` is a run-time
  choice, the same numbers on every backend: it may be edited.) Checkpoints written before this
  metadata existed still load; only their settings cannot be cross-checked.

Saving a model that runs :class:`~mhla_diffusers.MHLAProcessor` on self-attention layers whose
mixing matrices are not created yet (the bare one-liner ``model.set_attn_processor(MHLAProcessor())``
before its first forward) creates them first, as that forward would: the checkpoint is always the
MHLA model, never silently the stock one. A pipeline's ``id2label`` (DiT class names), which
diffusers' ``save_pretrained`` drops, is written into ``model_index.json``. A model with peft adapter
layers (LoRA, fused or not) is refused before anything is written, the message naming the fix, unless
``merge_lora=True`` (written merged; the model is left as it is). Layers that keep a mixing matrix
but run another processor are saved as they compute (stock), with a warning.

Loading: the base ``from_pretrained``, ``apply_mhla`` from the config, then the MHLA weights
strictly: a missing file, unknown, missing or mis-shaped key is an error, never a silent
re-initialisation (CASES C14). Base weights with peft-wrapped keys (``to_q.base_layer.weight``) are
refused before loading, and no loader returns a model with tensors on the meta device
(:func:`check_loaded`). Only safetensors is read; nothing is unpickled. Writes go to a
temporary folder beside the target that is renamed into place when complete.

A stock load is never silent: diffusers' own ``from_pretrained`` of a converted folder gives the
base model WITHOUT MHLA (the stock attention). The transformer's ``config.json`` therefore holds
the key ``mhla_checkpoint`` (:data:`CONFIG_MARKER_KEY`), unknown to diffusers, which logs it as a
warning ("The config attributes {'mhla_checkpoint': 'converted MHLA checkpoint ...: load it with
mhla_diffusers.load_mhla_transformer or load_mhla_pipeline ...'} were passed to ... but are not
expected and will be ignored"); our loaders drop that line and the key (the loaded model's config
is the base config). Checkpoints written before the key existed load as before (the key is not
covered by ``weights_sha256``). Where our code later sees a model loaded from a converted folder
that has no MHLA layers (``apply_mhla``, ``set_attn_processor``, ``materialize_mhla``, the bare
one-liner's first forward, the generation helpers), it warns (:func:`warn_if_stock_loaded`).

The parts live in their own modules, re-exported here (the same objects): :mod:`.spec` (the schema: names,
version, settings and their checks), :mod:`.marker` (the config marker and diffusers' log line),
:mod:`.lora_guard` (LoRA adapters on save and load), :mod:`.saving` and :mod:`.loading`; the family quirks
(DiT's ``id2label``, Wan 2.2's experts) come from :mod:`mhla_diffusers.families`.
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
