"""MHLA on Wan VACE (WanVACETransformer3DModel): two kinds of self-attention layers, a control path kept stock.

What a Wan VACE user is promised, as tests (the generic contract, tests/models/test_family_contract.py, already
covers cross-attention bit for bit under the one-liner, one-liner == apply_mhla, save / load, ring mode):

* the layer numbers: the main blocks first (``blocks.i.attn1`` is layer ``i``), then the VACE blocks
  (``vace_blocks.i.attn1`` is ``num_layers + i``); ``apply_mhla`` on main only, VACE only, both, a hybrid;
* what provably stays the stock computation, bit for bit, read off diffusers' forward (the VACE blocks all run
  first, on the patch-embedded main tokens and the control latent; hint ``j`` is added after main block
  ``vace_layers[j]``): with MHLA on main layers only, every VACE block's output (the hints); with MHLA on VACE
  block ``j`` only, the hints before ``j`` and every main block up to ``vace_layers[j]`` (its output is taken
  before the hint is added);
* ``control_hidden_states_scale = 0``: no hint reaches the trunk, so the output is the plain Wan model's on the
  main weights (``WanTransformer3DModel``), bit for bit, whatever the VACE layers run;
* ``layers="auto"`` sees both kinds (calibration inputs with a control latent, scores and a budget over all
  layers); gradients reach the mixing matrices of both kinds;
* a hybrid over both kinds under Ulysses context parallelism (the family's own plan) equals one process.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import randomize_mixing_
from helpers_wan_vace import VACE_IN_CHANNELS, run_wan_vace, tiny_wan_vace, tiny_wan_vace_pipeline, wan_vace_inputs

import mhla_diffusers
from mhla_diffusers import apply_mhla, calibration_inputs, mhla_spec, mixing_parameters, remove_mhla
from mhla_diffusers.families import family_of, self_attention_modules
from mhla_diffusers.selection.cost import layer_attention_flops

GRID = (1, 2, 3)  # a block grid for the 3 x 4 x 6 token grid of wan_vace_inputs()
MAIN = ["blocks.0.attn1", "blocks.1.attn1", "blocks.2.attn1"]
VACE = ["vace_blocks.0.attn1", "vace_blocks.1.attn1"]
FIT = dict(fit_steps=10, progress=False)
CP_TOL, CP_GRAD_TOL = 1e-5, 1e-4  # as tests/models/test_context_parallel.py


class Outputs:
    """Forward hooks recording each call's output (detached clones) of the modules named."""

    def __init__(self, model, names):
        self.modules = {n: model.get_submodule(n) for n in names}
        self.seen: dict[str, list] = {n: [] for n in names}
        self._handles = []

    def __enter__(self):
        def clone(x):
            return tuple(clone(v) for v in x) if isinstance(x, tuple) else x.detach().clone() if x is not None else None

        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(lambda m, a, out, name=name: self.seen[name].append(clone(out))))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False


