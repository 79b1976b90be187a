"""A layer's MHLA is its own record (CASE C17): every setting that changes what a layer computes lives on
``attn.mhla`` and is saved from there.

For each family, a model with MHLA at non-default settings (DiT: the authors' normaliser, input norm, power and
feature epsilon; SANA: eps, power, no normaliser, output norm, gate, LePE; Wan: RoPE before the feature map or none, power, eps, no
normaliser), and every way a processor is put back on it (diffusers' ``set_attn_processor(MHLAProcessor())``, ours,
``attn.set_processor`` per layer, a swap to the stock processors and back, ``copy.deepcopy``, pickling, a save and
load): the same output bit for bit (same computation on the same weights), and a save after it loads back to that
output. A processor given a value that contradicts the layer's record is refused, naming both values, before
anything changes.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers import dit_inputs, randomize_mixing_, realign_, run_dit, self_attn, tiny_dit
from helpers_sana import run_sana, sana_inputs, sana_self_attn, tiny_sana
from helpers_wan import run_wan, tiny_wan, wan_inputs, wan_self_attn

import mhla_diffusers
from mhla_diffusers import MHLAProcessor, apply_mhla, load_mhla_transformer, mhla_spec, save_mhla_transformer
from mhla_diffusers.families import family_of, stock_processor

CASES = {
    "dit": (tiny_dit, run_dit, dit_inputs, self_attn,
            dict(block_grid=(1, 2, 2), denominator="authors_dit", input_norm=True, feature_power=2.0, feature_eps=1e-3)),
    "sana": (tiny_sana, run_sana, sana_inputs, sana_self_attn,
             dict(block_grid=(1, 2, 2), eps=1e-4, feature_power=2.0, normalize=False, output_norm=True, gate="authors",
                  lepe=True)),
    "wan-before": (tiny_wan, run_wan, wan_inputs, wan_self_attn,
                   dict(block_grid=(1, 2, 2), rope="before", feature_power=2.0, eps=1e-4, feature_eps=1e-3)),
    "wan-none": (tiny_wan, run_wan, wan_inputs, wan_self_attn,
                 dict(block_grid=(1, 2, 2), rope="none", normalize=False, mixing_clamp=False)),
}
# A value contradicting each setting above.
OTHER = {"denominator": "paper", "input_norm": False, "feature_power": 1.0, "feature_eps": 0.0, "eps": 1e-6,
         "normalize": True, "output_norm": False, "rope": "after", "mixing_clamp": True, "block_grid": (1, 1, 2),
         "gate": False, "lepe": False}


def _model(case: str):
    make, run, inputs, attn_of, settings = CASES[case]
    model = make(num_layers=2).eval()
    apply_mhla(model, **settings)
    with torch.no_grad():
        randomize_mixing_(model, low=0.05, high=1.2)
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if ".mhla." in name and ".mixing." not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model, lambda m: run(realign_(m), inputs(batch=1)), attn_of


def _stock_processors(model) -> dict:
    family = family_of(model)
    return {key: stock_processor(family, key[: -len(".processor")]) for key in mhla_diffusers.attention_modules(model)}


def _diffusers_one_liner(model):
    if not hasattr(model, "set_attn_processor"):
        pytest.skip("DiTTransformer2DModel has no set_attn_processor in diffusers 0.42")
    model.set_attn_processor(MHLAProcessor())
    return model


def _ours(model):
    mhla_diffusers.set_attn_processor(model, MHLAProcessor())
    return model


def _per_layer(model):
    for attn in mhla_diffusers.attention_modules(model).values():
        attn.set_processor(MHLAProcessor())
    return model


def _stock_and_back(model):
    mhla_diffusers.set_attn_processor(model, _stock_processors(model))
    assert not mhla_diffusers.is_mhla_model(model)
    mhla_diffusers.set_attn_processor(model, MHLAProcessor())
    return model


def _saved_and_loaded(model, folder):
    save_mhla_transformer(model, folder)
    return load_mhla_transformer(folder)


PATHS = {
    "diffusers_one_liner": lambda m, _: _diffusers_one_liner(m),
    "ours": lambda m, _: _ours(m),
    "per_layer": lambda m, _: _per_layer(m),
    "stock_and_back": lambda m, _: _stock_and_back(m),
    "deepcopy": lambda m, _: copy.deepcopy(m),
    "pickle": lambda m, _: pickle.loads(pickle.dumps(m)),
    "saved_and_loaded": lambda m, folder: _saved_and_loaded(m, folder / "first"),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_runs_the_recorded_layer_and_saves_it(case, path, tmp_path):
    model, run, _ = _model(case)
    before, spec = run(model), mhla_spec(model)
    again = PATHS[path](model, tmp_path)
    assert torch.equal(run(again), before)
    assert mhla_spec(again) == spec
    reloaded = _saved_and_loaded(_ours(again), tmp_path / "after")  # a save after that path, loaded afresh
    assert torch.equal(run(reloaded), before) and mhla_spec(reloaded) == spec


@pytest.mark.parametrize("case", list(CASES))
def test_a_contradicting_processor_is_refused_naming_both_values(case):
    model, run, attn_of = _model(case)
    before = run(model)
    processors = [a.processor for a in attn_of(model)]
    for name, value in CASES[case][4].items():
        for install in (_ours_with, _per_layer_with):
            with pytest.raises(ValueError) as err:
                install(model, MHLAProcessor(**{name: OTHER[name]}))
            message = str(err.value)
            assert repr(value) in message and repr(OTHER[name]) in message and "remove_mhla" in message, message
    assert [a.processor for a in attn_of(model)] == processors  # nothing changed
    assert torch.equal(run(model), before)


def _ours_with(model, processor):
    mhla_diffusers.set_attn_processor(model, processor)


def _per_layer_with(model, processor):
    for attn in mhla_diffusers.attention_modules(model).values():
        attn.set_processor(processor)


def test_the_settings_live_on_the_layer_not_the_processor():
    """The record: attn.mhla's attributes and parts; the installed processor holds no layer setting (backend
    apart), and a processor's explicit settings are the defaults of a fresh layer only."""
    model, _, _ = _model("wan-before")
    layer = model.blocks[0].attn1.mhla
    assert (layer.rope, layer.feature_power, layer.eps, layer.feature_eps, layer.normalize) == ("before", 2.0, 1e-4, 1e-3, True)
    processor = model.blocks[0].attn1.processor
    assert all(getattr(processor, name) is None for name in ("normalize", "eps", "feature_power", "rope", "feature_eps"))
    assert layer.settings.block_grid == (1, 2, 2) and layer.settings.output_norm is False
    fresh = tiny_wan(num_layers=2)
    fresh.set_attn_processor(MHLAProcessor(rope="none", eps=1e-3))
    mhla_diffusers.materialize_mhla(fresh)
    assert (fresh.blocks[1].attn1.mhla.rope, fresh.blocks[1].attn1.mhla.eps) == ("none", 1e-3)
