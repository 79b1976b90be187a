"""What a converted checkpoint must never lose or silently change:

* the bare one-liner ``model.set_attn_processor(MHLAProcessor(...))`` saved before any forward is
  an MHLA checkpoint (its matrices are created as the first forward would), never the stock model;
* a pipeline's ``id2label`` (DiT class names) survives ``save_mhla_pipeline`` and conversion;
* every edit of a setting in ``mhla_config.json`` that gives the weights their meaning (block grid,
  family, number of blocks, layers, normalize, eps, output norm) is an ``MHLACheckpointError``;
  checkpoints written before the settings were recorded beside the weights still load.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dit_inputs, randomize_mixing_, realign_, run_dit, tiny_dit, tiny_dit_pipeline
from helpers_sana import run_sana, sana_inputs, sana_self_attn, tiny_sana
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mhla_diffusers import (
    MHLACheckpointError,
    MHLAProcessor,
    apply_mhla,
    is_mhla_model,
    load_mhla_pipeline,
    load_mhla_transformer,
    mhla_spec,
    read_mhla_config,
    save_mhla_pipeline,
    save_mhla_transformer,
)
from mhla_diffusers.checkpoint.spec import sha256 as _sha256

ROOT = Path(__file__).resolve().parents[2]


def _mixing_keys(model) -> list[str]:
    return sorted(k for k in model.state_dict() if ".mhla." in k)


# -- 1. the bare one-liner, saved before its first forward ----------------------------------------
def test_oneliner_sana_saved_before_any_forward_is_an_mhla_checkpoint(tmp_path):
    model = tiny_sana(num_layers=2)
    model.set_attn_processor(MHLAProcessor(num_blocks=4))  # diffusers' own method: processors only
    assert _mixing_keys(model) == []
    assert is_mhla_model(model)
    spec = mhla_spec(model)
    assert spec is not None and spec["layers"] == [0, 1] and spec["num_blocks"] == 4 and spec["family"] == "sana"
    assert _mixing_keys(model) == []  # the queries do not change the model

    # the matrices a first forward creates (a twin of the model that ran once)
    twin = copy.deepcopy(model)
    inputs = sana_inputs(1, 8)
    run_sana(twin, inputs)
    expected_keys = _mixing_keys(twin)
    assert expected_keys

    save_mhla_transformer(model, tmp_path / "t")
    assert (tmp_path / "t" / "mhla_config.json").is_file() and (tmp_path / "t" / "mhla.safetensors").is_file()
    assert _mixing_keys(model) == expected_keys  # created as the first forward would
    assert all(torch.equal(model.state_dict()[k], twin.state_dict()[k]) for k in expected_keys)
    assert mhla_spec(model) == spec == {k: v for k, v in read_mhla_config(tmp_path / "t").items() if k in spec}

    loaded = realign_(load_mhla_transformer(tmp_path / "t"))
    assert {type(a.processor).__name__ for a in sana_self_attn(loaded)} == {"MHLAProcessor"}
    assert mhla_spec(loaded) == spec
    out, ref = run_sana(loaded, inputs), run_sana(twin, inputs)
    assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_oneliner_dit_pipeline_saved_before_any_forward(tmp_path):
    pipe = tiny_dit_pipeline(num_layers=2)
    for module in pipe.transformer.modules():  # DiT has no set_attn_processor: the per-layer form
        if hasattr(module, "set_processor") and hasattr(module, "processor"):
            module.set_processor(MHLAProcessor(block_grid=(2, 2)))
    assert is_mhla_model(pipe.transformer) and mhla_spec(pipe.transformer)["block_grid"] == [1, 2, 2]
    save_mhla_pipeline(pipe, tmp_path / "p")
    config = read_mhla_config(tmp_path / "p")
    assert config is not None and config["layers"] == [0, 1] and config["block_grid"] == [1, 2, 2]
    loaded = load_mhla_pipeline(tmp_path / "p")
    assert _mixing_keys(loaded.transformer) == _mixing_keys(pipe.transformer)
    inputs = dit_inputs(batch=1)
    ref = run_dit(pipe.transformer, inputs)
    assert (run_dit(realign_(loaded.transformer), inputs) - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_oneliner_that_cannot_be_materialized_is_refused_not_saved_as_stock(tmp_path):
    """A processor whose matrices cannot be created for this model (a preset the DiT family lacks):
    saving raises MHLACheckpointError saying what to do, and writes nothing."""
    model = tiny_dit(num_layers=2)
    for module in model.modules():
        if hasattr(module, "set_processor") and hasattr(module, "processor"):
            module.set_processor(MHLAProcessor(block_grid="paper"))
    assert is_mhla_model(model)
    with pytest.raises(MHLACheckpointError, match=r"forward.*apply_mhla"):
        save_mhla_transformer(model, tmp_path / "t")
    assert not (tmp_path / "t").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_plain_model_is_not_mhla_and_saves_plain(tmp_path):
    model = tiny_sana(num_layers=1)
    assert not is_mhla_model(model) and mhla_spec(model) is None
    save_mhla_transformer(model, tmp_path / "t")
    assert read_mhla_config(tmp_path / "t") is None


# -- 2. id2label ----------------------------------------------------------------------------------
LABELS = {0: "astronaut", 1: "tench, Tinca tinca", 2: "hubble deep field"}


def _labelled_pipeline(num_layers=2):
    from diffusers import DiTPipeline

    pipe = tiny_dit_pipeline(num_layers=num_layers)
    return DiTPipeline(transformer=pipe.transformer, vae=pipe.vae, scheduler=pipe.scheduler, id2label=LABELS)


def _index(folder: Path) -> dict:
    return json.loads((folder / "model_index.json").read_text())


@pytest.mark.parametrize("with_mhla", [False, True])
def test_save_mhla_pipeline_keeps_id2label(tmp_path, with_mhla):
    """A DiTPipeline built with id2label (kept in pipe.labels only, not in pipe.config): the names
    reach model_index.json and come back in pipe.labels and pipe.config."""
    pipe = _labelled_pipeline()
    assert pipe.config.get("id2label") is None  # what diffusers' save_pretrained would drop
    if with_mhla:
        apply_mhla(pipe.transformer, num_blocks=4)
    save_mhla_pipeline(pipe, tmp_path / "p")
    written = _index(tmp_path / "p")["id2label"]
    assert {int(k): set(v.split(", ")) for k, v in written.items()} == {k: set(v.split(", ")) for k, v in LABELS.items()}
    loaded = load_mhla_pipeline(tmp_path / "p")
    assert loaded.labels == pipe.labels and loaded.labels["Tinca tinca"] == 1 and loaded.labels["astronaut"] == 0
    assert loaded.config["id2label"] == written
    assert is_mhla_model(loaded.transformer) == with_mhla
    # saved again from the loaded pipeline: the very same names, in the same order
    save_mhla_pipeline(loaded, tmp_path / "again")
    assert _index(tmp_path / "again")["id2label"] == written


def test_id2label_of_a_pipeline_loaded_by_plain_diffusers_is_exact(tmp_path):
    """A pipeline folder with id2label loaded by DiffusionPipeline.from_pretrained (names in pipe.labels
    only): save_mhla_pipeline writes the source's id2label exactly (order of the names kept)."""
    from diffusers import DiffusionPipeline

    pipe = _labelled_pipeline()
    pipe.register_to_config(id2label={str(k): v for k, v in LABELS.items()})
    pipe.save_pretrained(tmp_path / "src")
    source = _index(tmp_path / "src")["id2label"]
    plain = DiffusionPipeline.from_pretrained(tmp_path / "src")
    assert plain.config.get("id2label") is None and plain.labels
    apply_mhla(plain.transformer, num_blocks=4)
    save_mhla_pipeline(plain, tmp_path / "out")
    assert _index(tmp_path / "out")["id2label"] == source


