"""Import the authors' released Wan2.1-1.3B MHLA weights (DAGroup-PKU/MHLA) into a diffusers ``WanTransformer3DModel``.

Their model is the original Wan 2.1 code with some self-attention layers replaced by their
``MHLA_Video_Uni``; their released configuration (``mhla_videogen`` at commit ccf97b2) maps onto our
layer as: stock q/k/v/o and q/k norms (renamed by diffusers' converter), ``feature_eps=1e-6``
(``ReLU(x) + 1e-6``), ``normalize=False`` (numerator only, RoPE on the features), block grid
``(3, 5, 10)`` (``M = 150``) with ``W = block_attn.conv.weight[:, :, 0, 0]`` unclamped
(``mixing_clamp=False``), and their ``g_norm`` as our per-head :class:`~mhla_diffusers.OutputRMSNorm`.
Their layer's ``norm_output`` (default ``True`` in their constructors, ``false`` in the release) is not in the
weights: ``norm_output=False`` is assumed, ``norm_output=True`` (``--norm-output``) imports their normaliser.
Checkpoints of their gated / LePE variant (``is_gated``: ``g_norm(out) * SiLU(g(x))``; ``is_lepe``: a 3 x 3 x 3
depthwise ``Conv3d`` of v added before ``o``) map onto our ``gate="authors"`` and ``lepe`` with their weights.
The MHLA layers are those whose weights the file holds; the native
size 480 x 800 px, 81 frames is recorded as ``config._mhla_native_size``. Differences left are rounding.

The mapping in full, with the reasons: ``docs/checkpoints.md`` (the authors' importer).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from mhla_diffusers.apply import apply_mhla
from mhla_diffusers.checkpoint.conversion import load_failure, pipeline_around, single_file_target
from mhla_diffusers.checkpoint.format import check_loaded, save_mhla_pipeline, save_mhla_transformer
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError, load_safetensors
from mhla_diffusers.families import NATIVE_SIZE_KEY, WAN, family_of, self_attention_modules
from mhla_diffusers.families.wan import AUTHORS_BLOCK_GRID, AUTHORS_NATIVE_SIZE
from mhla_diffusers.models.installer import mhla_spec

__all__ = [
    "AUTHORS_BLOCK_GRID",
    "AUTHORS_FEATURE_EPS",
    "AUTHORS_EPS",
    "AUTHORS_NATIVE_SIZE",
    "NATIVE_SIZE_KEY",
    "AuthorsCheckpointError",
    "read_authors_state_dict",
    "read_authors_checkpoint",
    "authors_file",
    "split_authors_state_dict",
    "install_authors_mhla",
    "load_authors_wan",
    "import_authors_wan",
    "authors_state",
    "write_import",
    "storage_dtype",
]

# AUTHORS_BLOCK_GRID (3, 5, 10), AUTHORS_NATIVE_SIZE (480 x 800 px, 81 frames): the Wan family's (families/wan.py);
# NATIVE_SIZE_KEY: the config key recording a native size (families/base.py).
AUTHORS_FEATURE_EPS = 1e-6
AUTHORS_EPS = 1e-6  # their layer's eps: in the features and, with norm_output, in the normaliser
WEIGHTS_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")

# Key prefixes of wrapped models (DDP, torch.compile, FSDP, ComfyUI-style files), stripped when every key has one.
_WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.", "_fsdp_wrapped_module.", "diffusion_model.")
_MHLA_KEY = re.compile(r"^blocks\.(\d+)\.self_attn\.(block_attn\.conv\.weight|g_norm\.weight|(?:g|lepe)\.(?:weight|bias))$")
# their optional modules, each present on a layer with both of its keys or not at all
_OPTIONAL = {"gate": ("g.weight", "g.bias"), "lepe": ("lepe.weight", "lepe.bias")}
_LISTED = 12  # keys named in an error message


class AuthorsCheckpointError(ValueError):
    """The file is not the authors' Wan MHLA model for the given diffusers config (unknown, missing or
    mis-shaped keys, an unsupported variant, an unreadable or ambiguous file)."""


def _listed(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return f"{keys[:_LISTED]}{more}"


# -- reading the file -------------------------------------------------------------------------------
def read_authors_state_dict(path: str | os.PathLike, state_dict_key: str | None = None) -> dict[str, torch.Tensor]:
    """The flat ``{key: tensor}`` state dict of the authors' checkpoint file, in their key names.

    Reads ``.safetensors`` (header checked first) or a pickled ``.pth`` / ``.pt`` / ``.bin`` / ``.ckpt``
    through :func:`_torch_load_weights` (``weights_only``; nothing else is unpickled). A nested training
    checkpoint is unwrapped (``state_dict_key``, else its one dict of tensors); a prefix every key carries
    (``module.``, ``model.``, ``_orig_mod.``, ...) is removed. Tensors keep their stored dtype.

    Raises:
        FileNotFoundError: no such file or folder.
        AuthorsCheckpointError: an unknown suffix, a damaged or truncated file, a pickle ``weights_only``
            refuses, no dict of tensors, several candidates without ``state_dict_key``, or a missing key; a
            folder as :func:`authors_file`.
    """
    path = authors_file(path)
    return strip_wrapper_prefix(unwrap_state_dict(read_authors_checkpoint(path), state_dict_key, path))


def authors_file(path: str | os.PathLike) -> Path:
    """The checkpoint file ``path`` names: itself, or the one weights file (:data:`WEIGHTS_SUFFIXES`) a folder holds
    at its top level (a Hub download of their release: ``model.safetensors`` beside a README).

    Raises:
        FileNotFoundError: no such file or folder.
        AuthorsCheckpointError: a folder holding no weights file or several (naming them), or a diffusers model
            folder (``config.json`` / ``model_index.json``: not their layout).
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "config.json").is_file() or (path / "model_index.json").is_file():
        raise AuthorsCheckpointError(
            f"{path} is a diffusers model folder (config.json / model_index.json), not the authors' checkpoint: give "
            "it as --config (config=), and as --src (src=) their checkpoint file"
        )
    files = sorted(f.name for f in path.iterdir() if f.is_file() and f.suffix in WEIGHTS_SUFFIXES)
    if len(files) != 1:
        held = f"holds the weights files {files}" if files else f"holds no weights file ({', '.join(WEIGHTS_SUFFIXES)})"
        raise AuthorsCheckpointError(
            f"{path} is a folder and {held}: give the authors' checkpoint file itself as --src (src=), e.g. "
            f"{path / (files[0] if files else 'model.safetensors')}"
        )
    return path / files[0]


