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
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Iterator

import diffusers
import torch
from diffusers import DiffusionPipeline
from diffusers.configuration_utils import FrozenDict
from safetensors.torch import save_file
from torch import nn

import mhla_diffusers
from mhla_diffusers.checkpoint.adapter import describe_lora, has_lora, load_lora, lora_is_fused, lora_merged
from mhla_diffusers.checkpoint.io import atomic_directory
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError, load_safetensors, read_safetensors_header
from mhla_diffusers.checkpoint.safetensors_file import is_int as _is_int
from mhla_diffusers.families import (
    FAMILIES,
    canonical_model_class,
    expert_timestep_range,
    family_of,
    pipeline_quirks,
    pipeline_transformers,
    self_attention_modules,
    transformer_components,
)
from mhla_diffusers.models.install import (
    apply_mhla,
    idle_mhla_layers,
    materialize_mhla,
    mhla_spec,
    pending_mhla_layers,
    record_selection,
)
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.models.provenance import (
    LOADING_CONVERTED,
    MHLA_CONFIG_NAME,
    converted_source,
    warn_if_stock_loaded,
)
from mhla_diffusers.ops import available_backends

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

MHLA_WEIGHTS_NAME = "mhla.safetensors"
FORMAT_VERSION = 1


# -- writing --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _without_mixing(model: nn.Module) -> Iterator[dict[tuple[str, str], nn.Module]]:
    """Temporarily detach every MHLA submodule (``mhla_mixing``, ``mhla_output_norm``, any ``mhla_*``)
    so that ``save_pretrained`` writes the base model."""
    detached = {}
    for name, module in list(model.named_modules()):
        for child in [c for c in module._modules if c.startswith("mhla_")]:
            detached[(name, child)] = module._modules.pop(child)
    try:
        yield detached
    finally:
        for (name, child), sub in detached.items():
            model.get_submodule(name)._modules[child] = sub