def _identical(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _record(model, inputs, names):
    with Outputs(model, names) as rec:
        out = run_wan_vace(model, inputs)
    return out, rec.seen


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# -- the layers --------------------------------------------------------------------------------------
def test_layer_order_and_selection_by_kind():
    """3 main + 2 VACE blocks: layers 0-2 are blocks.{0,1,2}.attn1, 3-4 vace_blocks.{0,1}.attn1. Lists select by
    those numbers (negative ones count from the VACE end), the hybrid keeps every third stock over the whole
    order (0 and 3: one of each kind); cross-attention and the control path stay stock; remove_mhla restores the
    model bit for bit."""
    model = tiny_wan_vace()
    assert [n for n, _ in self_attention_modules(model)] == MAIN + VACE
    assert family_of(model).name == "wan_vace" and model.config.vace_layers == [0, 2]
    inputs = wan_vace_inputs()
    stock = run_wan_vace(model, inputs)
    cases = {
        "main only": ([0, 1, 2], MAIN),
        "VACE only": ([3, 4], VACE),
        "both": ("all", MAIN + VACE),
        "hybrid": ("hybrid", ["blocks.1.attn1", "blocks.2.attn1", "vace_blocks.1.attn1"]),
        "from the end": ([-1, 0], ["blocks.0.attn1", "vace_blocks.1.attn1"]),
    }
    for label, (layers, names) in cases.items():
        assert apply_mhla(model, layers=layers, block_grid=GRID) == names, label
        spec = mhla_spec(model)
        assert spec["family"] == "wan_vace" and spec["num_layers"] == 5, label
        assert spec["layers"] == [i for i, n in enumerate(MAIN + VACE) if n in names], label
        processors = {n: type(m.processor).__name__ for n, m in model.named_modules() if hasattr(m, "processor")}
        assert {n for n, p in processors.items() if p != "WanAttnProcessor"} == set(names), label  # every attn2 stock
        assert sorted(n.split(".mhla.mixing")[0] for n, _ in model.named_parameters() if "mhla.mixing" in n) == sorted(names)
        out = run_wan_vace(model, inputs)
        assert torch.isfinite(out).all() and _rel(out, stock) > 1e-4, label
        remove_mhla(model)
        assert torch.equal(run_wan_vace(model, inputs), stock), label
    with pytest.raises(ValueError):
        apply_mhla(model, layers=[5], block_grid=GRID)


def test_mhla_on_main_layers_leaves_the_hints_bit_identical():
    """The VACE blocks run before any main block, on the patch-embedded main tokens and the control latent: with
    MHLA on every main layer, the control patch embedding, every VACE block's hint and control state and the
    first main block's input are the stock ones, bit for bit; the output is not."""
    model = tiny_wan_vace()
    inputs = wan_vace_inputs()
    names = ["vace_patch_embedding", "patch_embedding", "vace_blocks.0", "vace_blocks.1", "vace_blocks.0.attn2",
             "vace_blocks.1.attn2"]
    stock, want = _record(model, inputs, names)
    apply_mhla(model, layers=[0, 1, 2], block_grid=GRID)
    randomize_mixing_(model)
    out, got = _record(model, inputs, names)
    for name in names:
        assert len(got[name]) == 1 and _identical(got[name], want[name]), name
    hint = want["vace_blocks.1"][0][0]
    assert hint.shape == (2, 72, 24) and hint.abs().max() > 0
    assert _rel(out, stock) > 1e-3


@pytest.mark.parametrize("vace_index", [0, 1])
def test_mhla_on_one_vace_block_leaves_the_trunk_before_its_hint_bit_identical(vace_index):
    """MHLA on VACE block j alone: the hints of VACE blocks before j and the output of every main block up to
    vace_layers[j] (the hint is added after the block returns) are the stock ones bit for bit; hint j, the main
    blocks after it and the output change."""
    model = tiny_wan_vace()
    inputs = wan_vace_inputs()
    joins = model.config.vace_layers[vace_index]  # hint j is added to the output of main block vace_layers[j]
    names = [f"blocks.{i}" for i in range(3)] + ["vace_blocks.0", "vace_blocks.1"]
    stock, want = _record(model, inputs, names)
    apply_mhla(model, layers=[3 + vace_index], block_grid=GRID)
    randomize_mixing_(model)
    out, got = _record(model, inputs, names)
    for j in range(2):
        assert _identical(got[f"vace_blocks.{j}"], want[f"vace_blocks.{j}"]) == (j < vace_index), j
    for i in range(3):
        assert torch.equal(got[f"blocks.{i}"][0], want[f"blocks.{i}"][0]) == (i <= joins), i
    assert _rel(out, stock) > 1e-4


def test_conditioning_scale_zero_is_the_plain_wan_trunk():
    """control_hidden_states_scale = 0 adds hint * 0 = 0 after each VACE layer (diffusers: hidden_states + hint *
    scale; hints are finite): the output is the WanTransformer3DModel's with the main weights, bit for bit; MHLA
    on the VACE layers then changes nothing, and MHLA on the main layers matches the plain model with the same
    mixing matrices; the VACE mixing matrices get exactly zero gradient."""
    from diffusers import WanTransformer3DModel

    model = tiny_wan_vace()
    config = {k: v for k, v in model.config.items() if not k.startswith("_") and k not in ("vace_layers", "vace_in_channels")}
    plain = WanTransformer3DModel(**config).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("vace_")}, strict=True)
    inputs = wan_vace_inputs()
    silent = dict(inputs, control_hidden_states_scale=torch.zeros(2))
    trunk = {k: inputs[k] for k in ("hidden_states", "timestep", "encoder_hidden_states")}
    with torch.no_grad():
        want = plain(**trunk).sample
    assert torch.equal(run_wan_vace(model, silent), want)
    assert not torch.equal(run_wan_vace(model, inputs), want)

    apply_mhla(model, layers=[3, 4], block_grid=GRID)
    randomize_mixing_(model)
    assert torch.equal(run_wan_vace(model, silent), want)
    remove_mhla(model)

    apply_mhla(model, layers="all", block_grid=GRID)
    apply_mhla(plain, layers="all", block_grid=GRID)
    randomize_mixing_(model)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("blocks.") and "mhla" in k}, strict=False)
    with torch.no_grad():
        assert torch.equal(run_wan_vace(model, silent), plain(**trunk).sample)
    model(**silent).sample.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "mhla.mixing" in n}
    assert all(torch.equal(g, torch.zeros_like(g)) for n, g in grads.items() if n.startswith("vace_blocks."))
    assert all(g.abs().max() > 0 for n, g in grads.items() if n.startswith("blocks."))


