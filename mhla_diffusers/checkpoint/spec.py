"""The converted-checkpoint format's schema: file names, version, the settings of ``mhla_config.json`` and
how they are checked (types, consistency, against the header of ``mhla.safetensors`` and its sha256),
the MHLA parameters' state-dict keys, and where a checkpoint keeps its transformer(s).

The format itself is described in :mod:`mhla_diffusers.checkpoint.format`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError, read_safetensors_header
from mhla_diffusers.checkpoint.safetensors_file import is_int as _is_int
from mhla_diffusers.families import FAMILIES, self_attention_modules, transformer_components
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.models.provenance import MHLA_CONFIG_NAME
from mhla_diffusers.models.spec import DENOMINATORS, GATE_FORMS, ROPE_MODES, SETTINGS_OFF

__all__ = [
    "MHLA_CONFIG_NAME", "MHLA_WEIGHTS_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "TRANSFORMER_COMPONENTS", "transformer_folder",
    "read_mhla_config",
]


MHLA_WEIGHTS_NAME = "mhla.safetensors"


# 2: the per-layer options lepe, gate, rope, feature_power, input_norm, denominator (absent: off, as every version-1
# checkpoint). 3: a layer's MHLA is one module, ``<attention>.mhla``: keys ``<attention>.mhla.mixing.weight``,
# ``.mhla.output_norm.weight``, ``.mhla.gate.*``, ``.mhla.lepe.*``, ``.mhla.input_norm.*`` (versions 1 and 2:
# ``<attention>.mhla_mixing.weight``, ``.mhla_output_norm.weight``, ...; read under the new names, LEGACY_KEY).
FORMAT_VERSION = 3
# The versions this mhla_diffusers reads (a version-1 folder loads with the version-2 options off).
READABLE_VERSIONS = (1, 2, 3)
# A version-1 / 2 key of a layer's MHLA part: ``<attention>.mhla_<part>.<name>``, read as ``<attention>.mhla.<part>.<name>``.
LEGACY_KEY = re.compile(r"\.mhla_(mixing|output_norm|gate|lepe|input_norm)\.")
# The keys each version added to mhla_config.json (and to the header's recorded settings).
ADDED_IN = {2: ("lepe", "gate", "rope", "feature_power", "input_norm", "denominator")}


# The pipeline components that are transformers MHLA may be installed on (families.transformer_components: Wan 2.2
# A14B's experts ``transformer`` and ``transformer_2``; every other pipeline has the first only).
TRANSFORMER_COMPONENTS = transformer_components()


# The settings of mhla_config.json that give the weights their meaning, repeated in the header
# metadata of mhla.safetensors (key "mhla_config") and so covered by weights_sha256. Not "backend":
# a run-time choice, every backend gives the same numbers. Absent keys take the values of ABSENT.
CHECKED_KEYS = (
    "family", "model_class", "num_layers", "layers", "block_grid", "num_blocks", "normalize", "eps", "output_norm",
    "feature_eps", "mixing_clamp", "lepe", "gate", "rope", "feature_power", "input_norm", "denominator",
)


METADATA_KEY = "mhla_config"


# The value a checked key has when a config leaves it out (settings added after format version 1 began): the
# setting off, as every checkpoint written before the key existed computes. rope None: the family's (Wan: "after").
ABSENT = SETTINGS_OFF


def checked_settings(config: dict) -> dict:
    """The :data:`CHECKED_KEYS` of ``config`` (absent ones at their :data:`ABSENT` value; a 2-D block grid as
    ``[1, H, W]``): what the weights' header records."""
    settings = {key: config.get(key, ABSENT.get(key)) for key in CHECKED_KEYS}
    if settings["rope"] == "after":  # the default, written as absent
        settings["rope"] = None
    grid = settings["block_grid"]
    if isinstance(grid, list) and len(grid) < 3:  # (H, W) = (1, H, W), as apply_mhla reads it
        settings["block_grid"] = [1] * (3 - len(grid)) + grid
    return settings


