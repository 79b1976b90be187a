"""Converted checkpoints (CASES C14, C15): save / load of MHLA transformers and pipelines, exact in a
fresh process; every broken checkpoint is an MHLACheckpointError, never a silent re-initialisation;
the base folder stays a plain diffusers folder; writes are atomic.

"Exact" means: every tensor of the state dict bitwise equal, and outputs bitwise equal once the loaded
weights sit in freshly allocated memory (``helpers.realign_``). Straight out of ``from_pretrained``
the weights keep the byte offsets they have in the memory-mapped file, and CPU BLAS results depend
on operand alignment in the last bit: the stock DiT itself then differs by ~1 ulp (about 5e-7
absolute at this size) from the same weights in fresh memory. Unrealigned outputs are checked to
1e-6 relative.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import WarningLog, dit_inputs, randomize_mixing_, realign_, run_dit, tiny_dit, tiny_dit_pipeline
from safetensors.torch import load_file, save_file

import mhla_diffusers
from mhla_diffusers import (
    MHLACheckpointError,
    apply_mhla,
    is_mhla_model,
    load_mhla_pipeline,
    load_mhla_transformer,
    mhla_spec,
    read_mhla_config,
    save_mhla_pipeline,
    save_mhla_transformer,
)
from mhla_diffusers.checkpoint.format import FORMAT_VERSION

GEN = dict(class_labels=[1], num_inference_steps=2, output_type="np")


def generate(pipe):
    return pipe(**GEN, generator=torch.Generator().manual_seed(0)).images


def mhla_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "mhla" in k}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A hybrid transformer (6 layers, M = 4, "trained" mixing partly outside [0, 1]) and an all-MHLA
    pipeline, saved once; with the outputs the in-memory originals give."""
    root = tmp_path_factory.mktemp("ckpt")
    model = tiny_dit(num_layers=6, seed=1)
    apply_mhla(model, layers="hybrid", num_blocks=4)
    randomize_mixing_(model, seed=1)
    inputs = dit_inputs(batch=3, seed=2)
    save_mhla_transformer(model, root / "transformer")

    pipe = tiny_dit_pipeline(num_layers=3, seed=2)
    apply_mhla(pipe.transformer, layers="all", num_blocks=4)
    randomize_mixing_(pipe.transformer, seed=2)
    image = generate(pipe)
    save_mhla_pipeline(pipe, root / "pipe")
    return dict(
        root=root,
        model=model,
        inputs=inputs,
        output=run_dit(model, inputs),
        pipe=pipe,
        image=image,
        transformer_dir=root / "transformer",
        pipe_dir=root / "pipe",
    )


