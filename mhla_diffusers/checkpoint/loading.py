"""Loading converted checkpoints (:mod:`~mhla_diffusers.checkpoint.format`): the base model through diffusers'
``from_pretrained``, MHLA installed from ``mhla_config.json``, then its weights strictly; base weights with
peft-wrapped keys refused before loading, no model returned with tensors on the meta device, only
safetensors read.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import warnings
from pathlib import Path

import diffusers
import torch
from diffusers import DiffusionPipeline
from torch import nn

from mhla_diffusers.apply import apply_mhla
from mhla_diffusers.checkpoint.lora_guard import load_saved_lora
from mhla_diffusers.checkpoint.marker import forget_marker, loading_converted
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError, load_safetensors, read_safetensors_header
from mhla_diffusers.checkpoint.spec import (
    MHLA_CONFIG_NAME,
    MHLA_WEIGHTS_NAME,
    READABLE_VERSIONS,
    TRANSFORMER_COMPONENTS,
    check_config_against_weights,
    checked_settings,
    current_key,
    mhla_parameters,
    read_mhla_config,
    sha256,
    transformer_folder,
)
from mhla_diffusers.families import canonical_model_class, family_of, pipeline_quirks, pipeline_transformers, self_attention_modules
from mhla_diffusers.models.installer import is_mhla_model, mhla_spec, record_selection
from mhla_diffusers.models.layer import holds_values
from mhla_diffusers.ops import available_backends, get_backend

__all__ = [
    "load_mhla_transformer", "load_mhla_pipeline", "load_mhla_weights", "check_loaded", "import_named_components",
]


# A key of a model saved with peft layers in it: "<module>.base_layer.weight", "<module>.lora_A.<adapter>.weight".
_PEFT_KEY = re.compile(r"\.(base_layer|lora_A|lora_B|lora_magnitude_vector)\.")


_BASE_WEIGHTS = "diffusion_pytorch_model*"


def check_base_weights(folder: Path) -> None:
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
    """Names of the parameters and buffers of ``model`` without values (:func:`holds_values`: on the meta device, or
    a quantized weight whose inner tensors are), outside modules whose weights accelerate's offload hooks
    (``_hf_hook``, ``device_map`` / sequential offload) hold elsewhere."""
    offloaded = [f"{name}." if name else "" for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in tensors if not holds_values(t) and not any(name.startswith(p) for p in offloaded)]


def check_loaded(model: nn.Module, source: str | os.PathLike) -> None:
    """Refuse a loaded model with a parameter or buffer without values (on the meta device, quantized weights
    included: :func:`holds_values`), outside accelerate's offload hooks.

    Raises:
        MHLACheckpointError: naming ``source``'s weights file(s) and the tensors.
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


def check_pipeline_loaded(pipe, path: str | os.PathLike) -> None:
    """:func:`check_loaded` on every model of a pipeline loaded from the folder ``path`` (or a Hub id)."""
    for name, component in getattr(pipe, "components", {}).items():
        if isinstance(component, nn.Module):
            check_loaded(component, Path(path) / name)


def load_mhla_weights(transformer: nn.Module, path: str | os.PathLike) -> None:
    """Put a converted checkpoint's MHLA onto ``transformer``, a base loaded any way (``from_pretrained``,
    ``from_single_file``, a GGUF file, a quantization config).

    Without MHLA, it is installed as the checkpoint's ``mhla_config.json`` records (layers, block grid, every setting),
    then its ``mhla.safetensors`` loaded strictly; with MHLA, the weights are loaded into it once its settings
    (``mhla_spec``) are the checkpoint's. What :func:`load_mhla_transformer` does after ``from_pretrained``.

    Args:
        path: the converted checkpoint: a pipeline folder or its transformer folder.

    Raises:
        FileNotFoundError: no transformer folder at ``path``.
        MHLACheckpointError: no ``mhla_config.json`` (not a converted checkpoint); a model whose MHLA settings differ
            from the checkpoint's (naming them); a config not fitting the model; the weights' errors
            (:func:`_load_weights`).
    """
    folder = transformer_folder(path)
    config = read_mhla_config(folder)
    if config is None:
        raise MHLACheckpointError(f"{folder} has no {MHLA_CONFIG_NAME}: it is not a converted MHLA checkpoint")
    if not is_mhla_model(transformer):
        _install_from_config(transformer, config, folder)
        return
    check_config_against_weights(config, folder)
    have, want = checked_settings(mhla_spec(transformer)), checked_settings(config)
    differ = [f"{key}: {have[key]!r} here, {want[key]!r} in the checkpoint" for key in want if have[key] != want[key]]
    if differ:
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} records other MHLA settings than this model's ({'; '.join(differ)}): its weights "
            "would run as another model. Call mhla_diffusers.remove_mhla(transformer) first to install the checkpoint's"
        )
    _load_weights(transformer, folder, config.get("weights_sha256"))


