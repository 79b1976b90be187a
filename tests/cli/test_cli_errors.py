"""Bad input to the command-line tools is refused up front (exit code 2, a clear message, nothing
written, nothing computed): conversion/convert.py --layers selecting no layer, pipelines/generate.py
--out with a suffix no image format goes by; and the image grid is written in the suffix's format."""

from __future__ import annotations

import pytest
import torch
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
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    with pytest.raises(ValueError, match="no layers selected"):
        convert_checkpoint(base_pipeline, tmp_path / "out", family="dit", layers=layers)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_hybrid_that_selects_nothing(one_layer_pipeline, tmp_path, capsys):
    """'hybrid' keeps softmax on layers 0, 3, ...: on a one-layer model it converts nothing."""
    code, err = run_main("conversion/convert.py", "--family", "dit", "--src", one_layer_pipeline,
                         "--out", tmp_path / "out", "--layers", "hybrid", capsys=capsys)
    assert code == 2 and "no layers selected" in err, err
    assert not (tmp_path / "out").exists()


# generation: the --out suffix


def _images(n=3):
    from PIL import Image

    return [Image.new("RGB", (8, 8), (40 * i, 100, 200)) for i in range(n)]


@pytest.mark.parametrize("name, fmt", [("a.png", "PNG"), ("b.jpg", "JPEG"), ("c.JPEG", "JPEG"), ("d.webp", "WEBP")])
def test_save_grid_writes_the_format_of_the_suffix(tmp_path, name, fmt):
    from PIL import Image

    from mhla_diffusers.generation import save_grid

    path = save_grid(_images(), tmp_path / name, rows=1)
    with Image.open(path) as image:
        assert image.format == fmt and image.size == (24, 8)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind


@pytest.mark.parametrize("name, message", [("v.mp4", "mp4"), ("g.gif", "unknown image suffix '.gif'"), ("grid", "no suffix")])
def test_save_grid_refuses_other_suffixes(tmp_path, name, message):
    from mhla_diffusers.generation import GenerationError, image_format, save_grid

    with pytest.raises(GenerationError, match=message):
        image_format(tmp_path / name)
    with pytest.raises(GenerationError, match=message):
        save_grid(_images(), tmp_path / name)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["b.mp4", "g.gif", "grid", "x.tiff"])
def test_generate_cli_refuses_a_bad_suffix_before_generating(base_pipeline, tmp_path, capsys, monkeypatch, name):
    from mhla_diffusers import generation

    def no_compute(*args, **kwargs):
        raise AssertionError("generation started before --out was checked")

    monkeypatch.setattr(generation, "generate_class_images", no_compute)
    monkeypatch.setattr(generation, "generate_text_images", no_compute)
    for kind in (["--class-labels", "1"], ["--prompt", "a cat"]):
        code, err = run_main("pipelines/generate.py", "--checkpoint", base_pipeline, *kind, "--steps", "1",
                             "--out", tmp_path / name, capsys=capsys)
        assert code == 2 and ".png" in err and ".jpg" in err, err
    assert not list(tmp_path.iterdir())


def test_generate_cli_writes_jpeg_and_webp(base_pipeline, tmp_path, capsys):
    from PIL import Image

    for name, fmt in (("a.jpg", "JPEG"), ("c.webp", "WEBP")):
        code, err = run_main("pipelines/generate.py", "--checkpoint", base_pipeline, "--class-labels", "1", "2",
                             "--steps", "1", "--out", tmp_path / name, capsys=capsys)
        assert code == 0, err
        with Image.open(tmp_path / name) as image:
            assert image.format == fmt and image.size == (2 * 8, 8)


def test_generate_cli_refuses_bad_rows_and_an_unwritable_folder_before_generating(base_pipeline, tmp_path, capsys, monkeypatch):
    """--rows below 1 (argparse, exit 2) and an --out whose folder is a file: refused before any compute."""
    from mhla_diffusers import generation

    def no_compute(*args, **kwargs):
        raise AssertionError("generation started before the arguments were checked")

    monkeypatch.setattr(generation, "generate_class_images", no_compute)
    for rows in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_info:
            run_main("pipelines/generate.py", "--checkpoint", base_pipeline, "--class-labels", "1", "--rows", rows,
                     "--out", tmp_path / "a.png", capsys=capsys)
        assert exit_info.value.code == 2
    (tmp_path / "file").write_text("not a folder")
    code, err = run_main("pipelines/generate.py", "--checkpoint", base_pipeline, "--class-labels", "1",
                         "--out", tmp_path / "file" / "sub" / "a.png", capsys=capsys)
    assert code == 2 and "is a file, not a folder" in err, err


# generation: the device


_DEVICES = [("gpu", "unknown device 'gpu'"), ("cuda:99", "device 'cuda:99'")]
if not torch.cuda.is_available():  # the case: --device cuda on a CPU-only torch
    _DEVICES.append(("cuda", "device 'cuda': CUDA is not available"))


