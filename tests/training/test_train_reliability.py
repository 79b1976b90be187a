"""The trainer loses no step silently and resumes say what they do (issue 11, section 4):

- gradient norms are clipped per parameter group (mixing matrices, LoRA, the rest), so a gradient
  spike in one group (SANA's eps = 1e-15 at the clamp boundary of a mixing entry) cannot scale the
  other groups' step to nothing; per-group norms are logged; a non-finite step is skipped and said;
- ``--resume`` applies changed optimizer settings (lr, mixing_lr, weight decay) and refuses changed
  settings that shape the model (``mhla.num_blocks``, ``mhla.layers``, ``train.trainable``) with an
  error naming them;
- ``mixed_precision: no`` (YAML's False) is accepted; ``train.py`` config errors are one line, exit 2.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_main
from test_train import _final_tensors, _snapshot, tiny_config
from test_train_sana import sana_base, sana_config  # noqa: F401 (sana_base: a module fixture)

from mhla_diffusers import training
from mhla_diffusers.ops import mhla_attention
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.mixing import MixingMatrix, mixing_parameters
from mhla_diffusers.training import load_config, logs, loop, read_grad_norms, read_loss_csv

ROOT = Path(__file__).resolve().parents[2]
MHLA = {"layers": "all", "num_blocks": 4}


# -- a gradient spike in one group --------------------------------------------------------------------
class _SpikeModel(torch.nn.Module):
    """The issue's repro: 2 tokens in 2 blocks, q = [1, 1], k = [-1, 1], v = w * [2, 5], identity
    mixing, eps = 1e-15. Token 0 has no attention mass but through Mc[0, 1] = 0, so
    dOut_0 / dMc[0, 1] = 5 w / eps = 5e15; ``w`` (the rest of the model) has an ordinary gradient."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.mixing = MixingMatrix((1, 1, 2))
        with torch.no_grad():
            self.mixing.weight.copy_(torch.eye(2))
        self.layout = BlockLayout((1, 1, 2), (1, 1, 2))

    def forward(self):
        q = torch.tensor([1.0, 1.0]).view(1, 1, 2, 1)
        k = torch.tensor([-1.0, 1.0]).view(1, 1, 2, 1)
        v = self.w * torch.tensor([2.0, 5.0]).view(1, 1, 2, 1)
        return mhla_attention(q, k, v, self.mixing.clamped(), self.layout, eps=1e-15, backend="torch")


def clip_grad_norms_(*args, **kwargs):
    return training.clip_grad_norms_(*args, **kwargs)


def gradient_groups(model):
    return training.gradient_groups(model)


def _spike_step(clip):
    """One AdamW step (lr 1e-3) on the loss ``out_0 + out_1`` after ``clip``; returns (norms, |dw|)."""
    model = _SpikeModel()
    model().sum().backward()
    norms = clip(model)
    opt = torch.optim.AdamW([{"params": [model.w]}, {"params": [model.mixing.weight], "weight_decay": 0.0}], lr=1e-3, weight_decay=0.0)
    opt.step()
    return norms, abs(float(model.w.detach()) - 1.0)


