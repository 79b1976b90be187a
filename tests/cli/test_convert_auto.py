"""convert.py --layers auto (issue 13): calibration made offline from the source, the selection and the
scores recorded in mhla_config.json, loading back (and loading folders written before the record)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import run_main, tiny_dit_pipeline
from helpers_sana import tiny_sana_pipeline

import mhla_diffusers
from mhla_diffusers.checkpoint.conversion import convert_checkpoint

SCRIPT = "conversion/convert.py"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short fits may be reported as not converged
        yield


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auto") / "dit"
    tiny_dit_pipeline(num_layers=3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sana_pipe():
    return tiny_sana_pipeline(num_layers=2, sample_size=16)


def _config(folder):
    return json.loads((folder / "transformer" / "mhla_config.json").read_text())


def test_dit_keep_softmax_round_trip(dit_folder, tmp_path, capsys):
    out = tmp_path / "auto"
    code, err = run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", out, "--layers", "auto",
                         "--keep-softmax", "1", "--calibration-samples", "3", "--calibration-seed", "1", capsys=capsys)
    assert code == 0, err
    config = _config(out)
    selection = config["selection"]
    assert selection["method"] == "auto" and selection["keep_softmax"] == 1
    assert len(selection["scores"]) == 3 and selection["sensitivity"]["num_calibration"] == 3
    kept = max(range(3), key=lambda i: (selection["scores"][i], -i))
    assert selection["softmax_layers"] == [kept] and config["layers"] == [i for i in range(3) if i != kept]

    pipe = mhla_diffusers.load_mhla_pipeline(out)
    assert mhla_diffusers.mhla_spec(pipe.transformer)["selection"] == selection  # kept by a re-save
    images = pipe(class_labels=[1], num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 8, 8, 3)

    # a folder written before the record (no "selection") loads as before, and says nothing of it
    (out / "transformer" / "mhla_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "selection"}))
    old = mhla_diffusers.load_mhla_transformer(out)
    assert mhla_diffusers.mhla_spec(old)["layers"] == config["layers"] and "selection" not in mhla_diffusers.mhla_spec(old)


def test_dit_attention_budget_and_library_calibration(dit_folder, tmp_path, capsys):
    """16 tokens, 2 heads x 8, M = 2: MHLA costs 4608 / 8192 of softmax per layer, so a budget of 0.75 keeps
    one layer (0.708) and not two (0.854); the library takes precomputed calibration inputs too."""
    out = tmp_path / "budget"
    code, err = run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", out, "--layers", "auto",
                         "--attention-budget", "0.75", "--calibration-samples", "2", capsys=capsys)
    assert code == 0, err
    selection = _config(out)["selection"]
    assert len(selection["softmax_layers"]) == 1 and selection["attention_cost"] == pytest.approx((8192 + 2 * 4608) / (3 * 8192))

    pipe = tiny_dit_pipeline(num_layers=3)
    calibration = mhla_diffusers.calibration_inputs(pipe, num_samples=2)
    spec = convert_checkpoint(dit_folder, tmp_path / "lib", layers="auto", keep_softmax=2, calibration=calibration)
    assert len(spec["layers"]) == 1 and spec["selection"]["keep_softmax"] == 2
    with pytest.raises(ValueError, match="do not apply with calibration"):
        convert_checkpoint(dit_folder, tmp_path / "x", layers="auto", keep_softmax=1, calibration=calibration, calibration_samples=2)


def test_dit_measured_cost_from_the_command_line(dit_folder, tmp_path, capsys):
    """--cost measured times each layer's attention here, at --cost-grid, kept in --cost-cache; the record says so."""
    out, cache = tmp_path / "measured", tmp_path / "costs.json"
    code, err = run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", out, "--layers", "auto", "--keep-softmax", "1",
                         "--calibration-samples", "2", "--cost", "measured", "--cost-grid", "4,4", "--cost-cache", cache,
                         capsys=capsys)
    assert code == 0, err
    model = _config(out)["selection"]["cost_model"]
    assert model["model"] == "measured" and model["grid"] == [1, 4, 4] and len(model["stock_seconds"]) == 3
    assert all(s > 0 for s in model["stock_seconds"] + model["mhla_seconds"])
    assert sorted(json.loads(cache.read_text()).values()) == sorted({*model["stock_seconds"], *model["mhla_seconds"]})
    for extra, message in ((["--cost-grid", "4,4"], "add --cost measured"), (["--cost-cache", "c.json"], "add --cost measured"),
                           (["--cost", "measured"], "cost only apply with layers='auto'")):
        code, err = run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", tmp_path / "x", *extra, capsys=capsys)
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as exit_:
        run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", tmp_path / "x", "--cost-grid", "4", capsys=capsys)
    assert exit_.value.code == 2 and "--cost-grid takes a token grid" in capsys.readouterr().err


