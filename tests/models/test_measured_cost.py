"""The measured attention-cost model (issue 23, section 2): ``cost="measured"`` / ``MeasuredCost`` prices each layer by
timing its attention operator; selection under a budget follows the measured prices; the cache file."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import tiny_dit
from helpers_sana import tiny_sana

import mhla_diffusers
from mhla_diffusers import MeasuredCost, apply_mhla, attention_cost, mhla_spec
from mhla_diffusers.selection import cost as cost_module
from mhla_diffusers.selection.cost import layer_attention_costs, time_attention


@pytest.fixture
def priced(monkeypatch):
    """Replace the timer: softmax 1.0 s, linear 0.5 s, MHLA ``prices["mhla"]`` s; count the calls."""
    prices = {"softmax": 1.0, "linear": 0.5, "mhla": 0.6}
    calls = []

    def fake(kind, heads, head_dim, grid, block_grid=(1, 1, 1), **kwargs):
        calls.append((kind, heads, head_dim, tuple(grid), tuple(block_grid), kwargs["dtype"]))
        return prices[kind]

    monkeypatch.setattr(cost_module, "time_attention", fake)
    return prices, calls


def test_time_attention_runs_every_operator_and_refuses_bad_requests():
    for kind in ("softmax", "linear", "mhla"):
        seconds = time_attention(kind, 2, 8, (1, 8, 8), (1, 2, 2), reps=1)
        assert math.isfinite(seconds) and seconds > 0, kind
    with pytest.raises(ValueError, match="kind must be"):
        time_attention("flash", 2, 8, (8, 8))
    with pytest.raises(ValueError, match="does not fit the token grid"):
        time_attention("mhla", 2, 8, (1, 4, 4), (1, 8, 8))


def test_measured_costs_one_timing_per_shape_at_the_native_grid(priced):
    prices, calls = priced
    model = tiny_dit(num_layers=4, sample_size=16)  # native grid 8 x 8, 2 heads x 8
    stock, mhla, record = layer_attention_costs(model, "measured", num_blocks=4)
    assert stock == [1.0] * 4 and mhla == [0.6] * 4
    assert [c[0] for c in calls] == ["softmax", "mhla"]  # four identical layers: one timing of each operator
    assert calls[0][1:4] == (2, 8, (1, 8, 8)) and calls[1][4] == (1, 2, 2) and calls[0][5] == torch.float32
    assert record["model"] == "measured" and record["grid"] == [1, 8, 8] and record["block_grid"] == [1, 2, 2]
    assert record["threads"] == torch.get_num_threads() and record["dtype"] == "float32" and record["device"]
    # another grid, given
    calls.clear()
    layer_attention_costs(model, MeasuredCost(grid=(4, 4)), num_blocks=4)
    assert calls[0][3] == (1, 4, 4)
    # SANA's stock attention is linear: priced as plain linear attention
    calls.clear()
    layer_attention_costs(tiny_sana(num_layers=2), "measured")
    assert [c[0] for c in calls] == ["linear", "mhla"]


def test_budget_selection_follows_the_measured_prices(priced):
    """Under measured prices (MHLA 0.6 of softmax per layer) a budget keeps other layers than under the FLOP model
    (MHLA 0.14 of softmax at 64 tokens), and one the FLOPs allow is out of reach."""
    prices, _ = priced
    model = tiny_dit(num_layers=4, sample_size=16)
    scores = [0.4, 0.3, 0.2, 0.1]
    flops = apply_mhla(_copy(model), "auto", max_attention_cost=0.7, sensitivity=scores, num_blocks=4)
    trial = _copy(model)
    measured = apply_mhla(trial, "auto", max_attention_cost=0.7, sensitivity=scores, num_blocks=4, cost="measured")
    assert len(flops) == 2 and len(measured) == 3  # FLOPs: 2 stock layers fit in 0.7; measured: 0.6 + 0.1 = one
    selection = mhla_spec(trial)["selection"]
    assert selection["softmax_layers"] == [0]
    assert selection["attention_cost"] == pytest.approx((1.0 + 3 * 0.6) / 4)
    assert selection["cost_model"]["model"] == "measured" and selection["cost_model"]["stock_seconds"] == [1.0] * 4
    with pytest.raises(ValueError, match="below the cost of MHLA on every layer"):
        apply_mhla(_copy(model), "auto", max_attention_cost=0.55, sensitivity=scores, num_blocks=4, cost="measured")
    apply_mhla(_copy(model), "auto", max_attention_cost=0.55, sensitivity=scores, num_blocks=4)  # the FLOPs allow it
    prices["mhla"] = 1.2  # measured slower than softmax: a budget selects nothing, said so
    with pytest.raises(ValueError, match="measured, MHLA's operator is the slower one"):
        apply_mhla(_copy(model), "auto", max_attention_cost=0.9, sensitivity=scores, num_blocks=4, cost="measured")


def test_the_cost_model_is_recorded_in_the_saved_folder(priced, tmp_path):
    model = tiny_dit(num_layers=4, sample_size=16)
    apply_mhla(model, "auto", keep_softmax=1, sensitivity=[0.1, 0.4, 0.2, 0.3], num_blocks=4, cost="measured")
    mhla_diffusers.save_mhla_transformer(model, tmp_path / "m")
    selection = json.loads((tmp_path / "m" / "mhla_config.json").read_text())["selection"]
    assert selection["softmax_layers"] == [1] and selection["cost_model"]["mhla_seconds"] == [0.6] * 4
    assert selection["attention_cost"] == pytest.approx((1.0 + 3 * 0.6) / 4)
    loaded = mhla_diffusers.load_mhla_transformer(tmp_path / "m")
    assert mhla_spec(loaded)["selection"] == mhla_spec(model)["selection"]


def test_the_cache_file_is_read_and_written_atomically(priced, tmp_path):
    _, calls = priced
    model = tiny_dit(num_layers=2, sample_size=16)
    cache = tmp_path / "sub" / "costs.json"
    first = layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == 2
    assert sorted(p.name for p in cache.parent.iterdir()) == ["costs.json"]  # no temporary left behind
    calls.clear()
    assert layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)[:2] == first[:2]
    assert calls == []  # every price from the cache
    layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=1)  # another block grid: MHLA timed again
    assert [c[0] for c in calls] == ["mhla"]
    cache.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)
    cache.write_text(json.dumps({"a": "b"}))
    with pytest.raises(ValueError, match="not a cost cache"):
        layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)


def test_bad_cost_settings_are_refused_before_anything_is_installed():
    model = tiny_dit(num_layers=2, sample_size=16)
    with pytest.raises(ValueError, match="cost only apply with layers='auto'"):
        apply_mhla(model, "all", cost="measured")
    with pytest.raises(ValueError, match="cost must be one of"):
        apply_mhla(model, "auto", keep_softmax=1, sensitivity=[0.1, 0.2], cost="seconds")
    assert mhla_spec(model) is None
    with pytest.raises(ValueError, match="reps"):
        MeasuredCost(reps=0)
    with pytest.raises(ValueError, match="does not fit the token grid"):
        attention_cost(model, "all", num_blocks=4, cost=MeasuredCost(grid=(1, 1)))


def test_attention_cost_under_both_models(priced):
    model = tiny_dit(num_layers=3, sample_size=16)
    assert attention_cost(model, "all", num_blocks=4, cost="measured") == pytest.approx(0.6)
    assert attention_cost(model, [0], num_blocks=4, cost="measured") == pytest.approx((0.6 + 2) / 3)
    assert attention_cost(model, "all", num_blocks=4) == pytest.approx((4 * 64 * 64 + 2 * 16 * 64) / (4 * 64 * 64 * 8))


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("seconds", [-0.5, 0, 0.0, True, False, float("nan"), float("inf"), float("-inf")])
def test_a_cache_entry_that_is_not_a_time_is_refused_naming_the_file_and_entry(priced, tmp_path, seconds):
    """A hand-edited cache used to pass every number through: a negative price changed the selection and was recorded
    as a negative cost, NaN was blamed on the budget. Now refused with the file, the entry and what to do."""
    _, calls = priced
    model = tiny_dit(num_layers=2, sample_size=16)
    cache = tmp_path / "costs.json"
    layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)
    entries = json.loads(cache.read_text())
    key = next(k for k in entries if k.startswith("mhla|"))
    cache.write_text(json.dumps({**entries, key: seconds}))  # json writes NaN / Infinity, and reads them back
    calls.clear()
    with pytest.raises(ValueError, match="not a cost cache") as info:
        layer_attention_costs(model, MeasuredCost(cache=cache), num_blocks=4)
    message = str(info.value)
    assert str(cache) in message and repr(key) in message and "delete that entry (or the file)" in message
    assert "\n" not in message and calls == []
    with pytest.raises(ValueError, match=re.escape(repr(key))):  # through apply_mhla: refused before anything is installed
        apply_mhla(model, "auto", keep_softmax=1, sensitivity=[0.1, 0.2], num_blocks=4, cost=MeasuredCost(cache=cache))
    assert mhla_spec(model) is None
