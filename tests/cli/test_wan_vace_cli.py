"""Wan VACE end to end on the command line: conversion/convert.py from a saved WanVACEPipeline folder (all layers,
the hybrid, --layers auto), a transformer-only folder and an original single file (the VACE keys mapped back,
read through diffusers' from_single_file with a local config); pipelines/generate.py from the converted folder
with a source video (a folder of png frames and an mp4), a mask and a reference image; the clear refusals.
Tiny models of the real classes (tests/helpers_wan_vace.py): 64 x 64 px, 5 frames, 2 steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import realign_, run_main
from helpers_wan_vace import original_wan_vace_state_dict, run_wan_vace, tiny_wan_vace, tiny_wan_vace_pipeline, wan_vace_inputs
from PIL import Image
from safetensors.torch import load_file, save_file

import mhla_diffusers
from mhla_diffusers import apply_mhla, load_mhla_pipeline, load_mhla_transformer, mhla_spec

CONVERT, GENERATE = "conversion/convert.py", "pipelines/generate.py"
SMALL = ("--block-grid", "1,2,2")  # the 2 x 4 x 4 token grid of a 64 x 64 px, 5-frame clip
SIZE = ("--frames", "5", "--height", "64", "--width", "64", "--steps", "2")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{"src": saved WanVACEPipeline, "frames": 5 png frames, "mask": 5 mask frames (white square: generate),
    "video": the frames as an mp4, "ref": a reference image, "six": 6 frames}`` (64 x 64 px)."""
    from mhla_diffusers.generation import save_video

    root = tmp_path_factory.mktemp("vace")
    pipe = tiny_wan_vace_pipeline(num_layers=3)
    pipe.save_pretrained(root / "src")
    g = np.random.default_rng(0)
    frames = [(g.random((64, 64, 3)) * 255).astype(np.uint8) for _ in range(5)]
    for name, count in (("frames", 5), ("mask", 5), ("six", 6)):
        (root / name).mkdir()
        for i in range(count):
            if name == "mask":
                image = np.zeros((64, 64, 3), np.uint8)
                image[16:48, 16:48] = 255
            else:
                image = frames[min(i, 4)]
            Image.fromarray(image).save(root / name / f"{i:03d}.png")
    save_video(np.stack(frames), root / "video.mp4")
    Image.fromarray((g.random((64, 64, 3)) * 255).astype(np.uint8)).save(root / "ref.png")
    return {name: root / name for name in ("src", "frames", "mask", "six", "ref.png", "video.mp4")}


@pytest.fixture(scope="module")
def converted(files, tmp_path_factory):
    """The source converted with the hybrid (softmax on main layer 0 and VACE layer 3)."""
    out = tmp_path_factory.mktemp("converted") / "hybrid"
    from helpers import load_script

    assert load_script(CONVERT).main(["--family", "wan_vace", "--src", str(files["src"]), "--out", str(out),
                                      "--layers", "hybrid", *SMALL]) == 0
    return out


def _attn(model):
    return {n: type(m.processor).__name__ for n, m in model.named_modules() if hasattr(m, "processor")}


def test_convert_pipeline_folder_all_and_hybrid(files, converted, tmp_path, capsys):
    """--layers all (default): MHLA on 3 main + 2 VACE layers; --layers hybrid: 1, 2, 4; every cross-attention
    stock; the written folder loads back as a WanVACEPipeline computing what apply_mhla computes in memory;
    converting it again is refused (exit 3)."""
    out = tmp_path / "all"
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", files["src"], "--out", out, *SMALL, capsys=capsys)
    assert code == 0, err
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "WanVACEPipeline" and mhla_spec(pipe.transformer)["layers"] == [0, 1, 2, 3, 4]
    assert {n for n, p in _attn(pipe.transformer).items() if p == "MHLAProcessor"} == {
        f"{k}.{i}.attn1" for k, n in (("blocks", 3), ("vace_blocks", 2)) for i in range(n)}

    hybrid = load_mhla_pipeline(converted)
    spec = json.loads((converted / "transformer" / "mhla_config.json").read_text())
    assert spec["family"] == "wan_vace" and spec["layers"] == [1, 2, 4] and spec["num_layers"] == 5
    assert mhla_spec(hybrid.transformer)["layers"] == [1, 2, 4]
    assert all(p == "WanAttnProcessor" for n, p in _attn(hybrid.transformer).items() if n.endswith("attn2"))
    expected = tiny_wan_vace(num_layers=3)
    apply_mhla(expected, layers="hybrid", block_grid=(1, 2, 2))
    inputs = wan_vace_inputs(batch=1, frames=2, size=(8, 8))
    realign_(hybrid.transformer), realign_(expected)
    assert torch.equal(run_wan_vace(hybrid.transformer, inputs), run_wan_vace(expected, inputs))

    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", converted, "--out", tmp_path / "again", capsys=capsys)
    assert code == 3 and "already an MHLA checkpoint" in err and not (tmp_path / "again").exists()
    code, err = run_main(CONVERT, "--family", "wan", "--src", files["src"], "--out", tmp_path / "x", capsys=capsys)
    assert code == 2 and "holds a WanVACETransformer3DModel (wan_vace)" in err