def _load_weights(transformer: nn.Module, folder: Path, expected_sha256: str | None = None) -> None:
    """Load ``mhla.safetensors`` from ``folder`` into a model with MHLA installed, strictly.

    Every tensor must be float32 and of the parameter's shape (never cast).

    Raises:
        MHLACheckpointError: file missing or corrupted (``expected_sha256`` mismatch included), keys
            missing or unexpected, a dtype other than float32, shapes differ, non-finite values, MHLA
            parameters without values (on the meta device).
    """
    path = Path(folder) / MHLA_WEIGHTS_NAME
    if not path.is_file():
        raise MHLACheckpointError(f"{path} is missing: the MHLA mixing matrices of this checkpoint are lost")
    version = _written_version(path)
    tensors = {current_key(key, version): tensor for key, tensor in load_safetensors(path, "MHLA weights").items()}
    params = mhla_parameters(transformer)
    meta = [key for key, param in params.items() if not holds_values(param)]
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
    if expected_sha256 is not None and sha256(path) != expected_sha256:
        raise MHLACheckpointError(
            f"{path} does not match the sha256 recorded in {MHLA_CONFIG_NAME}: the file is corrupted or was replaced"
        )
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(tensors[key])


def _written_version(path: Path) -> int:
    """The format version ``mhla.safetensors`` was written in (its header's ``mhla_format_version``; 1 without one).

    Raises:
        MHLACheckpointError: a version this mhla_diffusers cannot read.
    """
    recorded = read_safetensors_header(path).get("__metadata__", {}).get("mhla_format_version", "1")
    if not recorded.isdigit() or int(recorded) not in READABLE_VERSIONS:
        raise MHLACheckpointError(
            f"{path} was written in format version {recorded!r}; this mhla_diffusers reads versions "
            f"{', '.join(str(v) for v in READABLE_VERSIONS)} (a newer version: upgrade mhla_diffusers)"
        )
    return int(recorded)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _install_from_config(transformer: nn.Module, config: dict, folder: Path) -> None:
    check_config_against_weights(config, folder)
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
            # format version 2 (absent in version 1: off)
            feature_power=float(config.get("feature_power", 1.0)),
            rope=config.get("rope"),
            gate=config.get("gate") or False,
            lepe=bool(config.get("lepe", False)),
            input_norm=bool(config.get("input_norm", False)),
            denominator=config.get("denominator", "paper"),
        )
    except (ValueError, TypeError) as err:  # layers, block grid or settings that do not fit this model
        raise MHLACheckpointError(f"{folder / MHLA_CONFIG_NAME} does not fit the base model: {err}") from err
    _load_weights(transformer, folder, config.get("weights_sha256"))
    if "selection" in config:  # how the layers were chosen: kept, so that a re-saved model still says it
        record_selection(transformer, config["selection"])


def _usable_backend(backend: str) -> str:
    """The recorded backend if it can run here, else ``"auto"`` (backends give the same numbers)."""
    if backend in ("auto", "torch"):
        return backend
    if backend in available_backends() and get_backend(backend).kept_on_load():
        return backend
    warnings.warn(
        f"the checkpoint asks for MHLA backend {backend!r}, which is not available here; using 'auto'", stacklevel=2
    )
    return "auto"


