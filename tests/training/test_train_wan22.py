"""Fine-tuning Wan 2.2 A14B one expert at a time (``model.expert``), and the ``mhla`` section's operator options
``feature_eps`` / ``mixing_clamp`` (the authors' Wan settings) validated and passed to ``apply_mhla``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_wan import tiny_wan22_pipeline, tiny_wan_pipeline

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.training import load_config


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22")
    tiny_wan22_pipeline("t2v").save_pretrained(root / "t2v")
    tiny_wan22_pipeline("i2v").save_pretrained(root / "i2v")
    tiny_wan_pipeline(num_layers=1).save_pretrained(root / "wan21")
    return root


def config(out, base, *overrides):
    return load_config(None, [
        f"output_dir={out}", f"model.pretrained={base}", "model.text.max_sequence_length=16",
        "mhla.layers=all", "mhla.block_grid=[1,2,2]", "data.kind=photos", "data.photos=[cat,coffee]",
        "data.resolution=32", "data.caption_template=a photo of a {}", "data.batch_size=2", "train.max_steps=2",
        "train.log_every=1", "train.lr=1e-3", *overrides,
    ])


def test_each_expert_trains_on_its_own_timesteps(tmp_path, wan22):
    base = wan22 / "t2v"
    with pytest.raises(ValueError, match="has two experts .* set model.expert"):
        training.build_models(config(tmp_path / "a", base))
    draws = torch.linspace(0.001, 0.999, 101)
    latents = torch.zeros(101, 16, 1, 4, 4)
    for expert, inside in (("transformer", lambda t: t >= 875), ("transformer_2", lambda t: t < 875)):
        parts = training.build_models(config(tmp_path / expert, base, f"model.expert={expert}"))
        assert parts.expert == expert and parts.transformer is getattr(parts.pipeline, expert)
        other = parts.pipeline.transformer_2 if expert == "transformer" else parts.pipeline.transformer
        assert not any(p.requires_grad for p in other.parameters()) and not mhla_diffusers.is_mhla_model(other)
        _, timesteps, _, _ = parts.objective.inputs(latents, torch.randn_like(latents), draws)
        assert inside(timesteps).all() and len(set(timesteps.tolist())) > 20  # spread over the expert's range
        _, evenly, _, _ = parts.objective.inputs(latents[:4], latents[:4], parts.objective.evenly_spaced(torch.arange(4), 4))
        assert inside(evenly).all()


def test_train_the_low_noise_expert_with_the_authors_operator_options(tmp_path, wan22):
    base = wan22 / "t2v"
    run = config(tmp_path / "run", base, "model.expert=transformer_2", "mhla.feature_eps=1e-6", "mhla.mixing_clamp=false",
                 "mhla.normalize=false")
    assert run["mhla"]["feature_eps"] == 1e-6 and run["mhla"]["mixing_clamp"] is False
    parts = training.build_models(config(tmp_path / "t", base, "model.expert=transformer_2", "mhla.feature_eps=1e-6",
                                         "mhla.mixing_clamp=false", f"distill.teacher={base}", "distill.output_weight=1"))
    attn = parts.transformer.blocks[0].attn1
    assert attn.mhla.feature_eps == 1e-6 and attn.mhla.mixing.clamp is False
    teacher = parts.teacher.state_dict()  # a pipeline folder teaches the expert trained: its transformer_2
    assert all(torch.equal(v, teacher[k]) for k, v in parts.pipeline.transformer_2.state_dict().items() if ".mhla." not in k)
    assert not all(torch.equal(v, teacher[k]) for k, v in parts.pipeline.transformer.state_dict().items())
    summary = training.train(run)
    assert summary["steps"] == 2 and summary["mhla_layers"] == 2
    out = tmp_path / "run" / "final"
    recorded = json.loads((out / "transformer_2" / "mhla_config.json").read_text())
    assert recorded["feature_eps"] == 1e-6 and recorded["mixing_clamp"] is False
    assert not (out / "transformer" / "mhla_config.json").exists()
    trained, before = mhla_diffusers.load_mhla_pipeline(out), mhla_diffusers.load_mhla_pipeline(base)
    assert trained.config.boundary_ratio == 0.875 and mhla_diffusers.is_mhla_model(trained.transformer_2)
    for a, b in zip(trained.transformer.state_dict().values(), before.transformer.state_dict().values()):
        assert torch.equal(a, b)  # the high-noise expert is written as loaded
    changed = [k for k, v in before.transformer_2.state_dict().items() if not torch.equal(v, trained.transformer_2.state_dict()[k])]
    assert changed


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mhla.feature_eps=-1"], "mhla.feature_eps must be a finite number >= 0"),
        (["mhla.feature_eps=inf"], "mhla.feature_eps must be a finite number >= 0"),
        (["mhla.mixing_clamp=1"], "mhla.mixing_clamp must be true or false"),
        (["mhla.mixing_clamp=yes please"], "mhla.mixing_clamp must be true or false"),
        (["model.expert=transformer_3"], "model.expert must be one of"),
        (["model.expert=transformer_2", "train.trainable=lora", "lora.export=separate"], "use lora.export=merge"),
    ],
)
def test_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path / "x", tmp_path, *overrides)


def test_expert_errors(tmp_path, wan22):
    with pytest.raises(ValueError, match="has no transformer_2"):
        training.build_models(config(tmp_path / "a", wan22 / "wan21", "model.expert=transformer_2"))
    with pytest.raises(ValueError, match="takes 36 input channels.*image-to-video"):
        training.build_models(config(tmp_path / "b", wan22 / "i2v", "model.expert=transformer"))
    parts = training.build_models(config(tmp_path / "c", wan22 / "wan21", "model.expert=transformer"))
    assert parts.objective.timestep_range is None


def test_resume_refuses_another_expert():
    """A checkpoint of one expert does not resume as the other; null / unset (configs from before the key) and
    ``transformer`` on a one-transformer pipeline are the same run."""
    from mhla_diffusers.training.resume import _UNSET, _config_changes, _shape_changes

    def shaping(old, new):
        recorded = {"model": {} if old is _UNSET else {"expert": old}, "train": {"trainable": "full"}}
        config = {"model": {"expert": new}, "train": {"trainable": "full"}}
        return _shape_changes(_config_changes(recorded, config), config, recorded)

    assert shaping("transformer", "transformer_2") == ["model.expert"]
    assert shaping(None, "transformer") == [] and shaping(_UNSET, None) == []
