"""Retrofit a pretrained diffusers checkpoint with MHLA and write it in the converted format.

Sources: a Hub id, a local diffusers pipeline or transformer folder, or an original single-file
checkpoint (``.safetensors`` / ``.pth`` of the model's own repository, e.g. SANA's
``Sana_600M_1024px.pth`` or Wan's ``diffusion_pytorch_model.safetensors`` in the original layout),
read by diffusers' ``from_single_file`` with a diffusers ``config``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import diffusers
import torch
from diffusers import DiffusionPipeline

from mhla_diffusers.apply import apply_mhla
from mhla_diffusers.checkpoint.format import (
    TRANSFORMER_COMPONENTS,
    MHLACheckpointError,
    check_base_weights,
    check_loaded,
    check_pipeline_loaded,
    dtype_kwargs,
    expert_timestep_range,
    import_named_components,
    read_mhla_config,
    read_safetensors_header,
    save_mhla_pipeline,
    save_mhla_transformer,
    transformer_class_of,
    transformer_folder,
)
from mhla_diffusers.families import FAMILIES, family_of, get_family
from mhla_diffusers.models.installer import mhla_spec, record_selection
from mhla_diffusers.models.provenance import is_hub_id
from mhla_diffusers.models.spec import check_lepe_init, check_mixing_init, check_settings
from mhla_diffusers.selection.calibration import calibration_inputs, clip_timestep_range

__all__ = ["convert_checkpoint", "AlreadyConvertedError"]


class AlreadyConvertedError(MHLACheckpointError):
    """The source checkpoint already has MHLA; conversion starts from the original model."""


SINGLE_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The floating dtype of most parameters of a ``.safetensors`` file or model folder (headers only), or ``None``.

    Raises:
        MHLACheckpointError: a file that is not a readable safetensors file.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" else []
    counts: dict[torch.dtype, int] = {}
    for file in files:
        header = read_safetensors_header(file)
        for key, info in header.items():
            dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if key != "__metadata__" else None
            if dtype is not None:
                start, end = info["data_offsets"]
                counts[dtype] = counts.get(dtype, 0) + (end - start) // torch.empty((), dtype=dtype).element_size()
    return max(counts, key=counts.get) if counts else None


def _pipeline_dtypes(folder: Path) -> dict:
    """``{component: stored dtype}`` for ``DiffusionPipeline.from_pretrained(dtype=...)`` (float32 default)."""
    dtypes = {"default": torch.float32}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        dtype = stored_dtype(sub)
        if dtype is not None:
            dtypes[sub.name] = dtype
    return dtypes


def load_failure(err: BaseException) -> str:
    """``"ErrorType: reason"`` of the first error behind ``err`` (loaders wrap it, e.g. diffusers' "Unable to load
    weights from checkpoint file"); a ``torch.load(weights_only=True)`` refusal reduced to its reason, without
    torch's advice to allow-list globals."""
    root, here, seen = err, err, {id(err)}
    while (here := here.__cause__ or here.__context__) is not None and id(here) not in seen:
        seen.add(id(here))
        if not isinstance(here, StopIteration):  # a parser's control flow (json's scanner), not the fault
            root = here
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(root))
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].lstrip().split("\n\n", 1)[0].split(" Please use ", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else repr(root)}"


def _unreadable(src, err: BaseException) -> MHLACheckpointError:
    """The error for a local source that diffusers failed to read (a damaged weights or config file)."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    cause = load_failure(err)
    detail = first if cause.endswith(first) else f"{first} ({cause})"
    return MHLACheckpointError(f"{src} could not be loaded: {detail}; the file is damaged, truncated or not a checkpoint")


@contextlib.contextmanager
def _reading(src):
    """Turn diffusers' ``OSError`` on a local source into :func:`_unreadable`'s one-line error."""
    try:
        yield
    except OSError as err:
        raise _unreadable(src, err) from err


def _check_weight_files(path: Path) -> None:
    """The header of every ``.safetensors`` file of a local source (a single file; a folder's own and its
    component folders') checked before diffusers reads it (:func:`read_safetensors_header` raises)."""
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("*/*.safetensors")]
    for file in sorted(files):
        if file.suffix == ".safetensors":
            read_safetensors_header(file)


