"""The retrofit recipe (distillation then fine-tuning) and continuing a DiT at another resolution."""

import json
import math

import pytest
import torch
from helpers_train import TINY_DIT, tiny_config

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.checkpoint.conversion import convert_checkpoint
from mhla_diffusers.training import load_config
from mhla_diffusers.training.recipes import resize_dit


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny softmax DiT pipeline trained for 3 steps (the teacher)."""
    out = tmp_path_factory.mktemp("base") / "run"
    summary = training.train(load_config(tiny_config(out)))
    return summary["final_dir"]


def test_resize_dit_keeps_every_weight_and_runs_at_the_new_size():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    small = DiTTransformer2DModel(**TINY_DIT).eval()
    big = resize_dit(small, 16).eval()
    assert big.config.sample_size == 16 and resize_dit(small, 8) is small
    a, b = small.state_dict(), big.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, t, y = torch.randn(2, 12, 16, 16), torch.tensor([10, 500]), torch.tensor([1, 2])
    assert big(x, timestep=t, class_labels=y).sample.shape == (2, 12, 16, 16)
    # only the sincos table differs: diffusers scales positions by the base size (sample_size / patch)
    assert torch.equal(big.pos_embed.pos_embed, DiTTransformer2DModel(**{**TINY_DIT, "sample_size": 16}).pos_embed.pos_embed)
    with pytest.raises(ValueError, match="patch size"):
        resize_dit(small, 15)
    mhla_diffusers.apply_mhla(small, "all", num_blocks=4)
    with pytest.raises(ValueError, match="before converting"):
        resize_dit(small, 16)


def test_model_sample_size_continues_a_pretrained_dit_at_a_new_resolution(tmp_path, base):
    config = load_config(tiny_config(tmp_path / "up", model={"init": None, "pretrained": base, "sample_size": 16},
                                     data={"resolution": 32}, train={"max_steps": 1}))
    summary = training.train(config)
    assert json.loads((tmp_path / "up" / "final" / "transformer" / "config.json").read_text())["sample_size"] == 16
    assert summary["steps"] == 1
    with pytest.raises(ValueError, match="model.sample_size"):
        load_config(tiny_config(tmp_path / "bad", model={"sample_size": 16}))  # with model.init: refused


def test_retrofit_distils_then_finetunes_and_skips_distillation_for_the_control(tmp_path, base):
    cfg = tiny_config(tmp_path / "cfg", model={"init": None, "pretrained": base}, eval={"samples": 4, "batch_size": 4})
    student = tmp_path / "student"
    convert_checkpoint(base, student, family="dit", layers="all", num_blocks=4)
    r = training.retrofit(cfg, student, base, tmp_path / "runs", distill_steps=2, finetune_steps=1, distill_lr=1e-3)
    assert r["steps"] == {"distill": 2, "finetune": 1}
    h, d = r["heldout_loss"], r["heldout_teacher_mse"]
    assert all(math.isfinite(h[k]) for k in h) and d["conversion"] > 0
    assert h["distill"] != h["conversion"]  # phase 1 moved the student
    phase1 = load_config(tmp_path / "runs" / "distill" / "config.yaml")
    assert phase1["train"]["lr"] == 1e-3 and phase1["distill"]["data_weight"] == 0 and phase1["distill"]["condition"] == "random"
    assert mhla_diffusers.read_mhla_config(r["final_dir"])["layers"] == [0, 1]
    control = training.retrofit(cfg, base, base, tmp_path / "control", distill_steps=2, finetune_steps=1)
    assert control["steps"] == {"distill": 0, "finetune": 1} and control["runs"]["distill"] is None
    assert control["heldout_teacher_mse"]["conversion"] == 0.0
    with pytest.raises(ValueError, match="finetune_steps"):
        training.retrofit(cfg, base, base, tmp_path / "x", distill_steps=0, finetune_steps=0)
    for steps in (dict(distill_steps=0.5, finetune_steps=1), dict(distill_steps=1, finetune_steps=2.5),
                  dict(distill_steps=True, finetune_steps=1)):  # were truncated (0.5: distillation silently skipped)
        with pytest.raises(ValueError, match="integers finetune_steps >= 1 and distill_steps >= 0"):
            training.retrofit(cfg, base, base, tmp_path / "x", **steps)
