"""The per-layer options (``lepe``, ``gate``, ``rope``, ``feature_power``) in the checkpoint format, version 2.

* ``mhla_spec`` records each option only when on; saving and loading round-trip it (keys, weights, outputs);
* an edit of ``mhla_config.json`` that contradicts what the weights were written with (a gate's form, LePE, the
  RoPE placement, the feature power, the format version) is refused, as the other settings are; a bad value too;
* checkpoints written in format version 1 (before the options existed) load with the options off, and a
  version-1 config naming an option of version 2 is refused as edited.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dit_inputs, legacy_key, randomize_mixing_, realign_, run_dit, tiny_dit
from helpers_sana import run_sana, sana_inputs, tiny_sana
from helpers_wan import run_wan, tiny_wan, wan_inputs
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mhla_diffusers import (
    MHLACheckpointError,
    apply_mhla,
    load_mhla_transformer,
    mhla_attention,
    mhla_spec,
    read_mhla_config,
    save_mhla_transformer,
)
from mhla_diffusers.checkpoint.spec import FORMAT_VERSION, READABLE_VERSIONS
from mhla_diffusers.checkpoint.spec import sha256 as _sha256

POWER = 2.0 if "feature_power" in inspect.signature(mhla_attention).parameters else 1.0  # the operator's phi = ReLU ** p

# family -> (model, apply_mhla settings, inputs runner, the keys the spec records for them)
CASES = {
    "dit": (lambda: tiny_dit(num_layers=3), dict(layers=[1, 2], num_blocks=4, gate="neutral", lepe=True),
            lambda m: run_dit(m, dit_inputs(batch=1)), {"gate": "neutral", "lepe": True}),
    "sana": (lambda: tiny_sana(num_layers=2), dict(block_grid=(2, 2), gate="authors", lepe=True, lepe_init="authors",
                                                   output_norm=True, rope="none"),
             lambda m: run_sana(m, sana_inputs(size=(6, 8))), {"gate": "authors", "lepe": True, "output_norm": True}),
    "wan": (lambda: tiny_wan(num_layers=2), dict(block_grid=(1, 2, 2), normalize=False, rope="before", gate="authors",
                                                 lepe=True, feature_power=POWER),
            lambda m: run_wan(m, wan_inputs(batch=1, frames=3, size=(8, 12))),
            {"rope": "before", "gate": "authors", "lepe": True, "output_norm": True,
             **({"feature_power": POWER} if POWER != 1.0 else {})}),
}
NEW_KEYS = ("lepe", "gate", "rope", "feature_power")


@torch.no_grad()
def _train_(model, seed: int = 0) -> None:
    """A "trained" state: every MHLA parameter moved from its start."""
    randomize_mixing_(model, seed=seed, low=0.05, high=0.95)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".mhla." in name and ".mhla.mixing." not in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _save(family: str, folder: Path):
    make, settings, run, _ = CASES[family]
    model = make()
    apply_mhla(model, **settings)
    _train_(model)
    save_mhla_transformer(model, folder)
    return model, run


def _edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "mhla_config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "mhla_config.json").write_text(json.dumps(config))


_DROP = object()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    return {family: (root / family, *_save(family, root / family)) for family in CASES}


@pytest.mark.parametrize("family", list(CASES))
def test_options_round_trip(saved, family):
    """The spec records each option that is on (and no other new key); the folder loads back the same layers,
    weights (gate, LePE included) and outputs."""
    folder, model, run = saved[family]
    recorded = CASES[family][3]
    spec = mhla_spec(model)
    assert {k: spec[k] for k in recorded} == recorded
    assert not {k for k in NEW_KEYS if k in spec} - set(recorded)
    config = read_mhla_config(folder)
    assert config["format_version"] == FORMAT_VERSION == 3 and {k: config[k] for k in recorded} == recorded
    with safe_open(str(folder / "mhla.safetensors"), framework="pt") as f:
        header = json.loads(f.metadata()["mhla_config"])
        keys = set(f.keys())
    assert header["gate"] == recorded["gate"] and header["lepe"] is True
    assert header["rope"] == recorded.get("rope") and header["feature_power"] == recorded.get("feature_power", 1.0)
    assert any(k.endswith("mhla.gate.weight") for k in keys) and any(k.endswith("mhla.lepe.bias") for k in keys)
    loaded = load_mhla_transformer(folder)
    assert mhla_spec(loaded) == spec
    want = {k: v for k, v in model.state_dict().items() if ".mhla." in k}
    got = {k: v for k, v in loaded.state_dict().items() if ".mhla." in k}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(run(realign_(loaded)), run(realign_(model)))


@pytest.mark.parametrize(
    "family, changes, match",
    [
        ("wan", dict(gate="neutral"), r"gate: 'neutral' in mhla_config\.json, 'authors' in the weights"),
        ("wan", dict(gate=_DROP), r"gate: None in mhla_config\.json, 'authors' in the weights"),
        ("wan", dict(lepe=_DROP), r"lepe: False in mhla_config\.json, True in the weights"),
        ("wan", dict(rope="none"), r"rope: 'none' in mhla_config\.json, 'before' in the weights"),
        ("wan", dict(rope=_DROP), r"rope: None in mhla_config\.json, 'before' in the weights"),
        ("wan", dict(feature_power=3.0), r"feature_power: 3\.0 in mhla_config\.json"),
        ("dit", dict(gate="authors"), "gate: 'authors' in mhla_config.json, 'neutral' in the weights"),
        ("dit", dict(rope="none"), "rope: 'none' in mhla_config.json, None in the weights"),
        ("dit", dict(format_version=1), "format_version 1, which has no 'lepe', 'gate'"),
        ("wan", dict(gate="sigmoid"), r"'gate' must be one of \['neutral', 'authors'\]"),
        ("wan", dict(lepe="yes"), "'lepe' must be true or false"),
        ("wan", dict(rope="sideways"), r"'rope' must be one of \['after', 'before', 'none'\]"),
        ("wan", dict(feature_power=0), "'feature_power' must be a finite number > 0"),
        ("wan", dict(feature_power=True), "'feature_power' must be a finite number > 0"),
    ],
)
def test_edited_options_are_refused(saved, tmp_path, family, changes, match):
    folder = tmp_path / "copy"
    shutil.copytree(saved[family][0], folder)
    _edit(folder, **changes)
    with pytest.raises(MHLACheckpointError, match=match):
        load_mhla_transformer(folder)


def test_rope_after_is_the_default(saved, tmp_path):
    """A Wan config saying rope "after" (the default, written as absent) is the same setting."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2), rope="after")
    assert "rope" not in mhla_spec(model)
    save_mhla_transformer(model, tmp_path / "t")
    _edit(tmp_path / "t", rope="after")
    assert "rope" not in mhla_spec(load_mhla_transformer(tmp_path / "t"))