def _mhla_parameters(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """``{state-dict key: tensor}`` of every MHLA parameter / buffer of the self-attention layers that run
    MHLA: ``<attention path>.<mhla_* submodule>.<name>`` (e.g. ``blocks.1.attn1.mhla_mixing.weight``)."""
    out = {}
    for name, attn in self_attention_modules(transformer):
        if not isinstance(getattr(attn, "processor", None), MHLAProcessor):
            continue  # idle matrices (the layer runs another processor) are not part of the model it computes
        for child, sub in attn._modules.items():
            if child.startswith("mhla_") and sub is not None:
                for key, tensor in sub.state_dict(keep_vars=True).items():
                    out[f"{name}.{child}.{key}"] = tensor
    return out


# The settings of mhla_config.json that give the weights their meaning, repeated in the header
# metadata of mhla.safetensors (key "mhla_config") and so covered by weights_sha256. Not "backend":
# a run-time choice, every backend gives the same numbers. Absent keys take the values of _ABSENT.
_CHECKED_KEYS = (
    "family", "model_class", "num_layers", "layers", "block_grid", "num_blocks", "normalize", "eps", "output_norm",
    "feature_eps", "mixing_clamp",
)
_METADATA_KEY = "mhla_config"
# The value a checked key has when a config leaves it out (settings added after format version 1 began).
_ABSENT = {"output_norm": False, "feature_eps": 0.0, "mixing_clamp": True}


def _checked_settings(config: dict) -> dict:
    settings = {key: config.get(key, _ABSENT.get(key)) for key in _CHECKED_KEYS}
    grid = settings["block_grid"]
    if isinstance(grid, list) and len(grid) < 3:  # (H, W) = (1, H, W), as apply_mhla reads it
        settings["block_grid"] = [1] * (3 - len(grid)) + grid
    return settings


def _prepare_for_saving(transformer: nn.Module) -> None:
    """Create the mixing matrices of layers set up by the bare one-liner and not run yet.

    Raises:
        MHLACheckpointError: when they cannot be created here.
    """
    try:
        materialize_mhla(transformer)
    except (ValueError, TypeError, RuntimeError) as err:
        raise MHLACheckpointError(
            f"{type(transformer).__name__} runs MHLAProcessor on layers whose mixing matrices do not exist yet and "
            f"cannot be created here ({err}). Run one forward pass of the model first, or install MHLA with "
            "mhla_diffusers.apply_mhla(transformer), then save; nothing was written"
        ) from err


def _write_mhla_files(transformer: nn.Module, folder: Path) -> None:
    _prepare_for_saving(transformer)
    spec = mhla_spec(transformer)
    _mark_config(folder, converted=spec is not None)
    if spec is None:
        return
    tensors = {key: t.detach().to("cpu", torch.float32).contiguous() for key, t in _mhla_parameters(transformer).items()}
    names = [name for name, _ in self_attention_modules(transformer)]
    without = [names[i] for i in spec["layers"] if not any(k.startswith(f"{names[i]}.mhla_mixing.") for k in tensors)]
    if without or pending_mhla_layers(transformer):  # never write a checkpoint that loads as another model
        raise MHLACheckpointError(
            f"the MHLA layers {without or pending_mhla_layers(transformer)} have no mixing matrix to save; run one forward "
            "pass of the model first, or install MHLA with mhla_diffusers.apply_mhla(transformer)"
        )
    config = {"format_version": FORMAT_VERSION, "mhla_diffusers_version": mhla_diffusers.__version__, **spec}
    metadata = {
        "format": "pt",
        "mhla_format_version": str(FORMAT_VERSION),
        _METADATA_KEY: json.dumps(_checked_settings(config), sort_keys=True),
    }
    save_file(tensors, str(folder / MHLA_WEIGHTS_NAME), metadata=metadata)
    config["weights_sha256"] = _sha256(folder / MHLA_WEIGHTS_NAME)
    (folder / MHLA_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


# -- what a save refuses or leaves out ---------------------------------------------------------------
def _lora_fixes(model: nn.Module, ref: str, pipe=None, component: str | None = None) -> tuple[str, str | None]:
    """``(keep, drop)``: the calls that leave ``model`` without peft layers, keeping the LoRA in its
    weights or dropping it (``None`` where no call does it); ``ref`` names the model in them."""
    fused = lora_is_fused(model)
    if pipe is not None and hasattr(pipe, "unload_lora_weights") and component in getattr(pipe, "_lora_loadable_modules", ()):
        fuse, unfuse, unload = "pipe.fuse_lora()", "pipe.unfuse_lora()", "pipe.unload_lora_weights()"
    elif hasattr(model, "fuse_lora") and hasattr(model, "unload_lora"):  # diffusers' PeftAdapterMixin (SANA, Wan)
        fuse, unfuse, unload = f"{ref}.fuse_lora()", f"{ref}.unfuse_lora()", f"{ref}.unload_lora()"
    else:  # DiT (peft.inject_adapter_in_model), text encoders: the functions of mhla_diffusers.checkpoint.lora
        merge, unload = (f"mhla_diffusers.checkpoint.lora.{f}({ref})" for f in ("merge_lora_", "unload_lora_"))
        return (f"{unload} (the fused weights stay)", None) if fused else (merge, unload)
    if fused:
        return f"{unload} (the fused weights stay)", f"{unfuse} then {unload}"
    return f"{fuse} then {unload}", unload


def _check_saveable(models: dict[str, nn.Module], pipe=None, merge_lora: bool = False) -> None:
    """Refuse, before anything is written, a model that carries peft adapters (unless ``merge_lora``);
    warn about MHLA matrices a checkpoint leaves out (:func:`~mhla_diffusers.models.install.idle_mhla_layers`).

    Args:
        models: ``{component name: model}`` (one transformer, or every module of a pipeline).

    Raises:
        MHLACheckpointError: a model has LoRA adapters and ``merge_lora`` is False.
    """
    for name, model in models.items():
        if merge_lora or not has_lora(model):  # merge_lora: merged by _merged_adapters
            continue
        ref = name if pipe is None else f"pipe.{name}"
        keep, drop = _lora_fixes(model, ref, pipe, name)
        raise MHLACheckpointError(
            f"{ref} carries {describe_lora(model)}: saved as it is, it would write peft-wrapped keys "
            "(to_q.base_layer.weight, to_q.lora_A.<adapter>.weight) that no loader restores; nothing was written. "
            f"To save the LoRA in the weights: {keep}, or pass merge_lora=True (the model itself stays as it is)"
            + (f"; to save without it: {drop}" if drop else "")
        )
    for name, model in models.items():
        idle = idle_mhla_layers(model)
        if idle:
            warnings.warn(
                f"{name}: the layers {sorted(idle)} keep MHLA mixing matrices but run {sorted(set(idle.values()))} "
                "(set_attn_processor replaced MHLAProcessor), so they compute the stock attention: the checkpoint "
                "holds the model as it computes, without those matrices. To save them, give those layers "
                "MHLAProcessor back (set_attn_processor(MHLAProcessor())); to drop them, mhla_diffusers.remove_mhla",
                UserWarning,
                stacklevel=3,
            )


@contextlib.contextmanager
def _merged_adapters(models: dict[str, nn.Module], merge_lora: bool) -> Iterator[None]:
    """With ``merge_lora``, every model with peft adapters is seen merged inside the block
    (:func:`~mhla_diffusers.checkpoint.adapter.lora_merged`); unchanged afterwards.

    Raises:
        MHLACheckpointError: on entering the block (before anything is written), when adapters are
            disabled or a merged weight is not finite.
    """
    with contextlib.ExitStack() as stack:
        for name, model in models.items():
            if merge_lora and has_lora(model):
                try:
                    stack.enter_context(lora_merged(model))
                except ValueError as err:
                    raise MHLACheckpointError(f"{name}: cannot save with merge_lora=True: {err}; nothing was written") from err
        yield


# -- what a stock load of a converted folder says ---------------------------------------------------
CONFIG_MARKER_KEY = "mhla_checkpoint"
_CONFIG_MARKER = (
    "converted MHLA checkpoint (mhla_config.json and mhla.safetensors beside this config.json): load it with "
    "mhla_diffusers.load_mhla_transformer or mhla_diffusers.load_mhla_pipeline. diffusers' from_pretrained alone "
    "runs the base model WITHOUT MHLA, on the stock attention"
)


def _mark_config(folder: Path, converted: bool) -> None:
    """Add :data:`CONFIG_MARKER_KEY` to ``folder/config.json`` (a converted transformer folder), or take
    it out (a model without MHLA that was loaded from a converted folder carries it in its config)."""
    path = folder / "config.json"
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if converted:
        data[CONFIG_MARKER_KEY] = _CONFIG_MARKER
    elif data.pop(CONFIG_MARKER_KEY, None) is None:
        return
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")  # diffusers' own layout


class _DropMarkerLog(logging.Filter):
    """Takes the marker out of diffusers' "config attributes ... not expected" warning (the whole line
    when it is the only such attribute): our loaders know the key."""

    _ENTRY = f"{CONFIG_MARKER_KEY!r}: {_CONFIG_MARKER!r}"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._ENTRY not in message:
            return True
        message = message.replace(f", {self._ENTRY}", "").replace(f"{self._ENTRY}, ", "").replace(self._ENTRY, "")
        if "attributes {}" in message:
            return False
        record.msg, record.args = message, ()
        return True


@contextlib.contextmanager
def _loading_converted() -> Iterator[None]:
    """Inside our loaders: diffusers does not log the marker, and :func:`warn_if_stock_loaded` stays quiet."""
    logger = logging.getLogger("diffusers.configuration_utils")
    drop = _DropMarkerLog()
    logger.addFilter(drop)
    token = LOADING_CONVERTED.set(True)
    try:
        yield
    finally:
        LOADING_CONVERTED.reset(token)
        logger.removeFilter(drop)


def _forget_marker(model: nn.Module) -> None:
    """Drop the marker from a loaded model's config (diffusers keeps unknown keys there), so that its
    config is the base config and a later save writes the marker only where it belongs."""
    config = getattr(model, "_internal_dict", None)
    if config is not None and CONFIG_MARKER_KEY in config:
        model._internal_dict = FrozenDict({k: v for k, v in config.items() if k != CONFIG_MARKER_KEY})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_mhla_transformer(
    transformer: nn.Module, out_dir: str | os.PathLike, *, overwrite: bool = False, merge_lora: bool = False, **save_kwargs
) -> Path:
    """Write ``transformer`` as a converted checkpoint folder (atomic). A model without MHLA is
    written as a plain diffusers folder. Extra keyword arguments go to ``save_pretrained``.

    Layers that run :class:`~mhla_diffusers.MHLAProcessor` without a mixing matrix yet (the bare
    one-liner before any forward) get it now, as their first forward would. Layers that keep a
    mixing matrix but run another processor are written as they compute, stock (with a warning).

    A model with peft adapters (``add_adapter``, ``load_lora_weights``, fused or not) is refused:
    its peft-wrapped keys would load as missing weights. ``merge_lora=True`` writes the adapters
    merged into the weights instead (the model itself is left as it is).

    Raises:
        MHLACheckpointError: such matrices cannot be created; the model has LoRA adapters and not
            ``merge_lora`` (nothing is written; the message names the calls that fix it).
        ValueError: the MHLA layers disagree on settings (one config holds one setting).
    """
    _check_saveable({"transformer": transformer}, merge_lora=merge_lora)
    _prepare_for_saving(transformer)
    with _merged_adapters({"transformer": transformer}, merge_lora), atomic_directory(out_dir, overwrite) as tmp:
        with _without_mixing(transformer):
            transformer.save_pretrained(tmp, **save_kwargs)
        _write_mhla_files(transformer, tmp)
    return Path(out_dir)


# The pipeline components that are transformers MHLA may be installed on (families.transformer_components: Wan 2.2
# A14B's experts ``transformer`` and ``transformer_2``; every other pipeline has the first only).
TRANSFORMER_COMPONENTS = transformer_components()


def save_mhla_pipeline(
    pipe, out_dir: str | os.PathLike, *, overwrite: bool = False, merge_lora: bool = False, **save_kwargs
) -> Path:
    """Write a diffusers pipeline whose transformers may have MHLA (atomic); the MHLA files of each go into
    its own folder (``<out_dir>/transformer/``, and ``<out_dir>/transformer_2/`` for Wan 2.2's second expert,
    each with its own layers and settings). The pipeline's ``id2label`` (DiT class names), which
    diffusers' ``save_pretrained`` leaves out unless registered in ``pipe.config``, is written
    into ``model_index.json`` (see :class:`~mhla_diffusers.families.dit.DiTLabels`). A component with peft adapters
    (``pipe.load_lora_weights``, fused or not) is refused unless ``merge_lora=True``, as in
    :func:`save_mhla_transformer`, whose errors this raises."""
    transformers = pipeline_transformers(pipe)
    modules = {name: c for name, c in getattr(pipe, "components", {}).items() if isinstance(c, nn.Module)}
    _check_saveable({**modules, **transformers}, pipe=pipe, merge_lora=merge_lora)
    for model in transformers.values():
        _prepare_for_saving(model)
    with _merged_adapters({**modules, **transformers}, merge_lora), atomic_directory(out_dir, overwrite) as tmp:
        with contextlib.ExitStack() as stack:
            for model in transformers.values():
                stack.enter_context(_without_mixing(model))
            pipe.save_pretrained(tmp, **save_kwargs)
        for quirks in pipeline_quirks():  # DiT: the id2label diffusers left out of model_index.json
            quirks.after_save(pipe, tmp)
        for name, model in transformers.items():
            _write_mhla_files(model, tmp / name)
    return Path(out_dir)


# -- reading --------------------------------------------------------------------------------------
def transformer_folder(path: str | os.PathLike) -> Path:
    """The folder holding the transformer's ``config.json``: ``path`` itself or ``path/transformer``.

    Raises:
        FileNotFoundError: when neither holds a ``config.json``.
    """
    path = Path(path)
    if (path / "model_index.json").is_file() and (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither a diffusers pipeline folder nor a transformer folder (no config.json)")


def read_mhla_config(path: str | os.PathLike) -> dict | None:
    """The ``mhla_config.json`` of a checkpoint (pipeline or transformer folder), or ``None`` if it has none.

    Raises:
        MHLACheckpointError: unreadable JSON, unsupported format version, or weights without config.
    """
    folder = transformer_folder(path)
    config_file, weights_file = folder / MHLA_CONFIG_NAME, folder / MHLA_WEIGHTS_NAME
    if not config_file.is_file():
        if weights_file.is_file():
            raise MHLACheckpointError(f"{weights_file} exists but {config_file.name} is missing: the checkpoint is incomplete")
        stray = _mhla_keys_in_base(folder)
        if stray:
            raise MHLACheckpointError(
                f"{folder} holds MHLA mixing matrices inside its base weights ({stray[0]}, ...) but no {MHLA_CONFIG_NAME}: "
                "it was written with a plain save_pretrained, which diffusers cannot load back with MHLA. Re-save the "
                "model with mhla_diffusers.save_mhla_transformer / save_mhla_pipeline"
            )
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MHLACheckpointError(f"cannot read {config_file}: {err}") from err
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise MHLACheckpointError(
            f"{config_file} has format_version {version!r}; this mhla_diffusers reads version {FORMAT_VERSION}"
        )
    for key in ("family", "model_class", "num_layers", "layers", "block_grid", "normalize", "eps"):
        if key not in config:
            raise MHLACheckpointError(f"{config_file} lacks the key {key!r}")
    _validate_config(config, config_file)
    return config


def _validate_config(config: dict, config_file: Path) -> None:
    """The types and the internal consistency of the settings (not yet against the model or the weights).

    Raises:
        MHLACheckpointError: naming the key and what it should hold.
    """

    def bad(key: str, expected: str):
        return MHLACheckpointError(f"{config_file}: {key!r} must be {expected}; got {config.get(key)!r}")

    if config["family"] not in FAMILIES:
        raise bad("family", f"one of {sorted(FAMILIES)}")
    if not isinstance(config["model_class"], str):
        raise bad("model_class", "a diffusers class name")
    if not _is_int(config["num_layers"]) or config["num_layers"] < 1:
        raise bad("num_layers", "a positive integer")
    layers = config["layers"]
    if not isinstance(layers, list) or not layers or not all(_is_int(i) for i in layers):
        raise bad("layers", "a non-empty list of self-attention layer indices (integers)")
    grid = config["block_grid"]
    if not isinstance(grid, list) or not 1 <= len(grid) <= 3 or not all(_is_int(b) and b >= 1 for b in grid):
        raise bad("block_grid", "a list of 1 to 3 positive integers [bt, bh, bw]")
    if "num_blocks" in config:
        product = 1
        for b in grid:
            product *= b
        if not _is_int(config["num_blocks"]) or config["num_blocks"] != product:
            raise MHLACheckpointError(
                f"{config_file}: num_blocks {config['num_blocks']!r} is not the number of blocks of the block grid "
                f"{grid} ({product}); the config was edited"
            )
    if not isinstance(config["normalize"], bool):
        raise bad("normalize", "true or false")
    eps = config["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise bad("eps", "a number >= 0")
    if "output_norm" in config and not isinstance(config["output_norm"], bool):
        raise bad("output_norm", "true or false")
    feature_eps = config.get("feature_eps", 0.0)
    if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not 0 <= feature_eps < float("inf"):
        raise bad("feature_eps", "a finite number >= 0")
    if "mixing_clamp" in config and not isinstance(config["mixing_clamp"], bool):
        raise bad("mixing_clamp", "true or false")
    if "backend" in config and not isinstance(config["backend"], str):
        raise bad("backend", "a backend name")
    selection = config.get("selection")
    if selection is not None and not (isinstance(selection, dict) and selection.get("method") == "auto"):
        raise bad("selection", "an object with method 'auto' (how apply_mhla(layers='auto') chose the layers)")
    sha = config.get("weights_sha256")
    if sha is not None and not isinstance(sha, str):
        raise bad("weights_sha256", "a hex digest")


def _check_config_against_weights(config: dict, folder: Path) -> None:
    """Compare the settings of ``mhla_config.json`` with those recorded in the header of ``mhla.safetensors``.

    Files written before the header carried them (no ``mhla_config`` metadata) are accepted unchecked.

    Raises:
        MHLACheckpointError: the weights file is missing or unreadable, or a setting differs.
    """
    path = folder / MHLA_WEIGHTS_NAME
    if not path.is_file():
        raise MHLACheckpointError(f"{path} is missing: the MHLA mixing matrices of this checkpoint are lost")
    metadata = read_safetensors_header(path).get("__metadata__", {})
    if _METADATA_KEY not in metadata:
        return  # written before the settings were recorded beside the weights
    try:
        recorded = json.loads(metadata[_METADATA_KEY])
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise MHLACheckpointError(f"{path} is corrupted: its {_METADATA_KEY!r} metadata is unreadable ({err})") from err
    if not isinstance(config.get("weights_sha256"), str):
        # every writer of the current format records the digest: without it the weights could be swapped
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} has no weights_sha256, but {MHLA_WEIGHTS_NAME} was written in the current "
            "format, which always records it: the config was edited. Restore the original config"
        )
    given = _checked_settings(config)
    differ = [key for key in _CHECKED_KEYS if key in recorded and given[key] != recorded[key]]
    if differ:
        details = "; ".join(f"{key}: {given[key]!r} in {MHLA_CONFIG_NAME}, {recorded[key]!r} in the weights" for key in differ)
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} does not match the settings {MHLA_WEIGHTS_NAME} was written with ({details}): "
            "the config was edited or belongs to other weights. Restore the original config; to change the MHLA "
            "settings, convert again from the base model"
        )