def test_pipeline_without_labels_writes_none(tmp_path):
    save_mhla_pipeline(tiny_dit_pipeline(num_layers=1), tmp_path / "p")
    assert "id2label" not in _index(tmp_path / "p")


def test_converted_demo_pipeline_keeps_class_names(tmp_path):
    """conversion of demo/base_dit (id2label in model_index.json): the converted pipeline resolves the
    same class names (generate.py --class-labels astronaut)."""
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint
    from mhla_diffusers.generation import resolve_class_labels

    base = ROOT / "demo" / "base_dit"
    if not (base / "model_index.json").is_file():
        pytest.fail("demo/base_dit is missing")
    convert_checkpoint(base, tmp_path / "conv", family="dit", num_blocks=16)
    assert _index(tmp_path / "conv")["id2label"] == _index(base)["id2label"]
    pipe = load_mhla_pipeline(tmp_path / "conv")
    assert resolve_class_labels(pipe, ["astronaut", "hubble deep field", "3"]) == [0, 5, 3]


# -- 3. mhla_config.json is part of the integrity check -------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    model = tiny_dit(num_layers=3, seed=1)
    apply_mhla(model, layers=[1, 2], num_blocks=4)
    randomize_mixing_(model, seed=3)
    save_mhla_transformer(model, root / "t")
    inputs = dit_inputs(batch=1)
    return dict(model=model, folder=root / "t", inputs=inputs, output=run_dit(model, inputs))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "mhla_config.json").read_text())
    config.update(changes)
    (folder / "mhla_config.json").write_text(json.dumps(config))


