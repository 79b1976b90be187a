"""Numeric config options (issue 32, item 5; CASES.md C20): the "off" values users bring from other tools
(``-1``, ``0``, ``null``), booleans, NaN and infinities either keep their documented meaning or are refused in
one line naming the key; a YAML syntax error is one line naming the file, line and column (``train.py``: exit 2)."""

from __future__ import annotations

import pytest
from helpers import run_main
from helpers_train import tiny_config

from mhla_diffusers.training import load_config
from mhla_diffusers.training.config import _FREE_SECTIONS, _RULES, DEFAULT_CONFIG


def _numeric_keys(section: dict, path: tuple[str, ...] = ()) -> list[str]:
    keys = []
    for key, value in section.items():
        here = path + (key,)
        if isinstance(value, dict) and here not in _FREE_SECTIONS:
            keys += _numeric_keys(value, here)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            keys.append(".".join(here))
    return keys


def test_every_numeric_key_has_a_rule():
    numeric = _numeric_keys(DEFAULT_CONFIG)
    assert len(numeric) > 30
    checked_elsewhere = {"data.resolution"}  # an integer or [height, width] (videos): _check_data, tested below
    assert [key for key in numeric if key not in _RULES and key not in checked_elsewhere] == []


@pytest.mark.parametrize("override, message", [
    # the repro: -1 multiplied every gradient by a negative factor (gradient ascent, exit code 0)
    ("train.grad_clip=-1", r"train.grad_clip must be a finite number >= 0 or null \(0 or null: no clipping\); got -1"),
    ("train.grad_clip=.nan", "train.grad_clip must be a finite number >= 0"),
    ("train.grad_clip=.inf", "train.grad_clip must be a finite number >= 0"),
    ("train.grad_clip=true", "train.grad_clip must be a number; got True"),
    ("train.warmup_steps=-1", r"train.warmup_steps must be an integer >= 0 \(0: no warm-up\); got -1"),
    ("train.checkpointing_steps=-1", r"train.checkpointing_steps must be an integer >= 0 \(0: never\)"),
    ("train.checkpoints_total_limit=-1", r"train.checkpoints_total_limit must be a positive integer or null \(null: keep every"),
    ("train.checkpoints_total_limit=0", "train.checkpoints_total_limit must be a positive integer or null"),
    ("train.checkpoints_total_limit=true", r"train.checkpoints_total_limit must be a positive integer or null \(.*\); got True"),
    ("eval.samples=-1", r"eval.samples must be an integer >= 0 \(0: no held-out evaluation\); got -1"),
    ("eval.samples=null", "eval.samples must be an integer >= 0"),
    ("eval.samples=2.5", "eval.samples must be an integer >= 0"),
    ("eval.batch_size=0", "eval.batch_size must be a positive integer"),
    ("eval.seed=-1", "eval.seed must be an integer >= 0"),
    ("train.seed=-1", "train.seed must be an integer >= 0"),
    ("data.seed=-1", "data.seed must be an integer >= 0"),
    ("data.num_workers=-1", "data.num_workers must be an integer >= 0"),
    ("data.crops_per_image=0", "data.crops_per_image must be a positive integer"),
    ("data.short_side=0", "data.short_side must be a positive integer or null"),
    ("data.resolution=0", "data.resolution must be a positive integer"),
    ("data.resolution=true", "data.resolution must be a positive integer"),
    ("ema.decay=.nan", r"ema.decay must be a finite number in \(0, 1\)"),
    ("ema.update_after_step=-1", "ema.update_after_step must be an integer >= 0"),
    ("train.lr=.inf", "train.lr must be a finite number > 0"),
    ("train.lr=true", "train.lr must be a number; got True"),
    ("train.mixing_lr=0", r"train.mixing_lr must be a finite number > 0 or null \(null: train.lr; to freeze"),
    ("train.weight_decay=-0.01", "train.weight_decay must be a finite number >= 0"),
    ("train.adam_beta1=1", r"train.adam_beta1 must be a finite number in \[0, 1\)"),
    ("train.adam_beta2=-1", r"train.adam_beta2 must be a finite number in \[0, 1\)"),
    ("train.adam_eps=0", "train.adam_eps must be a finite number > 0"),
    ("train.class_dropout=.nan", r"train.class_dropout must be a finite number in \[0, 1\)"),
    ("objective.shift=.inf", "objective.shift must be a finite number > 0 or null"),
    ("objective.logit_mean=.nan", "objective.logit_mean must be a finite number"),
    ("objective.logit_std=-1", "objective.logit_std must be a finite number > 0"),
    ("objective.mode_scale=3", r"objective.mode_scale must be a finite number in \[-1, 1.75\]"),
    ("distill.output_weight=.inf", "distill.output_weight must be a finite number >= 0"),
    ("lora.alpha=0", r"lora.alpha must be a finite number > 0 or null \(null: the rank"),
    ("lora.alpha=-1", "lora.alpha must be a finite number > 0 or null"),
    ("mhla.feature_power=true", "mhla.feature_power must be a number; got True"),
])
def test_bad_numbers_are_refused_naming_the_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=message) as info:
        load_config(tiny_config(tmp_path / "x", mhla={"layers": "all"}), [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override, key, expected", [
    ("train.grad_clip=0", ("train", "grad_clip"), 0.0),  # documented: 0 or null, no clipping
    ("train.grad_clip=null", ("train", "grad_clip"), None),
    ("train.warmup_steps=0", ("train", "warmup_steps"), 0),
    ("train.checkpointing_steps=0", ("train", "checkpointing_steps"), 0),
    ("train.checkpoints_total_limit=null", ("train", "checkpoints_total_limit"), None),
    ("eval.samples=0", ("eval", "samples"), 0),
    ("objective.mode_scale=-1", ("objective", "mode_scale"), -1.0),
    ("lora.alpha=null", ("lora", "alpha"), None),
    ("train.mixing_lr=null", ("train", "mixing_lr"), None),
    ("train.lr=3e-4", ("train", "lr"), 3e-4),  # PyYAML reads 3e-4 as a string
])
def test_documented_off_values_keep_their_meaning(tmp_path, override, key, expected):
    config = load_config(tiny_config(tmp_path / "x"), [override])
    assert config[key[0]][key[1]] == expected


