"""The trainer on a tiny SANA pipeline: flow matching, captions, caption dropout, distillation,
LoRA (through diffusers' add_adapter) with both export modes, the latent / text-embedding cache."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.checkpoint.lora import LORA_DIR_NAME, load_mhla_pipeline_with_lora
from mhla_diffusers.training import load_config, read_loss_terms


@pytest.fixture(scope="module")
def sana_base(tmp_path_factory):
    from helpers_sana import tiny_sana_pipeline

    folder = tmp_path_factory.mktemp("sana") / "base"
    tiny_sana_pipeline(num_layers=2, sample_size=8, vae_levels=2).save_pretrained(folder)
    return folder


def sana_config(out, base, *overrides):
    config = {
        "output_dir": str(out),
        "model": {"pretrained": str(base), "text": {"max_sequence_length": 8, "complex_human_instruction": None}},
        "mhla": {"layers": "all", "num_blocks": 4},
        "data": {"resolution": 16, "crops_per_image": 2, "batch_size": 4, "photos": ["cat", "coffee", "flower"],
                 "caption_template": "a photo of a {}"},
        "train": {"max_steps": 3, "lr": 1e-3, "log_every": 1},
    }
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path, list(overrides))


def _sample(folder, lora=False):
    # lora=True: the explicit loader; False: the base alone (load_mhla_pipeline would apply an adapter found beside it)
    pipe = load_mhla_pipeline_with_lora(folder) if lora else mhla_diffusers.load_mhla_pipeline(folder, lora=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe, pipe("a photo of a cat", height=32, width=32, num_inference_steps=2, use_resolution_binning=False,
                      generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=8,
                      complex_human_instruction=None).images


def test_sana_flow_matching_with_distillation_exports_a_sana_pipeline(tmp_path, sana_base):
    config = sana_config(tmp_path / "run", sana_base, "distill.teacher=original", "distill.output_weight=0.5",
                         "distill.attention_weight=2.0", "eval.samples=4", "eval.batch_size=4", "objective.loss_weighting=cosmap")
    summary = training.train(config)
    assert summary["family"] == "sana" and summary["objective"] == "flow" and summary["mhla_layers"] == 2
    assert all(math.isfinite(summary[k]) for k in ("eval_loss_start", "eval_loss", "eval_distill_start", "eval_distill"))
    terms = read_loss_terms(tmp_path / "run" / "loss.csv")
    assert sorted(terms) == ["attention", "data", "output"] and len(terms["data"][0]) == 3
    pipe, images = _sample(tmp_path / "run" / "final")
    assert type(pipe).__name__ == "SanaPipeline" and mhla_diffusers.is_mhla_model(pipe.transformer)
    assert images.shape == (1, 32, 32, 3) and (tmp_path / "run" / "final" / "transformer" / "mhla.safetensors").is_file()
    # the flow shift comes from the pipeline's scheduler (flow_shift 3) unless the config sets one
    parts = training.build_models(sana_config(tmp_path / "x", sana_base))
    assert parts.objective.kind == "flow" and parts.noise_scheduler.config.shift == 3.0
    parts = training.build_models(sana_config(tmp_path / "x", sana_base, "objective.shift=1.5"))
    assert parts.noise_scheduler.config.shift == 1.5


def test_sana_captions_and_caption_dropout(tmp_path, sana_base):
    parts = training.build_models(sana_config(tmp_path / "c", sana_base, "model.text.complex_human_instruction=default"))
    assert parts.text["complex_human_instruction"] and parts.text["template"] == "a photo of a {}"
    parts.id2label = {0: "cat", 1: "dog"}
    recipe = parts.recipe
    recipe.prepare(parts, None, None)
    batch = {"pixel_values": torch.zeros(3, 3, 16, 16), "class_labels": torch.tensor([0, 1, 0])}
    assert recipe.captions(batch, parts.id2label, "a photo of a {}") == ["a photo of a cat", "a photo of a dog", "a photo of a cat"]
    kept = recipe.condition(parts, batch, torch.tensor([False, False, False]))
    dropped = recipe.condition(parts, batch, torch.tensor([False, True, False]))
    null = recipe.condition(parts, batch, torch.tensor([False, False, False]), mode="null")
    empty = recipe.encode_text(parts, [""], "cpu")["prompt_embeds"].float()
    assert torch.equal(kept["encoder_hidden_states"][0], dropped["encoder_hidden_states"][0])
    assert torch.allclose(dropped["encoder_hidden_states"][1], empty[0]) and not torch.allclose(kept["encoder_hidden_states"][1], empty[0])
    assert all(torch.allclose(null["encoder_hidden_states"][i], empty[0]) for i in range(3))
    with pytest.raises(ValueError, match="random needs class labels"):
        recipe.condition(parts, batch, torch.zeros(3, dtype=torch.bool), mode="random")


def _caption_folder(root):
    root.mkdir()
    rows = []
    for name, color in [("red", (230, 20, 20)), ("green", (20, 200, 20)), ("blue", (20, 20, 230))]:
        Image.new("RGB", (20, 18), color).save(root / f"{name}.png")
        rows.append({"file_name": f"{name}.png", "text": f"a {name} square"})
    (root / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def test_sana_lora_on_a_caption_folder_with_cache_merge_and_separate_exports_agree(tmp_path, sana_base):
    root = _caption_folder(tmp_path / "captions")
    common = ["data.kind=captions", f"data.root={root}", "data.photos=null", "data.crops_per_image=4", "train.trainable=lora",
              "lora.rank=4", "train.max_steps=2", "data.cache=true", f"data.cache_dir={tmp_path / 'cache'}"]
    merged = training.train(sana_config(tmp_path / "merged", sana_base, *common))
    assert merged["trainable"] == "lora" and merged["num_trainable_parameters"] < merged["num_parameters"] / 2
    caches = list((tmp_path / "cache").iterdir())
    assert len(caches) == 1 and len(list((caches[0] / "items").iterdir())) == 12
    separate = training.train(sana_config(tmp_path / "separate", sana_base, *common, "lora.export=separate"))
    assert list((tmp_path / "cache").iterdir()) == caches  # the same dataset + encoders: the cache is reused
    assert (tmp_path / "separate" / "final" / LORA_DIR_NAME / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "merged" / "final" / LORA_DIR_NAME).exists()
    _, a = _sample(tmp_path / "merged" / "final")
    _, b = _sample(tmp_path / "separate" / "final", lora=True)
    _, base_only = _sample(tmp_path / "separate" / "final")  # the base of a separate export, without its adapter
    assert separate["final_loss"] == pytest.approx(merged["final_loss"], rel=1e-6)
    assert abs(a - b).max() < 1e-4
    assert abs(a - base_only).max() > 1e-3
