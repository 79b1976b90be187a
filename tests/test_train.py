"""The DiT trainer end to end on a tiny model: outputs, MHLA clamp, resume, config handling, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.training import (
    apply_overrides,
    build_optimizer,
    load_config,
    plot_loss_curves,
    read_loss_csv,
    write_loss_csv,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_DIT = dict(
    num_attention_heads=2, attention_head_dim=8, in_channels=12, out_channels=12,
    num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
)


def tiny_config(out, **sections):
    config = {
        "output_dir": str(out),
        "model": {"init": TINY_DIT, "vae": {"factor": 2, "scaling_factor": 1.8}},
        "data": {"resolution": 16, "crops_per_image": 2, "batch_size": 4, "photos": ["cat", "coffee", "flower"]},
        "train": {"max_steps": 3, "lr": 1e-3, "log_every": 1},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def generate(folder, n=2):
    pipe = mhla_diffusers.load_mhla_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe, pipe(list(range(n)), num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images


def test_train_from_scratch_writes_everything(tmp_path):
    summary = training.train(load_config(tiny_config(tmp_path / "run"), ["eval.samples=6", "eval.batch_size=4"]))
    out = tmp_path / "run"
    rows = read_loss_csv(out / "loss.csv")
    assert [r[0] for r in rows] == [1, 2, 3] and all(r[1] > 0 and r[2] > 0 for r in rows)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 3
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3
    assert summary["steps"] == 3 and not summary["mhla"] and summary["step_time_s"] > 0
    assert summary["eval_loss_start"] > 0 and summary["eval_loss"] > 0
    pipe, images = generate(out / "final")
    assert images.shape == (2, 16, 16, 3)
    assert not mhla_diffusers.is_mhla_model(pipe.transformer)
    from diffusers import DDPMScheduler

    eval_set = training.build_dataset({**load_config(tiny_config(tmp_path / "run"))["data"], "seed": 12345})
    again = training.evaluate_loss(pipe.transformer, pipe.vae, DDPMScheduler.from_config(pipe.scheduler.config), eval_set, num_samples=6, batch_size=4)
    assert again == pytest.approx(summary["eval_loss"], rel=1e-5)  # deterministic, same set
    assert type(pipe.vae).__name__ == "SpaceToDepthAutoencoder"
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.labels == {"cat": 0, "coffee": 1, "flower": 2}  # id2label survives save / load
    from diffusers import DiTPipeline

    assert DiTPipeline.from_pretrained(out / "final").labels == pipe.labels


def _pretrained_mhla_with_bad_mixing(folder):
    """A tiny MHLA checkpoint whose first mixing matrix is out of [0, 1]."""
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(**TINY_DIT)
    mhla_diffusers.apply_mhla(dit, layers="all", num_blocks=4)
    weight = mhla_diffusers.mixing_parameters(dit)[0]
    with torch.no_grad():
        weight[0, 0], weight[0, 1] = 1.7, -0.5
    vae = mhla_diffusers.SpaceToDepthAutoencoder(factor=2, scaling_factor=1.8)
    training.export_pipeline(dit, vae, DDPMScheduler(), folder, sampler="ddim")
    return folder


def test_mhla_finetune_clamps_mixing_and_exports_mhla(tmp_path):
    src = _pretrained_mhla_with_bad_mixing(tmp_path / "src")
    loaded = mhla_diffusers.load_mhla_pipeline(src).transformer
    assert mhla_diffusers.mixing_parameters(loaded)[0].max() > 1.5  # really out of range before
    cfg = tiny_config(
        tmp_path / "ft",
        model={"pretrained": str(src), "init": None},
        mhla={"layers": "all", "num_blocks": 4},
        train={"max_steps": 2, "mixing_lr": 1e-2},
    )
    summary = training.train(load_config(cfg))
    assert summary["mhla"] and summary["mhla_layers"] == 2
    lo, hi = summary["mixing_range"]
    assert 0.0 <= lo and hi <= 1.0
    pipe, images = generate(tmp_path / "ft" / "final")
    assert mhla_diffusers.is_mhla_model(pipe.transformer)
    assert (tmp_path / "ft" / "final" / "transformer" / "mhla.safetensors").is_file()
    for p in mhla_diffusers.mixing_parameters(pipe.transformer):
        assert p.min() >= 0 and p.max() <= 1
    assert images.shape == (2, 16, 16, 3)


def test_mhla_section_applies_mhla_from_scratch(tmp_path):
    cfg = tiny_config(tmp_path / "hyb", mhla={"layers": "hybrid", "num_blocks": 4}, train={"max_steps": 1})
    summary = training.train(load_config(cfg))
    assert summary["mhla_layers"] == 1  # 2 layers, softmax kept on layer 0
    pipe, _ = generate(tmp_path / "hyb" / "final")
    assert mhla_diffusers.is_mhla_model(pipe.transformer)


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    extra = {"max_steps": 4, "checkpointing_steps": 2, "lr_scheduler": "constant_with_warmup", "warmup_steps": 3}
    mhla = {"layers": "all", "num_blocks": 4}
    training.train(load_config(tiny_config(tmp_path / "full", train=extra, mhla=mhla)))

    cfg = tiny_config(tmp_path / "cut", train=extra, mhla=mhla)
    import mhla_diffusers.mixing as mixing_module

    real_clamp, calls = mixing_module.clamp_mixing_, []

    def crash_on_third_step(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash after the step-2 checkpoint")
        return real_clamp(model, *args, **kwargs)

    monkeypatch.setattr(mixing_module, "clamp_mixing_", crash_on_third_step)
    with pytest.raises(KeyboardInterrupt):
        training.train(load_config(cfg))
    monkeypatch.setattr(mixing_module, "clamp_mixing_", real_clamp)
    with pytest.raises(ValueError, match="--resume"):
        training.train(load_config(cfg))  # refuses to start over silently
    training.train(load_config(cfg, ["train.resume=true"]))

    for name in ("diffusion_pytorch_model.safetensors", "mhla.safetensors"):
        a = load_file(tmp_path / "full" / "final" / "transformer" / name)
        b = load_file(tmp_path / "cut" / "final" / "transformer" / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    full, cut = read_loss_csv(tmp_path / "full" / "loss.csv"), read_loss_csv(tmp_path / "cut" / "loss.csv")
    assert full == cut


def test_config_loading_and_overrides(tmp_path):
    cfg_path = tiny_config(tmp_path / "c")
    config = load_config(cfg_path, ["train.max_steps=7", "mhla.layers=hybrid", "train.lr=3e-4", "data.photos=[cat]"])
    assert config["train"]["max_steps"] == 7 and config["train"]["lr"] == 3e-4
    assert config["mhla"] == {"layers": "hybrid"} and config["data"]["photos"] == ["cat"]
    assert config["train"]["grad_clip"] == 1.0  # defaults filled in
    assert load_config(cfg_path, ["mhla.layers=hybrid", "mhla=null"])["mhla"] is None
    assert apply_overrides(config, ["model.init.num_layers=3"])["model"]["init"]["num_layers"] == 3
    with pytest.raises(ValueError, match="unknown config key 'train.max_step'"):
        load_config(cfg_path, ["train.max_step=3"])
    with pytest.raises(ValueError, match="section.key=value"):
        load_config(cfg_path, ["train.max_steps"])
    with pytest.raises(ValueError, match="exactly one of model.pretrained"):
        load_config(cfg_path, ["model.pretrained=somewhere"])
    with pytest.raises(ValueError, match="unknown mhla keys"):
        load_config(cfg_path, ["mhla.blocks=4"])
    with pytest.raises(ValueError, match="positive integer"):
        load_config(cfg_path, ["data.batch_size=0"])
    with pytest.raises(ValueError, match="output_dir"):
        load_config(None, ["model.init={}"])
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        training.train(load_config(cfg_path, ["data.batch_size=64"]))
    with pytest.raises(ValueError, match="set data.resolution to 16"):
        training.train(load_config(cfg_path, ["data.resolution=32"]))


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "finetune" / "configs").glob("*.yaml")):
        config = load_config(path)
        assert config["output_dir"], path


def test_optimizer_groups_and_loss_log(tmp_path):
    from diffusers import DiTTransformer2DModel

    dit = DiTTransformer2DModel(**TINY_DIT)
    assert len(build_optimizer(dit, 1e-3).param_groups) == 1
    mhla_diffusers.apply_mhla(dit, layers="all", num_blocks=4)
    opt = build_optimizer(dit, 1e-3, mixing_lr=5e-2, weight_decay=0.01)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-2]
    assert opt.param_groups[1]["weight_decay"] == 0.0 and len(opt.param_groups[1]["params"]) == 2

    rows = [(1, 0.5, 1e-4), (2, 0.25, 1e-4)]
    write_loss_csv(tmp_path / "l.csv", rows)
    assert read_loss_csv(tmp_path / "l.csv") == rows
    plot_loss_curves({"a": ([1, 2], [0.5, 0.25]), "b": ([1, 2], [0.6, 0.3])}, tmp_path / "l.png", smooth=1)
    assert (tmp_path / "l.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no loss curves"):
        plot_loss_curves({}, tmp_path / "x.png")


def test_accelerate_launch_cli(tmp_path):
    cfg = tiny_config(tmp_path / "cli", train={"max_steps": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "finetune/accelerate/single_cpu.yaml"),
           str(ROOT / "finetune/train.py"), "--config", str(cfg), "--set", "mhla.layers=hybrid", "--max_steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout
    assert (tmp_path / "cli" / "final" / "transformer" / "mhla_config.json").is_file()
    help_text = subprocess.run([sys.executable, str(ROOT / "finetune/train.py"), "--help"], env=env, capture_output=True, text=True).stdout
    assert "--set" in help_text and "train.max_steps" in help_text
