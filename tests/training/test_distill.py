"""Distillation from the original model: the teacher, attention recorders, the losses, and
distillation-only training that needs no labels."""

import copy
import math

import pytest
import torch

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.training import load_config
from mhla_diffusers.training.distill import (
    AttentionRecorder,
    attention_transfer_loss,
    load_teacher,
    make_teacher,
    output_matching_loss,
    transfer_modules,
)


def test_teacher_is_the_frozen_original():
    from helpers import dit_inputs, run_dit, tiny_dit

    model = tiny_dit(num_layers=3)
    inputs = dit_inputs()
    original = run_dit(model, inputs)
    mhla_diffusers.apply_mhla(model, layers="hybrid", num_blocks=4)
    assert not torch.allclose(run_dit(model, inputs), original)
    from mhla_diffusers.checkpoint.lora import add_lora

    add_lora(model, rank=2)
    teacher = make_teacher(model)  # MHLA removed, LoRA dropped: the stock model
    assert not mhla_diffusers.is_mhla_model(teacher) and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert torch.equal(run_dit(teacher, inputs), original)
    assert mhla_diffusers.is_mhla_model(model)  # the student is untouched
    half = make_teacher(model, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_recorders_and_losses():
    from helpers import dit_inputs, tiny_dit

    student = tiny_dit(num_layers=3)
    teacher = make_teacher(student)
    latent, t, y = dit_inputs()
    names = list(transfer_modules(student))
    assert names == [f"transformer_blocks.{i}.attn1" for i in range(3)]  # no MHLA: every layer
    rs, rt = AttentionRecorder(transfer_modules(student)), AttentionRecorder(transfer_modules(teacher, "all"))
    with rs:
        out_s = student(latent, timestep=t, class_labels=y).sample
    with rt, torch.no_grad():
        out_t = teacher(latent, timestep=t, class_labels=y).sample
    assert sorted(rs.outputs) == names and rs.outputs[names[0]].requires_grad
    assert attention_transfer_loss(rs.outputs, rt.outputs) == 0 and output_matching_loss(out_s, out_t) == 0
    assert not student.transformer_blocks[0].attn1._forward_hooks  # hooks removed on exit

    mhla_diffusers.apply_mhla(student, layers="hybrid", num_blocks=4)
    assert list(transfer_modules(student)) == ["transformer_blocks.1.attn1", "transformer_blocks.2.attn1"]
    assert len(transfer_modules(student, "all")) == 3
    rs = AttentionRecorder(transfer_modules(student))
    with rs:
        out_s = student(latent, timestep=t, class_labels=y).sample
    loss = attention_transfer_loss(rs.outputs, rt.outputs) + output_matching_loss(out_s, out_t)
    assert loss > 0
    loss.backward()
    assert all(p.grad is not None for p in mhla_diffusers.mixing_parameters(student))
    with pytest.raises(KeyError, match="not recorded"):
        attention_transfer_loss(rs.outputs, {})
    with pytest.raises(ValueError, match="must be one of"):
        transfer_modules(student, "some")


def test_distillation_alone_needs_no_labels_and_closes_the_gap(tmp_path):
    """Attention transfer + output matching on unlabelled images (one folder, random class labels),
    training the mixing matrices only: the held-out distance to the teacher's output halves in 12 steps."""
    from PIL import Image
    from test_train import tiny_config

    from mhla_diffusers.data.photos import load_photo

    for i in range(3):
        (tmp_path / "images" / "all").mkdir(parents=True, exist_ok=True)
        photo = load_photo(["cat", "coffee", "rocket"][i])
        Image.fromarray(photo).save(tmp_path / "images" / "all" / f"{i}.png")
    cfg = tiny_config(
        tmp_path / "d", mhla={"layers": "all", "num_blocks": 4},
        data={"kind": "folder", "root": str(tmp_path / "images"), "photos": None, "crops_per_image": 8, "short_side": 24},
        distill={"teacher": "original", "data_weight": 0.0, "output_weight": 1.0, "attention_weight": 1.0, "condition": "random"},
        train={"max_steps": 12, "lr": 3e-3, "class_dropout": 0.0},
    )
    summary = training.train(load_config(cfg, ["eval.samples=8", "eval.batch_size=8", "train.trainable=mixing", "train.lr=1e-2"]))
    assert summary["eval_distill"] < 0.7 * summary["eval_distill_start"]
    assert math.isfinite(summary["eval_loss"])
    terms = training.read_loss_terms(tmp_path / "d" / "loss.csv")
    assert sorted(terms) == ["attention", "output"]
    assert terms["attention"][1][-1] < terms["attention"][1][0]


def test_teacher_from_a_folder_and_config_errors(tmp_path):
    from test_train import tiny_config

    first = training.train(load_config(tiny_config(tmp_path / "base", train={"max_steps": 1})))
    teacher = load_teacher(first["final_dir"])
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    cfg = tiny_config(tmp_path / "s", mhla={"layers": "all", "num_blocks": 4}, model={"init": None, "pretrained": first["final_dir"]},
                      distill={"teacher": first["final_dir"], "output_weight": 1.0}, train={"max_steps": 2})
    summary = training.train(load_config(cfg, ["eval.samples=4", "eval.batch_size=4"]))
    assert summary["eval_distill_start"] > 0
    with pytest.raises(ValueError, match="need a teacher"):
        load_config(cfg, ["distill.teacher=null"])
    with pytest.raises(ValueError, match="data_weight=0"):
        load_config(cfg, ["distill.condition=random"])
    with pytest.raises(ValueError, match="all loss weights are 0"):
        load_config(cfg, ["distill.data_weight=0", "distill.output_weight=0"])
    with pytest.raises(ValueError, match="condition must be one of"):
        load_config(cfg, ["distill.condition=labels"])


def test_output_distillation_gradient_flows_only_to_the_student():
    from helpers import dit_inputs, tiny_dit

    student = tiny_dit(num_layers=2)
    teacher = make_teacher(copy.deepcopy(student))
    mhla_diffusers.apply_mhla(student, layers="all", num_blocks=4)
    latent, t, y = dit_inputs()
    with torch.no_grad():
        target = teacher(latent, timestep=t, class_labels=y).sample
    loss = output_matching_loss(student(latent, timestep=t, class_labels=y).sample, target)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