def test_a_mixing_gradient_spike_no_longer_wipes_out_the_rest_of_the_step():
    groups = gradient_groups(_SpikeModel())
    assert list(groups) == ["model", "mhla_mixing"]
    # one global clip (the trainer before): the spike scales w's gradient by ~1 / 5e15: w does not move
    norm, moved = _spike_step(lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
    assert norm == pytest.approx(5e15, rel=1e-6)
    assert moved < 1e-6 * 1e-3
    # clipped per group: the mixing matrix's step is clipped on its own, w takes a full Adam step (lr)
    norms, moved = _spike_step(lambda m: clip_grad_norms_(gradient_groups(m), 1.0))
    assert norms["mhla_mixing"] == pytest.approx(5e15, rel=1e-6) and norms["model"] == pytest.approx(5.0)
    assert moved == pytest.approx(1e-3, rel=1e-3)


def test_clip_grad_norms_clips_each_group_to_max_norm():
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad, b.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([0.0, 0.3, 0.4])  # norms 5 and 0.5
    norms = clip_grad_norms_({"x": [a], "y": [b, c]}, 1.0)  # c has no gradient
    assert norms == pytest.approx({"x": 5.0, "y": 0.5})
    assert float(a.grad.norm()) == pytest.approx(1.0, rel=1e-5) and torch.equal(b.grad, torch.tensor([0.0, 0.3, 0.4]))
    assert clip_grad_norms_({"x": [a]}, None) == pytest.approx({"x": 1.0}, rel=1e-5)  # measured, not clipped
    a.grad = torch.tensor([float("inf"), 0.0, 0.0])
    assert math.isinf(clip_grad_norms_({"x": [a]}, 1.0)["x"])


def _spiking(monkeypatch, factor, at_step=None):
    """Make every mixing matrix's gradient ``factor`` times its true value (at optimizer step
    ``at_step`` only, or always): the size of SANA's boundary spike, injected into a tiny DiT run."""
    real_build, calls = training.build_models, []

    def build(config):
        parts = real_build(config)
        for p in mixing_parameters(parts.transformer):
            def hook(grad, p=p):
                calls.append(1)
                n_mixing = len(mixing_parameters(parts.transformer))
                step = (len(calls) - 1) // n_mixing + 1
                return grad * factor if at_step is None or step == at_step else grad
            p.register_hook(hook)
        return parts

    monkeypatch.setattr(loop, "build_models", build)  # train() looks it up in loop


def test_a_spiking_group_leaves_the_other_groups_step_untouched(tmp_path, monkeypatch):
    """The trainer on a tiny DiT with MHLA: a 1e15 spike in the mixing gradients (SANA's size) leaves
    every other weight after the step exactly where a run without the spike puts it (before: every
    other gradient was scaled by ~1e-15 by the global clip); the per-group norms are logged."""
    training.train(load_config(tiny_config(tmp_path / "plain", mhla=MHLA, train={"max_steps": 1})))
    _spiking(monkeypatch, 1e15)
    training.train(load_config(tiny_config(tmp_path / "spike", mhla=MHLA, train={"max_steps": 1})))
    plain, spike = _final_tensors(tmp_path / "plain"), _final_tensors(tmp_path / "spike")
    rest = [k for k in plain if k.startswith("diffusion_pytorch_model")]
    assert len(rest) > 10 and all(torch.equal(plain[k], spike[k]) for k in rest)

    rows = logs.read_rows(tmp_path / "spike" / "loss.csv")
    norms = rows[0][4]
    assert set(norms) == {"model", "mhla_mixing"} and norms["mhla_mixing"] > 1e12 * norms["model"]
    plain_norms = logs.read_rows(tmp_path / "plain" / "loss.csv")[0][4]
    assert plain_norms["model"] == norms["model"]
    assert norms["mhla_mixing"] == pytest.approx(1e15 * plain_norms["mhla_mixing"], rel=1e-4)


def test_a_non_finite_gradient_skips_the_step_and_says_so(tmp_path, monkeypatch, capsys):
    _spiking(monkeypatch, float("nan"), at_step=2)
    summary = training.train(load_config(tiny_config(tmp_path / "nan", mhla=MHLA, train={"max_steps": 3})))
    assert summary["skipped_steps"] == [2] and math.isfinite(summary["final_loss"])
    assert "step 2 skipped: non-finite gradient norm in mhla_mixing" in capsys.readouterr().out
    weights = _final_tensors(tmp_path / "nan")
    assert all(torch.isfinite(w).all() for w in weights.values())
    rows = logs.read_rows(tmp_path / "nan" / "loss.csv")
    assert [r[0] for r in rows] == [1, 2, 3] and math.isnan(rows[1][4]["mhla_mixing"])


# -- resume ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A tiny DiT + MHLA run stopped at its step-2 checkpoint (max_steps 2), to be resumed to step 4."""
    root = tmp_path_factory.mktemp("resume")
    cfg = tiny_config(root / "run", mhla=MHLA, train={"max_steps": 2, "checkpointing_steps": 2, "mixing_lr": 1e-2})
    training.train(load_config(cfg))
    return root / "run"


def _copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    cfg = tiny_config(out, mhla=MHLA, train={"max_steps": 2, "checkpointing_steps": 2, "mixing_lr": 1e-2})
    return out, cfg


def _record_lrs(monkeypatch):
    """Record each AdamW step's (lr, weight_decay) per parameter group, as the update uses them."""
    seen, real_step = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append([(g["lr"], g["weight_decay"]) for g in self.param_groups])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return seen


@pytest.mark.parametrize("override, expected", [
    ("train.lr=5e-4", [(5e-4, 0.0), (1e-2, 0.0)]),
    ("train.mixing_lr=2e-3", [(1e-3, 0.0), (2e-3, 0.0)]),
    ("train.weight_decay=0.05", [(1e-3, 0.05), (1e-2, 0.0)]),
])
def test_resume_applies_changed_optimizer_settings(two_step_run, tmp_path, monkeypatch, capsys, override, expected):
    """The checkpoint's optimizer state used to bring back the old rate (while config.yaml recorded the
    new one): the new setting now applies from the first resumed step, and the run says so."""
    out, cfg = _copy_run(two_step_run, tmp_path)
    seen = _record_lrs(monkeypatch)
    training.train(load_config(cfg, ["train.resume=true", "train.max_steps=4", override]))
    assert seen == [expected, expected]
    key, value = override.split("=")
    assert f"{key}: " in capsys.readouterr().out
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    section, name = key.split(".")
    assert recorded[section][name] == float(value)
    lrs = [r[2] for r in read_loss_csv(out / "loss.csv")]
    assert lrs[:2] == [1e-3, 1e-3] and lrs[2:] == [expected[0][0]] * 2


def test_resume_with_unchanged_settings_keeps_the_optimizer_state(two_step_run, tmp_path, monkeypatch):
    out, cfg = _copy_run(two_step_run, tmp_path)
    seen = _record_lrs(monkeypatch)
    training.train(load_config(cfg, ["train.resume=true", "train.max_steps=3"]))
    assert seen == [[(1e-3, 0.0), (1e-2, 0.0)]]


@pytest.mark.parametrize("override, named", [
    ("mhla.num_blocks=1", "mhla.num_blocks"),
    ("mhla.layers=hybrid", "mhla.layers"),
    ("train.trainable=attention", "train.trainable"),
    ("train.trainable=lora", "train.trainable"),
])
def test_resume_refuses_a_changed_model_shape_naming_the_setting(two_step_run, tmp_path, override, named):
    out, cfg = _copy_run(two_step_run, tmp_path)
    before = _snapshot(out)
    with pytest.raises(ValueError, match=rf"{named} changed since the checkpoint") as info:
        training.train(load_config(cfg, ["train.resume=true", "train.max_steps=4", override]))
    assert "new output_dir" in str(info.value)
    assert _snapshot(out) == before  # nothing written (config.yaml still records the run's settings)


def test_resume_without_a_recorded_config_still_explains_a_load_failure(two_step_run, tmp_path):
    """A checkpoint from before configs were recorded in it, and no config.yaml: the load failure is
    explained (not a raw size-mismatch traceback)."""
    out, cfg = _copy_run(two_step_run, tmp_path)
    state = out / "checkpoints" / "checkpoint_0" / "train_state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "config"}))
    (out / "config.yaml").unlink()
    with pytest.raises(ValueError, match="does not fit the model built from this config") as info:
        training.train(load_config(cfg, ["train.resume=true", "train.max_steps=4", "mhla.num_blocks=1"]))
    assert "mhla" in str(info.value) and "train.trainable" in str(info.value)


# -- config spelling, the CLI ------------------------------------------------------------------------
def test_mixed_precision_no_is_accepted_as_yaml_writes_it(tmp_path):
    path = tiny_config(tmp_path / "mp")
    path.write_text(path.read_text().replace("train:\n", "train:\n  mixed_precision: no\n"))
    assert yaml.safe_load(path.read_text())["train"]["mixed_precision"] is False  # YAML 1.1 reads `no` as False
    assert load_config(path)["train"]["mixed_precision"] == "no"
    assert load_config(tiny_config(tmp_path / "mp2"), ["train.mixed_precision=no"])["train"]["mixed_precision"] == "no"
    with pytest.raises(ValueError, match=r"train.mixed_precision must be one of \['no', 'fp16', 'bf16'\]; got True"):
        load_config(tiny_config(tmp_path / "mp3"), ["train.mixed_precision=yes"])


def test_train_cli_config_errors_are_one_line_and_exit_2(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "cli")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "finetune/train.py"), "--config", str(cfg), "--set", "train.max_step=3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["train.py: unknown config key 'train.max_step'; valid keys at train: "
                                                + str(sorted(training.DEFAULT_CONFIG["train"]))]
    code, err = run_main("finetune/train.py", "--config", tmp_path / "missing.yaml", capsys=capsys)
    assert code == 2 and err.strip().startswith("train.py: config file") and len(err.strip().splitlines()) == 1
    code, err = run_main("finetune/train.py", "--config", cfg, "--resume", capsys=capsys)  # raised inside train()
    assert code == 2 and "holds no complete checkpoint" in err and len(err.strip().splitlines()) == 1