def test_convert_layers_auto_scores_both_kinds(files, tmp_path, capsys):
    """--layers auto: calibration made from the pipeline (its text encoder; a whole-video control latent) scores all
    5 layers; --keep-softmax 2 keeps the two highest stock, whatever their kind; recorded in mhla_config.json."""
    import warnings

    out = tmp_path / "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short fits may be reported as not converged
        code, err = run_main(CONVERT, "--family", "wan_vace", "--src", files["src"], "--out", out, *SMALL, "--layers", "auto",
                             "--keep-softmax", "2", "--calibration-samples", "2", "--calibration-latent-size", "2,8,8",
                             capsys=capsys)
    assert code == 0, err
    selection = json.loads((out / "transformer" / "mhla_config.json").read_text())["selection"]
    scores = selection["scores"]
    assert len(scores) == 5 and all(s > 0 for s in scores)
    ranking = sorted(range(5), key=lambda i: (-scores[i], i))
    assert selection["softmax_layers"] == sorted(ranking[:2])
    assert mhla_spec(load_mhla_pipeline(out).transformer)["layers"] == sorted(ranking[2:])


def test_convert_transformer_folder(files, tmp_path, capsys):
    """A transformer-only folder converts to a transformer folder (no pipeline), loaded by load_mhla_transformer."""
    src = files["src"] / "transformer"
    out = tmp_path / "transformer"
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", src, "--out", out, "--layers", "3,4", *SMALL, capsys=capsys)
    assert code == 0, err
    assert not (out / "model_index.json").exists() and (out / "mhla_config.json").is_file()
    model = load_mhla_transformer(out)
    assert type(model).__name__ == "WanVACETransformer3DModel" and mhla_spec(model)["layers"] == [3, 4]
    assert {n for n, p in _attn(model).items() if p == "MHLAProcessor"} == {"vace_blocks.0.attn1", "vace_blocks.1.attn1"}


def test_convert_original_single_file(files, tmp_path, capsys):
    """An original Wan VACE file (vace_blocks.*.before_proj / after_proj, vace_patch_embedding, self_attn.q, ...;
    with and without the model.diffusion_model. prefix) converts through diffusers' from_single_file with a local
    config: a pipeline folder gives a whole pipeline, a transformer folder the transformer; the base weights are
    exactly the original ones."""
    from diffusers import WanVACETransformer3DModel

    base = WanVACETransformer3DModel.from_pretrained(files["src"] / "transformer")
    original = original_wan_vace_state_dict(base)
    for key in ("vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.bias", "vace_blocks.1.self_attn.q.weight",
                "vace_blocks.0.norm3.weight", "vace_patch_embedding.weight", "blocks.2.cross_attn.o.weight", "head.head.weight"):
        assert key in original, key
    assert not any(".attn1." in k or ".proj_in." in k or k.startswith(("condition_embedder", "vace_blocks.0.proj_out")) for k in original)
    single = tmp_path / "vace.safetensors"
    save_file(original, single)
    out = tmp_path / "from_file"
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", single, "--config", files["src"], "--out", out,
                         "--layers", "hybrid", *SMALL, capsys=capsys)
    assert code == 0, err
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "WanVACEPipeline" and mhla_spec(pipe.transformer)["layers"] == [1, 2, 4]
    got = {k: v for k, v in pipe.transformer.state_dict().items() if "mhla" not in k}
    want = base.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    prefixed = tmp_path / "vace_prefixed.safetensors"
    save_file(original_wan_vace_state_dict(base, prefix="model.diffusion_model."), prefixed)
    out2 = tmp_path / "from_prefixed"
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", prefixed, "--config", files["src"] / "transformer",
                         "--out", out2, *SMALL, capsys=capsys)
    assert code == 0, err
    stored = load_file(out2 / "diffusion_pytorch_model.safetensors")
    assert sorted(stored) == sorted(want) and all(torch.equal(stored[k], v) for k, v in want.items())
    assert mhla_spec(load_mhla_transformer(out2))["layers"] == [0, 1, 2, 3, 4]


