"""SANA-Video through the command lines: conversion/convert.py (a SanaVideoPipeline folder, a
SanaImageToVideoPipeline folder, a transformer folder; a single file refused, naming the fix) and
pipelines/generate.py on the converted folder (text-to-video, --image image-to-video, resolution binning on
and off, --context-parallel under torchrun), on tiny models of the real classes (tests/helpers_sana_video.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import realign_, run_main
from helpers_parallel import torchrun
from helpers_sana_video import tiny_sana_video, tiny_sana_video_pipeline
from PIL import Image
from safetensors.torch import load_file

import mhla_diffusers
from mhla_diffusers import apply_mhla, load_mhla_pipeline, load_mhla_transformer, mhla_spec
from mhla_diffusers.checkpoint.conversion import convert_checkpoint
from mhla_diffusers.generation import generate_videos, save_video

SIZE = ["--height", "64", "--width", "64", "--frames", "5", "--steps", "2", "--no-resolution-binning", "--device", "cpu"]


def _frames(path) -> np.ndarray:
    import imageio.v3 as iio

    return iio.imread(path)


def _video(pipe, **kwargs) -> np.ndarray:
    call = dict(height=64, width=64, frames=5, steps=2, device="cpu", use_resolution_binning=False)
    return generate_videos(None, ["a cat in the snow"], pipe=pipe, **{**call, **kwargs})[0]


def _first_frame(path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A saved tiny SanaVideoPipeline (3 layers: 64 x 64 px, 5 frames = 2 x 4 x 4 tokens)."""
    folder = tmp_path_factory.mktemp("sana_video") / "base"
    tiny_sana_video_pipeline(num_layers=3).save_pretrained(folder)
    return folder


def test_convert_pipeline_folder_then_generate_t2v_and_i2v(base, tmp_path, capsys):
    """convert.py on a SanaVideoPipeline folder (hybrid, blocks 1 x 2 x 2): the converted format, a ready
    SanaVideoPipeline equal to the same conversion in memory; generate.py writes a 5-frame 64 x 64 mp4 from a
    prompt and, with --image, from a first frame (the pipeline turned into SanaImageToVideoPipeline); converting
    the result again is refused (exit 3)."""
    out = tmp_path / "mhla"
    code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", base, "--out", out,
                         "--layers", "hybrid", "--block-grid", "1,2,2", capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["family"] == "sana_video" and config["model_class"] == "SanaVideoTransformer3DModel"
    assert config["layers"] == [1, 2] and config["block_grid"] == [1, 2, 2] and config["eps"] == 1e-15
    assert sorted(load_file(out / "transformer" / "mhla.safetensors")) == [
        f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in (1, 2)]
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "SanaVideoPipeline" and not pipe.transformer.training
    assert [type(b.attn1.processor).__name__ for b in pipe.transformer.transformer_blocks] == [
        "SanaLinearAttnProcessor3_0", "MHLAProcessor", "MHLAProcessor"]
    from diffusers import SanaVideoPipeline

    expected = SanaVideoPipeline.from_pretrained(base)
    apply_mhla(expected.transformer, layers="hybrid", block_grid=(1, 2, 2))
    realign_(pipe.transformer), realign_(expected.transformer)
    converted = _video(pipe)
    assert converted.shape == (5, 64, 64, 3) and np.array_equal(converted, _video(expected))
    # one string is one prompt, not one per character (the same video as the list of it)
    one = generate_videos(None, "a cat in the snow", pipe=pipe, height=64, width=64, frames=5, steps=2, device="cpu",
                          use_resolution_binning=False)
    assert len(one) == 1 and np.array_equal(one[0], converted)

    clip = tmp_path / "clip.mp4"
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat in the snow", *SIZE,
                         "--out", clip, capsys=capsys)
    assert code == 0, err
    t2v = _frames(clip)
    assert t2v.shape == (5, 64, 64, 3)
    i2v_clip = tmp_path / "i2v.mp4"
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat in the snow",
                         "--image", _first_frame(tmp_path / "first.png"), *SIZE, "--out", i2v_clip, capsys=capsys)
    assert code == 0, err
    i2v = _frames(i2v_clip)
    assert i2v.shape == (5, 64, 64, 3) and np.abs(i2v.astype(float) - t2v).mean() > 1

    code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", out, "--out", tmp_path / "again",
                         capsys=capsys)
    assert code == 3 and "already an MHLA checkpoint" in err and not (tmp_path / "again").exists()


