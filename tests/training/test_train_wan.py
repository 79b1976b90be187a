"""The trainer on a tiny Wan 2.1 pipeline: flow matching on a video folder (gif, mp4, frame folder),
distillation, LoRA (add_adapter), images as one-frame videos, and the video dataset itself."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.checkpoint.lora import load_mhla_pipeline_with_lora
from mhla_diffusers.data.video import VideoClips, read_video_frames
from mhla_diffusers.training import load_config


def _write_videos(root):
    import imageio.v2 as imageio

    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(2):  # animated gifs with sidecar captions
        frames = [Image.fromarray(rng.integers(0, 255, (48, 56, 3), dtype=np.uint8)) for _ in range(7)]
        frames[0].save(root / f"clip{i}.gif", save_all=True, append_images=frames[1:], duration=40)
        (root / f"clip{i}.txt").write_text(f"clip number {i}")
    writer = imageio.get_writer(root / "movie.mp4", fps=8, codec="libx264", macro_block_size=8)
    for _ in range(9):
        writer.append_data(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    writer.close()
    (root / "shots").mkdir()  # a folder of frames = one video
    for j in range(6):
        Image.fromarray(np.full((40, 40, 3), 20 * j, dtype=np.uint8)).save(root / "shots" / f"{j:03d}.png")
    (root / "metadata.jsonl").write_text(
        json.dumps({"file_name": "movie.mp4", "text": "a movie"}) + "\n" + json.dumps({"file_name": "shots", "text": "grey shots"}) + "\n"
    )
    return root


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    from helpers_wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan")
    tiny_wan_pipeline(num_layers=2).save_pretrained(root / "base")
    return root / "base", _write_videos(root / "videos")


def wan_config(out, base, videos, *overrides):
    return load_config(None, [
        f"output_dir={out}", f"model.pretrained={base}", "model.text.max_sequence_length=16",
        "mhla.layers=all", "mhla.block_grid=[1,2,2]", "mhla.normalize=false",  # the authors' Wan form: numerator + output norm
        "data.kind=video", f"data.root={videos}", "data.resolution=32", "data.num_frames=5", "data.crops_per_image=2",
        "data.batch_size=2", "train.max_steps=2", "train.log_every=1", "train.lr=1e-3", *overrides,
    ])


def test_video_clips(wan_setup):
    _, videos = wan_setup
    ds = VideoClips(videos, resolution=(32, 24), num_frames=5, frame_stride=1, clips_per_video=2, seed=0)
    assert len(ds) == 8 and [v.rsplit("/", 1)[-1] for v in ds.videos] == ["clip0.gif", "clip1.gif", "movie.mp4", "shots"]
    assert ds.captions == ["clip number 0", "clip number 1", "a movie", "grey shots"]
    item = ds[3]  # the frame folder, grey levels 0, 20, ..., 100
    assert item["pixel_values"].shape == (3, 5, 32, 24) and item["caption"] == "grey shots"
    levels = item["pixel_values"].mean(dim=(0, 2, 3))
    assert torch.all(levels[1:] > levels[:-1])  # frames in order
    again = VideoClips(videos, resolution=(32, 24), num_frames=5, clips_per_video=2, seed=0)
    assert torch.equal(again[2]["pixel_values"], ds[2]["pixel_values"])  # mp4, deterministic
    assert read_video_frames(videos / "movie.mp4").shape == (9, 3, 48, 64)
    assert read_video_frames(videos / "clip0.gif", start=1, count=3, stride=2).shape == (3, 3, 48, 56)
    too_long = VideoClips(videos, resolution=16, num_frames=9)
    with pytest.raises(ValueError, match="has 7 frames; a clip needs 9"):
        too_long[0]
    with pytest.raises(ValueError, match="num_frames must be a positive integer"):
        VideoClips(videos, num_frames=0)


def test_wan_flow_matching_with_distillation_on_videos(tmp_path, wan_setup):
    base, videos = wan_setup
    summary = training.train(wan_config(tmp_path / "run", base, videos, "distill.teacher=original", "distill.output_weight=1.0",
                                        "distill.attention_weight=1.0", "eval.samples=2", "eval.batch_size=2",
                                        "train.gradient_checkpointing=true"))
    assert summary["family"] == "wan" and summary["objective"] == "flow" and summary["mhla_layers"] == 2
    assert all(math.isfinite(summary[k]) for k in ("final_loss", "eval_loss", "eval_distill"))
    parts = training.build_models(wan_config(tmp_path / "x", base, videos))
    assert parts.noise_scheduler.config.shift == 3.0 and parts.text["max_sequence_length"] == 16
    pipe = mhla_diffusers.load_mhla_pipeline(tmp_path / "run" / "final")
    assert type(pipe).__name__ == "WanPipeline" and mhla_diffusers.is_mhla_model(pipe.transformer)
    state = pipe.transformer.state_dict()
    assert any("mhla.output_norm" in k for k in state)
    pipe.set_progress_bar_config(disable=True)
    video = pipe("clip number 1", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), max_sequence_length=16).frames
    assert video.shape == (1, 5, 32, 32, 3) and np.isfinite(video).all()


def test_wan_lora_on_photos_as_one_frame_videos(tmp_path, wan_setup):
    base, videos = wan_setup
    config = wan_config(tmp_path / "lora", base, videos, "data.kind=photos", "data.photos=[cat,coffee]", "data.resolution=32",
                        "data.caption_template=a photo of a {}", "train.trainable=lora", "lora.rank=2", "lora.export=separate",
                        "data.cache=true")
    summary = training.train(config)
    assert summary["trainable"] == "lora" and summary["steps"] == 2
    parts = training.build_models(config)
    latents = parts.recipe.latents(parts, {"pixel_values": torch.zeros(1, 3, 32, 32)})
    assert latents.shape == (1, 16, 1, 4, 4)  # one latent frame
    pipe = load_mhla_pipeline_with_lora(tmp_path / "lora" / "final")
    trainable = [n for n, p in pipe.transformer.named_parameters() if "lora_" in n]
    assert trainable and mhla_diffusers.is_mhla_model(pipe.transformer)


def test_wan_frozen_weights_in_bf16_keep_the_fp32_modules():
    from helpers_wan import tiny_wan

    model = tiny_wan(num_layers=1)
    training.set_trainable(model, "lora", lora={"rank": 2})
    counts = training.prepare_parameter_dtypes(model, torch.bfloat16)
    assert counts["kept_fp32"] > 0 and counts["frozen"] > 0 and counts["trainable"] > 0
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32  # _keep_in_fp32_modules
    assert dtypes["blocks.0.ffn.net.0.proj.weight"] == torch.bfloat16
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
