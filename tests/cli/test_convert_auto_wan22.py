"""Automatic hybrid selection on Wan 2.2 A14B (two experts) and its conversion options (reviewer findings N1-N4):

* each expert is scored on calibration inputs of its own timesteps (``transformer``: ``t >= boundary_ratio x 1000``,
  ``transformer_2``: below), the range recorded in its selection; ``calibration_inputs(timestep_range=)``;
* ``--device`` / ``--calibration-latent-size``; precomputed scores of another block grid warn;
* ``--layers-2`` errors name the second expert; ``--layers none --layers-2 all`` converts the low-noise expert only.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import run_main, tiny_dit
from helpers_wan import tiny_wan22_pipeline, wan_self_attn

import mhla_diffusers.checkpoint.conversion as conversion
from mhla_diffusers import apply_mhla, calibration_inputs, layer_sensitivity, load_mhla_pipeline, mhla_spec
from mhla_diffusers.checkpoint.format import expert_timestep_range

SCRIPT = "conversion/convert.py"
SMALL = ("--block-grid", "1,2,2")


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    pipe = tiny_wan22_pipeline("t2v")
    folder = tmp_path_factory.mktemp("wan22") / "src"
    pipe.save_pretrained(folder)
    return pipe, folder


def _config(folder, name):
    path = folder / name / "mhla_config.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_calibration_timestep_range(wan22):
    pipe, _ = wan22
    assert expert_timestep_range(pipe, "transformer") == (875.0, float("inf"))
    assert expert_timestep_range(pipe, "transformer_2") == (float("-inf"), 875.0)
    for name, (low, high) in (("transformer", (875, 1000)), ("transformer_2", (0, 875))):
        inputs = calibration_inputs(pipe, num_samples=4, latent_size=(2, 8, 8), timestep_range=expert_timestep_range(pipe, name))
        steps = [float(x["timestep"]) for x in inputs]
        assert all(low <= t < high for t in steps), (name, steps)
        assert max(steps) - min(steps) > 0.5 * (high - low)  # spread over the range, not bunched at one end
    whole = [float(x["timestep"]) for x in calibration_inputs(pipe, num_samples=4, latent_size=(2, 8, 8))]
    assert min(whole) < 875 <= max(whole)  # without a range: the whole process, as before
    for bad in ((900, 900), (1200, 1300), (float("nan"), 10), "ab", (1,)):
        with pytest.raises(ValueError, match="timestep_range"):
            calibration_inputs(pipe, num_samples=2, latent_size=(2, 8, 8), timestep_range=bad)


def test_auto_scores_each_expert_on_its_own_timesteps(wan22, tmp_path, capsys, monkeypatch):
    """convert.py --layers auto --layers-2 auto: the calibration each expert is measured on lies in its range
    (seen at apply_mhla), the range is recorded; --device cpu and --calibration-latent-size are used."""
    _, src = wan22
    seen = []
    real = conversion.apply_mhla

    def spy(model, layers, **kwargs):
        seen.append(([float(x["timestep"]) for x in kwargs["calibration"]], tuple(kwargs["calibration"][0]["hidden_states"].shape)))
        return real(model, layers, **kwargs)

    monkeypatch.setattr(conversion, "apply_mhla", spy)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short fits may be reported as not converged
        code, err = run_main(SCRIPT, "--family", "wan", "--src", src, "--out", out, *SMALL, "--layers", "auto", "--layers-2", "auto",
                             "--keep-softmax", "1", "--calibration-samples", "3", "--calibration-latent-size", "2,8,8",
                             "--device", "cpu", capsys=capsys)
    assert code == 0, err
    (high_noise, shape), (low_noise, _) = seen
    assert shape == (1, 16, 2, 8, 8)
    assert len(high_noise) == len(low_noise) == 3
    assert all(875 <= t <= 1000 for t in high_noise) and all(0 <= t < 875 for t in low_noise), seen
    assert _config(out, "transformer")["selection"]["calibration_timestep_range"] == [875.0, 1000.0]
    assert _config(out, "transformer_2")["selection"]["calibration_timestep_range"] == [0.0, 875.0]
    loaded = load_mhla_pipeline(out)
    assert next(loaded.transformer.parameters()).device.type == "cpu"


def test_device_and_latent_size_errors(wan22, tmp_path, capsys):
    _, src = wan22
    base = ("--family", "wan", "--src", src, "--out", tmp_path / "o", *SMALL)
    auto = ("--layers", "auto", "--keep-softmax", "1")
    cases = [
        (("--device", "nonsense", *auto), "device 'nonsense' (--device) cannot be used here"),
        (("--device", "cpu"), "device only apply with layers='auto'"),
        (("--calibration-latent-size", "2,8,8"), "calibration_latent_size only apply with layers='auto'"),
        (("--calibration-latent-size", "2,7,8", *auto), "not a multiple of the wan model's patch size"),
    ]
    if not torch.cuda.is_available():
        cases.append((("--device", "cuda", *auto), "device 'cuda' (--device) cannot be used here"))
    for extra, message in cases:
        code, err = run_main(SCRIPT, *base, *extra, capsys=capsys)
        assert code == 2 and message in err, (extra, err)
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        run_main(SCRIPT, *base, "--calibration-latent-size", "8", capsys=capsys)
    assert "--calibration-latent-size takes H,W" in capsys.readouterr().err


def test_layers_2_errors_and_help(wan22, tmp_path, capsys):
    _, src = wan22
    code, err = run_main(SCRIPT, "--family", "wan", "--src", src, "--out", tmp_path / "o", *SMALL, "--layers", "1", "--layers-2", "5",
                         capsys=capsys)
    assert code == 2 and "(transformer_2, --layers-2)" in err and "5" in err, err
    code, err = run_main(SCRIPT, "--family", "wan", "--src", src, "--out", tmp_path / "o", "--layers", "none", capsys=capsys)
    assert code == 2 and "no layers selected" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        run_main(SCRIPT, "--help", capsys=capsys)
    text = " ".join(capsys.readouterr().out.split())
    assert ("--layers-2 LAYERS_2 Wan 2.2 A14B only: layer selection of the second expert (transformer_2, low noise): "
            "all | hybrid | none | auto") in text


def test_low_noise_expert_only(wan22, tmp_path, capsys):
    """--layers none --layers-2 all: transformer stays stock (no MHLA files), transformer_2 is MHLA; it loads so."""
    _, src = wan22
    out = tmp_path / "low"
    code, err = run_main(SCRIPT, "--family", "wan", "--src", src, "--out", out, *SMALL, "--layers", "none", "--layers-2", "all",
                         capsys=capsys)
    assert code == 0, err
    assert _config(out, "transformer") is None and _config(out, "transformer_2")["layers"] == [0, 1]
    loaded = load_mhla_pipeline(out)
    assert [type(a.processor).__name__ for a in wan_self_attn(loaded.transformer)] == ["WanAttnProcessor"] * 2
    assert [type(a.processor).__name__ for a in wan_self_attn(loaded.transformer_2)] == ["MHLAProcessor"] * 2
    code, err = run_main(SCRIPT, "--family", "wan", "--src", out, "--out", tmp_path / "again", capsys=capsys)
    assert code == 3  # recognised as converted


def test_scores_of_another_block_grid_warn():
    model = tiny_dit(num_layers=2, sample_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = layer_sensitivity(model, calibration_inputs(model, num_samples=1), block_grid=(2, 2), fit_steps=3, progress=False)
    assert tuple(scores.settings["block_grid"])[-2:] == (2, 2)
    with pytest.warns(UserWarning, match=r"measured with block grid \(1, 2, 2\) but this call installs block grid \(1, 4, 4\)"):
        apply_mhla(model, "auto", keep_softmax=1, sensitivity=scores, block_grid=(4, 4))
    assert len(mhla_spec(model)["layers"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grid the scores were measured at: no warning
        apply_mhla(tiny_dit(num_layers=2, sample_size=16), "auto", keep_softmax=1, sensitivity=scores, block_grid=(2, 2))