def test_generate_refusals(base, tmp_path, capsys):
    """One line, exit 2, no mp4: a frame count that is not 4k + 1; resolution binning on at 64 x 64 (diffusers
    0.42.1 bins a square to 624 x 624, which its own SanaVideoPipeline refuses: not divisible by 32); an
    image-to-video folder without --image."""
    from diffusers import SanaImageToVideoPipeline, SanaVideoPipeline

    i2v = tmp_path / "i2v"
    SanaImageToVideoPipeline(**SanaVideoPipeline.from_pretrained(base).components).save_pretrained(i2v)
    small = ["--height", "64", "--width", "64", "--steps", "1", "--device", "cpu"]
    cases = [
        ((base, "--frames", "6", *small, "--no-resolution-binning"), "Nearest valid counts: 5 or 9"),
        ((base, "--frames", "5", *small), "divisible by 32 but are 624 and 624"),
        ((i2v, "--frames", "5", *small, "--no-resolution-binning"), "give the first frame (--image"),
    ]
    for (src, *extra), message in cases:
        code, err = run_main("pipelines/generate.py", "--checkpoint", src, "--prompt", "a cat", *extra,
                             "--out", tmp_path / "x.mp4", capsys=capsys)
        assert code == 2 and message in err.strip().splitlines()[-1], (extra, err)
    assert not (tmp_path / "x.mp4").exists()


def test_convert_image_to_video_folder(base, tmp_path, capsys):
    """A SanaImageToVideoPipeline folder converts to the same class; it generates from a first frame."""
    from diffusers import SanaImageToVideoPipeline, SanaVideoPipeline

    src = tmp_path / "i2v"
    SanaImageToVideoPipeline(**SanaVideoPipeline.from_pretrained(base).components).save_pretrained(src)
    out = tmp_path / "i2v-mhla"
    code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", src, "--out", out,
                         "--block-grid", "1,2,2", capsys=capsys)
    assert code == 0, err
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "SanaImageToVideoPipeline" and mhla_spec(pipe.transformer)["layers"] == [0, 1, 2]
    video = _video(pipe, image=_first_frame(tmp_path / "first.png"))
    assert video.shape == (5, 64, 64, 3) and np.isfinite(video).all()


def test_convert_transformer_folder(tmp_path, capsys):
    """A transformer-only folder: the transformer alone is written (bf16 with --dtype bf16), loads with MHLA and
    equals the same conversion in memory; convert_checkpoint (the Hub-id path is the same from_pretrained code)."""
    src = tmp_path / "transformer"
    model = tiny_sana_video(num_layers=3)
    model.save_pretrained(src)
    out = tmp_path / "out"
    code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", src, "--out", out,
                         "--layers", "0,2", "--num-blocks", "4", "--dtype", "bf16", capsys=capsys)
    assert code == 0, err
    assert not (out / "model_index.json").exists() and (out / "mhla_config.json").is_file()
    assert all(v.dtype == torch.bfloat16 for v in load_file(out / "diffusion_pytorch_model.safetensors").values())
    loaded = load_mhla_transformer(out)
    assert type(loaded).__name__ == "SanaVideoTransformer3DModel" and mhla_spec(loaded)["layers"] == [0, 2]

    spec = convert_checkpoint(src, tmp_path / "api", family="sana_video", layers="all", block_grid=(1, 2, 3))
    assert spec["layers"] == [0, 1, 2] and spec["block_grid"] == [1, 2, 3] and spec["family"] == "sana_video"
    from helpers_sana_video import run_sana_video, sana_video_inputs

    apply_mhla(model, layers="all", block_grid=(1, 2, 3))
    inputs = sana_video_inputs(batch=1)
    got = run_sana_video(realign_(load_mhla_transformer(tmp_path / "api")), inputs)
    assert torch.equal(got, run_sana_video(realign_(model), inputs))