def _as_legacy(folder: Path) -> None:
    """The checkpoint as written before the settings were recorded in the weights' header."""
    path = folder / "mhla.safetensors"
    save_file(load_file(path), str(path), metadata={"format": "pt", "mhla_format_version": "1"})
    _edit(folder, weights_sha256=_sha256(path))


def test_settings_are_recorded_beside_the_weights(saved):
    with safe_open(str(saved["folder"] / "mhla.safetensors"), framework="pt") as f:
        recorded = json.loads(f.metadata()["mhla_config"])
    config = read_mhla_config(saved["folder"])
    assert recorded == {
        "family": "dit", "model_class": "DiTTransformer2DModel", "num_layers": 3, "layers": [1, 2],
        "block_grid": [1, 2, 2], "num_blocks": 4, "normalize": True, "eps": config["eps"], "output_norm": False,
        "feature_eps": 0.0, "mixing_clamp": True, "lepe": False, "gate": None, "rope": None, "feature_power": 1.0,
        "input_norm": False, "denominator": "paper",
    }
    assert config["format_version"] == 3


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(block_grid=[1, 1, 4]), r"block_grid: \[1, 1, 4\] in mhla_config\.json, \[1, 2, 2\] in the weights"),
        (dict(block_grid=[1, 4, 1]), "block_grid"),
        (dict(family="wan"), "family: 'wan'"),
        (dict(family="sana", model_class="SanaTransformer2DModel"), "family"),
        (dict(layers=[0, 2]), "layers"),
        (dict(normalize=False), "normalize"),
        (dict(eps=1e-3), "eps"),
        (dict(output_norm=True), "output_norm"),
        (dict(block_grid=[2, 1, 2]), "block_grid"),  # same M, other layout (on the time axis)
        (dict(denominator="authors_dit"), "denominator"),
    ],
)
def test_edited_settings_are_refused(saved, tmp_path, changes, match):
    folder = _copy(saved["folder"], tmp_path)
    _edit(folder, **changes)
    with pytest.raises(MHLACheckpointError, match=match):
        load_mhla_transformer(folder)


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_blocks=99), r"num_blocks 99 is not the number of blocks of the block grid \[1, 2, 2\] \(4\)"),
        (dict(num_blocks=4.0), "num_blocks"),
        (dict(layers="all"), r"'layers' must be a non-empty list of self-attention layer indices"),
        (dict(layers=[1, "2"]), "'layers' must be"),
        (dict(layers=[]), "'layers' must be"),
        (dict(layers=[True, 2]), "'layers' must be"),
        (dict(family="nosuchfamily"), "'family' must be one of"),
        (dict(block_grid="2,2"), "'block_grid' must be"),
        (dict(block_grid=[1, 0, 4]), "'block_grid' must be"),
        (dict(normalize="yes"), "'normalize' must be"),
        (dict(eps=-1.0), "'eps' must be"),
        (dict(eps="1e-6"), "'eps' must be"),
        (dict(output_norm=1), "'output_norm' must be"),
        (dict(num_layers="3"), "'num_layers' must be"),
    ],
)
def test_malformed_settings_are_refused_clearly(saved, tmp_path, changes, match, legacy):
    folder = _copy(saved["folder"], tmp_path)
    if legacy:
        _as_legacy(folder)
    _edit(folder, **changes)
    with pytest.raises(MHLACheckpointError, match=match) as err:
        load_mhla_transformer(folder)
    assert "['a', 'l', 'l']" not in str(err.value)