@pytest.mark.parametrize("device, message", _DEVICES)
def test_generate_cli_refuses_an_unusable_device_before_loading(base_pipeline, tmp_path, capsys, monkeypatch, device, message):
    """--device cuda on a CPU-only torch ended in an uncaught AssertionError ("Torch not compiled with
    CUDA enabled") at pipe.to(device): now exit 2 with a message, before the pipeline is loaded."""
    from mhla_diffusers.checkpoint import format as checkpoint

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before --device was checked")

    monkeypatch.setattr(checkpoint, "load_mhla_pipeline", no_load)
    for kind in (["--class-labels", "1"], ["--prompt", "a cat"]):
        code, err = run_main("pipelines/generate.py", "--checkpoint", base_pipeline, *kind, "--steps", "1",
                             "--device", device, "--out", tmp_path / "a.png", capsys=capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


# conversion: damaged source files


def _damage(path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "text":
        path.write_text("this is a text file, not weights\n" * 4)
    elif kind == "random":
        path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).numpy().tobytes())
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "huge_length":  # stored_dtype asked to read 2^63 bytes
        path.write_bytes((1 << 63).to_bytes(8, "little") + data[8:])


def _one_line_error(err: str, path) -> bool:
    lines = [line for line in err.splitlines() if line.startswith("convert.py:")]
    return len(lines) == 1 and str(path) in lines[0] and "Traceback" not in err


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """A tiny diffusers Wan transformer folder (the --config) and its weights in the original layout, as
    .safetensors and .pth."""
    from helpers_wan import original_wan_state_dict, tiny_wan
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("damaged")
    model = tiny_wan(num_layers=1)
    model.save_pretrained(root / "config")
    state = original_wan_state_dict(model)
    save_file(state, str(root / "wan.safetensors"))
    torch.save(state, root / "wan.pth")
    return root


@pytest.mark.parametrize("source_kind", ["diffusers", "authors"])
@pytest.mark.parametrize("name, kind", [("wan.safetensors", "text"), ("wan.safetensors", "random"),
                                        ("wan.safetensors", "truncated"), ("wan.safetensors", "huge_length"),
                                        ("wan.pth", "text"), ("wan.pth", "random"), ("wan.pth", "truncated")])
def test_convert_refuses_a_damaged_single_file(wan_files, tmp_path, capsys, source_kind, name, kind):
    """A text file, random bytes, a truncated file, a header length of 2^63 as --src: exit 1 before (MemoryError,
    OverflowError, diffusers' OSError, safetensors' SafetensorError tracebacks); now exit 2 with one line naming it."""
    src = tmp_path / name
    src.write_bytes((wan_files / name).read_bytes())
    _damage(src, kind)
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", source_kind, "--src", src,
                         "--config", wan_files / "config", "--out", tmp_path / "out", capsys=capsys)
    assert code == 2 and _one_line_error(err, src), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [None, "fp32"])
@pytest.mark.parametrize("damaged, kind", [("transformer/diffusion_pytorch_model.safetensors", "text"),
                                           ("transformer/diffusion_pytorch_model.safetensors", "truncated"),
                                           ("vae/diffusion_pytorch_model.safetensors", "truncated"),
                                           ("transformer/config.json", "text")])
def test_convert_refuses_a_folder_with_a_damaged_file(base_pipeline, tmp_path, capsys, damaged, kind, dtype):
    """A diffusers pipeline folder (or its transformer folder) with a damaged weights or config file: exit 2 with
    one line naming the damaged file (or the folder diffusers failed to read), whatever --dtype."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(base_pipeline, src)
    _damage(src / damaged, kind)
    extra = () if dtype is None else ("--dtype", dtype)
    for source in (src, src / "transformer") if damaged.startswith("transformer/") else (src,):
        code, err = run_main("conversion/convert.py", "--family", "dit", "--src", source, "--out", tmp_path / "out",
                             *extra, capsys=capsys)
        named = src / damaged if damaged.endswith(".safetensors") else source
        assert code == 2 and _one_line_error(err, named), err
    assert not (tmp_path / "out").exists()


def test_convert_help_is_true_and_tidy(capsys):
    """--config applies to --from authors too (required there); the description has no runs of spaces left by
    backslash line continuations in the examples."""
    import re

    with pytest.raises(SystemExit):
        run_main("conversion/convert.py", "--help", capsys=capsys)
    text = capsys.readouterr().out
    description = text.split("\noptions:")[0].split("\n\n", 1)[1]
    assert [line for line in description.splitlines() if re.search(r"\S {2,}\S", line)] == []
    assert "\\\n        --out sana-mhla --dtype bf16" in description  # the continuation kept, as a shell reads it
    options = " ".join(text.split("\noptions:")[1].split())
    config = options.split("--config CONFIG", 1)[1].split(" --out OUT", 1)[0]
    assert "--from authors (required there)" in config and "single-file --src only" not in config


def test_convert_refuses_a_hub_id_that_is_not_cached_offline(tmp_path, capsys, monkeypatch):
    """An uncached Hub id with HF_HUB_OFFLINE=1: exit 1 with diffusers' OSError traceback before; now exit 2,
    one line naming the id and what to do."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache
    code, err = run_main("conversion/convert.py", "--family", "dit", "--src", "nobody/no-such-model",
                         "--out", tmp_path / "out", capsys=capsys)
    assert code == 2 and _one_line_error(err, "nobody/no-such-model"), err
    assert "pass a local folder" in err
    assert not (tmp_path / "out").exists()