def read_authors_checkpoint(path: str | os.PathLike):
    """The object stored in the checkpoint file ``path`` (a safetensors dict, or what ``torch.load`` returns
    under :func:`_torch_load_weights`), unwrapped by nothing.

    Raises:
        FileNotFoundError: no such file.
        AuthorsCheckpointError: an unknown suffix, a damaged or truncated file, a pickle ``weights_only`` refuses.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    if path.suffix in WEIGHTS_SUFFIXES:
        return _torch_load_weights(path)
    raise AuthorsCheckpointError(f"{path}: expected a .safetensors, .pth, .pt, .bin or .ckpt file")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(path, "the authors' checkpoint")
    except MHLACheckpointError as err:
        raise AuthorsCheckpointError(str(err)) from err


def _numpy_rng_globals() -> list:
    """The numpy globals ``weights_only`` loading needs for ``np.random.get_state()`` (numpy 1 and 2 names)."""
    import numpy as np

    reconstruct = np.empty(0).__reduce__()[0]  # numpy._core.multiarray._reconstruct (numpy.core.* in numpy 1)
    names = {f"{module}.multiarray._reconstruct" for module in ("numpy._core", "numpy.core")}
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), *((reconstruct, name) for name in sorted(names))]


_EXTRACT = (
    "If you trust the file, save the state dict alone and import that file: ckpt = torch.load(path, weights_only=False); "
    "torch.save(ckpt['state_dict'], 'model.pth') (the entry holding the weights)"
)


def _torch_load_weights(path: str | os.PathLike):
    """``torch.load(weights_only=True)`` on the CPU, numpy RNG-state types and ``argparse.Namespace`` (the run's
    arguments their DiT ``train.py`` saves beside the weights; a plain attribute holder) allowed for this call only;
    else AuthorsCheckpointError."""
    import argparse

    path = Path(path)
    extra = [*_numpy_rng_globals(), argparse.Namespace]
    ours = [g for g in extra if g not in torch.serialization.get_safe_globals()]
    try:
        with torch.serialization.safe_globals(ours):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:
        reason = load_failure(err)
        built = re.search(r"but got <class '([^']+)'>", reason)  # weights_only refusing to build an allowed global's type
        reason = built.group(1) if built else reason
        refused = _refused_globals(path, ours) if "weights only" in str(err).lower() else None
        if refused or built or "GLOBAL" in reason:
            raise AuthorsCheckpointError(
                f"{path} holds pickled objects that torch.load(weights_only=True) does not load "
                f"({', '.join(refused) if refused else reason}); nothing else is unpickled. {_EXTRACT}"
            ) from err
        raise AuthorsCheckpointError(
            f"{path} is not a readable torch checkpoint ({reason}): the file is damaged, truncated or of another format"
        ) from err


def _refused_globals(path: Path, allowed: list) -> list[str] | None:
    """The globals of a zip-format checkpoint that ``weights_only`` does not allow (``None``: not such a file)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # a damaged archive: reported as such by the caller
        return None


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _held(obj) -> str:
    """What a non-state-dict entry holds, for messages: its type, or the non-tensor entries of a dict."""
    if isinstance(obj, Mapping):
        others = sorted(f"{k!s}: {type(v).__name__}" for k, v in obj.items() if not isinstance(v, torch.Tensor))
        return f"entries that are not tensors, {others[:4]}" if others else "no tensors"
    return f"a {type(obj).__name__}"


