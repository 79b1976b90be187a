"""Wan 2.2 and image-to-video through the real diffusers pipelines (tiny models, CPU, 2 steps, 5 frames).

* A14B text-to-video (``WanPipeline`` with ``transformer`` + ``transformer_2``, switched at ``boundary_ratio``):
  convert.py converts both experts (``--layers-2`` gives the second its own selection), the converted format
  saves and loads both with their own mixing matrices, generation runs both, every self-attention call of
  each expert sees the true token grid; with MHLA removed the pipeline is the stock one again.
* A14B image-to-video (``WanImageToVideoPipeline``, two experts of 36 input channels) with the one-liner.
* Wan 2.1 image-to-video (CLIP image encoder; the cross-attention's image branch ``add_k_proj`` /
  ``add_v_proj`` stays stock): convert, save, load, ``generate.py --image``.
* TI2V-5B (z_dim 48 VAE, 16 x spatial, ``expand_timesteps``: per-token timesteps ``[B, N]``): the one-liner
  equals ``apply_mhla``; its native grid 31 x 22 x 40 and size 704 x 1280 x 121; its image-to-video form.
* ``--image`` errors: a checkpoint that cannot take an image, a missing or unreadable file, an I2V
  checkpoint without one: exit code 2 and one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import randomize_mixing_, run_main
from helpers_wan import tiny_wan22_pipeline, tiny_wan_i2v_pipeline, tiny_wan_pipeline, wan_cross_attn, wan_self_attn
from PIL import Image

from mhla_diffusers import MHLAProcessor, apply_mhla, choose_block_grid, load_mhla_pipeline, remove_mhla, save_mhla_pipeline
from mhla_diffusers.checkpoint.conversion import convert_checkpoint
from mhla_diffusers.families import WAN
from mhla_diffusers.generation import GenerationError, generate_videos, image_to_video_pipeline, native_video_size
from mhla_diffusers.models.grid import current_grid

SIZE = dict(height=64, width=64, frames=5, steps=2, guidance_scale=1.0, seed=0)
GRID = (2, 4, 4)  # 5 frames -> 2 latent frames; 64 px / 8 (VAE) / 2 (patch) = 4


def first_frame(path=None) -> Image.Image:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    if path is not None:
        image.save(path)
    return image


class Watch:
    """Per transformer: the number of forward calls, the timestep shapes it received, and the token grid
    each of its MHLA self-attention layers saw (read where the processor reads it)."""

    def __init__(self, *models):
        self.calls, self.timesteps, self.grids, self.handles = [0] * len(models), [], set(), []
        for i, model in enumerate(models):
            def count(module, args, kwargs, i=i):
                self.calls[i] += 1
                self.timesteps.append(tuple(kwargs["timestep"].shape))

            self.handles.append(model.register_forward_pre_hook(count, with_kwargs=True))
            for attn in wan_self_attn(model):
                if isinstance(attn.processor, MHLAProcessor):
                    self.handles.append(attn.register_forward_pre_hook(lambda m, a: self.grids.add(current_grid())))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def one_line(err: str, program: str) -> str:
    """The error a script printed last: one line ``<program>: ...`` (progress bars may precede it)."""
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{program}: "), err
    return last


def video(pipe, **kwargs) -> np.ndarray:
    return generate_videos(None, ["a cat in the snow"], pipe=pipe, device="cpu", **{**SIZE, **kwargs})[0]


def test_a14b_two_experts_convert_save_load_generate(tmp_path, capsys):
    pipe = tiny_wan22_pipeline("t2v")
    src = tmp_path / "wan22"
    pipe.save_pretrained(src)
    stock = video(pipe)

    out = tmp_path / "wan22-mhla"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", src, "--out", out, "--block-grid", "1,2,2",
                         "--layers-2", "1", capsys=capsys)
    assert code == 0, err
    first, second = (json.loads((out / n / "mhla_config.json").read_text()) for n in ("transformer", "transformer_2"))
    assert first["layers"] == [0, 1] and second["layers"] == [1] and first["block_grid"] == second["block_grid"] == [1, 2, 2]
    loaded = load_mhla_pipeline(out)
    assert loaded.config.boundary_ratio == 0.875
    assert [type(a.processor).__name__ for a in wan_self_attn(loaded.transformer_2)] == ["WanAttnProcessor", "MHLAProcessor"]

    # a trained state of both experts: each folder restores its own matrices
    for t in (loaded.transformer, loaded.transformer_2):
        randomize_mixing_(t, seed=len(wan_self_attn(t)) + id(t) % 7)
    save_mhla_pipeline(loaded, tmp_path / "trained")
    again = load_mhla_pipeline(tmp_path / "trained")
    for name in ("transformer", "transformer_2"):
        for a, b in zip(wan_self_attn(getattr(loaded, name)), wan_self_attn(getattr(again, name))):
            mixing_a, mixing_b = (getattr(getattr(m, "mhla", None), "mixing", None) for m in (a, b))
            assert (mixing_a is None) == (mixing_b is None)
            if mixing_a is not None:
                torch.testing.assert_close(mixing_a.weight, mixing_b.weight, rtol=0, atol=0)
    with Watch(again.transformer, again.transformer_2) as watch:
        got = video(again)
    assert watch.calls[0] > 0 and watch.calls[1] > 0, watch.calls  # 2 steps: one per expert (t = 1000, 750 < 875)
    assert watch.grids == {GRID}
    np.testing.assert_allclose(got, video(loaded), rtol=0, atol=1e-5)
    assert np.abs(got - stock).max() > 1e-3  # MHLA changes the video

    # the low-noise expert's own guidance (diffusers' guidance_scale_2): the default is guidance_scale
    same = video(again, guidance_scale=2.0, guidance_scale_2=2.0)
    np.testing.assert_allclose(video(again, guidance_scale=2.0), same, rtol=0, atol=1e-6)
    assert np.abs(video(again, guidance_scale=2.0, guidance_scale_2=50.0) - same).max() > 1e-4

    for t in (again.transformer, again.transformer_2):
        remove_mhla(t)
    with pytest.warns(UserWarning, match="stock attention"):  # removed from a model loaded as converted: said
        np.testing.assert_allclose(video(again), stock, rtol=0, atol=1e-5)  # the stock pipeline again

    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", out, "--out", tmp_path / "x", capsys=capsys)
    assert code == 3 and "already an MHLA checkpoint" in err


def test_layers_2_without_a_second_expert_is_refused(tmp_path, capsys):
    src = tmp_path / "wan21"
    tiny_wan_pipeline(num_layers=2).save_pretrained(src)
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", src, "--out", tmp_path / "o", "--layers-2", "1",
                         capsys=capsys)
    assert code == 2 and "has none" in one_line(err, "convert.py")
    assert not (tmp_path / "o").exists()


def test_a14b_image_to_video_one_liner_both_experts():
    pipe = tiny_wan22_pipeline("i2v")
    image = first_frame()
    stock = video(pipe, image=image)
    for t in (pipe.transformer, pipe.transformer_2):
        t.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 2)))
    with Watch(pipe.transformer, pipe.transformer_2) as watch:
        got = video(pipe, image=image)
    assert min(watch.calls) > 0 and watch.grids == {GRID}
    assert got.shape == (5, 64, 64, 3) and np.abs(got - stock).max() > 1e-3
    with pytest.raises(GenerationError, match="give the first frame"):
        video(pipe)


def test_wan21_image_to_video_cross_attention_stock_convert_generate(tmp_path, capsys):
    """Wan 2.1 I2V: MHLA on attn1 only; attn2 (text + CLIP image tokens through add_k_proj / add_v_proj)
    keeps the stock processor and no MHLA state; converted, saved, generated from a png by generate.py."""
    import imageio.v3 as iio

    pipe = tiny_wan_i2v_pipeline()
    src, out = tmp_path / "i2v", tmp_path / "i2v-mhla"
    pipe.save_pretrained(src)
    image_file = tmp_path / "first_frame.png"
    stock = video(pipe, image=first_frame(image_file))
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", src, "--out", out, "--block-grid", "1,2,2",
                         capsys=capsys)
    assert code == 0, err
    loaded = load_mhla_pipeline(out)
    assert type(loaded).__name__ == "WanImageToVideoPipeline" and loaded.image_encoder is not None
    for attn in wan_cross_attn(loaded.transformer):
        assert type(attn.processor).__name__ == "WanAttnProcessor" and attn.add_k_proj is not None
        assert not [n for n in attn._modules if n == "mhla"]
    assert all(isinstance(a.processor, MHLAProcessor) for a in wan_self_attn(loaded.transformer))
    got = video(loaded, image=image_file)
    assert np.abs(got - stock).max() > 1e-3
    remove_mhla(loaded.transformer)
    with pytest.warns(UserWarning, match="stock attention"):
        np.testing.assert_allclose(video(loaded, image=image_file), stock, rtol=0, atol=1e-5)

    without_encoder = type(pipe)(**{**pipe.components, "image_encoder": None, "image_processor": None})
    with pytest.raises(GenerationError, match="reads CLIP image features .* no image_encoder"):
        video(without_encoder, image=image_file)

    mp4 = tmp_path / "clip.mp4"
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", "--image", image_file,
                         "--height", 64, "--width", 64, "--frames", 5, "--steps", 2, "--device", "cpu", "--out", mp4,
                         capsys=capsys)
    assert code == 0, err
    assert iio.imread(mp4).shape == (5, 64, 64, 3)
    # an image-to-video checkpoint without --image; a missing, an unreadable first frame: one line, exit 2
    bad = tmp_path / "not_an_image.png"
    bad.write_text("hello")
    for extra, message in (([], "give the first frame"), (["--image", tmp_path / "none.png"], "no such file"),
                           (["--image", bad], "not an image")):
        code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", *extra, "--steps", 1,
                             "--device", "cpu", "--out", tmp_path / "e.mp4", capsys=capsys)
        assert code == 2 and message in one_line(err, "generate.py")


def test_text_to_video_checkpoint_refuses_an_image_and_a_second_guidance(tmp_path, capsys):
    src = tmp_path / "t2v"
    tiny_wan_pipeline(num_layers=1).save_pretrained(src)
    first_frame(tmp_path / "f.png")
    code, err = run_main("pipelines/generate.py", "--checkpoint", src, "--prompt", "a cat", "--image", tmp_path / "f.png",
                         "--steps", 1, "--device", "cpu", "--out", tmp_path / "c.mp4", capsys=capsys)
    assert code == 2 and "cannot take an image" in one_line(err, "generate.py")
    code, err = run_main("pipelines/generate.py", "--checkpoint", src, "--prompt", "a cat", "--guidance-scale-2", 3,
                         "--steps", 1, "--device", "cpu", "--out", tmp_path / "c.mp4", capsys=capsys)
    assert code == 2 and "one denoising model" in one_line(err, "generate.py")
    assert not (tmp_path / "c.mp4").exists()


def test_ti2v_expand_timesteps_one_liner_native_size_convert_and_image(tmp_path):
    pipe = tiny_wan22_pipeline("ti2v")
    config = pipe.transformer.config
    assert WAN.reference_grid(config) == (31, 22, 40)
    assert native_video_size(pipe) == {"height": 704, "width": 1280, "frames": 121}
    size = dict(height=128, width=128)  # VAE 16 x, patch 2: 4 x 4 tokens a frame, 2 latent frames
    stock = video(pipe, **size)
    pipe.transformer.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 2)))  # the one-liner
    with Watch(pipe.transformer) as watch:
        one_liner = video(pipe, **size)
    assert watch.grids == {GRID} and set(watch.timesteps) == {(1, 32)}  # per-token timesteps [B, N]
    remove_mhla(pipe.transformer)
    np.testing.assert_allclose(video(pipe, **size), stock, rtol=0, atol=1e-5)
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    np.testing.assert_allclose(video(pipe, **size), one_liner, rtol=0, atol=1e-5)
    assert np.abs(one_liner - stock).max() > 1e-3

    # conversion with the defaults: M = 105 blocks chosen on TI2V's native 31 x 22 x 40 grid
    remove_mhla(pipe.transformer)
    pipe.save_pretrained(tmp_path / "ti2v")
    spec = convert_checkpoint(tmp_path / "ti2v", tmp_path / "ti2v-mhla", family="wan")
    assert tuple(spec["block_grid"]) == choose_block_grid((31, 22, 40), 105)
    loaded = load_mhla_pipeline(tmp_path / "ti2v-mhla")
    assert loaded.config.expand_timesteps and all(isinstance(a.processor, MHLAProcessor) for a in wan_self_attn(loaded.transformer))
    assert np.abs(video(loaded, **size) - stock).max() > 1e-3

    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    i2v = image_to_video_pipeline(pipe)
    assert type(i2v).__name__ == "WanImageToVideoPipeline" and i2v.config.expand_timesteps and i2v.transformer is pipe.transformer
    with Watch(pipe.transformer) as watch:
        got = video(pipe, image=first_frame(), **size)
    assert got.shape == (5, 128, 128, 3) and watch.grids == {GRID} and set(watch.timesteps) == {(1, 32)}


def test_automatic_selection_per_expert(tmp_path):
    """--layers auto with --layers-2 auto: each expert's layers measured on the same calibration inputs, each
    expert's selection recorded in its own mhla_config.json (the experts have different weights)."""
    from mhla_diffusers import calibration_inputs

    pipe = tiny_wan22_pipeline("t2v")
    pipe.save_pretrained(tmp_path / "src")
    calibration = calibration_inputs(pipe, num_samples=2, latent_size=(2, 8, 8))
    spec = convert_checkpoint(tmp_path / "src", tmp_path / "out", layers="auto", layers_2="auto", keep_softmax=1,
                              calibration=calibration, block_grid=(1, 2, 2))
    for name, entry in (("transformer", spec), ("transformer_2", spec["transformer_2"])):
        recorded = json.loads((tmp_path / "out" / name / "mhla_config.json").read_text())
        assert recorded["selection"]["method"] == "auto" and len(recorded["layers"]) == 1
        assert recorded["layers"] == entry["layers"] and recorded["selection"]["scores"] == entry["selection"]["scores"]
    assert spec["selection"]["scores"] != spec["transformer_2"]["selection"]["scores"]
    with pytest.raises(ValueError, match="needs layers='auto' too"):
        convert_checkpoint(tmp_path / "src", tmp_path / "x", layers="all", layers_2="auto")
    with pytest.raises(ValueError, match="one transformer's scores"):
        convert_checkpoint(tmp_path / "src", tmp_path / "x", layers="auto", layers_2="auto", keep_softmax=1,
                           sensitivity=[0.1, 0.2])
    assert not (tmp_path / "x").exists()
    # layers_2="none": the low-noise expert stays stock (and loads as such)
    spec = convert_checkpoint(tmp_path / "src", tmp_path / "first-only", layers=[1], layers_2="none", block_grid=(1, 2, 2))
    assert spec["layers"] == [1] and spec["transformer_2"] is None
    assert not (tmp_path / "first-only" / "transformer_2" / "mhla_config.json").exists()
    loaded = load_mhla_pipeline(tmp_path / "first-only")
    assert [type(a.processor).__name__ for a in wan_self_attn(loaded.transformer_2)] == ["WanAttnProcessor"] * 2
