"""The README's commands fit together: what one step writes, the next one reads, and the trainer accepts it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from mhla_diffusers.training import check_resolution
from mhla_diffusers.training.config import load_config

ROOT = Path(__file__).resolve().parents[2]
# DiT-XL/2-256 on the Hub: a 32x32 latent (sample_size) from sd-vae-ft's AutoencoderKL (4 levels: factor 8)
HUB_DIT = {"facebook/DiT-XL-2-256": (32, [128, 256, 512, 512])}


def _section_commands(title: str) -> list[list[str]]:
    """The shell commands of the first ```bash block under README heading ``title`` (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {title}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    return [shlex.split(line) for line in lines]


def _option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_convert_finetune_generate_fit_together():
    convert, train, generate = _section_commands("Convert, fine-tune, generate")
    assert convert[1] == "conversion/convert.py" and "finetune/train.py" in train and generate[1] == "pipelines/generate.py"
    (src,), (converted,) = _option(convert, "--src"), _option(convert, "--out")
    (config_path,) = _option(train, "--config")
    config = load_config(ROOT / config_path, _option(train, "--set"))
    pretrained = (_option(train, "--pretrained") or [config["model"]["pretrained"]])[0]
    assert pretrained == converted, "train.py must fine-tune what convert.py wrote"
    (output_dir,) = _option(train, "--output_dir")
    assert _option(generate, "--checkpoint")[0].startswith(output_dir)
    sample_size, levels = HUB_DIT[src]
    transformer = SimpleNamespace(config=SimpleNamespace(sample_size=sample_size))
    vae = SimpleNamespace(config=_Config(block_out_channels=levels))
    check_resolution(transformer, vae, int(config["data"]["resolution"]))
    # and the demo's config is the one the trainer refuses for this model, naming the resolution it needs
    demo = load_config(ROOT / "finetune/configs/dit_demo_finetune.yaml")
    with pytest.raises(ValueError, match=r"set data.resolution to 256"):
        check_resolution(transformer, vae, int(demo["data"]["resolution"]))


class _Config(dict):
    """A diffusers-style config: ``"key" in config`` and ``config.key``."""

    __getattr__ = dict.__getitem__


def test_every_config_named_in_the_readme_loads():
    text = (ROOT / "README.md").read_text()
    named = sorted(set(re.findall(r"finetune/configs/[\w.]+\.yaml", text)))
    assert named
    for path in named:
        assert (ROOT / path).is_file(), path
        load_config(ROOT / path)


def test_the_data_free_commands_fit_together():
    """README, "Without a dataset": retrofit.py trains what convert.py wrote, against the model it converted, with a
    data-free config whose resolution the Hub DiT takes."""
    text = (ROOT / "README.md").read_text()
    block = text.split("**Without a dataset**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    convert, retrofit = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert convert[1] == "conversion/convert.py" and "finetune/retrofit.py" in retrofit
    assert _option(retrofit, "--pretrained") == _option(convert, "--out")
    assert _option(retrofit, "--teacher") == _option(convert, "--src")
    config = load_config(ROOT / _option(retrofit, "--config")[0])
    assert config["data"]["kind"] == "teacher"
    sample_size, levels = HUB_DIT[_option(convert, "--src")[0]]
    transformer = SimpleNamespace(config=SimpleNamespace(sample_size=sample_size))
    check_resolution(transformer, SimpleNamespace(config=_Config(block_out_channels=levels)), int(config["data"]["resolution"]))
    from helpers import load_script

    args = load_script("finetune/retrofit.py").parse_args(retrofit[retrofit.index("finetune/retrofit.py") + 1:])
    assert args.distill_steps > 0 and args.finetune_steps > 0