def test_sana_boundary_spike_no_longer_voids_the_step(tmp_path, sana_base):  # noqa: F811 (the fixture)
    """The real thing: a tiny SANA (eps = 1e-15) with MHLA; its first step has a mixing-gradient spike
    (mixing entries at 0 from the locality init carry a query's only attention mass). The rest of the
    model now takes the step it takes when the mixing matrices do not train at all (before: a
    ~1e-9 fraction of it, lost to the global clip)."""
    from safetensors.torch import load_file

    training.train(sana_config(tmp_path / "spike", sana_base, "train.max_steps=1"))
    norms = read_grad_norms(tmp_path / "spike" / "loss.csv")
    assert norms["mhla_mixing"][1][0] > 1e6 * norms["model"][1][0]  # the spike is there
    training.train(sana_config(tmp_path / "frozen", sana_base, "train.max_steps=1", "train.train_mixing=false"))

    def weights(folder):
        return load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")

    base, spike, frozen = weights(sana_base), weights(tmp_path / "spike" / "final"), weights(tmp_path / "frozen" / "final")
    moved = max(float((frozen[k] - base[k]).abs().max()) for k in base)
    assert moved > 5e-4  # one Adam step at lr 1e-3
    for k in base:
        torch.testing.assert_close(spike[k], frozen[k], rtol=1e-5, atol=1e-6, msg=k)