def test_video_resolution_must_be_positive(tmp_path):
    cfg = tiny_config(tmp_path / "v", data={"kind": "video", "root": str(tmp_path)})
    with pytest.raises(ValueError, match=r"data.resolution must be a positive integer or \[height, width\]"):
        load_config(cfg, ["data.resolution=[0, 16]"])
    assert load_config(cfg, ["data.resolution=[8, 16]"])["data"]["resolution"] == [8, 16]


def _broken_yaml(tmp_path):
    path = tiny_config(tmp_path / "broken")
    lines = path.read_text().splitlines()
    lines.insert(2, "  grad_clip: [1.0")  # an unclosed flow sequence, on line 3
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path):
    path = _broken_yaml(tmp_path)
    with pytest.raises(ValueError, match=rf"^{path}:\d+:\d+: not valid YAML \(") as info:
        load_config(path)
    assert "\n" not in str(info.value) and "fix the file" in str(info.value)


def test_a_yaml_syntax_error_in_an_override_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^override 'train.lr=\[1': not valid YAML \(.*\); quote or fix the value$") as info:
        load_config(tiny_config(tmp_path / "x"), ["train.lr=[1"])
    assert "\n" not in str(info.value)


def test_train_cli_yaml_syntax_error_is_one_line_exit_2(tmp_path, capsys):
    path = _broken_yaml(tmp_path)
    code, err = run_main("finetune/train.py", "--config", path, capsys=capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"train.py: {path}:")


def test_nan_is_refused_even_where_any_number_goes(tmp_path):
    """``objective.logit_mean`` takes any number, but not NaN / inf (its timesteps would be NaN)."""
    assert load_config(tiny_config(tmp_path / "x"), ["objective.logit_mean=-0.5"])["objective"]["logit_mean"] == -0.5
    for bad in ("nan", ".inf", "-.inf"):
        with pytest.raises(ValueError, match="objective.logit_mean must be a finite number"):
            load_config(tiny_config(tmp_path / "y"), [f"objective.logit_mean={bad}"])