def unwrap_state_dict(obj, key: str | None, path: Path) -> dict[str, torch.Tensor]:
    """The dict of tensors inside a loaded checkpoint object (see :func:`read_authors_state_dict`)."""
    if not isinstance(obj, Mapping):
        raise AuthorsCheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
    if key is not None:
        if key not in obj or not _is_tensor_dict(obj[key]):
            entries = sorted(str(k) for k, v in obj.items() if _is_tensor_dict(v))
            flat = " (the file is itself a state dict: leave out state_dict_key / --state-dict-key)" if _is_tensor_dict(obj) else ""
            held = "" if key not in obj else f" (its {key!r} entry holds {_held(obj[key])})"
            raise AuthorsCheckpointError(
                f"{path} has no state dict under {key!r}{held}; its entries holding state dicts: {entries or 'none'}{flat}"
            )
        return dict(obj[key])
    if _is_tensor_dict(obj):
        return dict(obj)
    candidates = sorted(str(k) for k, v in obj.items() if _is_tensor_dict(v))
    if len(candidates) == 1:
        return dict(obj[candidates[0]])
    if not candidates:
        raise AuthorsCheckpointError(
            f"{path} holds no state dict (no dict of tensors at the top level or under one entry; entries: "
            f"{_listed(str(k) for k in obj)})"
        )
    raise AuthorsCheckpointError(
        f"{path} holds several state dicts {candidates} (e.g. the model and its EMA): choose one with "
        "state_dict_key= (--state-dict-key)"
    )