def test_convert_auto_selection(base, tmp_path, capsys):
    """--layers auto --keep-softmax 1: calibration inputs made from the folder's own Gemma-2 prompts at a small
    latent (--calibration-latent-size F,H,W), one stock linear layer kept, the selection recorded; an attention-cost
    budget is refused (exit 2, nothing written): MHLA is not cheaper than SANA-Video's linear attention."""
    common = ["--family", "sana_video", "--src", base, "--layers", "auto", "--calibration-samples", "2",
              "--calibration-latent-size", "2,8,8", "--block-grid", "1,2,2"]
    out = tmp_path / "auto"
    code, err = run_main("conversion/convert.py", *common, "--keep-softmax", "1", "--out", out, capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    selection = config["selection"]
    assert selection["method"] == "auto" and selection["keep_softmax"] == 1 and len(selection["softmax_layers"]) == 1
    assert len(config["layers"]) == 2 and max(selection["scores"]) < 1e-5  # the stock layer is MHLA at M = 1
    code, err = run_main("conversion/convert.py", *common, "--attention-budget", "0.9", "--out", tmp_path / "x", capsys=capsys)
    assert code == 2 and "selects nothing: use keep_softmax" in err and not (tmp_path / "x").exists()


def test_single_file_is_refused_naming_the_fix(base, tmp_path, capsys):
    """diffusers 0.42.1 has no single-file loader for SanaVideoTransformer3DModel (not in
    SINGLE_FILE_LOADABLE_CLASSES, though the class has from_single_file): a .safetensors file is refused with one
    line naming the diffusers folder to convert from, exit 2, nothing written; with --config, without, and from
    Python without family= (the class read from the config folder)."""
    single = tmp_path / "sana_video.safetensors"
    single.write_bytes((base / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes())
    for extra, fix in ((["--config", base], f"--src {base}, without --config"), ([], "--src <its diffusers folder or Hub id>")):
        code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", single, *extra,
                             "--out", tmp_path / "x", capsys=capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and "no single-file loader for SanaVideoTransformer3DModel" in last and fix in last, err
        assert "Traceback" not in err and not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="no single-file loader for SanaVideoTransformer3DModel"):
        convert_checkpoint(single, tmp_path / "x", config=base / "transformer")
    assert not (tmp_path / "x").exists()


def test_resolution_binning_on_builds_blocks_on_the_binned_latent():
    """Binning on (the pipeline's default): 32 x 64 px snaps to the 448 x 896 bin, the blocks are laid on that
    latent's 1 x 28 x 56 tokens, and the video comes back at 32 x 64; off: 1 x 2 x 4 tokens. (A transformer with a
    longer RoPE table than the tiny one: 56 columns.)"""
    from diffusers import SanaVideoPipeline

    pipe = tiny_sana_video_pipeline(num_layers=2)
    pipe = SanaVideoPipeline(**{**pipe.components, "transformer": tiny_sana_video(in_channels=16, rope_max_seq_len=64)})
    pipe.set_progress_bar_config(disable=True)
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    grids = []
    pipe.transformer.patch_embedding.register_forward_pre_hook(lambda module, args: grids.append(tuple(args[0].shape[2:])))
    for binning, latent in ((None, (1, 56, 112)), (False, (1, 4, 8))):
        grids.clear()
        video = _video(pipe, height=32, width=64, frames=1, steps=1, use_resolution_binning=binning)
        assert video.shape == (1, 32, 64, 3) and set(grids) == {latent}
        seen = pipe.transformer.transformer_blocks[0].attn1.mhla.seen_grids
        assert (latent[0], latent[1] // 2, latent[2] // 2) in seen[latent[0] * latent[1] * latent[2] // 4]


def test_generate_under_context_parallelism(base, tmp_path, capsys):
    """generate.py --context-parallel ring under torchrun with 2 gloo processes on a hybrid (the "layers" plan: each
    MHLA layer split alone, the stock linear layer on all tokens): rank 0 writes one mp4, the single process's
    frames (both through the same mp4 encoder)."""
    out = tmp_path / "mhla"
    code, err = run_main("conversion/convert.py", "--family", "sana_video", "--src", base, "--out", out,
                         "--layers", "hybrid", "--block-grid", "1,2,2", capsys=capsys)
    assert code == 0, err
    run = torchrun(2, "pipelines/generate.py", "--checkpoint", str(out), "--prompt", "a cat", *SIZE,
                   "--context-parallel", "ring", "--out", str(tmp_path / "cp.mp4"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("wrote 1 video(s)") == 1
    single = generate_videos(out, ["a cat"], height=64, width=64, frames=5, steps=2, device="cpu", use_resolution_binning=False)[0]
    save_video(single, tmp_path / "single.mp4")
    got, want = (_frames(tmp_path / name).astype(float) for name in ("cp.mp4", "single.mp4"))
    assert got.shape == want.shape == (5, 64, 64, 3) and want.std() > 1
    assert np.abs(got - want).mean() < 0.5  # measured 0.0
    assert mhla_diffusers.context_parallel_plan(load_mhla_pipeline(out).transformer)