def _mhla_keys_in_base(folder: Path) -> list[str]:
    """MHLA keys found in the base ``*.safetensors`` weights of a transformer folder (headers only).

    Raises:
        MHLACheckpointError: a base weights file that is not a readable safetensors file (see
            :func:`read_safetensors_header`).
    """
    found = []
    for file in sorted(folder.glob("*.safetensors")):
        if file.name != MHLA_WEIGHTS_NAME:
            found += [key for key in read_safetensors_header(file) if ".mhla_" in key]
    return found


# A key of a model saved with peft layers in it: "<module>.base_layer.weight", "<module>.lora_A.<adapter>.weight".
_PEFT_KEY = re.compile(r"\.(base_layer|lora_A|lora_B|lora_magnitude_vector)\.")
_BASE_WEIGHTS = "diffusion_pytorch_model*"


def _check_base_weights(folder: Path) -> None:
    """Refuse a transformer folder whose base weights hold peft-wrapped keys (headers only, before loading):
    diffusers would load the layers under them without weights (meta tensors or a fresh init).

    Raises:
        MHLACheckpointError: naming the file, a key and the fix.
    """
    for file in sorted(folder.glob(f"{_BASE_WEIGHTS}.safetensors")):
        wrapped = [key for key in read_safetensors_header(file) if _PEFT_KEY.search(key)]
        if wrapped:
            raise MHLACheckpointError(
                f"{file} holds peft-wrapped keys ({wrapped[0]}, ... {len(wrapped)} in all): it was saved from a model "
                "that still had LoRA adapters, and the layers under them would load without weights. Save the model "
                "again from memory without peft layers (fuse_lora() then unload_lora_weights() keeps the LoRA in the "
                "weights; unload_lora_weights() drops it), or with save_mhla_pipeline(..., merge_lora=True)"
            )


