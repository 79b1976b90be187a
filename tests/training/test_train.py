"""The DiT trainer end to end on a tiny model: outputs, MHLA clamp, resume, config handling, the CLI."""

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers_parallel import free_port
from helpers_train import TINY_DIT, tiny_config  # noqa: E402,F401  (shared with tests/checkpoint)

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.training import (
    apply_overrides,
    build_optimizer,
    load_config,
    plot_loss_curves,
    read_loss_csv,
    resume,
    write_loss_csv,
)

ROOT = Path(__file__).resolve().parents[2]
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
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    again = training.evaluate_loss(pipe.transformer, pipe.vae, scheduler, eval_set, num_samples=6, batch_size=4)
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
    import mhla_diffusers.ops.mixing as mixing_module

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
    with pytest.raises(ValueError, match="mhla.layers=auto is not available in the trainer.*--layers auto"):
        load_config(cfg_path, ["mhla.layers=auto"])  # was accepted, then failed at build time naming calibration=
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


# -- checkpoints, processes, precision, EMA -------------------------------------------------------
def _final_tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for name in ("diffusion_pytorch_model.safetensors", "mhla.safetensors"):
        path = Path(folder) / "final" / "transformer" / name
        if path.is_file():
            out.update({f"{name}:{k}": v for k, v in load_file(path).items()})
    return out


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_a_killed_run_resumes_to_the_same_weights(tmp_path):
    """SIGKILL a real training process after its first complete checkpoint; resume; compare bitwise."""
    import signal
    import time

    extra = {"max_steps": 160, "checkpointing_steps": 16, "lr_scheduler": "cosine", "warmup_steps": 5, "log_every": 8}
    sections = dict(mhla={"layers": "all", "num_blocks": 4}, ema={"enabled": True, "decay": 0.9},
                    data={"crops_per_image": 8, "batch_size": 4})
    cut_cfg = tiny_config(tmp_path / "cut", train=extra, **sections)
    log = open(tmp_path / "cut.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "finetune/train.py"), "--config", str(cut_cfg)],
                            env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not resume._complete_checkpoints(tmp_path / "cut" / "checkpoints"):
            assert proc.poll() is None, (tmp_path / "cut.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "cut" / "final").exists(), "the run finished before the kill: raise max_steps"
    killed_at = resume._complete_checkpoints(tmp_path / "cut" / "checkpoints")[-1][0]
    assert 0 < killed_at < extra["max_steps"]

    training.train(load_config(cut_cfg, ["train.resume=true"]))
    training.train(load_config(tiny_config(tmp_path / "full", train=extra, **sections)))
    a, b = _final_tensors(tmp_path / "full"), _final_tensors(tmp_path / "cut")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert read_loss_csv(tmp_path / "full" / "loss.csv") == read_loss_csv(tmp_path / "cut" / "loss.csv")


def test_incomplete_checkpoint_is_discarded_on_resume(tmp_path):
    cfg = tiny_config(tmp_path / "r", train={"max_steps": 4, "checkpointing_steps": 2})
    training.train(load_config(cfg, ["train.max_steps=2"]))
    ckpts = tmp_path / "r" / "checkpoints"
    (ckpts / "checkpoint_1").mkdir()  # a save interrupted by a kill: no train_state.json
    (ckpts / "checkpoint_1" / "model.safetensors").write_bytes(b"partial")
    summary = training.train(load_config(cfg, ["train.resume=true"]))
    assert summary["steps"] == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint_0", "checkpoint_1"]  # re-saved at step 4
    assert json.loads((ckpts / "checkpoint_1" / "train_state.json").read_text())["step"] == 4


def _snapshot(out):
    """{relative path: bytes} of every file a run writes outside its checkpoints (final model, logs, config)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*"))
            if p.is_file() and "checkpoints" not in p.relative_to(out).parts}


def test_resume_never_goes_back_behind_a_later_step(tmp_path, capsys):
    """A finished run resumed with a smaller train.max_steps (a typo, a copied command) is refused before
    anything is written: neither the latest checkpoint nor the exported final model may be past max_steps.
    Resuming a finished run with its own max_steps is a no-op; a run killed while exporting (its last
    checkpoint at max_steps, no final model) is only exported, to the weights of the uninterrupted run."""
    from helpers import load_script

    cfg = tiny_config(tmp_path / "r", train={"max_steps": 4, "checkpointing_steps": 2})
    out = tmp_path / "r"
    training.train(load_config(cfg))  # checkpoints at steps 2 and 4, final/ at step 4
    full, weights = _snapshot(out), _final_tensors(out)

    # the last checkpoint (step 4) is past max_steps: refused, nothing written
    with pytest.raises(ValueError, match=r"checkpoint_1\) is at step 4, past train.max_steps = 3"):
        training.train(load_config(cfg, ["train.resume=true", "train.max_steps=3"]))
    assert _snapshot(out) == full

    # the same max_steps again: the run is finished, nothing to do (nothing rewritten)
    cli = load_script("finetune/train.py")
    cli.main(["--config", str(cfg), "--resume"])
    printed = capsys.readouterr().out
    assert "holds a finished run" in printed and "done: 4 steps" in printed
    assert _snapshot(out) == full

    # killed while exporting: the step-4 checkpoint is complete, final/ and the summary are not there
    shutil.rmtree(out / "final")
    (out / "train_summary.json").unlink()
    cli.main(["--config", str(cfg), "--resume"])
    printed = capsys.readouterr().out
    assert "at step 4 = train.max_steps: nothing left to train, exporting" in printed
    assert "done: 4 steps" in printed and "None s/step" not in printed
    again = _final_tensors(out)
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert [r[0] for r in read_loss_csv(out / "loss.csv")] == [1, 2, 3, 4]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["step_time_s"] is None
    assert (out / "loss.csv").read_bytes() == full["loss.csv"]

    # the step-4 checkpoint gone (e.g. checkpoints_total_limit), the step-4 final model stays: resuming
    # to step 3 (or 2) would export an earlier model over it and cut loss.csv; refused
    after = _snapshot(out)
    shutil.rmtree(out / "checkpoints" / "checkpoint_1")
    for max_steps in (3, 2):
        with pytest.raises(ValueError, match=f"already went to step 4, past train.max_steps = {max_steps}"):
            training.train(load_config(cfg, ["train.resume=true", f"train.max_steps={max_steps}"]))
        assert _snapshot(out) == after


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """accelerate launch, 2 CPU processes (gloo DDP) x batch 4 == 1 process x batch 8.

    Tolerance: the same samples, noise and timesteps reach both runs (draws are made for the global
    batch and sliced per rank); only the summation order of the gradient differs (two per-rank means
    averaged by all-reduce vs one mean over 8), ~1 ulp per gradient entry. Adam turns that into
    weight differences of order lr * 1e-7 per step; atol 1e-5 after 4 steps leaves a wide margin while a
    single different sample or noise draw moves weights by >1e-3. The exception, softmax layers' key bias
    (no gradient at all: Adam amplifies the noise), is named below.
    """
    sections = dict(mhla={"layers": "hybrid", "num_blocks": 4}, data={"crops_per_image": 8, "batch_size": 4},
                    train={"max_steps": 4, "gradient_accumulation_steps": 1, "warmup_steps": 2})
    cfg = tiny_config(tmp_path / "two", **sections)
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "finetune/accelerate/multi_cpu.yaml"), "--num_processes", "2", "--main_process_port", str(free_port()),
           str(ROOT / "finetune/train.py"), "--config", str(cfg)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: 4 steps") == 1  # one summary: the main process
    two = json.loads((tmp_path / "two" / "train_summary.json").read_text())
    assert two["batch_size"] == 8
    one = training.train(load_config(tiny_config(tmp_path / "one", **sections), ["data.batch_size=8"]))
    assert one["batch_size"] == 8
    a, b = _final_tensors(tmp_path / "one"), _final_tensors(tmp_path / "two")
    assert a.keys() == b.keys()
    # A softmax layer's key bias gets no gradient (softmax is invariant to adding q . b to every score): its
    # gradient is rounding noise, which Adam turns into steps of up to lr in either direction. Those weights
    # are compared to within 2 lr per step; every other weight to 1e-5.
    mhla_layers = json.loads((tmp_path / "one" / "final" / "transformer" / "mhla_config.json").read_text())["layers"]
    key_biases = {k: re.search(r"blocks\.(\d+)\.attn1\.to_k\.bias$", k) for k in a}
    noise_only = [k for k, m in key_biases.items() if m and int(m[1]) not in mhla_layers]
    assert noise_only  # the hybrid keeps softmax layers
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2 * 1e-3 * 4 if k in noise_only else 1e-5, msg=k)
    la, lb = read_loss_csv(tmp_path / "one" / "loss.csv"), read_loss_csv(tmp_path / "two" / "loss.csv")
    assert [r[0] for r in la] == [r[0] for r in lb]
    for ra, rb in zip(la, lb):
        assert ra[1] == pytest.approx(rb[1], rel=1e-5)
    # the control: another seed (other noise) moves the weights far beyond the tolerance
    training.train(load_config(tiny_config(tmp_path / "seed", **sections), ["data.batch_size=8", "train.seed=1"]))
    c = _final_tensors(tmp_path / "seed")
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-3


def test_ema_is_checkpointed_resumed_and_exported(tmp_path):
    from safetensors.torch import load_file

    ema = {"enabled": True, "decay": 0.5, "export": True}
    extra = {"max_steps": 4, "checkpointing_steps": 2}
    mhla = {"layers": "all", "num_blocks": 4}
    full = training.train(load_config(tiny_config(tmp_path / "full", train=extra, mhla=mhla, ema=ema)))
    assert (tmp_path / "full" / "checkpoints" / "checkpoint_0" / "ema.safetensors").is_file()
    cut_cfg = tiny_config(tmp_path / "cut", train=extra, mhla=mhla, ema=ema)
    training.train(load_config(cut_cfg, ["train.max_steps=2"]))
    shutil.rmtree(tmp_path / "cut" / "final")
    training.train(load_config(cut_cfg, ["train.resume=true"]))
    a, b = _final_tensors(tmp_path / "full"), _final_tensors(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the exported weights are the EMA ones, not the raw ones of the last step
    raw = training.train(load_config(tiny_config(tmp_path / "raw", train=extra, mhla=mhla, ema={**ema, "export": False})))
    r = _final_tensors(tmp_path / "raw")
    assert any(not torch.equal(a[k], r[k]) for k in a)
    assert full["steps"] == raw["steps"] == 4
    state = load_file(tmp_path / "full" / "checkpoints" / "checkpoint_1" / "ema.safetensors")
    assert len(state) == sum(1 for k in a)  # one shadow per trainable tensor (all of them, full fine-tune)


def test_bf16_mixed_precision_on_cpu(tmp_path):
    summary = training.train(load_config(
        tiny_config(tmp_path / "bf16", mhla={"layers": "all", "num_blocks": 4}, train={"mixed_precision": "bf16", "max_steps": 2}),
        ["eval.samples=4", "eval.batch_size=4"],
    ))
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["eval_loss"])
    pipe = mhla_diffusers.load_mhla_pipeline(tmp_path / "bf16" / "final")
    assert all(p.dtype == torch.float32 for p in pipe.transformer.parameters())  # trained and exported in fp32
    # LoRA: the frozen weights (and the distillation teacher) run in bf16 under CPU autocast
    summary = training.train(load_config(
        tiny_config(tmp_path / "bf16_lora", mhla={"layers": "all", "num_blocks": 4},
                    train={"mixed_precision": "bf16", "max_steps": 2, "trainable": "lora"},
                    distill={"teacher": "original", "output_weight": 1.0, "attention_weight": 1.0}),
        ["eval.samples=4", "eval.batch_size=4"],
    ))
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["eval_distill"])
    pipe = mhla_diffusers.load_mhla_pipeline(tmp_path / "bf16_lora" / "final")
    # frozen weights ran in bf16, but the export merges the LoRA into their fp32 originals
    assert all(p.dtype == torch.float32 for p in pipe.transformer.parameters())
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)  # train() seeds 0 before building the model from scratch
    fresh = DiTTransformer2DModel(**TINY_DIT).state_dict()
    saved = pipe.transformer.state_dict()
    untouched = [k for k in fresh if "attn1" not in k and "mhla" not in k]
    assert untouched and all(torch.equal(saved[k], fresh[k]) for k in untouched)  # not rounded through bf16


def test_fp16_recipe_keeps_trainable_parameters_fp32_c16(tmp_path):
    """CASES C16. accelerate has no fp16 autocast / GradScaler on the CPU, so the scaler logic is
    exercised here with torch's own CPU autocast + GradScaler, on the parameters as the trainer
    prepares them; then the trainer itself runs fp16 + LoRA + checkpoint + resume + validation."""
    import warnings

    from diffusers import DiTTransformer2DModel

    from mhla_diffusers.checkpoint.lora import lora_parameters

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(**TINY_DIT)
    mhla_diffusers.apply_mhla(dit, layers="all", num_blocks=4)
    training.set_trainable(dit, "lora", lora={"rank": 4})
    counts = training.prepare_parameter_dtypes(dit, torch.float16)
    assert counts["trainable"] > 0 and counts["frozen"] > 0
    for name, p in dit.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.float16), name
    assert all(p.dtype == torch.float32 and p.requires_grad for p in mhla_diffusers.mixing_parameters(dit))
    assert all(p.dtype == torch.float32 for p in lora_parameters(dit))
    opt = training.build_optimizer(dit, 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(2, 12, 8, 8)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            out = dit(x, timestep=torch.tensor([10, 500]), class_labels=torch.tensor([1, 2])).sample
        scaler.scale(out.float().pow(2).mean()).backward()
        scaler.unscale_(opt)  # raises "Attempting to unscale FP16 gradients" if a trainable param were fp16
        torch.nn.utils.clip_grad_norm_([p for p in dit.parameters() if p.requires_grad], 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # a validation pass
        assert torch.isfinite(dit(x, timestep=torch.tensor([10, 500]), class_labels=torch.tensor([1, 2])).sample).all()
    # the naive recipe (whole model in fp16) is what C16 is about
    naive = DiTTransformer2DModel(**TINY_DIT).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out = naive(x, timestep=torch.tensor([10, 500]), class_labels=torch.tensor([1, 2])).sample
    opt2 = torch.optim.AdamW(naive.parameters())
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.scale(out.float().pow(2).mean()).backward()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        scaler2.unscale_(opt2)

    # the trainer: fp16 + LoRA, checkpoint, resume, validation, export (fp32 weights on the CPU)
    cfg = tiny_config(tmp_path / "fp16", mhla={"layers": "all", "num_blocks": 4},
                      train={"mixed_precision": "fp16", "trainable": "lora", "max_steps": 3, "checkpointing_steps": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        training.train(load_config(cfg, ["train.max_steps=2"]))
        shutil.rmtree(tmp_path / "fp16" / "final")
        summary = training.train(load_config(cfg, ["train.resume=true", "eval.samples=4", "eval.batch_size=4"]))
    assert summary["steps"] == 3 and math.isfinite(summary["eval_loss"])


def test_gradient_checkpointing_gives_the_same_gradients_with_mhla():
    from diffusers import DiTTransformer2DModel

    from mhla_diffusers.training.distill import AttentionRecorder, attention_transfer_loss, make_teacher, transfer_modules

    torch.manual_seed(0)
    base = DiTTransformer2DModel(**TINY_DIT)
    teacher = make_teacher(base)
    mhla_diffusers.apply_mhla(base, layers="all", num_blocks=4)
    models = [base, copy.deepcopy(base)]
    models[1].enable_gradient_checkpointing()
    x = torch.randn(2, 12, 8, 8)
    kwargs = dict(timestep=torch.tensor([3, 700]), class_labels=torch.tensor([0, 5]))
    grads, recomputed = [], []
    for model in models:
        model.train()
        training.disable_internal_label_dropout(model)  # DiT drops labels from the global RNG in train mode
        calls = []
        model.transformer_blocks[1].attn1.register_forward_hook(
            lambda *a: calls.append(torch._C._current_graph_task_id() != -1))
        rec = AttentionRecorder(transfer_modules(model))
        trec = AttentionRecorder(transfer_modules(teacher))
        with rec:
            out = model(x, **kwargs).sample
        with trec, torch.no_grad():
            teacher(x, **kwargs)
        loss = out.pow(2).mean() + attention_transfer_loss(rec.outputs, trec.outputs)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        recomputed.append(sum(calls[1:]))
    assert models[1].is_gradient_checkpointing and recomputed == [0, 1]  # MHLA re-ran inside backward
    assert grads[0].keys() == grads[1].keys()
    assert any("mhla.mixing" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


def test_tensorboard_is_optional(tmp_path):
    import importlib.util

    cfg = tiny_config(tmp_path / "tb", train={"max_steps": 1, "report_to": "tensorboard"})
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ValueError, match="pip install tensorboard"):
            load_config(cfg)
    else:  # pragma: no cover - depends on the environment
        training.train(load_config(cfg))
        assert any((tmp_path / "tb" / "logs").rglob("events.out.tfevents*"))


def test_latent_cache_reproduces_the_first_epoch(tmp_path):
    """Within the first epoch the cached latents are the uncached crops: same weights, bit for bit."""
    sections = dict(mhla={"layers": "all", "num_blocks": 4}, data={"crops_per_image": 4, "batch_size": 4}, train={"max_steps": 3})
    training.train(load_config(tiny_config(tmp_path / "plain", **sections)))
    cache = tmp_path / "cache"
    training.train(load_config(tiny_config(tmp_path / "cached", **sections),
                               ["data.cache=true", f"data.cache_dir={cache}", "eval.samples=4", "eval.batch_size=4"]))
    a, b = _final_tensors(tmp_path / "plain"), _final_tensors(tmp_path / "cached")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert len(list(cache.iterdir())) == 2  # the training set and the held-out set, keyed apart