def test_gradients_reach_the_mixing_matrices_of_both_kinds():
    """A training step with MHLA on every layer: each of the 5 mixing matrices (3 main, 2 VACE) gets a finite,
    non-zero gradient; gradient checkpointing gives the same gradients."""
    model = tiny_wan_vace()
    apply_mhla(model, layers="all", block_grid=GRID)
    randomize_mixing_(model, low=0.1, high=0.9)  # inside the clamp's range: every entry passes its gradient
    model.train()
    inputs = wan_vace_inputs(batch=1)
    target = torch.randn(1, 16, 3, 8, 12, generator=torch.Generator().manual_seed(3))

    def grads(m):
        m.zero_grad(set_to_none=True)
        (m(**inputs).sample - target).square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if "mhla.mixing" in n}

    plain = grads(model)
    assert sorted(n.split(".attn1.")[0] for n in plain) == ["blocks.0", "blocks.1", "blocks.2", "vace_blocks.0", "vace_blocks.1"]
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in plain.values()), {n: g.abs().max() for n, g in plain.items()}
    assert len(mixing_parameters(model)) == 5
    model.enable_gradient_checkpointing()
    checkpointed = grads(model)
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-5, atol=1e-7)


# -- automatic selection -----------------------------------------------------------------------------
def test_calibration_inputs_carry_a_control_latent():
    """calibration_inputs of a VACE pipeline (the family's calibration_extras): control_hidden_states laid out as
    WanVACEPipeline lays them out for a whole-video control task: 16 inactive channels zero, 16 reactive channels a
    smooth random latent, the 64 mask channels ones; the forward runs on every entry."""
    pipe = tiny_wan_vace_pipeline()
    inputs = calibration_inputs(pipe, num_samples=2, latent_size=(2, 8, 8))
    for entry in inputs:
        control = entry["control_hidden_states"]
        assert control.shape == (1, VACE_IN_CHANNELS, 2, 8, 8) and entry["hidden_states"].shape == (1, 16, 2, 8, 8)
        assert torch.equal(control[:, :16], torch.zeros_like(control[:, :16]))
        assert torch.equal(control[:, 32:], torch.ones_like(control[:, 32:]))
        assert control[:, 16:32].std() > 0.5
        with torch.no_grad():
            assert pipe.transformer(**entry).sample.shape == (1, 16, 2, 8, 8)
    assert not torch.equal(inputs[0]["control_hidden_states"], inputs[1]["control_hidden_states"])