def test_single_file_errors(files, tmp_path, capsys):
    """What diffusers does with a tiny VACE file, and our errors. diffusers' model-type inference (used only without a
    config) tells VACE from Wan by key, and 1.3B from 14B by the patch embedding's width (1,536 / 5,120): the real
    widths are detected, a tiny one fails inside diffusers (UnboundLocalError); convert.py asks for --config before
    that. A VACE file read with a plain Wan config would silently lose its VACE branch (diffusers only logs the
    unused weights): refused, naming them; a plain Wan file with a VACE config: its missing weights are refused."""
    from diffusers import WanVACETransformer3DModel
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from helpers_wan import original_wan_state_dict, tiny_wan

    base = WanVACETransformer3DModel.from_pretrained(files["src"] / "transformer")
    original = original_wan_vace_state_dict(base)
    with pytest.raises(UnboundLocalError):
        infer_diffusers_model_type(original)
    for width, kind in ((1536, "wan-vace-1.3B"), (5120, "wan-vace-14B")):
        shapes = {"head.modulation": (1, 2, width), "patch_embedding.weight": (width, 16, 1, 2, 2),
                  "vace_blocks.0.after_proj.bias": (width,)}
        assert infer_diffusers_model_type({k: torch.empty(s, device="meta") for k, s in shapes.items()}) == kind
    single = tmp_path / "vace.safetensors"
    save_file(original, single)
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", single, "--out", tmp_path / "a", capsys=capsys)
    assert code == 2 and "pass config= (--config)" in err and not (tmp_path / "a").exists()

    tiny_wan(num_layers=3).save_pretrained(tmp_path / "plain_wan")
    code, err = run_main(CONVERT, "--family", "wan", "--src", single, "--config", tmp_path / "plain_wan", "--out", tmp_path / "b",
                         capsys=capsys)
    assert code == 2 and "has no place for (vace_blocks." in err and "62 tensors" in err, err
    assert not (tmp_path / "b").exists()

    save_file(original_wan_state_dict(tiny_wan(num_layers=3)), tmp_path / "wan.safetensors")
    code, err = run_main(CONVERT, "--family", "wan_vace", "--src", tmp_path / "wan.safetensors", "--config", files["src"],
                         "--out", tmp_path / "c", capsys=capsys)
    assert code == 2 and "does not match the config" in err and not (tmp_path / "c").exists()


# -- generation -----------------------------------------------------------------------------------------
def test_generate_from_a_video_mask_and_reference_image(files, converted, tmp_path, capsys):
    """generate.py from the converted folder: a frame folder + mask folder + reference image, and an mp4 source
    video; 5-frame mp4s of 64 x 64 come out, different inputs giving different videos. The reference image adds
    one latent frame in front: every MHLA layer sees a 3 x 4 x 4 token grid (2 x 4 x 4 without it)."""
    import imageio.v3 as iio

    clips = {}
    for label, extra in {
        "folder": ("--video", files["frames"], "--mask", files["mask"], "--reference-image", files["ref.png"]),
        "mp4": ("--video", files["video.mp4"], "--conditioning-scale", "0.5"),
    }.items():
        clips[label] = tmp_path / f"{label}.mp4"
        code, err = run_main(GENERATE, "--checkpoint", converted, "--prompt", "a cat", *extra, *SIZE, "--out", clips[label],
                             capsys=capsys)
        assert code == 0, err
        frames = iio.imread(clips[label])
        assert frames.shape == (5, 64, 64, 3) and frames.std() > 1, label
    assert np.abs(iio.imread(clips["folder"]).astype(float) - iio.imread(clips["mp4"]).astype(float)).mean() > 1

    from mhla_diffusers.generation import generate_videos

    pipe = load_mhla_pipeline(converted)
    grids = []
    pipe.transformer.patch_embedding.register_forward_pre_hook(lambda m, args: grids.append(tuple(args[0].shape[2:])))
    call = dict(frames=5, height=64, width=64, steps=1, pipe=pipe, video=files["frames"], mask=files["mask"])
    generate_videos(None, ["a cat"], reference_images=[files["ref.png"]], **call)
    generate_videos(None, ["a cat"], **call)
    assert grids == [(3, 8, 8)] * 2 + [(2, 8, 8)] * 2  # latent [F, H, W] per call (cond, uncond), patch (1, 2, 2)


