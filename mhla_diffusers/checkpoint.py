"""The converted-checkpoint format: save and load MHLA transformers and pipelines.

A converted checkpoint is the base diffusers checkpoint (``save_pretrained``, without any MHLA
keys) plus, in the transformer's folder:

* ``mhla_config.json`` — ``format_version``, family, model class, layers, block grid, normalize,
  eps, backend (see :func:`~mhla_diffusers.mhla_spec`);
* ``mhla.safetensors`` — the MHLA parameters, fp32: the mixing matrices, keyed
  ``<attention path>.mhla_mixing.weight``, and any other per-layer MHLA submodule's parameters
  (Wan's per-head output RMSNorm: ``<attention path>.mhla_output_norm.weight``).

Loading: the base ``from_pretrained``, ``apply_mhla`` from the config, then the MHLA weights
strictly: a missing file, unknown, missing or mis-shaped key is an error, never a silent
re-initialisation (CASES C14). Only safetensors is read; nothing is unpickled. Writes go to a
temporary folder beside the target that is renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .apply import apply_mhla, mhla_spec
from .families import self_attention_modules

__all__ = [
    "MHLA_CONFIG_NAME",
    "MHLA_WEIGHTS_NAME",
    "FORMAT_VERSION",
    "MHLACheckpointError",
    "read_mhla_config",
    "save_mhla_transformer",
    "save_mhla_pipeline",
    "load_mhla_transformer",
    "load_mhla_pipeline",
    "load_mhla_weights",
    "transformer_folder",
]

MHLA_CONFIG_NAME = "mhla_config.json"
MHLA_WEIGHTS_NAME = "mhla.safetensors"
FORMAT_VERSION = 1


class MHLACheckpointError(ValueError):
    """A converted checkpoint is missing, corrupted or does not match the model."""


# -- writing --------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success it replaces ``out_dir`` in one rename.

    Raises:
        FileExistsError: if ``out_dir`` exists, is not empty and ``overwrite`` is False.
    """
    out = Path(out_dir).resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty; choose another folder or pass overwrite=True (--overwrite on the command "
            "line), which replaces the folder's whole content"
        )
    if overwrite and out.exists() and Path.cwd().resolve().is_relative_to(out):
        raise ValueError(f"refusing to replace {out}: it contains the current directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it owner-only; the result is an ordinary folder
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    """``{state-dict key: tensor}`` of every MHLA parameter / buffer of the self-attention layers:
    ``<attention path>.<mhla_* submodule>.<name>`` (e.g. ``blocks.1.attn1.mhla_mixing.weight``)."""
    out = {}
    for name, attn in self_attention_modules(transformer):
        for child, sub in attn._modules.items():
            if child.startswith("mhla_") and sub is not None:
                for key, tensor in sub.state_dict(keep_vars=True).items():
                    out[f"{name}.{child}.{key}"] = tensor
    return out


def _write_mhla_files(transformer: nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file

    import mhla_diffusers

    spec = mhla_spec(transformer)
    if spec is None:
        return
    config = {"format_version": FORMAT_VERSION, "mhla_diffusers_version": mhla_diffusers.__version__, **spec}
    tensors = {key: t.detach().to("cpu", torch.float32).contiguous() for key, t in _mhla_parameters(transformer).items()}
    save_file(tensors, str(folder / MHLA_WEIGHTS_NAME), metadata={"format": "pt", "mhla_format_version": str(FORMAT_VERSION)})
    config["weights_sha256"] = _sha256(folder / MHLA_WEIGHTS_NAME)
    (folder / MHLA_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_mhla_transformer(transformer: nn.Module, out_dir: str | os.PathLike, *, overwrite: bool = False, **save_kwargs) -> Path:
    """Write ``transformer`` as a converted checkpoint folder (atomic). A model without MHLA is
    written as a plain diffusers folder. Extra keyword arguments go to ``save_pretrained``."""
    with atomic_directory(out_dir, overwrite) as tmp:
        with _without_mixing(transformer):
            transformer.save_pretrained(tmp, **save_kwargs)
        _write_mhla_files(transformer, tmp)
    return Path(out_dir)


def save_mhla_pipeline(pipe, out_dir: str | os.PathLike, *, overwrite: bool = False, **save_kwargs) -> Path:
    """Write a diffusers pipeline whose ``transformer`` may have MHLA (atomic); the MHLA files go
    into ``<out_dir>/transformer/``."""
    with atomic_directory(out_dir, overwrite) as tmp:
        with _without_mixing(pipe.transformer):
            pipe.save_pretrained(tmp, **save_kwargs)
        _write_mhla_files(pipe.transformer, tmp / "transformer")
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
    return config


def _mhla_keys_in_base(folder: Path) -> list[str]:
    """MHLA keys found in the base ``*.safetensors`` weights of a transformer folder (headers only)."""
    from safetensors import safe_open

    found = []
    for file in sorted(folder.glob("*.safetensors")):
        if file.name == MHLA_WEIGHTS_NAME:
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                found += [key for key in f.keys() if ".mhla_" in key]
        except Exception:  # unreadable base weights: diffusers' own loader reports them
            continue
    return found


def load_mhla_weights(transformer: nn.Module, folder: str | os.PathLike, expected_sha256: str | None = None) -> None:
    """Load ``mhla.safetensors`` from ``folder`` into a model with MHLA installed, strictly.

    Args:
        expected_sha256: the digest recorded in ``mhla_config.json`` (checked when given).

    Raises:
        MHLACheckpointError: file missing or corrupted (digest mismatch included), keys missing or
            unexpected, shapes differ, non-finite values.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / MHLA_WEIGHTS_NAME
    if not path.is_file():
        raise MHLACheckpointError(f"{path} is missing: the MHLA mixing matrices of this checkpoint are lost")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise MHLACheckpointError(f"{path} is corrupted or not a safetensors file: {err}") from err
    params = _mhla_parameters(transformer)
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise MHLACheckpointError(f"{path} does not match the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for key, param in params.items():
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


def _install_from_config(transformer: nn.Module, config: dict, folder: Path) -> None:
    if type(transformer).__name__ != config["model_class"]:
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} was written for {config['model_class']}, but the base model is {type(transformer).__name__}"
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
        )
    except (ValueError, TypeError) as err:  # layers, block grid or settings that do not fit this model
        raise MHLACheckpointError(f"{folder / MHLA_CONFIG_NAME} does not fit the base model: {err}") from err
    load_mhla_weights(transformer, folder, config.get("weights_sha256"))


def _usable_backend(backend: str) -> str:
    """The recorded backend if it can run here, else ``"auto"`` (backends give the same numbers).

    ``"triton"`` runs only on CUDA tensors: a checkpoint saved with it and loaded on a machine
    without CUDA (triton installed or not) gets ``"auto"``, not a failure at the first forward.
    """
    from .ops import available_backends

    if backend in ("auto", "torch"):
        return backend
    if backend in available_backends() and (backend != "triton" or torch.cuda.is_available()):
        return backend
    import warnings

    warnings.warn(f"the checkpoint asks for MHLA backend {backend!r}, which is not available here; using 'auto'")
    return "auto"


def _dtype_kwargs(torch_dtype: torch.dtype | None) -> dict:
    """diffusers 0.42 takes ``dtype=`` (``torch_dtype=`` is deprecated there)."""
    return {} if torch_dtype is None else {"dtype": torch_dtype}


def _transformer_class(folder: Path):
    import diffusers

    name = json.loads((folder / "config.json").read_text()).get("_class_name")
    if name == "Transformer2DModel":  # the original DiT checkpoints
        name = "DiTTransformer2DModel"
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise MHLACheckpointError(f"{folder / 'config.json'} names an unknown model class {name!r}")
    return cls


def _load_saved_lora(model: nn.Module, default_dir: Path, lora) -> None:
    """Apply a LoRA adapter saved beside a checkpoint (``transformer_lora/``, see ``mhla_diffusers.lora``).

    ``lora=True``: the adapter in ``default_dir`` if there is one; ``False``: none; a path: that
    adapter, which must exist.
    """
    if lora is False or lora is None:
        return
    folder = default_dir if lora is True else Path(lora)
    if lora is True and not folder.is_dir():
        return
    from .lora import load_lora

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
        MHLACheckpointError: see :func:`read_mhla_config` and :func:`load_mhla_weights`.
        ValueError: an adapter whose keys do not match the model.
    """
    folder = transformer_folder(path)
    config = read_mhla_config(folder)
    model = _transformer_class(folder).from_pretrained(folder, **_dtype_kwargs(torch_dtype), **kwargs)
    if config is not None:
        _install_from_config(model, config, folder)
    _load_saved_lora(model, folder.parent / "transformer_lora", lora)
    return model.eval()


def load_mhla_pipeline(
    path: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, lora: bool | str | os.PathLike = True, **kwargs
):
    """Load a diffusers pipeline folder whose transformer may be a converted MHLA checkpoint.

    Returns a ready pipeline (its ``transformer`` in eval mode, MHLA installed if recorded, and
    the LoRA adapter of ``<path>/transformer_lora`` applied when present and ``lora=True``;
    ``lora=False`` skips it, a path loads that adapter folder).

    Raises:
        FileNotFoundError: ``path`` holds no ``model_index.json`` (or no adapter at an explicit ``lora`` path).
        MHLACheckpointError: see :func:`load_mhla_transformer`.
    """
    from diffusers import DiffusionPipeline

    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
    config = read_mhla_config(path)
    pipe = DiffusionPipeline.from_pretrained(path, **_dtype_kwargs(torch_dtype), **kwargs)
    if config is not None:
        _install_from_config(pipe.transformer, config, path / "transformer")
    _load_saved_lora(pipe.transformer, path / "transformer_lora", lora)
    pipe.transformer.eval()
    return pipe