def test_auto_selection_sees_both_kinds():
    """layers='auto': layer_sensitivity scores all 5 layers, VACE ones included (each fitted in place, the model
    restored); the FLOP model prices a VACE layer as a main one (the same tokens, the same width); a budget keeps
    the most sensitive layers stock whatever their kind, and the selection record says so."""
    model = tiny_wan_vace()
    text = {"encoder_hidden_states": torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1))}
    calibration = calibration_inputs(model, num_samples=3, embeddings=text, latent_size=(3, 8, 12))
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 10-step fit may be reported as not converged
        scores = mhla_diffusers.layer_sensitivity(model, calibration, block_grid=GRID, **FIT)
    assert sorted(scores) == [0, 1, 2, 3, 4] and all(math.isfinite(s) and s > 0 for s in scores.values())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    stock, mhla = layer_attention_flops(model, block_grid=GRID)
    assert len(set(stock)) == 1 and len(set(mhla)) == 1 and mhla[0] < stock[0]

    rigged = {0: 0.1, 1: 0.5, 2: 0.05, 3: 0.9, 4: 0.2}  # VACE layer 3 the most sensitive, then main layer 1
    names = apply_mhla(model, layers="auto", max_attention_cost=0.45, sensitivity=rigged, block_grid=GRID)
    assert names == ["blocks.0.attn1", "blocks.2.attn1", "vace_blocks.1.attn1"]
    selection = mhla_spec(model)["selection"]
    assert selection["softmax_layers"] == [1, 3] and selection["scores"] == [rigged[i] for i in range(5)]
    assert selection["attention_cost"] == pytest.approx((2 * stock[0] + 3 * mhla[0]) / (5 * stock[0]))
    remove_mhla(model)

    names = apply_mhla(model, layers="auto", keep_softmax=1, sensitivity=scores, block_grid=GRID)
    kept = scores.ranking()[0]
    assert mhla_spec(model)["selection"]["softmax_layers"] == [kept] and len(names) == 4
    assert (MAIN + VACE)[kept] not in names


# -- context parallelism ------------------------------------------------------------------------------
def test_vace_hybrid_ulysses_matches_one_process(results):
    """tests/models/context_parallel_check.py's case_wan_vace_hybrid_ulysses, under torchrun with 2 and 3 gloo
    processes: a hybrid over both kinds (softmax on main layer 0 and VACE layer 3, diffusers' Ulysses attention;
    MHLA per head on the others), the family's own plan; output and the gradients of a training step (q, k, v and
    mixing matrices of main and VACE layers) equal the single-process run."""
    world, all_results = results
    case = all_results["case_wan_vace_hybrid_ulysses"]
    assert "exception" not in case, f"P={world}: {case.get('exception')}"
    assert case["output"] < CP_TOL, case["output"]
    assert case["grads"] and max(case["grads"].values()) < CP_GRAD_TOL, case["grads"]
    mixing = sorted(n.split(".attn1.")[0] for n in case["grads"] if n.endswith("mhla.mixing.weight"))
    assert mixing == ["blocks.1", "blocks.2", "vace_blocks.1"]
    assert "vace_blocks.0.attn1.to_q.weight" in case["grads"] and "blocks.0.attn1.to_q.weight" in case["grads"]
    shard = 1 * 72 // world * 6 * 8 * 4  # [B, N / P, heads, d] float32: q, k, v, output per MHLA layer, heads mode
    assert [e["bytes"] for e in case["exchanges"] if e["direction"] == "forward" and e["kind"] == "all_to_all"] == [shard] * 12