def test_generate_refusals(files, converted, tmp_path, capsys):
    """Stopped before any denoising, exit 2 with one line: --video / --mask on a plain Wan or a SANA checkpoint, --mask
    without --video, a video or mask whose frame count is not --frames (a count that is not 4k + 1 named as such),
    --image on VACE (its first frame goes in as a reference image or the first frame of --video)."""
    from helpers_sana import tiny_sana_pipeline
    from helpers_wan import tiny_wan_pipeline

    tiny_wan_pipeline(num_layers=2).save_pretrained(tmp_path / "wan")
    tiny_sana_pipeline().save_pretrained(tmp_path / "sana")
    out = tmp_path / "x.mp4"
    cases = [
        (tmp_path / "wan", ("--video", files["frames"]), "holds a WanPipeline, which takes no video: --video is for Wan VACE"),
        (tmp_path / "wan", ("--video", files["frames"], "--mask", files["mask"]), "--video, --mask are for Wan VACE"),
        (tmp_path / "sana", ("--video", files["frames"]), "not a text-to-video pipeline"),
        (converted, ("--mask", files["mask"]), "--mask marks which pixels of --video to generate: give the video too"),
        (converted, ("--video", files["six"]), "--video has 6 frames and the request 5: WanVACEPipeline takes 4k + 1 frames"),
        (converted, ("--video", files["frames"], "--mask", files["six"]), "--mask has 6 frames and the request 5"),
        (converted, ("--image", files["ref.png"]), "Wan VACE takes no first frame (--image)"),
        (converted, ("--video", files["frames"], "--conditioning-scale", "nan"), "--conditioning-scale must be a finite number"),
    ]
    for checkpoint, extra, message in cases:
        code, err = run_main(GENERATE, "--checkpoint", checkpoint, "--prompt", "a cat", *extra, *SIZE, "--out", out, capsys=capsys)
        assert code == 2 and message in err, (extra, err)
    code, err = run_main(GENERATE, "--checkpoint", converted, "--prompt", "a cat", "--video", files["frames"], *SIZE[2:],
                         "--frames", "9", "--out", out, capsys=capsys)
    assert code == 2 and "--video has 5 frames and the request 9: give --frames 5" in err, err
    assert not out.exists()
    pipe = load_mhla_pipeline(converted)
    assert mhla_diffusers.is_mhla_model(pipe.transformer)
    from mhla_diffusers.generation import GenerationError, generate_videos

    with pytest.raises(GenerationError, match="--reference-image: an empty list"):  # diffusers: a bare StopIteration
        generate_videos(converted, "a cat", pipe=pipe, reference_images=[], frames=5, height=64, width=64, steps=1)
    from PIL import Image

    mixed = [Image.new("RGB", (64, 64))] * 4 + [Image.new("RGB", (80, 64))]  # diffusers would stretch the last one
    with pytest.raises(GenerationError, match="frame 4 is 80 x 64 px and frame 0 64 x 64; give frames of one size"):
        generate_videos(converted, "a cat", pipe=pipe, video=mixed, frames=5, height=64, width=64, steps=1)


def test_generate_under_torchrun_ulysses(files, converted, tmp_path):
    """generate.py --context-parallel ulysses under torchrun with 2 gloo processes: the family's own plan, the hybrid's
    softmax layers in diffusers' Ulysses attention, MHLA per head; rank 0 writes the mp4 once; its frames match the
    single-process run's (both through the same mp4 encoder)."""
    import imageio.v3 as iio
    from helpers_parallel import torchrun

    from mhla_diffusers.generation import generate_videos, save_video

    inputs = ("--video", str(files["frames"]), "--mask", str(files["mask"]), "--reference-image", str(files["ref.png"]))
    run = torchrun(2, GENERATE, "--checkpoint", str(converted), "--prompt", "a cat", *inputs, *SIZE, "--seed", "1",
                   "--context-parallel", "ulysses", "--out", str(tmp_path / "cp.mp4"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("wrote 1 video(s)") == 1
    (single,) = generate_videos(converted, ["a cat"], frames=5, height=64, width=64, steps=2, seed=1, video=files["frames"],
                                mask=files["mask"], reference_images=[files["ref.png"]])
    save_video(single, tmp_path / "single.mp4")
    got, want = (iio.imread(tmp_path / name).astype(float) for name in ("cp.mp4", "single.mp4"))
    assert got.shape == want.shape == (5, 64, 64, 3) and want.std() > 1
    assert abs(got - want).mean() < 0.5