def test_sana_pipeline_and_transformer_folder(sana_pipe, tmp_path, capsys):
    """SANA: prompts through the pipeline's own text encoder; a transformer folder has none, so it needs
    --calibration-embeddings (a clear error without), written by encode_calibration_prompts."""
    from safetensors.torch import save_file

    folder = tmp_path / "sana"
    sana_pipe.save_pretrained(folder)
    code, err = run_main(SCRIPT, "--family", "sana", "--src", folder, "--out", tmp_path / "auto", "--layers", "auto",
                         "--keep-softmax", "1", "--calibration-samples", "2", capsys=capsys)
    assert code == 0, err
    assert len(_config(tmp_path / "auto")["layers"]) == 1
    mhla_diffusers.load_mhla_pipeline(tmp_path / "auto")

    code, err = run_main(SCRIPT, "--family", "sana", "--src", folder / "transformer", "--out", tmp_path / "t", "--layers", "auto",
                         "--keep-softmax", "1", capsys=capsys)
    assert code == 2 and "--calibration-embeddings" in err and not (tmp_path / "t").exists()
    save_file(mhla_diffusers.encode_calibration_prompts(sana_pipe), str(tmp_path / "emb.safetensors"))
    code, err = run_main(SCRIPT, "--family", "sana", "--src", folder / "transformer", "--out", tmp_path / "t", "--layers", "auto",
                         "--keep-softmax", "1", "--calibration-samples", "2", "--calibration-embeddings",
                         tmp_path / "emb.safetensors", capsys=capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "t" / "mhla_config.json").read_text())["selection"]["keep_softmax"] == 1


def test_bad_auto_options(dit_folder, tmp_path, capsys):
    cases = [
        (["--keep-softmax", "1"], "only apply with layers='auto'"),
        (["--calibration-samples", "2"], "only apply with layers='auto'"),
        (["--layers", "auto"], "exactly one of keep_softmax"),
        (["--layers", "auto", "--keep-softmax", "3"], "keep_softmax must be an integer in 0..2"),
        (["--layers", "auto", "--attention-budget", "0.1"], "below the cost of MHLA on every layer"),
        (["--layers", "auto", "--keep-softmax", "1", "--calibration-embeddings", "x.safetensors"], "class-conditional"),
    ]
    for extra, message in cases:
        code, err = run_main(SCRIPT, "--family", "dit", "--src", dit_folder, "--out", tmp_path / "x", *extra, capsys=capsys)
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "x").exists()
    code, err = run_main(SCRIPT, "--family", "wan", "--from", "authors", "--src", tmp_path / "m.safetensors", "--config",
                         dit_folder, "--out", tmp_path / "x", "--keep-softmax", "1", capsys=capsys)
    assert code == 2 and "--keep-softmax / --attention-budget" in err


@pytest.fixture(scope="module")
def short_rope_wan(tmp_path_factory):
    """A tiny Wan pipeline whose RoPE table holds 4 positions per axis: the native latent (21 x 60 x 104, tokens
    21 x 30 x 52) does not run through its forward."""
    from diffusers import WanPipeline
    from helpers_wan import tiny_wan, tiny_wan_pipeline

    pipe = tiny_wan_pipeline(num_layers=2)
    pipe = WanPipeline(**{**pipe.components, "transformer": tiny_wan(num_layers=2, rope_max_seq_len=4)})
    folder = tmp_path_factory.mktemp("auto") / "wan"
    pipe.save_pretrained(folder)
    return pipe, folder


def test_wan_calibration_fits_the_rope_table(short_rope_wan, tmp_path, capsys):
    """--layers auto without --calibration-latent-size failed with "calibration entry 0 does not run through the
    WanTransformer3DModel's forward (RuntimeError: shape '[21, 1, 1, -1]' is invalid ...)", blaming entries the tool made:
    now the calibration is made at the largest latent the RoPE table takes (4 x 8 x 8), with a warning saying so; a
    --calibration-latent-size beyond it is exit 2 naming the bound."""
    pipe, folder = short_rope_wan
    with pytest.warns(UserWarning, match=r"native latent \(21, 60, 104\) cannot run.*at most \(4, 4, 4\) tokens.*"
                                         r"Calibrating at \(4, 8, 8\).*--calibration-latent-size"):
        inputs = mhla_diffusers.calibration_inputs(pipe, num_samples=1)
    assert tuple(inputs[0]["hidden_states"].shape) == (1, 16, 4, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model whose table takes the native latent: no warning, the native size
        assert tuple(mhla_diffusers.calibration_inputs(pipe.transformer.__class__.from_config(
            {**pipe.transformer.config, "rope_max_seq_len": 64}), num_samples=1,
            embeddings={"encoder_hidden_states": torch.zeros(1, 4, 32)})[0]["hidden_states"].shape) == (1, 16, 21, 60, 104)

    out = tmp_path / "auto"
    code, err = run_main(SCRIPT, "--family", "wan", "--src", folder, "--out", out, "--layers", "auto", "--keep-softmax", "1",
                         "--calibration-samples", "1", "--block-grid", "1,2,2", capsys=capsys)
    assert code == 0, err
    assert len(_config(out)["layers"]) == 1
    code, err = run_main(SCRIPT, "--family", "wan", "--src", folder, "--out", tmp_path / "x", "--layers", "auto",
                         "--keep-softmax", "1", "--calibration-latent-size", "2,16,8", "--block-grid", "1,2,2", capsys=capsys)
    assert code == 2 and "latent_size (2, 16, 8) is too large" in err and "a latent of at most (4, 8, 8)" in err, err
    assert not (tmp_path / "x").exists()