def _copy(src: Path, tmp_path: Path, name="copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# -- round trips -----------------------------------------------------------------------------
FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    import torch
    from safetensors.torch import load_file, save_file
    import mhla_diffusers as M

    torch.set_num_threads(1)
    transformer_dir, pipe_dir, inputs_file, out_file = sys.argv[1:]
    x = load_file(inputs_file)
    model = M.load_mhla_transformer(transformer_dir)

    def run():
        with torch.no_grad():
            return model(x["latent"], timestep=x["timestep"], class_labels=x["labels"]).sample

    res = {"output_as_loaded": run(), "training": torch.tensor(int(model.training))}
    res.update({"base." + k: v.detach().contiguous() for k, v in model.state_dict().items() if "mhla" not in k})
    for t in list(model.parameters()) + list(model.buffers()):  # helpers.realign_
        t.data = t.data.clone()
    res["output"] = run()
    res.update({k: v.detach().contiguous() for k, v in model.state_dict().items() if "mhla" in k})
    pipe = M.load_mhla_pipeline(pipe_dir)
    pipe.set_progress_bar_config(disable=True)
    for t in list(pipe.transformer.parameters()) + list(pipe.transformer.buffers()) + list(pipe.vae.parameters()):
        t.data = t.data.clone()
    image = pipe(class_labels=[1], num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    res["image"] = torch.from_numpy(image).contiguous()
    try:  # C15: converting a converted model again is refused
        M.apply_mhla(model, layers="all")
        refused = 0
    except ValueError as err:
        refused = 1 if "already installed" in str(err) else 2
    res["double_conversion_refused"] = torch.tensor(refused)
    save_file(res, out_file)
    """
)


def test_round_trip_in_a_fresh_process(saved, tmp_path):
    """C14: one subprocess (imports cost ~8 s) loads both checkpoints and writes its outputs."""
    latent, timestep, labels = saved["inputs"]
    save_file({"latent": latent, "timestep": timestep, "labels": labels}, tmp_path / "inputs.safetensors")
    script = tmp_path / "load.py"
    script.write_text(FRESH_PROCESS)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = [sys.executable, str(script), str(saved["transformer_dir"]), str(saved["pipe_dir"])]
    args += [str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors")]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = load_file(tmp_path / "out.safetensors")
    assert torch.equal(res["output"], saved["output"])
    scale = saved["output"].abs().max()
    assert (res["output_as_loaded"] - saved["output"]).abs().max() <= 1e-6 * scale
    base = {k: v for k, v in saved["model"].state_dict().items() if "mhla" not in k}
    assert sorted(k[5:] for k in res if k.startswith("base.")) == sorted(base)
    assert all(torch.equal(res["base." + k], v) for k, v in base.items())
    for key, value in mhla_state(saved["model"]).items():
        assert torch.equal(res[key], value), key  # raw values (outside [0, 1] too), not re-initialised
    assert sorted(k for k in res if "mhla" in k) == sorted(mhla_state(saved["model"]))
    assert int(res["training"]) == 0
    assert torch.equal(res["image"], torch.from_numpy(saved["image"]))
    assert int(res["double_conversion_refused"]) == 1


def test_transformer_round_trip_in_process(saved):
    model = load_mhla_transformer(saved["transformer_dir"])
    assert not model.training
    assert mhla_spec(model) == mhla_spec(saved["model"])
    expected = saved["model"].state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(run_dit(realign_(model), saved["inputs"]), saved["output"])
    # from the pipeline folder too
    from_pipe = load_mhla_transformer(saved["pipe_dir"])
    assert mhla_spec(from_pipe) == mhla_spec(saved["pipe"].transformer)


def test_load_in_bfloat16(saved):
    """C08/C13 at load time: torch_dtype=bfloat16 gives a working bf16 model whose mixing matrices hold
    the saved values (fp32 kept, or rounded to the model dtype)."""
    model = load_mhla_transformer(saved["transformer_dir"], torch_dtype=torch.bfloat16)
    assert model.transformer_blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    for key, value in mhla_state(saved["model"]).items():
        got = model.state_dict()[key]
        assert torch.equal(got, value.to(got.dtype)), key
    latent, timestep, labels = saved["inputs"]
    out = run_dit(model, (latent.bfloat16(), timestep, labels))
    assert out.dtype == torch.bfloat16
    assert (out.float() - saved["output"]).abs().max() <= 0.1 * saved["output"].abs().max()


def test_pipeline_round_trip(saved, tmp_path):
    pipe = load_mhla_pipeline(saved["pipe_dir"])
    pipe.set_progress_bar_config(disable=True)
    realign_(pipe.transformer), realign_(pipe.vae)
    assert type(pipe).__name__ == "DiTPipeline"
    assert sorted(mhla_state(pipe.transformer)) == sorted(mhla_state(saved["pipe"].transformer))
    for key, value in mhla_state(saved["pipe"].transformer).items():
        assert torch.equal(mhla_state(pipe.transformer)[key], value)
    image = generate(pipe)
    assert image.shape == (1, 8, 8, 3) and torch.isfinite(torch.from_numpy(image)).all()
    assert (image == saved["image"]).all()
    # the original pipeline still generates the same after having been saved
    assert (generate(saved["pipe"]) == saved["image"]).all()
    # save the reloaded pipeline again (convert -> save -> load -> save -> load): still exact
    save_mhla_pipeline(pipe, tmp_path / "again")
    again = load_mhla_pipeline(tmp_path / "again")
    again.set_progress_bar_config(disable=True)
    realign_(again.transformer), realign_(again.vae)
    assert (generate(again) == saved["image"]).all()
    # a plain diffusers load of the converted folder is the base model, MHLA-free
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(saved["pipe_dir"])
    assert not is_mhla_model(plain.transformer)


def test_saving_leaves_the_model_unchanged(saved):
    model = saved["model"]
    assert is_mhla_model(model)
    assert sorted(mhla_state(model)) == [f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in (1, 2, 4, 5)]
    assert torch.equal(run_dit(model, saved["inputs"]), saved["output"])


def test_base_folder_is_plain_diffusers(saved):
    from diffusers import DiTTransformer2DModel

    folder = saved["transformer_dir"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "mhla.safetensors",
        "mhla_config.json",
    ]
    base = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert not [k for k in base if "mhla" in k]
    assert sorted(load_file(folder / "mhla.safetensors")) == sorted(mhla_state(saved["model"]))
    assert all(v.dtype == torch.float32 for v in load_file(folder / "mhla.safetensors").values())
    config = json.loads((folder / "config.json").read_text())
    marker = config.pop(mhla_diffusers.checkpoint.format.CONFIG_MARKER_KEY)  # the one key added to the base config
    assert "load_mhla_transformer" in marker and "WITHOUT MHLA" in marker
    assert "mhla" not in json.dumps(config)
    with WarningLog() as log:
        plain = DiTTransformer2DModel.from_pretrained(folder)
    assert not [m for m in log.messages if "not used" in m or "unexpected" in m.lower() or "newly initialized" in m]
    # all a stock load says: diffusers' warning about the unknown config key, which carries the marker's text
    assert len(log.messages) == 1 and marker in log.messages[0] and "not expected" in log.messages[0], log.messages
    assert not is_mhla_model(plain)
    expected = {k: v for k, v in saved["model"].state_dict().items() if "mhla" not in k}
    got = plain.state_dict()
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    config = read_mhla_config(folder)
    assert config["format_version"] == FORMAT_VERSION == 3
    assert config["layers"] == [1, 2, 4, 5] and config["block_grid"] == [1, 2, 2]


def test_warning_capture_works(tmp_path):
    """Positive control for the check above: a raw save_pretrained of an MHLA model writes mhla keys
    that a plain from_pretrained drops with a warning."""
    from diffusers import DiTTransformer2DModel

    model = tiny_dit(num_layers=1)
    apply_mhla(model, num_blocks=4)
    model.save_pretrained(tmp_path / "raw")
    with WarningLog() as log:
        DiTTransformer2DModel.from_pretrained(tmp_path / "raw")
    assert any("mhla.mixing" in m for m in log.messages)


def test_model_without_mhla_saves_plain(tmp_path):
    model = tiny_dit(num_layers=2)
    save_mhla_transformer(model, tmp_path / "plain")
    assert not (tmp_path / "plain" / "mhla_config.json").exists()
    assert not (tmp_path / "plain" / "mhla.safetensors").exists()
    assert read_mhla_config(tmp_path / "plain") is None
    loaded = realign_(load_mhla_transformer(tmp_path / "plain"))
    assert not is_mhla_model(loaded)
    inputs = dit_inputs(batch=1)
    assert torch.equal(run_dit(loaded, inputs), run_dit(model, inputs))


def test_double_conversion_refused(saved):
    """C15: a loaded converted model already has MHLA; converting again is refused, clearly."""
    model = load_mhla_transformer(saved["transformer_dir"])
    for layers in ("hybrid", "all"):
        with pytest.raises(ValueError, match=r"already installed.*remove_mhla"):
            apply_mhla(model, layers=layers, num_blocks=4)
    assert torch.equal(run_dit(realign_(model), saved["inputs"]), saved["output"])


# -- broken checkpoints: always MHLACheckpointError ------------------------------------------
def _expect_error(folder, match):
    with pytest.raises(MHLACheckpointError, match=match):
        load_mhla_transformer(folder)


def test_missing_weights(saved, tmp_path):
    folder = _copy(saved["transformer_dir"], tmp_path)
    (folder / "mhla.safetensors").unlink()  # config without weights
    _expect_error(folder, r"mhla\.safetensors is missing")
    pipe = _copy(saved["pipe_dir"], tmp_path, "pipe")
    (pipe / "transformer" / "mhla.safetensors").unlink()
    with pytest.raises(MHLACheckpointError, match="missing"):
        load_mhla_pipeline(pipe)


def test_weights_without_config(saved, tmp_path):
    folder = _copy(saved["transformer_dir"], tmp_path)
    (folder / "mhla_config.json").unlink()
    _expect_error(folder, r"mhla_config\.json is missing")


@pytest.mark.parametrize("damage", ["truncate", "header", "length", "empty"])
def test_corrupted_weights(saved, tmp_path, damage):
    folder = _copy(saved["transformer_dir"], tmp_path)
    path = folder / "mhla.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "header":  # garble the JSON header
        data[10:40] = b"\xff" * 30
    elif damage == "length":  # header length far past the end of the file
        data[:8] = (10**9).to_bytes(8, "little")
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    _expect_error(folder, "corrupted")


def test_non_finite_weights(saved, tmp_path):
    folder = _copy(saved["transformer_dir"], tmp_path)
    tensors = load_file(folder / "mhla.safetensors")
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, folder / "mhla.safetensors")
    _expect_error(folder, "NaN")


def _converted(tmp_path, name, **kwargs):
    model = tiny_dit(num_layers=6, seed=1)
    apply_mhla(model, **kwargs)
    return save_mhla_transformer(model, tmp_path / name)


@pytest.mark.parametrize(
    "kwargs, match, legacy_match",
    [
        (dict(layers="all", num_blocks=4), r"layers: \[1, 2, 4, 5\] in mhla_config\.json", "unexpected keys"),
        (dict(layers=[1, 2], num_blocks=4), "layers", "missing keys"),
        (dict(layers="hybrid", num_blocks=2), "block_grid.*num_blocks", "shape"),  # another M
    ],
)
def test_mismatched_weights(saved, tmp_path, kwargs, match, legacy_match):
    """Weights of another conversion: the settings recorded in their header differ from the config;
    without recorded settings (files written before they existed) the keys or shapes differ."""
    folder = _copy(saved["transformer_dir"], tmp_path)
    other = _converted(tmp_path, "other", **kwargs)
    shutil.copy(other / "mhla.safetensors", folder / "mhla.safetensors")
    _expect_error(folder, match)
    save_file(load_file(other / "mhla.safetensors"), folder / "mhla.safetensors", metadata={"format": "pt"})
    _expect_error(folder, legacy_match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(format_version=4), "format_version 4"),
        (lambda c: c.update(format_version=True), "format_version True"),
        (lambda c: c.pop("format_version"), "format_version None"),
        (lambda c: c.pop("block_grid"), "block_grid"),
        (lambda c: c.update(model_class="SanaTransformer2DModel"), "SanaTransformer2DModel"),
        (lambda c: c.update(num_layers=28), "layers"),
        (lambda c: c.update(layers=[1, 2, 4, 5, 9]), "layer"),  # index beyond the model
        (lambda c: c.update(block_grid=[1, 8, 8]), "block grid"),  # does not fit the 4 x 4 native grid
    ],
)
def test_bad_config(saved, tmp_path, edit, match):
    folder = _copy(saved["transformer_dir"], tmp_path)
    config = json.loads((folder / "mhla_config.json").read_text())
    edit(config)
    (folder / "mhla_config.json").write_text(json.dumps(config))
    _expect_error(folder, match)


def test_unreadable_config(saved, tmp_path):
    folder = _copy(saved["transformer_dir"], tmp_path)
    (folder / "mhla_config.json").write_text("{not json")
    _expect_error(folder, "cannot read")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_mhla_transformer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        load_mhla_pipeline(tmp_path)


# -- atomic writes ------------------------------------------------------------------------------
def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_existing_folder_needs_overwrite(tmp_path):
    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    out = tmp_path / "out"
    out.mkdir()
    save_mhla_transformer(model, out)  # an empty folder is fine
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_mhla_transformer(model, out)
    (out / "stale.txt").write_text("old")
    with torch.no_grad():
        model.transformer_blocks[0].attn1.mhla.mixing.weight.fill_(0.5)
    save_mhla_transformer(model, out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert torch.equal(load_file(out / "mhla.safetensors")["transformer_blocks.0.attn1.mhla.mixing.weight"], torch.full((4, 4), 0.5))
    assert _leftovers(tmp_path, "out") == []
    pipe = tiny_dit_pipeline(num_layers=1)
    with pytest.raises(FileExistsError):
        save_mhla_pipeline(pipe, out)


def test_failed_save_leaves_no_partial_folder(tmp_path, monkeypatch):
    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    inputs = dit_inputs(batch=1)
    expected = run_dit(model, inputs)
    real_save = type(model).save_pretrained

    def failing_save(self, folder, **kwargs):
        real_save(self, folder, **kwargs)  # writes the base files, then fails
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_mhla_transformer(model, tmp_path / "new")
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path, "new") == []
    # an existing checkpoint survives a failed overwrite
    monkeypatch.undo()
    save_mhla_transformer(model, tmp_path / "kept")
    before = sorted(p.name for p in (tmp_path / "kept").iterdir())
    monkeypatch.setattr(type(model), "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_mhla_transformer(model, tmp_path / "kept", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == before and _leftovers(tmp_path, "kept") == []
    # and the model keeps its mixing matrices
    assert is_mhla_model(model) and torch.equal(run_dit(model, inputs), expected)

    # a model MHLA cannot describe in one config fails before anything is written
    monkeypatch.undo()
    mixed = tiny_dit(num_layers=2)
    apply_mhla(mixed, layers=[0], block_grid=(2, 2))
    apply_mhla(mixed, layers=[1], block_grid=(1, 1))
    with pytest.raises(ValueError, match="different settings"):
        save_mhla_transformer(mixed, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists() and _leftovers(tmp_path, "mixed") == []
    assert is_mhla_model(mixed)


def test_silent_data_damage_caught_by_digest(saved, tmp_path):
    """A flipped byte inside the tensor data (header intact, values finite) is caught by the sha256
    recorded in mhla_config.json."""
    folder = _copy(saved["transformer_dir"], tmp_path)
    path = folder / "mhla.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # low mantissa bits of the last fp32 value: still finite, still parses
    path.write_bytes(bytes(data))
    _expect_error(folder, "sha256")


def test_plain_save_pretrained_of_an_mhla_model_is_refused_on_load(tmp_path):
    """A model with MHLA written by plain save_pretrained carries its mixing matrices inside the base
    weights, which diffusers drops on load: loading it must say so, not return a softmax model."""
    from mhla_diffusers import MHLACheckpointError, apply_mhla, load_mhla_transformer

    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(MHLACheckpointError, match="save_mhla_transformer"):
        load_mhla_transformer(tmp_path / "plain")


def test_overwrite_never_replaces_the_source_or_the_working_directory(tmp_path, monkeypatch):
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint
    from mhla_diffusers.checkpoint.io import atomic_directory

    src = tmp_path / "work" / "base"
    tiny_dit(num_layers=2).save_pretrained(src)
    for out in (src, src.parent):
        with pytest.raises(ValueError, match="replace the source"):
            convert_checkpoint(src, out, overwrite=True)
    assert (src / "config.json").is_file()
    monkeypatch.chdir(src.parent)
    with pytest.raises(ValueError, match="current directory"):
        with atomic_directory(src.parent, overwrite=True):
            pass
    assert (src / "config.json").is_file()


def test_recorded_backend_that_cannot_run_here_becomes_auto(monkeypatch):
    """A checkpoint saved with backend 'triton' loads on a machine without CUDA (triton installed or not)."""
    from mhla_diffusers.checkpoint import loading as checkpoint  # format.py re-exports its public names only

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert checkpoint._usable_backend("torch") == "torch"
    assert checkpoint._usable_backend("auto") == "auto"
    with pytest.warns(UserWarning, match="not available here"):
        assert checkpoint._usable_backend("triton") == "auto"
    with pytest.warns(UserWarning):
        assert checkpoint._usable_backend("no-such-backend") == "auto"