def _single_file_loadable(cls) -> bool:
    """``cls`` has a diffusers single-file loader: ``from_single_file`` and a class (or base) in diffusers'
    ``SINGLE_FILE_LOADABLE_CLASSES`` (``FromOriginalModelMixin`` alone is not enough: SANA-Video has it, no loader)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    if not isinstance(cls, type) or not hasattr(cls, "from_single_file"):
        return False
    return any(isinstance(base, type) and issubclass(cls, base)
               for base in (getattr(diffusers, name, None) for name in SINGLE_FILE_LOADABLE_CLASSES))


def _no_single_file(src: Path, class_name: str, config: str | None) -> ValueError:
    """The error for a single file of a class diffusers cannot read from one: convert from the diffusers folder."""
    folder = f"--src {config}" if config is not None else "--src <its diffusers folder or Hub id>"
    return ValueError(
        f"{src}: diffusers {diffusers.__version__} has no single-file loader for {class_name} (it is not in "
        f"diffusers.loaders.single_file_model.SINGLE_FILE_LOADABLE_CLASSES), so this file cannot be converted; nothing "
        f"was written. Convert from the model's diffusers folder or Hub id instead ({folder}, without --config)"
    )


def _load_single_file(src: Path, config: str | None, family: str | None, torch_dtype: torch.dtype | None):
    """``(pipeline or None, transformer)`` from an original single-file checkpoint and a diffusers ``config``."""
    if (src.parent / "mhla_config.json").is_file():
        raise AlreadyConvertedError(
            f"{src} belongs to an MHLA checkpoint ({src.parent / 'mhla_config.json'}); nothing was written. Convert "
            "from the original checkpoint, or load this one with mhla_diffusers.load_mhla_transformer."
        )
    if family is not None and not any(_single_file_loadable(getattr(diffusers, n, None)) for n in get_family(family).model_classes):
        raise _no_single_file(src, get_family(family).model_classes[0], config)
    if config is None:
        raise ValueError(
            f"{src} is a single-file checkpoint: pass config= (--config) naming a diffusers folder or Hub id with "
            "the model's config.json (a local copy of the model's diffusers release, e.g. "
            "Wan-AI/Wan2.1-T2V-1.3B-Diffusers for a Wan file); diffusers would otherwise guess a model and fetch its "
            "config from the Hub"
        )
    cls, load_kwargs, pipeline_folder = single_file_target(src, config, family)
    if not _single_file_loadable(cls):
        raise _no_single_file(src, cls.__name__, config)
    _check_weight_files(src)
    if torch_dtype is None:
        torch_dtype = stored_dtype(src)  # None for pickled files: diffusers' float32
    try:
        with _unused_weights() as unused:
            model = cls.from_single_file(str(src), **load_kwargs, **dtype_kwargs(torch_dtype))
    except OSError as err:  # diffusers' "Unable to load weights from checkpoint file": a damaged or foreign file
        raise _unreadable(src, err) from err
    except (KeyError, IndexError) as err:  # diffusers' key mapping fails on another model's file
        raise ValueError(f"{src} is not an original {cls.__name__} checkpoint (missing key {err})") from err
    except (NotImplementedError, RuntimeError) as err:  # weights left on the meta device, or shape mismatches
        raise ValueError(
            f"{src} does not match the config {config} (layers or sizes differ; diffusers said: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); pass the config of the model this file belongs to"
        ) from err
    if unused:  # diffusers only logs them: a Wan VACE file read with a plain Wan config would lose its VACE branch
        names = ", ".join(unused[:3]) + (f", ... ({len(unused)} tensors)" if len(unused) > 3 else "")
        raise ValueError(
            f"{src} holds weights the {cls.__name__} of the config {config} has no place for ({names}): they would be "
            "dropped and nothing was written. Pass the config of the model this file belongs to"
        )
    if pipeline_folder is None:
        return None, model
    return pipeline_around(pipeline_folder, model, torch_dtype), None


@contextlib.contextmanager
def _unused_weights():
    """Collects the checkpoint tensors diffusers' ``from_single_file`` left unused (it logs them, at WARNING, and
    loads the model without them); the names of every such report, in a list the block may read afterwards."""
    unused: list[str] = []
    logger = logging.getLogger("diffusers.loaders.single_file_model")

    class Collect(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith("Some weights of the model checkpoint were not used"):
                listed = re.search(r"\['(.*)'\]", text, flags=re.S)
                unused.extend(n.strip() for n in (listed[1] if listed else text).split(",") if n.strip())

    handler, level = Collect(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))  # seen even when diffusers' verbosity is ERROR
    try:
        yield unused
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def single_file_target(src, config: str, family: str | None):
    """``(transformer class, config kwargs of from_single_file, pipeline folder or Hub id or None)`` for a
    single-file ``src`` read with the diffusers ``config`` (a local pipeline or transformer folder, or a
    Hub id of a pipeline: then ``family`` names the class).

    Raises:
        ValueError: a Hub id without ``family``. FileNotFoundError: ``config`` is neither.
    """
    folder = Path(config)
    if folder.exists():
        transformer_dir = transformer_folder(folder)
        cls = transformer_class_of(transformer_dir)
        return cls, {"config": str(transformer_dir)}, (folder if transformer_dir != folder else None)
    if is_hub_id(str(config)):
        if family is None:
            raise ValueError(f"pass family= (--family) to convert {src} with the Hub config {config!r}")
        cls = getattr(diffusers, get_family(family).model_classes[0])
        return cls, {"config": str(config), "subfolder": "transformer"}, str(config)
    raise FileNotFoundError(f"config {config} does not exist (and does not look like a Hub id 'owner/name')")


def pipeline_around(pipeline_folder, model, torch_dtype: torch.dtype | None):
    """The diffusers pipeline of ``pipeline_folder`` (local or Hub id) with ``model`` as its transformer; the
    other components in their stored dtypes (local) or ``torch_dtype``.

    Loaded through the pipeline's own class (named in ``model_index.json``): diffusers 0.42's
    ``DiffusionPipeline.from_pretrained`` silently ignores a passed component that the pipeline
    class lists as optional (``WanPipeline``'s ``transformer``) and loads the folder's own instead.
    """

    import_named_components(pipeline_folder)
    name = DiffusionPipeline.load_config(str(pipeline_folder)).get("_class_name")
    pipeline_class = getattr(diffusers, str(name), None)
    if pipeline_class is None:
        raise ValueError(f"{pipeline_folder}: model_index.json names an unknown pipeline class {name!r}")
    local = Path(pipeline_folder).is_dir()
    dtypes = _pipeline_dtypes(Path(pipeline_folder)) if local else {}
    if dtypes and torch_dtype is not None:
        dtypes["transformer"] = torch_dtype
    with _reading(pipeline_folder) if local else contextlib.nullcontext():
        pipe = pipeline_class.from_pretrained(pipeline_folder, transformer=model, **dtype_kwargs(dtypes or torch_dtype))
    if pipe.transformer is not model:  # never write the config's transformer in place of the converted one
        raise RuntimeError(f"diffusers did not take the converted transformer into the {type(pipe).__name__} of {pipeline_folder}")
    check_pipeline_loaded(pipe, pipeline_folder)
    return pipe


def _load_source(src: str, torch_dtype: torch.dtype | None, config: str | None = None, family: str | None = None):
    """(pipeline or None, transformer) from a local pipeline/transformer folder, a Hub id, or a single file."""

    path = Path(src)
    if path.is_file():
        if path.suffix not in SINGLE_FILE_SUFFIXES:
            raise ValueError(f"{src} is a file but not a checkpoint ({', '.join(SINGLE_FILE_SUFFIXES)})")
        return _load_single_file(path, config, family, torch_dtype)
    if config is not None:
        raise ValueError("config= (--config) is only for single-file checkpoints; a diffusers folder or Hub id carries its own")
    if path.exists():
        folder = transformer_folder(path)
        mhla = read_mhla_config(folder)
        if mhla is None and (path / "transformer_2" / "config.json").is_file():
            mhla = read_mhla_config(path / "transformer_2")  # Wan 2.2: MHLA on the second expert only
        if mhla is not None:
            raise AlreadyConvertedError(
                f"{src} is already an MHLA checkpoint (layers {mhla['layers']}, block grid {mhla['block_grid']}); "
                "nothing was written. Convert from the original checkpoint to change settings, or load this one "
                "with mhla_diffusers.load_mhla_pipeline / load_mhla_transformer."
            )
        if (path / "model_index.json").is_file():
            import_named_components(path)
            _check_weight_files(path)
            for name in TRANSFORMER_COMPONENTS:
                check_base_weights(path / name)
            dtype = _pipeline_dtypes(path) if torch_dtype is None else torch_dtype
            with _reading(path):
                pipe = DiffusionPipeline.from_pretrained(path, **dtype_kwargs(dtype))
            check_pipeline_loaded(pipe, path)
            return pipe, None
        _check_weight_files(folder)
        check_base_weights(folder)
        dtype = stored_dtype(folder) if torch_dtype is None else torch_dtype
        with _reading(folder):
            model = transformer_class_of(folder).from_pretrained(folder, **dtype_kwargs(dtype))
        check_loaded(model, folder)
        return None, model
    if not is_hub_id(src):
        raise FileNotFoundError(f"{src} does not exist (and does not look like a Hub id 'owner/name')")
    try:
        return DiffusionPipeline.from_pretrained(src, **dtype_kwargs(torch_dtype)), None
    except OSError as err:  # FileNotFoundError (an OSError): the command lines' exit 2 with one line
        cause = " ".join(str(err).split())
        raise FileNotFoundError(
            f"could not load {src!r} from the Hugging Face Hub or its local cache ({cause}). Offline "
            "(HF_HUB_OFFLINE=1) only cached repositories load; pass a local folder instead."
        ) from err


def _check_calibration_options(
    layers, keep_softmax, max_attention_cost, calibration, sensitivity, samples, seed, embeddings, latent_size=None, device=None,
    cost=None,
) -> None:
    """Refuse ``layers="auto"`` / calibration options that would be ignored (``ValueError`` naming them)."""
    made = {"calibration_samples": samples, "calibration_seed": seed, "calibration_embeddings": embeddings,
            "calibration_latent_size": latent_size}
    if isinstance(layers, str) and layers == "auto" and (keep_softmax is None) == (max_attention_cost is None):
        raise ValueError("layers='auto' needs exactly one of keep_softmax=K (--keep-softmax) or max_attention_cost=F (--attention-budget)")
    given = [name for name, value in made.items() if value is not None]
    if not (isinstance(layers, str) and layers == "auto"):
        others = (("keep_softmax", keep_softmax), ("max_attention_cost", max_attention_cost), ("calibration", calibration),
                  ("sensitivity", sensitivity), ("device", device), ("cost", cost))
        given = [name for name, value in others if value is not None] + given
        if given:
            raise ValueError(f"{', '.join(given)} only apply with layers='auto' (--layers auto); got layers={layers!r}")
    elif given and (calibration is not None or sensitivity is not None):
        raise ValueError(f"{', '.join(given)} make calibration inputs; they do not apply with calibration= or sensitivity= given")


def _check_request(src, out, family: str | None, layers, layers_2):
    """Checks made before loading anything (``ValueError``); returns ``layers``."""
    if not isinstance(layers, str):
        layers = list(layers)
    if (layers == "none" and layers_2 in (None, "none")) or (not isinstance(layers, str) and not layers):
        raise ValueError(
            f"no layers selected (layers={layers!r}): a conversion installs MHLA on at least one layer; "
            "give 'all', 'hybrid' or a non-empty list of indices (layers='none' only beside a layers_2 of a Wan 2.2 "
            "transformer_2)"
        )
    src_path, out_path = Path(src).resolve(), Path(out).resolve()
    if Path(src).exists() and (src_path == out_path or src_path.is_relative_to(out_path)):
        raise ValueError(f"--out {out} would replace the source {src}; write the converted checkpoint elsewhere")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    return layers


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    family: str | None = None,
    layers: str | Sequence[int] = "all",
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
    normalize: bool = True,
    eps: float | None = None,
    torch_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    config: str | os.PathLike | None = None,
    output_norm: bool | None = None,
    keep_softmax: int | None = None,
    max_attention_cost: float | None = None,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    sensitivity=None,
    calibration_samples: int | None = None,
    calibration_seed: int | None = None,
    calibration_embeddings: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    layers_2: str | Sequence[int] | None = None,
    calibration_latent_size: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    init: str = "locality",
    feature_eps: float = 0.0,
    mixing_clamp: bool = True,
    feature_power: float = 1.0,
    rope: str | None = None,
    gate: bool | str | None = None,
    lepe: bool = False,
    lepe_init: str = "zeros",
    cost=None,
) -> dict:
    """Load a pretrained checkpoint, install MHLA, write it as a converted checkpoint at ``out``.

    Args:
        src: a Hub id, a local pipeline or transformer folder, or a single-file checkpoint (with ``config``).
        config: single-file ``src`` only: a local pipeline / transformer folder or a pipeline Hub id.
        out: output folder (atomic; must not exist or be empty unless ``overwrite``).
        family: expected family (``"dit"``, ``"sana"``, ``"wan"``), checked when given.
        layers, num_blocks, block_grid, normalize, eps, output_norm, keep_softmax, max_attention_cost,
            calibration, sensitivity, cost: see :func:`~mhla_diffusers.apply_mhla` (``cost=None``: ``"flops"``).
        init, feature_eps, mixing_clamp, feature_power, rope, gate, lepe, lepe_init: the per-layer options of
            :func:`~mhla_diffusers.apply_mhla` (mixing-matrix start, features, clamp, RoPE placement, output gate,
            LePE), for every converted transformer.
        layers_2: Wan 2.2's ``transformer_2`` selection (``None``: ``layers``; ``"none"``: stock).
        calibration_samples, calibration_seed, calibration_latent_size, calibration_embeddings, device:
            ``layers="auto"`` with calibration made here (:func:`~mhla_diffusers.calibration_inputs`).
        torch_dtype: base weights' dtype; ``None`` keeps each local component's stored dtype.

    Returns:
        The spec written to ``mhla_config.json`` plus ``"out"``.

    Raises:
        AlreadyConvertedError: ``src`` already has MHLA: nothing is written.
        ValueError: unknown or mismatched family, bad layer / block / calibration options, a single file
            without ``config`` or the reverse, a ``layers_2`` without a second transformer, an unusable ``device``.
        FileNotFoundError / OSError: ``src`` (or ``calibration_embeddings``) cannot be found or loaded.

    Every option's rules in full: ``docs/checkpoints.md`` (Converting).
    """
    _check_calibration_options(
        layers, keep_softmax, max_attention_cost, calibration, sensitivity, calibration_samples, calibration_seed,
        calibration_embeddings, calibration_latent_size, device, cost,
    )
    device = _check_device(device)
    layers = _check_request(src, out, family, layers, layers_2)
    options = dict(init=init, feature_eps=feature_eps, mixing_clamp=mixing_clamp, feature_power=feature_power, rope=rope,
                   gate=gate, lepe=lepe, lepe_init=lepe_init)
    _check_options(num_blocks, block_grid, normalize, eps, **options)
    pipe, transformer = _load_source(str(src), torch_dtype, None if config is None else str(config), family)
    model = pipe.transformer if pipe is not None else transformer
    found = family_of(model if model is not None else pipe.transformer_2)
    if family is not None and found.name != family:
        raise ValueError(f"--family {family} was given but {src} holds a {type(model).__name__} ({found.name})")
    second = getattr(pipe, "transformer_2", None) if pipe is not None else None
    if layers_2 is not None and second is None:
        raise ValueError(f"layers_2 (--layers-2) selects layers of a second transformer (Wan 2.2's transformer_2); {src} has none")
    if layers == "none" and second is None:
        raise ValueError(f"layers='none' (--layers none) leaves the only transformer of {src} stock: nothing to convert")
    layers_2 = layers if layers_2 is None else layers_2
    _check_auto_settings(layers, layers_2 if second is not None else None, sensitivity)
    settings = dict(num_blocks=num_blocks, block_grid=block_grid, normalize=normalize, eps=eps, output_norm=output_norm,
                    **options)
    auto = dict(keep_softmax=keep_softmax, max_attention_cost=max_attention_cost, calibration=calibration, sensitivity=sensitivity,
                samples=calibration_samples, seed=calibration_seed, embeddings=calibration_embeddings,
                latent_size=calibration_latent_size, device=device, cost="flops" if cost is None else cost)
    if model is not None and layers != "none":
        _convert_one(pipe, "transformer", model, layers, settings, auto if layers == "auto" else None, src)
    if second is not None and layers_2 != "none":
        _convert_one(pipe, "transformer_2", second, layers_2, settings, auto if layers_2 == "auto" else None,
                     f"{src} (transformer_2, --layers-2)")
    spec = (mhla_spec(model) if model is not None else None) or {}  # {}: transformer left stock (layers="none")
    if second is not None:
        spec = {**spec, "transformer_2": mhla_spec(second)}
    if pipe is not None:
        save_mhla_pipeline(pipe, out, overwrite=overwrite)
    else:
        save_mhla_transformer(model, out, overwrite=overwrite)
    return {**spec, "out": str(out)}


def _check_options(num_blocks, block_grid, normalize, eps, *, init, feature_eps, mixing_clamp, feature_power, rope, gate, lepe,
                   lepe_init) -> None:
    """The MHLA settings checked before anything is loaded (``ValueError`` naming the bad one); family-specific rules
    (``rope`` without RoPE, a preset the family lacks) are checked when the model is known."""
    check_settings(num_blocks, block_grid, normalize, eps, "auto", feature_eps, feature_power=feature_power, rope=rope,
                   gate=gate, lepe=lepe)
    check_mixing_init(init)
    check_lepe_init(lepe_init)
    for name, value in (("mixing_clamp", mixing_clamp), ("lepe", lepe)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r}")


def _check_auto_settings(layers, layers_2, sensitivity) -> None:
    """Raises ``ValueError``: ``layers_2="auto"`` without ``layers="auto"`` (the options belong to the latter), or
    ``sensitivity`` (one model's scores) with two experts selecting automatically."""
    if layers_2 == "auto" and layers != "auto":
        raise ValueError("layers_2='auto' (--layers-2 auto) needs layers='auto' too (its keep_softmax / attention budget apply to both)")
    if layers == "auto" and layers_2 == "auto" and sensitivity is not None:
        raise ValueError("sensitivity= holds one transformer's scores; with both experts on layers='auto' give calibration= instead")


def _check_device(device) -> torch.device | None:
    """``device`` as a usable ``torch.device``, or ``None`` (``ValueError`` for one this machine lacks)."""
    if device is None:
        return None
    try:
        device = torch.device(device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, TypeError) as err:  # torch: bad name, or e.g. CUDA not compiled / no GPU
        raise ValueError(
            f"device {str(device)!r} (--device) cannot be used here: {err}; give cpu, or cuda / cuda:N on a GPU machine"
        ) from err
    return device


def _auto_settings(pipe, name: str, model, auto: dict) -> tuple[dict, tuple[float, float] | None]:
    """``(apply_mhla kwargs, calibration timestep range or None)`` of ``layers="auto"`` for expert ``name``."""
    calibration, timestep_range = auto["calibration"], None
    if calibration is None and auto["sensitivity"] is None:
        timestep_range = expert_timestep_range(pipe, name) if pipe is not None else None
        calibration = calibration_inputs(
            pipe if pipe is not None else model, num_samples=8 if auto["samples"] is None else auto["samples"],
            seed=auto["seed"] or 0, embeddings=auto["embeddings"], latent_size=auto["latent_size"], timestep_range=timestep_range,
        )
        # calibration_inputs reads pipe.transformer: the second expert gets its own inputs on its own device / dtype
        parameter = next(model.parameters())
        calibration = [{k: v.to(parameter.device, parameter.dtype if v.is_floating_point() and k != "timestep" else v.dtype)
                        for k, v in entry.items()} for entry in calibration]
    elif calibration is not None:
        device = next(model.parameters()).device
        calibration = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()} for entry in calibration]
    settings = dict(keep_softmax=auto["keep_softmax"], max_attention_cost=auto["max_attention_cost"], calibration=calibration,
                    sensitivity=auto["sensitivity"], cost=auto["cost"])
    return settings, timestep_range


