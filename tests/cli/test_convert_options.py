"""conversion/convert.py's per-layer options (``--lepe``, ``--lepe-init``, ``--gate``, ``--rope``,
``--feature-power``, ``--feature-eps``, ``--mixing-init``, ``--no-mixing-clamp``) and ``convert_checkpoint``'s:
written into the converted checkpoint, loaded back, refused with exit code 2 and nothing written when bad."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from helpers import dit_inputs, realign_, run_dit, run_main, tiny_dit_pipeline
from helpers_wan import run_wan, tiny_wan, wan_inputs
from safetensors.torch import load_file

from mhla_diffusers import apply_mhla, load_mhla_pipeline, load_mhla_transformer, mhla_attention, mhla_spec
from mhla_diffusers.checkpoint.conversion import convert_checkpoint

HAS_POWER = "feature_power" in inspect.signature(mhla_attention).parameters


@pytest.fixture(scope="module")
def dit_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options") / "dit"
    tiny_dit_pipeline(num_layers=3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wan_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options") / "wan"
    tiny_wan(num_layers=2).save_pretrained(folder)
    return folder


def test_dit_options_written_and_loaded(dit_base, tmp_path, capsys):
    """--lepe --gate neutral --mixing-init uniform --feature-eps --no-mixing-clamp on DiT: recorded, the weights
    (zero gate and LePE, all-ones matrices) written; the loaded pipeline computes what apply_mhla with the same
    settings computes on the base."""
    out = tmp_path / "out"
    code, err = run_main("conversion/convert.py", "--family", "dit", "--src", dit_base, "--out", out, "--block-grid", "2,2",
                         "--lepe", "--gate", "neutral", "--mixing-init", "uniform", "--feature-eps", "1e-6",
                         "--no-mixing-clamp", capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["gate"] == "neutral" and config["lepe"] is True and config["feature_eps"] == 1e-6
    assert config["mixing_clamp"] is False and "rope" not in config and "feature_power" not in config
    weights = load_file(out / "transformer" / "mhla.safetensors")
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in weights.items() if k.endswith("mhla.mixing.weight"))
    assert all(torch.count_nonzero(v) == 0 for k, v in weights.items() if ".mhla.gate." in k or ".mhla.lepe." in k)
    assert {k.split(".attn1.")[1] for k in weights} == {"mhla.mixing.weight", "mhla.gate.weight", "mhla.gate.bias",
                                                        "mhla.lepe.weight", "mhla.lepe.bias"}
    loaded = load_mhla_pipeline(out).transformer
    base = load_mhla_pipeline(dit_base).transformer
    apply_mhla(base, block_grid=(2, 2), lepe=True, gate="neutral", init="uniform", feature_eps=1e-6, mixing_clamp=False)
    assert mhla_spec(loaded) == mhla_spec(base)
    inputs = dit_inputs(batch=1)
    assert torch.equal(run_dit(realign_(loaded), inputs), run_dit(realign_(base), inputs))


def test_wan_options_written_and_loaded(wan_base, tmp_path, capsys):
    """Wan (a transformer folder): --rope before --gate authors --lepe --lepe-init authors --no-normalize
    --mixing-init authors_constant (and --feature-power where the operator has it)."""
    out = tmp_path / "out"
    power = ["--feature-power", "2"] if HAS_POWER else []
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", wan_base, "--out", out, "--block-grid", "1,2,2",
                         "--rope", "before", "--gate", "authors", "--lepe", "--lepe-init", "authors", "--no-normalize",
                         "--mixing-init", "authors_constant", *power, capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "mhla_config.json").read_text())
    assert (config["rope"], config["gate"], config["lepe"], config["output_norm"]) == ("before", "authors", True, True)
    assert config.get("feature_power", 1.0) == (2.0 if HAS_POWER else 1.0)
    weights = load_file(out / "mhla.safetensors")
    for key, value in weights.items():
        if key.endswith(("mhla.mixing.weight", "mhla.output_norm.weight")):
            assert torch.all(value == 1e-6), key  # the authors' constant start
        elif key.endswith("mhla.lepe.weight"):
            assert value.shape == (24, 1, 3, 3, 3) and value.abs().max() > 0  # PyTorch's conv init
    model = load_mhla_transformer(out)
    assert model.blocks[0].attn1.mhla.rope == "before" and model.blocks[0].attn1.mhla.gate.form == "authors"
    assert torch.isfinite(run_wan(model, wan_inputs(batch=1, frames=2, size=(8, 8)))).all()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--family", "dit", "--rope", "before"], "rope='before' places RoPE in the attention, but the DiT family has no RoPE"),
        (["--family", "dit", "--mixing-init", "paper"], "unknown mixing-matrix init 'paper'"),
        (["--family", "dit", "--lepe-init", "authors"], "--lepe-init only applies with --lepe"),
        (["--family", "dit", "--feature-power", "0"], "feature_power must be a finite number > 0"),
        (["--family", "dit", "--feature-eps", "-1"], "feature_eps must be a finite number >= 0"),
        (["--family", "wan", "--from", "authors", "--config", "x", "--lepe"], "cannot be set with --from authors"),
        (["--family", "wan", "--from", "authors", "--config", "x", "--mixing-init", "uniform"],
         "cannot be set with --from authors"),
    ],
)
def test_bad_options_exit_2_and_write_nothing(dit_base, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    code, err = run_main("conversion/convert.py", "--src", dit_base, "--out", out, *extra, capsys=capsys)
    assert code == 2 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("extra", [["--gate", "sigmoid"], ["--rope", "sideways"], ["--lepe-init", "kaiming"]])
def test_choices_are_refused_by_the_parser(dit_base, tmp_path, capsys, extra):
    with pytest.raises(SystemExit) as exit_info:
        run_main("conversion/convert.py", "--family", "dit", "--src", dit_base, "--out", tmp_path / "out", *extra, capsys=capsys)
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_convert_checkpoint_checks_options_before_loading(tmp_path):
    """Bad options are refused before the source is read (here it does not even exist)."""
    for kwargs, match in ((dict(gate="sigmoid"), "gate must be one of"), (dict(lepe_init="x"), "lepe_init must be one of"),
                          (dict(init="paper"), "unknown mixing-matrix init"), (dict(lepe="yes"), "lepe must be"),
                          (dict(feature_power=-2.0), "feature_power")):
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(tmp_path / "nowhere", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
