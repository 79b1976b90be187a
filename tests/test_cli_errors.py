"""Bad input to the command-line tools is refused up front (exit code 2, a clear message, nothing
written, nothing computed): conversion/convert.py --layers selecting no layer, pipelines/generate.py
--out with a suffix no image format goes by; and the image grid is written in the suffix's format."""

from __future__ import annotations

import pytest

from helpers import load_script, run_main, tiny_dit_pipeline


@pytest.fixture(scope="module")
def base_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_errors") / "base"
    tiny_dit_pipeline(num_layers=3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_layer_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_errors") / "one_layer"
    tiny_dit_pipeline(num_layers=1).save_pretrained(folder)
    return folder


# conversion: an empty layer selection


@pytest.mark.parametrize("text", ["", ",", " , "])
def test_parse_layers_refuses_an_empty_selection(text):
    import argparse

    convert = load_script("conversion/convert.py")
    with pytest.raises(argparse.ArgumentTypeError, match="no layers selected"):
        convert.parse_layers(text)
    assert convert.parse_layers("1, 2,") == [1, 2] and convert.parse_layers("hybrid") == "hybrid"


@pytest.mark.parametrize("text", ["", ","])
def test_convert_cli_refuses_empty_layers_before_writing(base_pipeline, tmp_path, capsys, text):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run_main("conversion/convert.py", "--family", "dit", "--src", base_pipeline, "--out", out, "--layers", text,
                 capsys=capsys)
    assert exit_info.value.code == 2
    assert "no layers selected" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("layers", [[], (), "none"])
def test_convert_checkpoint_refuses_an_empty_selection(base_pipeline, tmp_path, layers):
    from mhla_diffusers.conversion import convert_checkpoint

    with pytest.raises(ValueError, match="no layers selected"):
        convert_checkpoint(base_pipeline, tmp_path / "out", family="dit", layers=layers)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_hybrid_that_selects_nothing(one_layer_pipeline, tmp_path, capsys):
    """'hybrid' keeps softmax on layers 0, 3, ...: on a one-layer model it converts nothing."""
    code, err = run_main("conversion/convert.py", "--family", "dit", "--src", one_layer_pipeline,
                         "--out", tmp_path / "out", "--layers", "hybrid", capsys=capsys)
    assert code == 2 and "no layers selected" in err, err
    assert not (tmp_path / "out").exists()