# -- format version 1 ----------------------------------------------------------------------------
V1_HEADER_KEYS = (
    "family", "model_class", "num_layers", "layers", "block_grid", "num_blocks", "normalize", "eps", "output_norm",
    "feature_eps", "mixing_clamp",
)


def _as_version_1(folder: Path) -> None:
    """Rewrite a folder saved without the new options as the version-1 writer wrote it: config
    ``format_version`` 1, the header's ``mhla_format_version`` "1" and its recorded settings without the new keys."""
    path = folder / "mhla.safetensors"
    with safe_open(str(path), framework="pt") as f:
        recorded = json.loads(f.metadata()["mhla_config"])
    assert all(recorded[k] == v for k, v in (("lepe", False), ("gate", None), ("rope", None), ("feature_power", 1.0)))
    old = {k: recorded[k] for k in V1_HEADER_KEYS}
    tensors = {legacy_key(k): v for k, v in load_file(path).items()}  # version 1: <attention>.mhla_mixing.weight, ...
    save_file(tensors, str(path), metadata={"format": "pt", "mhla_format_version": "1",
                                           "mhla_config": json.dumps(old, sort_keys=True)})
    config = json.loads((folder / "mhla_config.json").read_text())
    assert not set(NEW_KEYS) & set(config)
    config.update(format_version=1, weights_sha256=_sha256(path))
    (folder / "mhla_config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("family", ["dit", "wan"])
def test_version_1_checkpoints_load_with_the_options_off(tmp_path, family):
    make, settings, run, _ = CASES[family]
    plain = {k: v for k, v in settings.items() if k not in ("gate", "lepe", "lepe_init", "rope", "feature_power")}
    model = make()
    apply_mhla(model, **plain)
    _train_(model)
    save_mhla_transformer(model, tmp_path / "v1")
    _as_version_1(tmp_path / "v1")
    assert 1 in READABLE_VERSIONS and read_mhla_config(tmp_path / "v1")["format_version"] == 1
    loaded = load_mhla_transformer(tmp_path / "v1")
    spec = mhla_spec(loaded)
    assert spec == mhla_spec(model) and not set(NEW_KEYS) & set(spec)
    attn = loaded.blocks[0].attn1 if family == "wan" else loaded.transformer_blocks[1].attn1
    assert attn.mhla.gate is None and attn.mhla.lepe is None
    assert attn.mhla.feature_power == 1.0 and attn.mhla.rope == ("after" if family == "wan" else None)
    assert torch.equal(run(realign_(loaded)), run(realign_(model)))
    # a version-1 config naming an option of version 2 was edited
    for key, value in (("rope", "none"), ("feature_power", 2.0), ("lepe", False)):
        folder = tmp_path / f"edited-{key}"
        shutil.copytree(tmp_path / "v1", folder)
        _edit(folder, **{key: value})
        with pytest.raises(MHLACheckpointError, match=rf"format_version 1, which has no '{key}' \(added in version 2\)"):
            load_mhla_transformer(folder)
    # the config says version 2, the weights were written in version 1
    folder = tmp_path / "edited-version"
    shutil.copytree(tmp_path / "v1", folder)
    _edit(folder, format_version=2)
    with pytest.raises(MHLACheckpointError, match="format_version 2 but mhla.safetensors was written in version 1"):
        load_mhla_transformer(folder)


@pytest.mark.parametrize("family", list(CASES))
def test_version_2_checkpoints_with_the_old_keys_load(saved, family, tmp_path):
    """Format version 2 kept each MHLA part as a child of the attention module: <attention>.mhla_mixing.weight,
    .mhla_gate.*, .mhla_lepe.*, .mhla_output_norm.*. Such a folder loads under today's names, to the same model."""
    folder, model, run = saved[family]
    old = tmp_path / "v2"
    shutil.copytree(folder, old)
    path = old / "mhla.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = {legacy_key(k): v for k, v in load_file(path).items()}
    assert all(".mhla_" in k and ".mhla." not in k for k in tensors)
    save_file(tensors, str(path), metadata={**metadata, "mhla_format_version": "2"})
    _edit(old, format_version=2, weights_sha256=_sha256(path))
    loaded = load_mhla_transformer(old)
    assert mhla_spec(loaded) == mhla_spec(model)
    assert torch.equal(run(realign_(loaded)), run(realign_(model)))
    save_file(tensors, str(path), metadata={**metadata, "mhla_format_version": "3"})  # a version-3 file with old keys
    _edit(old, format_version=3, weights_sha256=_sha256(path))
    with pytest.raises(MHLACheckpointError, match="missing keys"):
        load_mhla_transformer(old)


def test_a_setting_the_header_lacks_was_written_off(tmp_path):
    """Recorded settings without a key (written before the key existed) mean the setting off: a config turning
    it on does not match the weights."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2))
    save_mhla_transformer(model, tmp_path / "t")
    path = tmp_path / "t" / "mhla.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    recorded = json.loads(metadata["mhla_config"])
    del recorded["rope"]
    save_file(load_file(path), str(path), metadata={**metadata, "mhla_config": json.dumps(recorded)})
    _edit(tmp_path / "t", weights_sha256=_sha256(path))
    load_mhla_transformer(tmp_path / "t")  # the same settings: loads
    _edit(tmp_path / "t", rope="none")
    with pytest.raises(MHLACheckpointError, match=r"rope: 'none' in mhla_config\.json, None in the weights"):
        load_mhla_transformer(tmp_path / "t")


def test_newer_format_versions_are_refused(saved, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(saved["dit"][0], folder)
    _edit(folder, format_version=4)
    with pytest.raises(MHLACheckpointError, match="format_version 4; this mhla_diffusers reads versions 1, 2, 3.*upgrade"):
        load_mhla_transformer(folder)


def test_load_mhla_weights_onto_a_base_loaded_any_way(saved, tmp_path):
    """load_mhla_weights puts a checkpoint's MHLA on a base loaded by other means (a single file, GGUF, ...): a model
    without MHLA gets it installed as recorded, then the weights; one with MHLA at other settings is refused naming
    them (its weights would run as another model); a folder without mhla_config.json is not a converted checkpoint."""
    from mhla_diffusers import load_mhla_weights, remove_mhla

    folder, model, run = saved["wan"]
    base = type(model).from_pretrained(folder)  # diffusers' own load: the base weights, no MHLA
    load_mhla_weights(base, folder)
    assert mhla_spec(base) == mhla_spec(model)
    assert torch.equal(run(realign_(base)), run(realign_(model)))
    load_mhla_weights(base, folder)  # already the checkpoint's settings: the weights again
    other = type(model).from_pretrained(folder)
    apply_mhla(other, **{**CASES["wan"][1], "eps": 1e-3})
    with pytest.raises(MHLACheckpointError, match=r"eps: 0\.001 here, 1e-06 in the checkpoint.*remove_mhla"):
        load_mhla_weights(other, folder)
    remove_mhla(other)
    load_mhla_weights(other, folder)
    assert torch.equal(run(realign_(other)), run(realign_(model)))
    type(model).from_config(model.config).save_pretrained(tmp_path / "plain")
    with pytest.raises(MHLACheckpointError, match="not a converted MHLA checkpoint"):
        load_mhla_weights(base, tmp_path / "plain")