def test_family_is_checked_against_the_model_without_recorded_settings(saved, tmp_path):
    folder = _copy(saved["folder"], tmp_path)
    _as_legacy(folder)
    _edit(folder, family="wan")
    with pytest.raises(MHLACheckpointError, match=r"family 'wan'.*DiTTransformer2DModel.*'dit'"):
        load_mhla_transformer(folder)


def test_settings_edited_in_the_weights_header_too_are_caught_by_the_digest(saved, tmp_path):
    folder = _copy(saved["folder"], tmp_path)
    path = folder / "mhla.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    recorded = json.loads(metadata["mhla_config"])
    recorded["block_grid"] = [1, 1, 4]
    save_file(load_file(path), str(path), metadata={**metadata, "mhla_config": json.dumps(recorded, sort_keys=True)})
    _edit(folder, block_grid=[1, 1, 4])
    with pytest.raises(MHLACheckpointError, match="sha256"):
        load_mhla_transformer(folder)


def test_unreadable_recorded_settings_are_corruption(saved, tmp_path):
    folder = _copy(saved["folder"], tmp_path)
    path = folder / "mhla.safetensors"
    save_file(load_file(path), str(path), metadata={"format": "pt", "mhla_config": "{oops"})
    with pytest.raises(MHLACheckpointError, match="corrupted"):
        load_mhla_transformer(folder)


def test_backend_may_be_edited(saved, tmp_path):
    """The backend is a run-time choice (every backend gives the same numbers): not a checked setting;
    nor is writing the block grid with two axes, (bh, bw) = (1, bh, bw)."""
    folder = _copy(saved["folder"], tmp_path)
    _edit(folder, backend="torch", block_grid=[2, 2])
    model = realign_(load_mhla_transformer(folder))
    assert torch.equal(run_dit(model, saved["inputs"]), saved["output"])


def test_checkpoint_without_recorded_settings_still_loads(saved, tmp_path):
    """Checkpoints written before the settings were recorded in the weights' header load as before
    (their settings cannot be cross-checked; the family, num_blocks and types still are)."""
    folder = _copy(saved["folder"], tmp_path)
    _as_legacy(folder)
    model = realign_(load_mhla_transformer(folder))
    assert mhla_spec(model) == mhla_spec(saved["model"])
    assert torch.equal(run_dit(model, saved["inputs"]), saved["output"])
    # the untouched checkpoint loads exactly too
    model = realign_(load_mhla_transformer(saved["folder"]))
    assert torch.equal(run_dit(model, saved["inputs"]), saved["output"])