def strip_wrapper_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without a wrapper prefix that every key carries (repeatedly: ``module.model.`` too)."""
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                changed = True
    return state


def split_authors_state_dict(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Split their state dict into the stock Wan keys and the MHLA keys of each MHLA layer.

    Returns:
        ``(stock, mhla)``: ``stock`` every other key (their names); ``mhla``
        ``{layer: {"block_attn.conv.weight": [M, M, 1, 1], "g_norm.weight": [head_dim]}}`` (unchecked), with
        ``"g.weight"``, ``"g.bias"`` (gated variant) and ``"lepe.weight"``, ``"lepe.bias"`` (LePE) where the file has them.
    """
    stock, mhla = {}, {}
    for key, value in state.items():
        match = _MHLA_KEY.match(key)
        if match:
            mhla.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            stock[key] = value
    return stock, mhla


# -- building the diffusers model ---------------------------------------------------------------------
def _empty_transformer(cls, load_kwargs: dict):
    """The transformer of the diffusers config, parameters on the meta device (for names and shapes)."""
    # function-level import: accelerate (heavy) is needed only to build an empty model for the authors' import
    from accelerate import init_empty_weights

    config = cls.load_config(load_kwargs["config"], subfolder=load_kwargs.get("subfolder"))
    with init_empty_weights():
        return cls.from_config(config)


