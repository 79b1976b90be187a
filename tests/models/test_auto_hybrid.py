"""Automatic hybrid selection: layer_sensitivity, apply_mhla(layers="auto"), the attention-cost budget,
calibration inputs made from a pipeline (issue 13, section 1)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import dit_inputs, run_dit, tiny_dit, tiny_dit_pipeline
from helpers_sana import sana_inputs, tiny_sana, tiny_sana_pipeline
from helpers_wan import tiny_wan, tiny_wan_pipeline, wan_inputs

import mhla_diffusers
from mhla_diffusers import apply_mhla, attention_cost, calibration_inputs, layer_sensitivity, mhla_spec

FIT = dict(fit_steps=15, progress=False)


def _peaked_dit(peaked: int = 2, num_layers: int = 4):
    """A tiny DiT (8 x 8 = 64 tokens, 2 heads x 8) whose layer ``peaked`` has near one-hot softmax attention
    (q, k weights x 6) while the others are smooth (x 0.3): the peaked one is much harder to linearise."""
    model = tiny_dit(num_layers=num_layers, sample_size=16)
    with torch.no_grad():
        for i, block in enumerate(model.transformer_blocks):
            scale = 6.0 if i == peaked else 0.3
            block.attn1.to_q.weight.mul_(scale)
            block.attn1.to_k.weight.mul_(scale)
    return model


def _dit_calibration(n: int = 3, size: int = 16):
    out = []
    for seed in range(n):
        latent, t, y = dit_inputs(batch=1, size=size, seed=seed)
        out.append({"hidden_states": latent, "timestep": t, "class_labels": y})
    return out


@pytest.fixture(scope="module")
def peaked():
    model = _peaked_dit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 15-step fit may be reported as not converged
        scores = layer_sensitivity(model, _dit_calibration(), **FIT)
    return model, scores


def test_the_layer_hardest_to_linearise_scores_highest_and_is_kept(peaked):
    """The peaked layer gets the highest score, by a wide margin, and keep_softmax=1 keeps exactly it;
    apply_mhla computing the scores itself (calibration=) picks the same layers."""
    model, scores = peaked
    assert sorted(scores) == [0, 1, 2, 3] and all(math.isfinite(s) and s > 0 for s in scores.values())
    assert scores.ranking()[0] == 2
    assert scores[2] > 2 * max(scores[i] for i in (0, 1, 3)), dict(scores)  # measured: 3x
    assert all(scores.fit_error[i] <= scores.init_error[i] for i in scores)  # the fit never made a layer worse

    chosen = copy.deepcopy(model)
    names = apply_mhla(chosen, "auto", keep_softmax=1, sensitivity=scores)
    assert names == [f"transformer_blocks.{i}.attn1" for i in (0, 1, 3)]
    selection = mhla_spec(chosen)["selection"]
    assert selection["method"] == "auto" and selection["keep_softmax"] == 1 and selection["softmax_layers"] == [2]
    assert selection["scores"] == [scores[i] for i in range(4)]
    assert selection["sensitivity"]["fit_steps"] == FIT["fit_steps"]

    measured = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_mhla(measured, "auto", keep_softmax=1, calibration=_dit_calibration())
    assert mhla_spec(measured)["layers"] == [0, 1, 3]


def test_keep_softmax_zero_is_layers_all(peaked):
    model, scores = peaked
    auto, every = copy.deepcopy(model), copy.deepcopy(model)
    apply_mhla(auto, "auto", keep_softmax=0, sensitivity=scores, num_blocks=4)
    apply_mhla(every, "all", num_blocks=4)
    a, b = auto.state_dict(), every.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    spec_auto, spec_all = mhla_spec(auto), mhla_spec(every)
    assert spec_auto.pop("selection")["softmax_layers"] == [] and spec_auto == spec_all
    inputs = dit_inputs(batch=2, size=16, seed=5)
    torch.testing.assert_close(run_dit(auto, inputs), run_dit(every, inputs), rtol=0, atol=0)


def _per_layer_cost(model, num_blocks: int) -> tuple[float, float]:
    """The documented FLOP model, written out here: softmax 4 N^2 d vs MHLA 4 N d^2 + 2 M^2 d^2, per head."""
    n, d, heads = 64, 8, 2  # tiny_dit(sample_size=16, patch 2): 8 x 8 tokens, 2 heads x 8
    return heads * 4 * n * n * d, heads * (4 * n * d * d + 2 * num_blocks**2 * d * d)


def test_budget_is_respected_and_tight():
    """max_attention_cost=F keeps the longest prefix of the ranking whose cost is <= F: one more layer
    would exceed F; attention_cost agrees with the formula written out independently."""
    model = tiny_dit(num_layers=6, sample_size=16)
    scores = {0: 0.1, 1: 0.5, 2: 0.05, 3: 0.3, 4: 0.2, 5: 0.4}
    ranking = [1, 5, 3, 4, 0, 2]
    softmax, mhla = _per_layer_cost(model, num_blocks=4)
    all_mhla = mhla / softmax
    assert attention_cost(model, "all", num_blocks=4) == pytest.approx(all_mhla)
    for budget in (0.2, 0.35, 0.5, 0.8, 0.99):
        trial = copy.deepcopy(model)
        apply_mhla(trial, "auto", max_attention_cost=budget, sensitivity=scores, num_blocks=4)
        layers = mhla_spec(trial)["layers"]
        kept = [i for i in range(6) if i not in layers]
        assert kept == sorted(ranking[: len(kept)]), (budget, kept)  # the most sensitive ones
        cost = (len(kept) * softmax + len(layers) * mhla) / (6 * softmax)
        assert cost <= budget < cost + (softmax - mhla) / (6 * softmax), (budget, cost)  # respected and tight
        assert attention_cost(trial, layers, num_blocks=4) == pytest.approx(cost)
        assert mhla_spec(trial)["selection"]["attention_cost"] == pytest.approx(cost)
        assert mhla_spec(trial)["selection"]["max_attention_cost"] == budget
    with pytest.raises(ValueError, match="below the cost of MHLA on every layer"):
        apply_mhla(copy.deepcopy(model), "auto", max_attention_cost=all_mhla * 0.99, sensitivity=scores, num_blocks=4)
    with pytest.raises(ValueError, match="nothing would be converted"):
        apply_mhla(copy.deepcopy(model), "auto", max_attention_cost=1.0, sensitivity=scores, num_blocks=4)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="0 < F <= 1"):
            apply_mhla(copy.deepcopy(model), "auto", max_attention_cost=bad, sensitivity=scores)


def test_bad_selection_requests_are_refused():
    model = tiny_dit(num_layers=3)
    scores = [0.1, 0.2, 0.3]
    cases = [
        (dict(keep_softmax=3, sensitivity=scores), "keep_softmax must be an integer in 0..2"),
        (dict(keep_softmax=-1, sensitivity=scores), "keep_softmax must be an integer in 0..2"),
        (dict(keep_softmax=float("nan"), sensitivity=scores), "keep_softmax must be an integer in 0..2"),  # was int()'s own error
        (dict(keep_softmax=1, max_attention_cost=0.5, sensitivity=scores), "exactly one of keep_softmax"),
        (dict(sensitivity=scores), "exactly one of keep_softmax"),
        (dict(keep_softmax=1), "needs calibration inputs"),
        (dict(keep_softmax=1, sensitivity=scores, calibration=_dit_calibration(1, 8)), "exactly one of them"),
        (dict(keep_softmax=1, sensitivity=[0.1, 0.2]), "has 2 scores"),
        (dict(keep_softmax=1, sensitivity={0: 0.1, 1: 0.2, 5: 0.3}), "every self-attention layer"),
        (dict(keep_softmax=1, sensitivity=[0.1, float("nan"), 0.3]), "finite"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            apply_mhla(copy.deepcopy(model), "auto", **kwargs)
    with pytest.raises(ValueError, match="only apply with layers='auto'"):
        apply_mhla(copy.deepcopy(model), "all", keep_softmax=1)
    sana = tiny_sana(num_layers=2)
    with pytest.raises(ValueError, match="already linear"):
        apply_mhla(sana, "auto", max_attention_cost=0.9, sensitivity=[0.1, 0.2])
    assert not mhla_diffusers.is_mhla_model(model) and not mhla_diffusers.is_mhla_model(sana)


def test_bad_calibration_is_refused():
    model = tiny_dit(num_layers=2)
    for calibration, message in (
        ([], "calibration is empty"),
        (None, "list of dicts"),
        ({"hidden_states": torch.zeros(1)}, "list of dicts"),
        ([("not", "a dict")], "entry 0 must be a dict"),
        ([{"hidden_states": torch.randn(1, 3, 8, 8), "timestep": torch.tensor([1]), "class_labels": torch.tensor([1])}],
         "entry 0 does not run through"),
    ):
        with pytest.raises(ValueError, match=message):
            layer_sensitivity(model, calibration, **FIT)
    calibration = _dit_calibration(1, 8)
    for bad in (dict(fit_steps=True), dict(fit_steps=2.0), dict(convergence_tol=-1), dict(convergence_tol=float("nan"))):
        with pytest.raises(ValueError, match="fit_steps must be an integer >= 0"):  # were accepted (a bool, a float)
            layer_sensitivity(model, calibration, **{**FIT, **bad})
    apply_mhla(model, [0])
    with pytest.raises(ValueError, match="remove_mhla first"):
        layer_sensitivity(model, _dit_calibration(1, 8), **FIT)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._load_state_dict_pre_hooks) for m in model.modules())


def test_deterministic_and_the_model_is_restored_exactly():
    """Same seed, same scores; afterwards the model is the one given: weights bitwise, the same processor
    objects, no MHLA module or hook, requires_grad / .grad / train mode untouched, the same output."""
    model = tiny_dit(num_layers=2, sample_size=16).train()
    model.transformer_blocks[0].attn1.to_k.requires_grad_(False)
    grad = torch.ones_like(model.transformer_blocks[1].attn1.to_q.weight)
    model.transformer_blocks[1].attn1.to_q.weight.grad = grad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    processors = [m.attn1.processor for m in model.transformer_blocks]
    hooks = _hooks(model)
    inputs = dit_inputs(batch=1, size=16, seed=9)
    expected = run_dit(copy.deepcopy(model).eval(), inputs)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = layer_sensitivity(model, _dit_calibration(2), **FIT)
        second = layer_sensitivity(model, _dit_calibration(2), **FIT)
    # the same computation twice on one thread: equal up to float rounding (never asserted bitwise)
    assert first.scores == pytest.approx(second.scores, rel=1e-6, abs=0)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not consumed
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    assert model.transformer_blocks[1].attn1.to_q.weight.grad is grad
    assert all(p.grad is None for n, p in model.named_parameters() if "transformer_blocks.1.attn1.to_q.weight" not in n)
    assert [m.attn1.processor for m in model.transformer_blocks] == processors
    assert all(a is b for a, b in zip([m.attn1.processor for m in model.transformer_blocks], processors))
    assert _hooks(model) == hooks and model.training and not mhla_diffusers.is_mhla_model(model)
    assert not any(name.startswith("_mhla") for name in model.__dict__)
    torch.testing.assert_close(run_dit(model.eval(), inputs), expected, rtol=1e-6, atol=1e-6)


def test_wan_with_rope():
    model = tiny_wan(num_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calibration = [wan_inputs(batch=1, frames=2, size=8, seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = layer_sensitivity(model, calibration, **FIT)
    assert sorted(scores) == [0, 1] and all(math.isfinite(s) and s > 0 for s in scores.values())
    assert all(scores.fit_error[i] <= scores.init_error[i] for i in scores)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert apply_mhla(model, "auto", keep_softmax=1, sensitivity=scores) == [f"blocks.{scores.ranking()[1]}.attn1"]


def test_sana_stock_linear_attention_is_reproduced():
    """SANA's stock self-attention is ReLU linear attention: an all-ones mixing matrix reproduces it, so the
    fit starts there and every score is float rounding."""
    model = tiny_sana(num_layers=2)
    latent, text, t, mask = sana_inputs(batch=1, size=8)
    calibration = [{"hidden_states": latent, "encoder_hidden_states": text, "timestep": t, "encoder_attention_mask": mask}]
    scores = layer_sensitivity(model, calibration, **FIT)
    assert all(scores.init[i] == "ones" for i in scores)
    assert max(scores.values()) < 1e-5, dict(scores)


def test_calibration_inputs_dit():
    pipe = tiny_dit_pipeline(num_layers=2)
    rng = torch.get_rng_state()
    inputs = calibration_inputs(pipe, num_samples=4, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(inputs) == 4 and all(sorted(e) == ["class_labels", "hidden_states", "timestep"] for e in inputs)
    assert all(e["hidden_states"].shape == (1, 4, 8, 8) for e in inputs)
    steps = [int(e["timestep"]) for e in inputs]
    assert steps == [125, 375, 625, 875]  # spread: (i + 0.5) / n of 1000 training steps
    assert all(0 <= int(e["class_labels"]) < 1000 for e in inputs)
    again = calibration_inputs(pipe.transformer, num_samples=4, seed=3)  # the transformer alone is enough
    assert all(torch.equal(a["hidden_states"], b["hidden_states"]) for a, b in zip(inputs, again))
    other = calibration_inputs(pipe, num_samples=4, seed=4)
    assert not torch.equal(inputs[0]["hidden_states"], other[0]["hidden_states"])
    with pytest.raises(ValueError, match="class-conditional"):
        calibration_inputs(pipe, prompts=["a cat"])
    with pytest.raises(ValueError, match="num_samples"):
        calibration_inputs(pipe, num_samples=0)


def test_calibration_inputs_text_families(tmp_path):
    """SANA: prompts through the pipeline's own encode_prompt; a transformer alone needs cached embeddings
    (a clear error without them), which encode_calibration_prompts writes; Wan at a small latent size."""
    from safetensors.torch import save_file

    pipe = tiny_sana_pipeline(num_layers=2, sample_size=8)
    inputs = calibration_inputs(pipe, num_samples=3)
    assert [sorted(e) for e in inputs] == [["encoder_attention_mask", "encoder_hidden_states", "hidden_states", "timestep"]] * 3
    assert inputs[0]["hidden_states"].shape == (1, 4, 8, 8)
    assert [float(e["timestep"]) for e in inputs] == pytest.approx([1000 / 6, 500, 5000 / 6])
    with pytest.raises(ValueError, match="calibration-embeddings"):
        calibration_inputs(pipe.transformer)
    cached = mhla_diffusers.encode_calibration_prompts(pipe)
    save_file(cached, str(tmp_path / "emb.safetensors"))
    from_file = calibration_inputs(pipe.transformer, num_samples=3, embeddings=tmp_path / "emb.safetensors")
    for a, b in zip(inputs, from_file):
        torch.testing.assert_close(a["encoder_hidden_states"], b["encoder_hidden_states"])
    wan = tiny_wan_pipeline(num_layers=1)
    video = calibration_inputs(wan, num_samples=2, latent_size=(2, 8, 8))  # UMT5 through WanPipeline.encode_prompt
    assert video[0]["hidden_states"].shape == (1, 16, 2, 8, 8) and video[1]["encoder_hidden_states"].shape[::2] == (1, 32)
    text = {"encoder_hidden_states": torch.randn(2, 6, 32)}
    cached = calibration_inputs(wan.transformer, num_samples=2, embeddings=text, latent_size=(2, 8, 8))
    assert torch.equal(cached[1]["encoder_hidden_states"], text["encoder_hidden_states"][1:])
    with torch.no_grad():
        wan.transformer(**video[0])
        wan.transformer(**cached[1])
    # sizes the patch embedding cannot take whole (it would drop the remainder), non-integers (were truncated)
    for source, size in ((wan, (2, 7, 8)), (wan, (2, 8.5, 8)), (pipe.transformer, (1, 8, 8)), (pipe.transformer, (True, 8))):
        with pytest.raises(ValueError, match="latent_size"):
            calibration_inputs(source, num_samples=1, embeddings=text, latent_size=size)