def mhla_parameters(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """``{state-dict key: tensor}`` of every parameter / buffer of the MHLA of the self-attention layers that run
    MHLA: ``<attention path>.mhla.<part>.<name>`` (e.g. ``blocks.1.attn1.mhla.mixing.weight``)."""
    out = {}
    for name, attn in self_attention_modules(transformer):
        layer = getattr(attn, "mhla", None)
        if layer is None or not isinstance(getattr(attn, "processor", None), MHLAProcessor):
            continue  # idle matrices (the layer runs another processor) are not part of the model it computes
        for key, tensor in layer.state_dict(keep_vars=True).items():
            out[f"{name}.mhla.{key}"] = tensor
    return out


def current_key(key: str, version: int) -> str:
    """``key`` of an ``mhla.safetensors`` written in format ``version``, under today's name (:data:`LEGACY_KEY`)."""
    return LEGACY_KEY.sub(r".mhla.\1.", key) if version < 3 else key


def sha256(path: Path) -> str:
    """The hex sha256 digest of the file ``path`` (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise MHLACheckpointError(
            f"{config_file} has format_version {version!r}; this mhla_diffusers reads versions "
            f"{', '.join(str(v) for v in READABLE_VERSIONS)} (a newer version was written by a newer mhla_diffusers: "
            "upgrade it)"
        )
    for added, keys in ADDED_IN.items():
        newer = [key for key in keys if key in config]
        if version < added and newer:
            raise MHLACheckpointError(
                f"{config_file} has format_version {version}, which has no {', '.join(repr(k) for k in newer)} (added in "
                f"version {added}): the config was edited. Restore the original config; to use these options, convert "
                "again from the base model"
            )
    for key in ("family", "model_class", "num_layers", "layers", "block_grid", "normalize", "eps"):
        if key not in config:
            raise MHLACheckpointError(f"{config_file} lacks the key {key!r}")
    _validate_config(config, config_file)
    return config


def _validate_config(config: dict, config_file: Path) -> None:
    """Check the settings' types and consistency (:class:`MHLACheckpointError` naming the key)."""

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
    for key in ("lepe", "input_norm"):
        if key in config and not isinstance(config[key], bool):
            raise bad(key, "true or false")
    if "denominator" in config and config["denominator"] not in DENOMINATORS:
        raise bad("denominator", f"one of {list(DENOMINATORS)} (absent: the paper's)")
    if "gate" in config and config["gate"] is not None and config["gate"] not in GATE_FORMS:
        raise bad("gate", f"one of {list(GATE_FORMS)} (absent: no output gate)")
    if "rope" in config and config["rope"] is not None and config["rope"] not in ROPE_MODES:
        raise bad("rope", f"one of {list(ROPE_MODES)} (absent: the family's)")
    power = config.get("feature_power", 1.0)
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 < power < float("inf"):
        raise bad("feature_power", "a finite number > 0")
    if "backend" in config and not isinstance(config["backend"], str):
        raise bad("backend", "a backend name")
    selection = config.get("selection")
    if selection is not None and not (isinstance(selection, dict) and selection.get("method") == "auto"):
        raise bad("selection", "an object with method 'auto' (how apply_mhla(layers='auto') chose the layers)")
    sha = config.get("weights_sha256")
    if sha is not None and not isinstance(sha, str):
        raise bad("weights_sha256", "a hex digest")


def check_config_against_weights(config: dict, folder: Path) -> None:
    """Compare the settings of ``mhla_config.json`` with those recorded in the header of ``mhla.safetensors``.

    Files written before the header carried them (no ``mhla_config`` metadata) are accepted unchecked.

    Raises:
        MHLACheckpointError: the weights file is missing or unreadable, or a setting differs.
    """
    path = folder / MHLA_WEIGHTS_NAME
    if not path.is_file():
        raise MHLACheckpointError(f"{path} is missing: the MHLA mixing matrices of this checkpoint are lost")
    metadata = read_safetensors_header(path).get("__metadata__", {})
    if METADATA_KEY not in metadata:
        return  # written before the settings were recorded beside the weights
    try:
        recorded = json.loads(metadata[METADATA_KEY])
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise MHLACheckpointError(f"{path} is corrupted: its {METADATA_KEY!r} metadata is unreadable ({err})") from err
    if not isinstance(config.get("weights_sha256"), str):
        # every writer of the current format records the digest: without it the weights could be swapped
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} has no weights_sha256, but {MHLA_WEIGHTS_NAME} was written in the current "
            "format, which always records it: the config was edited. Restore the original config"
        )
    version = metadata.get("mhla_format_version")
    if version is not None and version != str(config.get("format_version")):
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} has format_version {config.get('format_version')!r} but {MHLA_WEIGHTS_NAME} was "
            f"written in version {version}: the config was edited or belongs to other weights. Restore the original config"
        )
    given = checked_settings(config)
    # a key the header lacks was written before it existed, so at its ABSENT value (the setting off)
    recorded = {**{key: ABSENT[key] for key in ABSENT if key not in recorded}, **recorded}
    if recorded.get("rope") == "after":
        recorded["rope"] = None
    differ = [key for key in CHECKED_KEYS if key in recorded and given[key] != recorded[key]]
    if differ:
        details = "; ".join(f"{key}: {given[key]!r} in {MHLA_CONFIG_NAME}, {recorded[key]!r} in the weights" for key in differ)
        raise MHLACheckpointError(
            f"{folder / MHLA_CONFIG_NAME} does not match the settings {MHLA_WEIGHTS_NAME} was written with ({details}): "
            "the config was edited or belongs to other weights. Restore the original config; to change the MHLA "
            "settings, convert again from the base model"
        )


def _mhla_keys_in_base(folder: Path) -> list[str]:
    """MHLA keys in a transformer folder's base ``*.safetensors`` (headers only)."""
    found = []
    for file in sorted(folder.glob("*.safetensors")):
        if file.name != MHLA_WEIGHTS_NAME:
            found += [key for key in read_safetensors_header(file) if ".mhla." in key or LEGACY_KEY.search(key)]
    return found