def dtype_kwargs(torch_dtype: torch.dtype | None) -> dict:
    """diffusers 0.42 takes ``dtype=`` (``torch_dtype=`` is deprecated there)."""
    return {} if torch_dtype is None else {"dtype": torch_dtype}


def import_named_components(pipeline_folder: str | os.PathLike) -> list[str]:
    """Import the ``mhla_diffusers`` modules ``model_index.json`` names as component libraries; returns their names.

    diffusers loads a foreign component only from an imported module, and ``import mhla_diffusers``
    imports none, so pipeline loaders call this first.

    Raises:
        MHLACheckpointError: ``model_index.json`` is not a JSON object, or names a missing module.
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
    """The JSON object in ``path``, else :class:`MHLACheckpointError` naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise MHLACheckpointError(f"{path} is not readable JSON ({err}): the checkpoint is damaged") from err
    if not isinstance(data, dict):
        raise MHLACheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object: the checkpoint is damaged")
    return data


def transformer_class_of(folder: Path):
    """The diffusers model class named by ``folder/config.json`` (``_class_name``; the original DiT
    checkpoints' ``Transformer2DModel`` is ``DiTTransformer2DModel``).

    Raises:
        MHLACheckpointError: a class diffusers does not have (or an unreadable ``config.json``).
    """
    name = _read_json_object(folder / "config.json").get("_class_name")
    name = canonical_model_class(name)  # the original DiT checkpoints: Transformer2DModel
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise MHLACheckpointError(f"{folder / 'config.json'} names an unknown model class {name!r}")
    return cls


def load_mhla_transformer(
    path: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, lora: bool | str | os.PathLike = True, **kwargs
) -> nn.Module:
    """Load a transformer from a converted (or plain) checkpoint: a transformer folder or a pipeline folder.

    Returns it in eval mode, MHLA installed as recorded, the ``transformer_lora/`` adapter applied with
    ``lora=True`` (``False`` skips it, a path loads that folder).

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (or no adapter at an explicit ``lora`` path).
        MHLACheckpointError: see :func:`read_mhla_config`, :func:`_load_weights`; peft-wrapped base
            keys; tensors left on the meta device.
        ValueError: an adapter whose keys do not match the model.
    """
    folder = transformer_folder(path)
    config = read_mhla_config(folder)
    check_base_weights(folder)
    with loading_converted():
        model = transformer_class_of(folder).from_pretrained(folder, **dtype_kwargs(torch_dtype), **kwargs)
        check_loaded(model, folder)
        forget_marker(model)
        if config is not None:
            _install_from_config(model, config, folder)
    load_saved_lora(model, folder.parent / "transformer_lora", lora)
    return model.eval()


def load_mhla_pipeline(
    path: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, lora: bool | str | os.PathLike = True, **kwargs
):
    """Load a diffusers pipeline folder whose transformer(s) may be converted MHLA checkpoints.

    The transformer(s) in eval mode with MHLA as recorded in each folder, ``transformer_lora/`` applied
    as in :func:`load_mhla_transformer`, ``id2label`` in ``pipe.config`` and ``pipe.labels``.

    Raises:
        FileNotFoundError: no ``model_index.json`` (or no adapter at an explicit ``lora`` path).
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
        check_base_weights(path / name)
    with loading_converted():
        pipe = DiffusionPipeline.from_pretrained(path, **dtype_kwargs(torch_dtype), **kwargs)
        check_pipeline_loaded(pipe, path)
        for quirks in pipeline_quirks():  # DiT: id2label kept in pipe.config
            quirks.after_load(pipe, path)
        for name, model in pipeline_transformers(pipe).items():
            forget_marker(model)
            if configs.get(name) is not None:
                _install_from_config(model, configs[name], path / name)
    if pipe.transformer is not None:
        load_saved_lora(pipe.transformer, path / "transformer_lora", lora)
    for model in pipeline_transformers(pipe).values():
        model.eval()
    return pipe