def _convert_one(pipe, name: str, model, layers, settings: dict, auto: dict | None, where: str) -> None:
    """``apply_mhla`` on transformer ``name``; ``transformer_2`` errors prefixed with ``where``."""
    if not isinstance(layers, str):
        layers = list(layers)
    if layers == "none" or (not isinstance(layers, str) and not layers):
        raise ValueError(f"no layers selected for {where} (layers={layers!r}): give 'all', 'hybrid' or a non-empty list of indices")
    try:
        _apply(pipe, name, model, layers, settings, auto)
    except ValueError as err:
        if name == "transformer":
            raise
        raise ValueError(f"{where}: {err}") from err
    if mhla_spec(model) is None:  # e.g. "hybrid" on a model with a single self-attention layer
        raise ValueError(f"no layers selected: layers={layers!r} picks none of the self-attention layers of {where}; nothing was written")


def _apply(pipe, name: str, model, layers, settings: dict, auto: dict | None) -> None:
    """``apply_mhla`` of :func:`_convert_one`; ``layers="auto"`` measured on ``auto["device"]`` (then ``model`` goes
    back to its device), the timestep range of the calibration made here added to the selection record."""
    if auto is None:
        apply_mhla(model, layers, **settings)
        return
    home = next(model.parameters()).device
    if auto["device"] is not None:
        model.to(auto["device"])
    try:
        extra, timestep_range = _auto_settings(pipe, name, model, auto)
        apply_mhla(model, layers, **settings, **extra)
    finally:
        model.to(home)
    selection = (mhla_spec(model) or {}).get("selection")
    if selection is not None and auto["calibration"] is None and auto["sensitivity"] is None:
        record_selection(model, {**selection, "calibration_timestep_range": list(clip_timestep_range(timestep_range))})