def _meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` on the meta device (no values), outside modules whose
    weights accelerate's offload hooks (``_hf_hook``, ``device_map`` / sequential offload) hold elsewhere."""
    offloaded = [f"{name}." if name else "" for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in tensors if t.is_meta and not any(name.startswith(p) for p in offloaded)]


def check_loaded(model: nn.Module, source: str | os.PathLike) -> None:
    """Make sure a loaded model holds values everywhere: no parameter or buffer on the meta device (where
    diffusers leaves weights whose keys its file lacks), except under accelerate's offload hooks.

    Args:
        source: the folder or file the model was loaded from (named in the error).

    Raises:
        MHLACheckpointError: naming ``source``'s weights file(s), how many tensors and which.
    """
    names = _meta_tensors(model)
    if not names:
        return
    path = Path(source)
    weights = path.iterdir() if path.is_dir() else ()
    files = sorted(f for f in weights if f.suffix in (".safetensors", ".bin") and f.name != MHLA_WEIGHTS_NAME)
    where = ", ".join(str(f) for f in files) or str(source)
    raise MHLACheckpointError(
        f"{where} left {len(names)} tensors of {type(model).__name__} without values (on the meta device: "
        f"{names[:5]}{', ...' if len(names) > 5 else ''}): the file lacks their keys, and the model would fail at its "
        "first forward. Save the model again from a complete copy (mhla_diffusers.save_mhla_pipeline / "
        "save_mhla_transformer)"
    )


def _check_pipeline_loaded(pipe, path: str | os.PathLike) -> None:
    """:func:`check_loaded` on every model of a pipeline loaded from the folder ``path`` (or a Hub id)."""
    for name, component in getattr(pipe, "components", {}).items():
        if isinstance(component, nn.Module):
            check_loaded(component, Path(path) / name)


def load_mhla_weights(transformer: nn.Module, folder: str | os.PathLike, expected_sha256: str | None = None) -> None:
    """Load ``mhla.safetensors`` from ``folder`` into a model with MHLA installed, strictly.

    Args:
        expected_sha256: the digest recorded in ``mhla_config.json`` (checked when given).

    Every tensor must be float32 (the format's dtype) of the model parameter's shape: a file whose
    tensors were rewritten in another dtype is refused, not cast.

    Raises:
        MHLACheckpointError: file missing or corrupted (digest mismatch included; see
            :func:`read_safetensors_header`), keys missing or unexpected, a dtype other than float32,
            shapes differ, non-finite values; the model's MHLA parameters on the meta device.
    """
    path = Path(folder) / MHLA_WEIGHTS_NAME
    if not path.is_file():
        raise MHLACheckpointError(f"{path} is missing: the MHLA mixing matrices of this checkpoint are lost")
    tensors = load_safetensors(path, "MHLA weights")
    params = _mhla_parameters(transformer)
    meta = [key for key, param in params.items() if param.is_meta]
    if meta:  # copy_ into a meta tensor is a no-op: the model would keep no values
        raise MHLACheckpointError(
            f"{path}: the model's {meta[0]} (and {len(meta) - 1} more) are on the meta device, so the weights cannot be "
            "loaded into them: its base weights did not load (see mhla_diffusers.checkpoint.format.check_loaded)"
        )
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise MHLACheckpointError(f"{path} does not match the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for key, param in params.items():
        if tensors[key].dtype != torch.float32:
            raise MHLACheckpointError(
                f"{path}: {key} is stored as {_dtype_name(tensors[key].dtype)}; the format stores every MHLA parameter as "
                f"float32 (this one of shape {tuple(param.shape)}): the file was rewritten. Restore it, or convert again"
            )
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise MHLACheckpointError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, the model expects {tuple(param.shape)}")
        if not torch.isfinite(tensors[key]).all():
            raise MHLACheckpointError(f"{path}: {key} holds NaN or infinite values")
    # Last: the specific messages above say more when the file parses; this catches silent damage.
    if expected_sha256 is not None and _sha256(path) != expected_sha256:
        raise MHLACheckpointError(
            f"{path} does not match the sha256 recorded in {MHLA_CONFIG_NAME}: the file is corrupted or was replaced"
        )
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(tensors[key])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _install_from_config(transformer: nn.Module, config: dict, folder: Path) -> None:
    _check_config_against_weights(config, folder)
    if type(transformer).__name__ != config["model_class"]:
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} was written for {config['model_class']}, but the base model is {type(transformer).__name__}"
        )
    try:
        family = family_of(transformer).name
    except ValueError as err:
        raise MHLACheckpointError(f"{folder / MHLA_CONFIG_NAME}: {err}") from err
    if family != config["family"]:
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} names the family {config['family']!r}, but the base model "
            f"{type(transformer).__name__} is of the family {family!r}"
        )
    num_layers = len(self_attention_modules(transformer))
    if num_layers != config["num_layers"]:
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} counts {config['num_layers']} self-attention layers, the base model has {num_layers}"
        )
    try:
        apply_mhla(
            transformer,
            layers=list(config["layers"]),
            block_grid=tuple(config["block_grid"]),
            normalize=bool(config["normalize"]),
            eps=float(config["eps"]),
            backend=_usable_backend(config.get("backend", "auto")),
            output_norm=bool(config.get("output_norm", False)),
            feature_eps=float(config.get("feature_eps", 0.0)),
            mixing_clamp=bool(config.get("mixing_clamp", True)),
        )
    except (ValueError, TypeError) as err:  # layers, block grid or settings that do not fit this model
        raise MHLACheckpointError(f"{folder / MHLA_CONFIG_NAME} does not fit the base model: {err}") from err
    load_mhla_weights(transformer, folder, config.get("weights_sha256"))
    if "selection" in config:  # how the layers were chosen: kept, so that a re-saved model still says it
        record_selection(transformer, config["selection"])


def _usable_backend(backend: str) -> str:
    """The recorded backend if it can run here, else ``"auto"`` (backends give the same numbers).

    ``"triton"`` runs only on CUDA tensors: a checkpoint saved with it and loaded on a machine
    without CUDA (triton installed or not) gets ``"auto"``, not a failure at the first forward.
    """
    if backend in ("auto", "torch"):
        return backend
    if backend in available_backends() and (backend != "triton" or torch.cuda.is_available()):
        return backend
    warnings.warn(
        f"the checkpoint asks for MHLA backend {backend!r}, which is not available here; using 'auto'", stacklevel=2
    )
    return "auto"


def _dtype_kwargs(torch_dtype: torch.dtype | None) -> dict:
    """diffusers 0.42 takes ``dtype=`` (``torch_dtype=`` is deprecated there)."""
    return {} if torch_dtype is None else {"dtype": torch_dtype}


def import_named_components(pipeline_folder: str | os.PathLike) -> list[str]:
    """Import the ``mhla_diffusers`` modules that ``pipeline_folder/model_index.json`` names as component
    libraries (the demo's ``["mhla_diffusers.autoencoder", "SpaceToDepthAutoencoder"]`` vae); returns their names.

    diffusers 0.42 loads a component from a library that is not its own only when the module is
    already imported, and ``import mhla_diffusers`` stays cheap (it imports no component modules), so
    every loader of a pipeline folder calls this first. Modules outside ``mhla_diffusers`` are left to
    diffusers' own rules. A folder without ``model_index.json`` (a Hub id) imports nothing.

    Raises:
        MHLACheckpointError: ``model_index.json`` is not a JSON object, or names an ``mhla_diffusers`` module
            that does not exist.
    """
    index = Path(pipeline_folder) / "model_index.json"
    if not index.is_file():
        return []
    names = sorted({
        entry[0]
        for entry in _read_json_object(index).values()
        if isinstance(entry, list) and entry and isinstance(entry[0], str) and entry[0].startswith("mhla_diffusers.")
    })
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            raise MHLACheckpointError(
                f"{index} names the component library {name!r}, which this mhla_diffusers does not have ({err}); "
                "upgrade mhla_diffusers or edit model_index.json"
            ) from err
    return names


def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (a ``config.json`` or ``model_index.json``).

    Raises:
        MHLACheckpointError: unreadable, not JSON, or not an object (naming the file).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise MHLACheckpointError(f"{path} is not readable JSON ({err}): the checkpoint is damaged") from err
    if not isinstance(data, dict):
        raise MHLACheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object: the checkpoint is damaged")
    return data


def _transformer_class(folder: Path):
    name = _read_json_object(folder / "config.json").get("_class_name")
    name = canonical_model_class(name)  # the original DiT checkpoints: Transformer2DModel
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise MHLACheckpointError(f"{folder / 'config.json'} names an unknown model class {name!r}")
    return cls


def _load_saved_lora(model: nn.Module, default_dir: Path, lora) -> None:
    """Apply a LoRA adapter saved beside a checkpoint (``transformer_lora/``, see ``mhla_diffusers.checkpoint.lora``).

    ``lora=True``: the adapter in ``default_dir`` if there is one; ``False``: none; a path: that
    adapter, which must exist.
    """
    if lora is False or lora is None:
        return
    folder = default_dir if lora is True else Path(lora)
    if lora is True and not folder.is_dir():
        return
    load_lora(model, folder)


def load_mhla_transformer(
    path: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, lora: bool | str | os.PathLike = True, **kwargs
) -> nn.Module:
    """Load a transformer from a converted (or plain) checkpoint: a transformer folder or a pipeline folder.

    Returns the model in eval mode with MHLA installed as recorded (unchanged if none recorded) and,
    with ``lora=True`` (default), the LoRA adapter a fine-tuning run saved beside the transformer
    folder (``transformer_lora/``, export mode "separate") applied; ``lora=False`` skips it, a
    path loads that adapter folder.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (or no adapter at an explicit ``lora`` path).
        MHLACheckpointError: see :func:`read_mhla_config` and :func:`load_mhla_weights`; base weights
            with peft-wrapped keys (saved with LoRA layers in the model) or that leave tensors on the
            meta device (:func:`check_loaded`): never a model without values.
        ValueError: an adapter whose keys do not match the model.
    """
    folder = transformer_folder(path)
    config = read_mhla_config(folder)
    _check_base_weights(folder)
    with _loading_converted():
        model = _transformer_class(folder).from_pretrained(folder, **_dtype_kwargs(torch_dtype), **kwargs)
        check_loaded(model, folder)
        _forget_marker(model)
        if config is not None:
            _install_from_config(model, config, folder)
    _load_saved_lora(model, folder.parent / "transformer_lora", lora)
    return model.eval()


def load_mhla_pipeline(
    path: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, lora: bool | str | os.PathLike = True, **kwargs
):
    """Load a diffusers pipeline folder whose transformer may be a converted MHLA checkpoint.

    Returns a ready pipeline (its ``transformer`` in eval mode, MHLA installed if recorded — on each of
    Wan 2.2's two experts ``transformer`` / ``transformer_2`` as recorded in its own folder —, and
    the LoRA adapter of ``<path>/transformer_lora`` applied when present and ``lora=True``;
    ``lora=False`` skips it, a path loads that adapter folder). A class-conditional pipeline keeps
    the ``id2label`` of ``model_index.json`` in ``pipe.config`` as well as in ``pipe.labels``.

    Raises:
        FileNotFoundError: ``path`` holds no ``model_index.json`` (or no adapter at an explicit ``lora`` path).
        MHLACheckpointError: see :func:`load_mhla_transformer`.
    """
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
    configs = {name: read_mhla_config(path / name) for name in TRANSFORMER_COMPONENTS if (path / name / "config.json").is_file()}
    if not configs:
        transformer_folder(path)  # raises FileNotFoundError: a pipeline folder without a transformer
    import_named_components(path)
    for name in configs:
        _check_base_weights(path / name)
    with _loading_converted():
        pipe = DiffusionPipeline.from_pretrained(path, **_dtype_kwargs(torch_dtype), **kwargs)
        _check_pipeline_loaded(pipe, path)
        for quirks in pipeline_quirks():  # DiT: id2label kept in pipe.config
            quirks.after_load(pipe, path)
        for name, model in pipeline_transformers(pipe).items():
            _forget_marker(model)
            if configs.get(name) is not None:
                _install_from_config(model, configs[name], path / name)
    if pipe.transformer is not None:
        _load_saved_lora(pipe.transformer, path / "transformer_lora", lora)
    for model in pipeline_transformers(pipe).values():
        model.eval()
    return pipe