def test_digest_removed_from_a_current_format_config_is_refused(saved, tmp_path):
    """Deleting weights_sha256 must not switch the check off: the current format always records it, so its
    absence means an edited config (else another checkpoint's weights with the same settings would load)."""
    folder = _copy(saved["folder"], tmp_path)
    config = json.loads((folder / "mhla_config.json").read_text())
    del config["weights_sha256"]
    (folder / "mhla_config.json").write_text(json.dumps(config))
    with pytest.raises(MHLACheckpointError, match="has no weights_sha256"):
        load_mhla_transformer(folder)


# -- 4. damaged safetensors files and rewritten MHLA weights ---------------------------------------
def _damaged(kind: str, good: bytes) -> bytes:
    """A damaged copy of the safetensors bytes ``good``."""
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8: 8 + n])
    if kind == "text":
        return b"this is a text file, not weights\n" * 4
    if kind == "random":
        return torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes()
    if kind == "truncated":
        return good[: len(good) - 12]
    if kind == "truncated_header":
        return good[: 8 + n // 2]
    if kind == "huge_length":
        return (1 << 63).to_bytes(8, "little") + good[8:]
    if kind == "short":
        return b"\x01\x02"
    if kind == "lfs_pointer":
        return b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456\n"
    if kind == "not_json":
        return len(b"{oops").to_bytes(8, "little") + b"{oops"
    if kind == "offsets_outside":
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 10**9
    elif kind == "wrong_length":
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [d + 1 for d in header[name]["shape"]]
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + good[8 + n:]


DAMAGE = {
    "text": "header length field says", "random": "header length field says", "truncated": "a truncated file",
    "truncated_header": "header length field says", "huge_length": "header length field says 9223372036854775808 bytes",
    "short": "fewer than the 8", "lfs_pointer": "Git LFS pointer", "not_json": "not UTF-8 JSON",
    "offsets_outside": "a truncated file", "wrong_length": "needs",
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_read_safetensors_header_refuses_damaged_files(tmp_path, kind):
    """Text, random bytes, a truncated file, a header length of 2^63 (stored_dtype asked to read that many bytes:
    MemoryError / OverflowError): one line naming the file and the fault, never a read past the file's end."""
    from mhla_diffusers.checkpoint.conversion import stored_dtype
    from mhla_diffusers.checkpoint.format import read_safetensors_header

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.float16)}, str(good), metadata={"k": "v"})
    assert read_safetensors_header(good)["__metadata__"] == {"k": "v"} and stored_dtype(good) == torch.float32
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_damaged(kind, good.read_bytes()))
    for reader in (read_safetensors_header, stored_dtype):
        with pytest.raises(MHLACheckpointError, match=DAMAGE[kind]) as err:
            reader(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("place", ["weights", "base"])
def test_damaged_files_of_a_converted_checkpoint_are_clear_errors(saved, tmp_path, place):
    folder = _copy(saved["folder"], tmp_path)
    path = folder / ("mhla.safetensors" if place == "weights" else "diffusion_pytorch_model.safetensors")
    path.write_bytes(_damaged("huge_length", path.read_bytes()))
    if place == "base":  # a folder without mhla_config.json peeks into its base weights
        (folder / "mhla_config.json").unlink()
        (folder / "mhla.safetensors").unlink()
    with pytest.raises(MHLACheckpointError, match=f"{path.name} is not a readable safetensors file"):
        load_mhla_transformer(folder)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.float64])
def test_mhla_weights_rewritten_in_another_dtype_are_refused(saved, tmp_path, dtype):
    """mhla.safetensors rewritten as int64 or float16, weights_sha256 updated: loaded silently and cast before (int64
    changed the output by 0.067); refused now, naming the format's dtype and the expected shape."""
    folder = _copy(saved["folder"], tmp_path)
    path = folder / "mhla.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    save_file({k: (v * 4).to(dtype) for k, v in tensors.items()}, str(path), metadata=metadata)
    _edit(folder, weights_sha256=_sha256(path))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(MHLACheckpointError, match=rf"is stored as {name}; the format stores every MHLA parameter as float32 "
                                                  r"\(this one of shape \(4, 4\)\)"):
        load_mhla_transformer(folder)
