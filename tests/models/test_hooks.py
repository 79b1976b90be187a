"""Hooks belong to a model: the token-grid hooks sit on each model that has MHLA, and a process-wide
forward pre-hook exists only while a layer given an MHLAProcessor (the bare one-liner) waits for
its transformer to be found; a model without MHLA runs with no hook of ours at all."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers_sana import sana_inputs, tiny_sana
from torch import nn

from mhla_diffusers import MHLAProcessor, apply_mhla, materialize_mhla, remove_mhla
from mhla_diffusers.models import grid as grid_module
from mhla_diffusers.models import lazy as lazy_module

module_hooks = nn.modules.module


def _ours(hooks: dict) -> list:
    return [h for h in hooks.values() if getattr(h, "__module__", "").startswith("mhla_diffusers")]


def _global_forward_hooks() -> list:
    return _ours(module_hooks._global_forward_pre_hooks) + _ours(module_hooks._global_forward_hooks)


def _run(model):
    latent, text, timestep, mask = sana_inputs(size=8)
    with torch.no_grad():
        return model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample


@pytest.fixture(autouse=True)
def _nothing_waits():
    gc.collect()  # layers of other tests' models, gone
    assert grid_module.waiting_layers() == 0 and _global_forward_hooks() == []


class _CountCalls:
    def __init__(self):
        self.modules = 0

    def __call__(self, module, args):
        self.modules += 1


def test_apply_mhla_leaves_no_process_wide_forward_hook_and_a_stock_model_sees_none():
    model, stock = tiny_sana(num_layers=2, sample_size=8), tiny_sana(num_layers=2, sample_size=8)
    apply_mhla(model)
    _run(model)
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0
    assert grid_module.has_grid_hooks(model) and not grid_module.has_grid_hooks(stock)
    # the stock model's modules run with no hook of ours: only torch's own hooks of the test itself
    counter = _CountCalls()
    handle = module_hooks.register_module_forward_pre_hook(counter)
    try:
        _run(stock)
    finally:
        handle.remove()
    assert counter.modules > 0 and _global_forward_hooks() == []
    assert all(not _ours(m._forward_pre_hooks) and not _ours(m._forward_hooks) for m in stock.modules())


def test_bare_one_liner_finder_exists_only_until_the_model_is_found():
    model = tiny_sana(num_layers=2, sample_size=8)
    assert _global_forward_hooks() == []
    model.set_attn_processor(MHLAProcessor())
    assert len(_global_forward_hooks()) == 1 and grid_module.waiting_layers() == 4  # self- and cross-attention
    _run(model)
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0
    assert grid_module.has_grid_hooks(model)
    remove_mhla(model)
    assert not grid_module.has_grid_hooks(model) and _global_forward_hooks() == []


def test_finder_goes_when_the_waiting_layers_go_back_to_stock_or_their_model_is_hooked():
    model = tiny_sana(num_layers=2, sample_size=8)
    model.set_attn_processor(MHLAProcessor())
    remove_mhla(model)  # back to stock before any forward: nothing waits any more
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0
    model.set_attn_processor(MHLAProcessor())
    materialize_mhla(model)  # hooks the model now
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0


def test_stock_processors_set_by_diffusers_let_the_finder_go_at_the_next_forward():
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = tiny_sana(num_layers=2, sample_size=8)
    model.set_attn_processor(MHLAProcessor())
    model.set_attn_processor(AttnProcessor2_0())  # diffusers' own call: we are not told
    assert len(_global_forward_hooks()) == 1
    _run(model)  # a stock forward: its layers wait no more
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0
    assert not grid_module.has_grid_hooks(model)


def test_registration_hook_lives_only_while_an_mhla_processor_does():
    gc.collect()
    before = len(_ours(module_hooks._global_module_registration_hooks))
    model = tiny_sana(num_layers=2, sample_size=8)
    apply_mhla(model)
    assert len(_ours(module_hooks._global_module_registration_hooks)) == 1
    remove_mhla(model)
    gc.collect()
    after = len(_ours(module_hooks._global_module_registration_hooks))
    assert before <= 1 and (after == 0) == (lazy_module._live_processors == 0), (before, after)


def test_copies_of_a_one_liner_model_before_its_first_forward_find_their_model_too():
    import copy
    import io
    import warnings

    model = tiny_sana(num_layers=2, sample_size=8)
    model.set_attn_processor(MHLAProcessor())
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _run(model)  # the original is found first: the copies still wait
        assert len(_global_forward_hooks()) == 1
        assert torch.equal(_run(twin), expected)
        buffer.seek(0)
        assert torch.equal(_run(torch.load(buffer, weights_only=False)), expected)
    gc.collect()
    assert _global_forward_hooks() == [] and grid_module.waiting_layers() == 0
