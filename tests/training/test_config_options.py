"""The trainer's ``mhla`` section takes the per-layer options (``gate``, ``lepe``, ``lepe_init``, ``rope``,
``feature_power``, the ``init`` names): validated with the key named, applied with ``apply_mhla``, trained and
exported in the converted format."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_train import tiny_config
from safetensors.torch import load_file

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.training import load_config
from mhla_diffusers.training.config import _MHLA_KEYS


def test_the_new_keys_are_mhla_keys():
    assert {"gate", "lepe", "lepe_init", "rope", "feature_power", "init"} <= _MHLA_KEYS


def test_valid_values(tmp_path):
    config = load_config(tiny_config(tmp_path / "x", mhla={"layers": "all"}), [
        "mhla.gate=authors", "mhla.lepe=true", "mhla.lepe_init=authors", "mhla.rope=none", "mhla.feature_power=2",
        "mhla.init=authors_constant",
    ])
    assert config["mhla"] == {"layers": "all", "gate": "authors", "lepe": True, "lepe_init": "authors", "rope": "none",
                              "feature_power": 2.0, "init": "authors_constant"}
    for gate in ("true", "false", "null", "neutral"):
        load_config(tiny_config(tmp_path / "y", mhla={"layers": "all"}), [f"mhla.gate={gate}"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mhla.gate=sigmoid", r"mhla.gate must be one of \['neutral', 'authors'\], true \('neutral'\), false or null"),
        ("mhla.gate=1", "mhla.gate must be one of"),
        ("mhla.lepe=1", "mhla.lepe must be true or false"),
        ("mhla.lepe_init=kaiming", r"mhla.lepe_init must be one of \['zeros', 'authors'\]"),
        ("mhla.rope=sideways", r"mhla.rope must be one of \['after', 'before', 'none'\] or null"),
        ("mhla.feature_power=0", "mhla.feature_power must be a finite number > 0"),
        ("mhla.feature_power=inf", "mhla.feature_power must be a finite number > 0"),
        ("mhla.init=paper", r"mhla.init: unknown mixing-matrix init 'paper': .*locality.*authors_constant"),
        ("mhla.lepe_size=3", "unknown mhla keys"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        load_config(tiny_config(tmp_path / "x", mhla={"layers": "all"}), [override])


def test_gate_and_lepe_train_and_export(tmp_path):
    """One step of DiT from scratch with the authors' gate and LePE (PyTorch's inits): the step changes them (they
    are MHLA parameters, trained with the model), the exported checkpoint records and holds them, and loads."""
    mhla = {"layers": "all", "num_blocks": 4, "gate": "authors", "lepe": True, "lepe_init": "authors", "init": "uniform"}
    summary = training.train(load_config(tiny_config(tmp_path / "run", mhla=mhla, train={"max_steps": 1})))
    assert summary["mhla_layers"] == 2
    folder = tmp_path / "run" / "final" / "transformer"
    config = json.loads((folder / "mhla_config.json").read_text())
    assert config["gate"] == "authors" and config["lepe"] is True
    weights = load_file(folder / "mhla.safetensors")
    assert sum(k.endswith(("mhla.gate.weight", "mhla.lepe.weight")) for k in weights) == 4
    # uniform start: every mixing matrix moved by the step (lr 1e-3), then clamped back into [0, 1]
    mixing = [v for k, v in weights.items() if k.endswith("mhla.mixing.weight")]
    assert all(not torch.equal(m, torch.ones_like(m)) and m.max() <= 1 for m in mixing)
    pipe = mhla_diffusers.load_mhla_pipeline(tmp_path / "run" / "final")
    attn = pipe.transformer.transformer_blocks[0].attn1
    assert attn.mhla.gate.form == "authors" and attn.mhla.lepe.weight.shape == (16, 1, 3, 3)
