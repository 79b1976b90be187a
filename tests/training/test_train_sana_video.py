"""The trainer on a tiny SANA-Video pipeline (tests/helpers_sana_video.py): finetune/train.py with the shipped
configs (finetune/configs/sana_video_all.yaml, sana_video_all_lora.yaml) made tiny with --set, after
conversion/convert.py as the docs do it: flow matching on a video folder, full fine-tune and LoRA (cached
latents and Gemma-2 embeddings), images as one-frame videos; the saved pipeline loads with MHLA and generates."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import run_main
from PIL import Image
from safetensors.torch import load_file

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.families import FAMILIES
from mhla_diffusers.training import load_config, read_loss_csv

ROOT = Path(__file__).resolve().parents[2]
TINY = [  # the shipped configs at tiny sizes: 32 x 32 px, 5 frames (2 x 2 x 2 tokens), 2 steps on CPU
    "data.resolution=32", "data.num_frames=5", "data.crops_per_image=2", "data.batch_size=2", "data.num_workers=0",
    "train.max_steps=2", "train.warmup_steps=0", "train.mixed_precision=no", "train.log_every=1",
    "train.checkpointing_steps=0", "model.text.max_sequence_length=8", "model.text.complex_human_instruction=null",
    "eval.samples=2", "eval.batch_size=2",
]


def _write_videos(root: Path) -> Path:
    """Two 7-frame gifs with sidecar captions and a folder of 6 frames captioned in metadata.jsonl."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(2):
        frames = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(7)]
        frames[0].save(root / f"clip{i}.gif", save_all=True, append_images=frames[1:], duration=40)
        (root / f"clip{i}.txt").write_text(f"clip number {i} motion score: 10.")
    (root / "shots").mkdir()
    for j in range(6):
        Image.fromarray(np.full((36, 36, 3), 30 * j, dtype=np.uint8)).save(root / "shots" / f"{j:03d}.png")
    (root / "metadata.jsonl").write_text(json.dumps({"file_name": "shots", "text": "grey shots"}) + "\n")
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(converted pipeline folder, videos)``: a tiny SanaVideoPipeline converted with --layers all (blocks 1 x 2 x 2)."""
    from helpers_sana_video import tiny_sana_video_pipeline

    root = tmp_path_factory.mktemp("sana_video_train")
    tiny_sana_video_pipeline(num_layers=2).save_pretrained(root / "base")
    code = _convert(root / "base", root / "mhla")
    assert code == 0
    return root / "mhla", _write_videos(root / "videos")


def _convert(src, out) -> int:
    from helpers import load_script

    return load_script("conversion/convert.py").main(
        ["--family", "sana_video", "--src", str(src), "--out", str(out), "--layers", "all", "--block-grid", "1,2,2"])


def _args(config: str, out, pretrained, videos, *extra) -> list:
    sets = [f"data.root={videos}", *TINY, *extra]
    return ["--config", ROOT / "finetune" / "configs" / config, "--pretrained", pretrained, "--output_dir", out,
            *[a for s in sets for a in ("--set", s)]]


def _generate(folder):
    pipe = mhla_diffusers.load_mhla_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    video = pipe("clip number 1", height=32, width=32, frames=5, num_inference_steps=2, output_type="np",
                 use_resolution_binning=False, generator=torch.Generator().manual_seed(0), max_sequence_length=8,
                 complex_human_instruction=None).frames
    return pipe, video


def test_full_fine_tune_with_the_shipped_config(tmp_path, setup, capsys):
    """train.py --config sana_video_all.yaml on a converted folder: flow matching on the video folder (gradient
    checkpointing on, as shipped), finite losses, the mixing matrices trained; final/ is a SanaVideoPipeline with
    MHLA on both layers that generates a 5-frame video."""
    converted, videos = setup
    out = tmp_path / "run"
    code, err = run_main("finetune/train.py", *_args("sana_video_all.yaml", out, converted, videos), capsys=capsys)
    assert code == 0, err
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["family"] == "sana_video" and summary["objective"] == "flow" and summary["mhla_layers"] == 2
    assert summary["trainable"] == "full" and summary["steps"] == 2
    assert all(math.isfinite(summary[k]) for k in ("final_loss", "eval_loss", "eval_loss_start"))
    assert len(read_loss_csv(out / "loss.csv")) == 2 and all(math.isfinite(loss) for _, loss, _ in read_loss_csv(out / "loss.csv"))
    before = load_file(converted / "transformer" / "mhla.safetensors")
    after = load_file(out / "final" / "transformer" / "mhla.safetensors")
    assert sorted(before) == sorted(after) and any(not torch.equal(before[k], after[k]) for k in before)
    pipe, video = _generate(out / "final")
    assert type(pipe).__name__ == "SanaVideoPipeline" and mhla_diffusers.mhla_spec(pipe.transformer)["layers"] == [0, 1]
    assert video.shape == (1, 5, 32, 32, 3) and np.isfinite(video).all()


def test_lora_with_the_shipped_config(tmp_path, setup, capsys):
    """train.py --config sana_video_all_lora.yaml: LoRA on the attention projections + the mixing matrices, latents
    and Gemma-2 embeddings cached, merged into the exported weights: the final pipeline has MHLA and no adapter."""
    converted, videos = setup
    out = tmp_path / "lora"
    code, err = run_main("finetune/train.py", *_args("sana_video_all_lora.yaml", out, converted, videos, "lora.rank=2",
                                                     f"data.cache_dir={tmp_path / 'cache'}"), capsys=capsys)
    assert code == 0, err
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["trainable"] == "lora" and summary["num_trainable_parameters"] < summary["num_parameters"] / 2
    assert math.isfinite(summary["final_loss"]) and any((tmp_path / "cache").iterdir())
    pipe, video = _generate(out / "final")
    assert mhla_diffusers.is_mhla_model(pipe.transformer) and not any("lora_" in n for n, _ in pipe.transformer.named_parameters())
    assert video.shape == (1, 5, 32, 32, 3) and np.isfinite(video).all()


def test_images_train_as_one_frame_videos_and_another_vae_is_refused(tmp_path, setup):
    """data.kind=photos: one latent frame per image (16 x 1 x 4 x 4 for 32 px), one step trains; a SanaVideoPipeline
    whose VAE is not the Wan one (a DC-AE) is refused at load, naming the Wan VAE."""
    from helpers_sana import tiny_dc_ae

    converted, videos = setup
    config = load_config(ROOT / "finetune" / "configs" / "sana_video_all.yaml", [
        f"output_dir={tmp_path / 'photos'}", f"model.pretrained={converted}", *TINY, "data.kind=photos",
        "data.photos=[cat,coffee]", "train.max_steps=1", "eval.samples=0", "train.gradient_checkpointing=false"])
    parts = training.build_models(config)
    assert parts.recipe.latents(parts, {"pixel_values": torch.zeros(1, 3, 32, 32)}).shape == (1, 16, 1, 4, 4)
    summary = training.train(config)
    assert summary["steps"] == 1 and math.isfinite(summary["final_loss"])

    # SanaVideoPipeline also takes a video DC-AE or LTX-2 VAE; the recipe's latent normalisation is the Wan VAE's
    spec = FAMILIES["sana_video"].training
    parts = SimpleNamespace(vae=tiny_dc_ae(latent_channels=16), text={"complex_human_instruction": None}, pipeline=None)
    with pytest.raises(ValueError, match="AutoencoderDC; the SANA-Video recipe trains with the Wan VAE"):
        spec.finish_load(parts, {"model": {"pretrained": "sana-video-dc-ae"}})


def test_a_clip_length_the_vae_cannot_encode_is_refused(tmp_path, setup):
    """data.num_frames=6 on a video folder: the Wan VAE encodes 4k + 1 frames, so a 6-frame clip would lose its
    last frame; refused at load, naming the nearest valid counts (5 or 9), before any step."""
    converted, videos = setup
    config = load_config(ROOT / "finetune" / "configs" / "sana_video_all.yaml", [
        f"output_dir={tmp_path / 'six'}", f"model.pretrained={converted}", f"data.root={videos}", *TINY, "data.kind=video",
        "data.num_frames=6"])
    with pytest.raises(ValueError, match=r"data.num_frames=6: .* Nearest valid counts: 5 or 9"):
        training.build_models(config)
    assert not (tmp_path / "six").exists()