def _to_diffusers_keys(stock: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(converted, original name of each converted key)`` through diffusers' own Wan key mapping."""
    names = {id(v): k for k, v in stock.items()}
    converted = convert_wan_transformer_to_diffusers(dict(stock))  # renames keys; pops from the copy
    return converted, {new: names.get(id(v), new) for new, v in converted.items()}


def _check_stock_keys(converted: dict, original: dict[str, str], empty, src) -> None:
    """Every model parameter given once with its shape, else :class:`AuthorsCheckpointError` listing the differences."""
    expected = {k: tuple(v.shape) for k, v in empty.state_dict().items()}
    unknown = [original[k] for k in converted if k not in expected]
    missing = [k for k in expected if k not in converted]
    shapes = [
        f"{original[k]}: {tuple(v.shape)} in the file, {expected[k]} in the config"
        for k, v in converted.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    problems = []
    if unknown:
        problems.append(f"unknown keys {_listed(unknown)}")
    if missing:
        problems.append(f"missing keys (diffusers names) {_listed(missing)}")
    if shapes:
        problems.append(f"shape mismatches {shapes[:_LISTED]}")
    if problems:
        raise AuthorsCheckpointError(
            f"{src} does not match the diffusers Wan config ({'; '.join(problems)}); pass the config of the model this "
            "file belongs to (Wan2.1-T2V-1.3B-Diffusers for the released weights); nothing was written"
        )


def storage_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype holding most parameter values of ``state`` (float32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def install_authors_mhla(
    transformer, mhla: Mapping[int, Mapping[str, torch.Tensor]], block_grid=AUTHORS_BLOCK_GRID, *, norm_output: bool = False
) -> list[int]:
    """Install MHLA on a diffusers ``WanTransformer3DModel`` as the authors' layers run, with their weights.

    ``apply_mhla`` on the layers of ``mhla`` (numerator only, per-head output RMSNorm,
    ``feature_eps=1e-6``, unclamped); mixing ``<- block_attn.conv.weight[:, :, 0, 0]``, output norm
    ``<- g_norm.weight`` on every head, float32. Their gated variant: ``gate="authors"`` (``SiLU``),
    ``mhla.gate <- g``; their LePE: ``lepe=True`` (3 x 3 x 3), ``mhla.lepe <- lepe``. ``norm_output=True``:
    their normaliser ``sum_j W[i, j] (phi(q[j, l]) . z_j) + 1e-6`` on the un-rotated features, the form of their DiT
    layer's (``normalize=True``, ``denominator="authors_dit"``, ``eps=1e-6``; blocks of equal size only).

    Args:
        mhla: as :func:`split_authors_state_dict` returns it.
        block_grid: ``(bt, bh, bw)`` with ``bt * bh * bw = M``; their code always builds (3, 5, 10).
        norm_output: their layer's ``norm_output`` (``normalize_out``): ``False`` in their released config (the
            default here), ``True`` the default of their constructors. The weights are the same either way: the file
            cannot tell.

    Returns:
        The MHLA layer indices.

    Raises:
        AuthorsCheckpointError: no MHLA layer, an unknown layer index, one key of the two only, a mixing
            matrix not ``[M, M, 1, 1]`` (or differing between layers), a norm not ``[head_dim]``, non-finite values;
            gate / LePE weights on some MHLA layers only, with one key of two, or mis-shaped.
    """
    family = family_of(transformer)
    if family is not WAN:
        raise AuthorsCheckpointError(f"the authors' MHLA video model is a Wan model; got a {type(transformer).__name__}")
    modules = self_attention_modules(transformer, family)
    if not mhla:
        raise AuthorsCheckpointError(
            "the file holds no MHLA layer (no blocks.<i>.self_attn.block_attn.conv.weight): it is a plain Wan model; "
            "convert it with convert.py --from diffusers (the default) instead"
        )
    beyond = sorted(i for i in mhla if i >= len(modules))
    if beyond:
        raise AuthorsCheckpointError(
            f"unknown keys: MHLA weights for layers {beyond}, but the config has {len(modules)} layers; nothing was written"
        )
    m = block_grid[0] * block_grid[1] * block_grid[2]
    heads = transformer.config.num_attention_heads
    head_dim = transformer.config.attention_head_dim
    expected = {"block_attn.conv.weight": (m, m, 1, 1), "g_norm.weight": (head_dim,)}
    for i in sorted(mhla):
        lacking = [f"blocks.{i}.self_attn.{name}" for name in expected if name not in mhla[i]]
        if lacking:
            raise AuthorsCheckpointError(f"missing keys {lacking}: layer {i} has only part of an MHLA layer; nothing was written")
        for name, shape in expected.items():
            got = tuple(mhla[i][name].shape)
            if got != shape:
                what = f"the mixing matrix of {m} = {' x '.join(map(str, block_grid))} blocks" if "conv" in name else (
                    f"one weight per channel of a head (head dim {head_dim})")
                raise AuthorsCheckpointError(
                    f"blocks.{i}.self_attn.{name} has shape {got}, expected {shape}: {what}"
                    + (" (their code always builds blocks (3, 5, 10); for another layout give block_grid= / "
                       "--block-grid with that many blocks)" if "conv" in name else "")
                )
            if not torch.isfinite(mhla[i][name]).all():
                raise AuthorsCheckpointError(f"blocks.{i}.self_attn.{name} holds NaN or infinite values")
    layers = sorted(mhla)
    options = _authors_variant(mhla, heads * head_dim)
    normaliser = {"normalize": True, "denominator": "authors_dit", "eps": AUTHORS_EPS} if norm_output else {"normalize": False}
    apply_mhla(
        transformer, layers, block_grid=tuple(block_grid), output_norm=True, feature_eps=AUTHORS_FEATURE_EPS,
        mixing_clamp=False, gate="authors" if options["gate"] else None, lepe=options["lepe"], **normaliser,
    )
    with torch.no_grad():
        for i in layers:
            attn = modules[i][1]
            attn.mhla.mixing.weight.copy_(mhla[i]["block_attn.conv.weight"][:, :, 0, 0].float())
            attn.mhla.output_norm.weight.copy_(mhla[i]["g_norm.weight"].float().expand(heads, head_dim))
            for module, (weight, bias) in ((attn.mhla.gate, _OPTIONAL["gate"]),
                                           (attn.mhla.lepe, _OPTIONAL["lepe"])):
                if module is not None:
                    module.weight.copy_(mhla[i][weight].float())
                    module.bias.copy_(mhla[i][bias].float())
    return layers


def _authors_variant(mhla: Mapping[int, Mapping[str, torch.Tensor]], channels: int) -> dict[str, bool]:
    """``{"gate": bool, "lepe": bool}``: the optional modules every MHLA layer of the file has (their model builds
    all its MHLA layers from one config), their weights checked: ``g`` ``[C, C]`` + ``[C]``, ``lepe``
    ``[C, 1, 3, 3, 3]`` + ``[C]`` for ``C = heads * head_dim`` channels, finite.

    Raises:
        AuthorsCheckpointError: a module with one of its two keys; layers that differ; a wrong shape; NaN / inf.
    """
    shapes = {"g.weight": (channels, channels), "g.bias": (channels,), "lepe.weight": (channels, 1, 3, 3, 3),
              "lepe.bias": (channels,)}
    found = {}
    for option, keys in _OPTIONAL.items():
        for i, params in sorted(mhla.items()):
            held = [k for k in keys if k in params]
            if held and len(held) < len(keys):
                lacking = [f"blocks.{i}.self_attn.{k}" for k in keys if k not in params]
                raise AuthorsCheckpointError(f"missing keys {lacking}: layer {i} has only part of its {option}; nothing was written")
        with_it = [i for i, params in sorted(mhla.items()) if keys[0] in params]
        if with_it and len(with_it) != len(mhla):
            without = sorted(set(mhla) - set(with_it))
            raise AuthorsCheckpointError(
                f"MHLA layers {with_it} have the {option} weights ({keys[0]}) and layers {without} do not; the authors' model "
                "builds every MHLA layer from one config, so this file is damaged or not theirs; nothing was written"
            )
        found[option] = bool(with_it)
        for i in with_it:
            for key in keys:
                got = tuple(mhla[i][key].shape)
                if got != shapes[key]:
                    raise AuthorsCheckpointError(
                        f"blocks.{i}.self_attn.{key} has shape {got}, expected {shapes[key]} ({channels} channels: "
                        f"{'nn.Linear(dim, dim)' if option == 'gate' else 'a depthwise 3 x 3 x 3 Conv3d with bias'})"
                    )
                if not torch.isfinite(mhla[i][key]).all():
                    raise AuthorsCheckpointError(f"blocks.{i}.self_attn.{key} holds NaN or infinite values")
    return found


def load_authors_wan(
    src: str | os.PathLike | Mapping[str, torch.Tensor],
    config: str | os.PathLike,
    *,
    torch_dtype: torch.dtype | None = None,
    state_dict_key: str | None = None,
    block_grid=AUTHORS_BLOCK_GRID,
    norm_output: bool = False,
):
    """The authors' Wan MHLA model as a diffusers pipeline (or transformer) with our MHLA layers.

    Args:
        src: their checkpoint file, a folder holding just that one (:func:`authors_file`), or the loaded object.
        config: a local diffusers Wan2.1-T2V-1.3B pipeline or transformer folder, or a Hub id.
        torch_dtype: base weights' dtype (``None``: the file's); MHLA parameters are float32.
        state_dict_key: see :func:`read_authors_state_dict`.
        block_grid (tuple[int, int, int]): see :func:`install_authors_mhla`.
        norm_output: their layers' ``norm_output`` (:func:`install_authors_mhla`): ``False`` (their release, the
            default) runs the numerator only, ``True`` (their constructors' default) their normaliser.

    Returns:
        (tuple): ``(pipeline or None, transformer)``, the transformer in eval mode with ``config._mhla_native_size``.

    Raises:
        AuthorsCheckpointError: as the readers above; stock keys unknown, missing or mis-shaped; another family.
        MHLACheckpointError: tensors left on the meta device.
        FileNotFoundError: ``src`` or ``config`` does not exist.
    """
    name, state, _ = authors_state(src, state_dict_key)
    stock, mhla = split_authors_state_dict(state)
    cls, load_kwargs, pipeline_folder = single_file_target(name, str(config), "wan")
    if cls.__name__ != "WanTransformer3DModel":
        raise AuthorsCheckpointError(f"config {config} describes a {cls.__name__}; the authors' model needs a Wan2.1 config")
    converted, original = _to_diffusers_keys(stock)
    _check_stock_keys(converted, original, _empty_transformer(cls, load_kwargs), name)
    dtype = torch_dtype or storage_dtype(state)
    # the checked stock weights through diffusers' own single-file loader (its key mapping and dtype handling)
    model = cls.from_single_file(dict(stock), **load_kwargs, dtype=dtype)
    check_loaded(model, name)  # never a model without values (the stock keys were checked above)
    install_authors_mhla(model, mhla, block_grid, norm_output=norm_output)
    model.register_to_config(**{NATIVE_SIZE_KEY: dict(AUTHORS_NATIVE_SIZE)})
    model.eval()
    if pipeline_folder is None:
        return None, model
    return pipeline_around(pipeline_folder, model, dtype), model


def import_authors_wan(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    state_dict_key: str | None = None,
    block_grid=AUTHORS_BLOCK_GRID,
    norm_output: bool = False,
) -> dict:
    """Convert the authors' checkpoint file into a converted checkpoint at ``out`` (atomic).

    Arguments as :func:`load_authors_wan`; a pipeline ``config`` writes a whole ``WanPipeline``.

    Returns:
        The spec written to ``mhla_config.json`` plus ``"native_size"`` and ``"out"``.

    Raises:
        ValueError: ``out`` would replace ``src``.
        FileExistsError: a non-empty ``out`` without ``overwrite``.

    Otherwise raises as :func:`load_authors_wan`.
    """
    model = write_import(src, out, overwrite, lambda: load_authors_wan(
        src, config, torch_dtype=torch_dtype, state_dict_key=state_dict_key, block_grid=block_grid,
        norm_output=norm_output))
    return {**mhla_spec(model), "native_size": dict(AUTHORS_NATIVE_SIZE), "out": str(out)}


def authors_state(src, state_dict_key: str | None) -> tuple[str, dict[str, torch.Tensor], object]:
    """``(name for messages, state dict, the whole stored object)`` of a checkpoint file or folder
    (:func:`read_authors_state_dict`) or a loaded object (the object: e.g. their DiT trainer's ``args`` beside the
    weights)."""
    if isinstance(src, Mapping):
        return "the state dict", strip_wrapper_prefix(unwrap_state_dict(src, state_dict_key, "the state dict")), src
    path = authors_file(src)
    obj = read_authors_checkpoint(path)
    return str(path), strip_wrapper_prefix(unwrap_state_dict(obj, state_dict_key, path)), obj


def write_import(src, out, overwrite: bool, load) -> torch.nn.Module:
    """Check ``out`` (not the source, empty unless ``overwrite``) before ``load()`` (minutes), then write what it
    returns, ``(pipeline or None, transformer)``, atomically; returns the transformer.

    Raises:
        ValueError: ``out`` would replace ``src``. FileExistsError: a non-empty ``out`` without ``overwrite``.
    """
    src_path, out_path = Path(src).resolve(), Path(out).resolve()
    if src_path == out_path or src_path.is_relative_to(out_path):
        raise ValueError(f"--out {out} would replace the source {src}; write the converted checkpoint elsewhere")
    if out_path.exists() and any(out_path.iterdir()) and not overwrite:  # before minutes of loading
        raise FileExistsError(f"{out} exists and is not empty; choose another folder or pass overwrite=True (--overwrite)")
    pipe, model = load()
    if pipe is not None:
        save_mhla_pipeline(pipe, out, overwrite=overwrite)
    else:
        save_mhla_transformer(model, out, overwrite=overwrite)
    return model
