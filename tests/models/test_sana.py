"""MHLA on SANA (SanaTransformer2DModel, SanaPipeline).

What a SANA user is promised, as tests:

* one block (M = 1) is the stock ``SanaLinearAttnProcessor2_0`` in fp16, the fp16 clip to +-65504
  included (FACTS.md section 2), and on a real-size 36 x 32 layer (fp32 on the tiny model, and the
  one-liner's cross-attention running ``SanaAttnProcessor2_0`` bit for bit: the family contract,
  tests/models/test_family_contract.py); ``apply_mhla`` touches self-attention only; one shared
  processor, one mixing matrix per layer;
* the block grid is built on the true token grid of the latent (C05: 1024 x 256 px is 32 x 8, not
  16 x 16), with the pipeline's resolution binning on and off;
* hybrid selection through a complete processor dict (C12), dtype / device moves and CPU offload
  (C13, C08), gradient checkpointing;
* tiny SanaPipelines end to end (all, hybrid, M = 1), conversion from a folder and from an original
  single-file checkpoint, double conversion refused (C15), generate.py --prompt;
* the real SANA-600M architecture (random weights from the published config): one forward at a small
  non-square latent, conversion, and a save / load round trip in a fresh process (C14).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import AttnCapture, randomize_mixing_, realign_, run_main
from helpers_sana import (
    SANA_600M,
    original_sana_state_dict,
    run_sana,
    sana_cross_attn,
    sana_inputs,
    sana_self_attn,
    stock_copy,
    tiny_sana,
    tiny_sana_pipeline,
)
from safetensors.torch import load_file, save_file

import mhla_diffusers
from mhla_diffusers import (
    BlockLayout,
    MHLAProcessor,
    apply_mhla,
    is_mhla_model,
    load_mhla_pipeline,
    load_mhla_transformer,
    mhla_attention,
    mhla_spec,
    mixing_parameters,
    remove_mhla,
    set_attn_processor,
    token_grid,
)
from mhla_diffusers.families import FAMILIES, family_of, self_attention_modules, stock_processor

processor_module = importlib.import_module("mhla_diffusers.models.layer")  # where get_layout is called
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
FP16_MAX = 65504.0


def _stock_linear():
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    return SanaLinearAttnProcessor2_0()


def by_hand(attn, hidden: torch.Tensor, grid, eps: float = 1e-15) -> torch.Tensor:
    """MHLA on the layer's own q, k, v (norms over all heads, as SANA), then its to_out: nothing else."""
    b, n, _ = hidden.shape
    q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    if attn.norm_q is not None:
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.view(b, n, attn.heads, -1).transpose(1, 2) for t in (q, k, v))
    mixing = attn.mhla.mixing
    out = mhla_attention(q, k, v, mixing.weight.clamp(0.0, 1.0), BlockLayout(grid, mixing.block_grid), eps=eps)
    return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# -- the family ----------------------------------------------------------------------------------
def test_sana_family_facts():
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0

    model = tiny_sana(num_layers=3)
    family = family_of(model)
    assert family is FAMILIES["sana"] and family.default_eps == 1e-15
    assert [n for n, _ in self_attention_modules(model)] == [f"transformer_blocks.{i}.attn1" for i in range(3)]
    assert family.reference_grid(model.config) == (1, 32, 32)  # sample_size 32, patch 1: 1024 px
    assert family.grid_from_latent(torch.zeros(1, 4, 32, 8), model.config) == (1, 32, 8)
    assert isinstance(stock_processor(family, "transformer_blocks.2.attn1"), SanaLinearAttnProcessor2_0)
    assert isinstance(stock_processor(family, "transformer_blocks.2.attn2"), SanaAttnProcessor2_0)
    # the stock model really is built this way (what "restore" means)
    assert all(isinstance(a.processor, SanaLinearAttnProcessor2_0) for a in sana_self_attn(model))
    assert all(isinstance(a.processor, SanaAttnProcessor2_0) for a in sana_cross_attn(model))


# -- M = 1 is the stock linear attention (fp32: tests/models/test_family_contract.py) ------------------
def _same_clipping(got, want, exact) -> bool:
    """``got`` and ``want`` (fp16, two computations of one output) clip the same entries to exactly
    +-65504, except entries whose float64 value ``exact`` lies within 8 fp16 ulps (256) of a value
    where fp16 rounding changes (65488: 65472 vs 65504; 65520: 65504 vs inf, clipped): there two
    computations that sum in different orders may round differently, so those need only be near."""
    a = exact.abs()
    near = ((a - 65488.0).abs() < 256) | ((a - 65520.0).abs() < 256)
    sat_got, sat_want = got.abs() == FP16_MAX, want.abs() == FP16_MAX
    clear = ~near
    return bool(
        torch.equal(sat_got[clear], sat_want[clear])
        and torch.equal(got[sat_got & clear], want[sat_want & clear])
        and ((got.double() - want.double())[near].abs() <= 512).all()
    )


def _check_fp16_layer(attn, hidden, got, name) -> int:
    """``got`` (MHLA, M = 1) against the stock processor on the same fp16 input: identical clipping to
    +-65504, elsewhere within the stock's own fp16 error (measured against an fp64 run). Returns the
    number of clipped entries."""
    want = _stock_linear()(attn, hidden)
    exact = copy.deepcopy(attn).double()
    exact.set_processor(_stock_linear())
    raw64 = exact(hidden.double())
    want64 = raw64.clamp(-FP16_MAX, FP16_MAX)
    assert hidden.dtype == got.dtype == want.dtype == torch.float16 and torch.isfinite(got).all(), name
    sat_got, sat_want = got.abs() == FP16_MAX, want.abs() == FP16_MAX
    assert _same_clipping(got, want, raw64), name
    inside = ~(sat_want | sat_got)
    err = (got.double() - want.double())[inside].abs().max()
    stock_err = (want.double() - want64)[inside].abs().max()
    assert err <= 3 * stock_err + 1e-2, (name, err.item(), stock_err.item())
    return int(sat_got.sum())


def test_one_block_equals_stock_fp16_clip_included():
    """fp16 model, N(0, 30^2) latents: the one-liner at M = 1 gives the stock model's output, every attn1
    output within the stock processor's own fp16 error. Then layer 0's to_out is scaled so that its
    output overflows fp16: MHLA clips exactly the entries the stock processor clips, to exactly +-65504
    (but for entries within 8 fp16 ulps of a rounding boundary: ``_same_clipping``) (the rest of that model then
    overflows in the residual stream, stock and MHLA alike: not compared)."""
    model = tiny_sana(num_layers=2).half()
    stock = stock_copy(model)
    model.set_attn_processor(MHLAProcessor(num_blocks=1))
    latent, text, timestep, mask = sana_inputs(batch=2, size=(16, 8))
    inputs = (latent.half() * 30, text.half(), timestep, mask)
    with AttnCapture(model) as cap:
        out = run_sana(model, inputs)
    ref = run_sana(stock, inputs)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and _rel(out, ref) < 1e-2
    with torch.no_grad():
        for i, attn in enumerate(sana_self_attn(model)):
            name = f"transformer_blocks.{i}.attn1"
            assert _check_fp16_layer(attn, cap.inputs[name][0], cap.outputs[name][0], name) == 0

        layer = model.transformer_blocks[0].attn1
        layer.to_v.weight.mul_(30), layer.to_out[0].weight.mul_(1e4)  # weights stay finite in fp16
        with AttnCapture(model, r"transformer_blocks\.0\.attn1$") as cap:
            run_sana(model, inputs)
        name = "transformer_blocks.0.attn1"
        assert _check_fp16_layer(sana_self_attn(model)[0], cap.inputs[name][0], cap.outputs[name][0], name) > 0


def test_clip_is_sana_only_and_fp16_only():
    """The clip belongs to SANA's stock processor: an fp32 SANA layer and a generic (family-less)
    processor do not clip."""
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(query_dim=16, heads=2, dim_head=8, bias=False, processor=_stock_linear()).eval()
    with torch.no_grad():
        attn.to_v.weight.mul_(30), attn.to_out[0].weight.mul_(1e4)  # finite fp16 weights, overflowing output
    x = torch.randn(1, 16, 16) * 30
    x = x.half()
    for family, dtype in (("sana", torch.float16), ("sana", torch.float32), (None, torch.float16)):
        layer = copy.deepcopy(attn).to(dtype)
        proc = MHLAProcessor(num_blocks=1, family=family)
        proc.attach(layer, (1, 4, 4))
        layer.set_processor(proc)
        with torch.no_grad(), token_grid((4, 4)):
            out = layer(x.to(dtype))
        if family == "sana" and dtype == torch.float16:
            assert torch.isfinite(out).all() and out.abs().max() == FP16_MAX
        elif family == "sana":
            assert out.abs().max() > FP16_MAX  # fp32: no clip
        else:
            assert torch.isinf(out).any()  # generic processor: no clip


# -- apply_mhla, shared processor (cross-attention: tests/models/test_family_contract.py) ---------------
def test_apply_mhla_touches_self_attention_only():
    model = tiny_sana(num_layers=3)
    cross_before = [a.processor for a in sana_cross_attn(model)]
    names = apply_mhla(model)
    assert names == [f"transformer_blocks.{i}.attn1" for i in range(3)]
    assert [a.processor for a in sana_cross_attn(model)] == cross_before  # the very same stock objects
    assert sorted(k for k in model.state_dict() if "mhla" in k) == [
        f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in range(3)
    ]
    spec = mhla_spec(model)
    assert spec["family"] == "sana" and spec["eps"] == 1e-15 and spec["block_grid"] == [1, 4, 4]
    assert spec["model_class"] == "SanaTransformer2DModel"


def test_shared_processor_gets_per_layer_mixing():
    """One MHLAProcessor object on every layer; each attn1 has its own matrix (created at the first
    forward by the bare one-liner) and uses it: outputs equal MHLA by hand with that layer's matrix."""
    model = tiny_sana(num_layers=3)
    model.set_attn_processor(MHLAProcessor())
    inputs = sana_inputs(batch=2, size=(8, 16))
    run_sana(model, inputs)  # creates the matrices
    params = mixing_parameters(model)
    assert len(params) == 3 and len({id(p) for p in params}) == 3
    randomize_mixing_(model)
    with AttnCapture(model) as cap:
        run_sana(model, inputs)
    with torch.no_grad():
        for i, attn in enumerate(sana_self_attn(model)):
            name = f"transformer_blocks.{i}.attn1"
            (hidden,), (got,) = cap.inputs[name], cap.outputs[name]
            assert torch.equal(got, by_hand(attn, hidden, (8, 16))), name
            other = sana_self_attn(model)[(i + 1) % 3]
            swapped = copy.deepcopy(attn)
            swapped.mhla.mixing = copy.deepcopy(other.mhla.mixing)
            assert not torch.allclose(got, by_hand(swapped, hidden, (8, 16))), name


# -- the token grid --------------------------------------------------------------------------------
def test_grid_from_latent_non_square(monkeypatch):
    """C05: a 1024 x 256 px latent (32 x 8 tokens, N = 256 = 16 x 16) gets blocks on 32 x 8; the result
    is MHLA on that grid and differs from a square guess. Different shapes of equal N, different layouts."""
    model = tiny_sana(num_layers=2)
    model.set_attn_processor(MHLAProcessor(num_blocks=16))
    grids = []
    real = processor_module.get_layout

    def spy(grid, block_grid):
        grids.append((grid, block_grid))
        return real(grid, block_grid)

    monkeypatch.setattr(processor_module, "get_layout", spy)
    for size, grid in (((32, 8), (1, 32, 8)), ((8, 32), (1, 8, 32)), ((16, 16), (1, 16, 16))):
        grids.clear()
        with AttnCapture(model) as cap:
            run_sana(model, sana_inputs(batch=2, size=size))
        assert grids and all(g == grid for g, _ in grids), (size, grids)
        if size == (32, 8):
            with torch.no_grad():
                attn = sana_self_attn(model)[0]
                (hidden,), (got,) = cap.inputs["transformer_blocks.0.attn1"], cap.outputs["transformer_blocks.0.attn1"]
                assert torch.equal(got, by_hand(attn, hidden, (32, 8)))
                assert not torch.allclose(got, by_hand(attn, hidden, (16, 16)), atol=1e-4)


@pytest.mark.parametrize("binning", [True, False])
def test_pipeline_grid_with_resolution_binning(binning):
    """SanaPipeline with resolution binning on (its default) and off: the transformer's blocks are built on
    the latent it actually receives (binned size / 32), and the image comes back at the requested size."""
    pipe = tiny_sana_pipeline(num_layers=2, sample_size=16, vae_levels=6)  # 512-px bins, VAE factor 32
    assert pipe.vae_scale_factor == 32
    pipe.transformer.set_attn_processor(MHLAProcessor())
    grids = []
    pipe.transformer.transformer_blocks[0].attn1.register_forward_pre_hook(
        lambda m, a: grids.append(mhla_diffusers.models.grid.current_grid())
    )
    height, width = (250, 1000) if binning else (512, 128)
    image = pipe(
        "a lighthouse at dawn", height=height, width=width, num_inference_steps=2, output_type="np",
        use_resolution_binning=binning, generator=torch.Generator().manual_seed(0), complex_human_instruction=None,
    ).images
    assert image.shape == (1, height, width, 3) and torch.isfinite(torch.from_numpy(image)).all()
    expected = (1, 8, 32) if binning else (1, 16, 4)  # 250 x 1000 snaps to the 256 x 1024 bin
    assert grids and all(g == expected for g in grids), grids


def test_no_grid_raises_naming_the_fix():
    model = tiny_sana(num_layers=1)
    apply_mhla(model)
    attn = sana_self_attn(model)[0]
    with pytest.raises(RuntimeError, match="token_grid"), torch.no_grad():
        attn(torch.randn(1, 64, 16))
    with torch.no_grad(), token_grid((8, 8)):
        attn(torch.randn(1, 64, 16))  # the named fix works
    wrong = tiny_sana(num_layers=1)
    wrong.set_attn_processor(MHLAProcessor(family="dit"))
    with pytest.raises(RuntimeError, match="family='dit'"):
        run_sana(wrong, sana_inputs(size=8))


# -- hybrid (C12) -----------------------------------------------------------------------------------
def test_hybrid_via_complete_dict():
    """C12 on a model that HAS set_attn_processor (diffusers demands a complete dict): our helper's
    partial dict, a complete dict built from attn_processors, and apply_mhla(layers="hybrid") give
    the same model; kept layers run the stock linear attention bit for bit."""
    model = tiny_sana(num_layers=6)
    stock = stock_copy(model)
    chosen = mhla_diffusers.select_layers(6, "hybrid")
    assert chosen == [1, 2, 4, 5]
    proc = MHLAProcessor()
    partial = {f"transformer_blocks.{i}.attn1.processor": proc for i in chosen}

    a = stock_copy(stock)
    set_attn_processor(a, partial)  # no "number of processors" error
    b = stock_copy(stock)
    complete = {k: partial.get(k, v) for k, v in b.attn_processors.items()}
    b.set_attn_processor(complete)
    c = stock_copy(stock)
    assert apply_mhla(c, layers="hybrid") == [f"transformer_blocks.{i}.attn1" for i in chosen]

    inputs = sana_inputs(batch=2, size=(8, 16))
    with AttnCapture(a) as cap:
        out = run_sana(a, inputs)
    assert torch.equal(out, run_sana(b, inputs)) and torch.equal(out, run_sana(c, inputs))
    assert not torch.allclose(out, run_sana(stock, inputs), atol=1e-4)
    with torch.no_grad():
        for i, attn in enumerate(sana_self_attn(a)):
            name = f"transformer_blocks.{i}.attn1"
            (hidden,), (got,) = cap.inputs[name], cap.outputs[name]
            if i in chosen:
                assert isinstance(attn.processor, MHLAProcessor)
            else:
                assert type(attn.processor).__name__ == "SanaLinearAttnProcessor2_0"
                assert torch.equal(got, sana_self_attn(stock)[i](hidden)), name


def test_remove_mhla_after_apply_restores_stock_bitwise():
    model = tiny_sana(num_layers=3)
    stock = stock_copy(model)
    apply_mhla(model, layers="hybrid")
    assert remove_mhla(model) == ["transformer_blocks.1.attn1", "transformer_blocks.2.attn1"]
    assert not is_mhla_model(model)
    inputs = sana_inputs(batch=2)
    assert torch.equal(run_sana(model, inputs), run_sana(stock, inputs))


def test_remove_mhla_after_one_liner_restores_cross_attention():
    model = tiny_sana(num_layers=2)
    stock = stock_copy(model)
    model.set_attn_processor(MHLAProcessor())
    run_sana(model, sana_inputs())
    remove_mhla(model)
    assert all(type(a.processor).__name__ == "SanaAttnProcessor2_0" for a in sana_cross_attn(model))
    assert torch.equal(run_sana(model, sana_inputs()), run_sana(stock, sana_inputs()))


# -- dtypes, devices, offload, checkpointing (C08, C13) -------------------------------------------
@pytest.mark.parametrize("case", ["to_bf16", "to_fp16", "fp16_model_fp32_mixing", "autocast_bf16"])
def test_dtypes(case):
    model = tiny_sana(num_layers=3)
    apply_mhla(model, layers="hybrid")
    inputs = sana_inputs(batch=2, size=(8, 16))
    ref = run_sana(model, inputs)
    latent, text, timestep, mask = inputs
    if case == "autocast_bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
        out.float().square().mean().backward()
        for p in mixing_parameters(model):
            assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        out, dtype = out.detach(), torch.bfloat16
    else:
        dtype = torch.bfloat16 if case == "to_bf16" else torch.float16
        model.to(dtype).to("cpu")
        if case == "fp16_model_fp32_mixing":  # trainable parameters upcast, as fine-tuning does
            for p in mixing_parameters(model):
                p.data = p.data.float()
        else:
            assert all(p.dtype == dtype for p in mixing_parameters(model))
        out = run_sana(model, (latent.to(dtype), text.to(dtype), timestep, mask))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < 0.15  # bf16 / autocast: ~1% measured


def test_pipeline_cpu_offload_and_to():
    """C13: enable_model_cpu_offload (execution device cpu here) and pipe.to() after installing MHLA."""
    pipe = tiny_sana_pipeline(num_layers=2)
    pipe.transformer.set_attn_processor(MHLAProcessor())
    kwargs = dict(prompt="a cat", height=64, width=32, num_inference_steps=2, output_type="np",
                  use_resolution_binning=False, complex_human_instruction=None)
    ref = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.enable_model_cpu_offload(device="cpu")
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert torch.equal(torch.from_numpy(out), torch.from_numpy(ref))
    pipe.remove_all_hooks()
    pipe.to("cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in mixing_parameters(pipe.transformer))
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert abs(out - ref).max() < 0.1


def test_gradient_checkpointing_same_gradients():
    model = tiny_sana(num_layers=3)
    apply_mhla(model, layers="hybrid")
    randomize_mixing_(model, low=0.1, high=1.0)
    other = copy.deepcopy(model)
    other.enable_gradient_checkpointing()
    other.train(), model.train()
    latent, text, timestep, mask = sana_inputs(batch=2, size=(8, 16))
    for m in (model, other):
        m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample.square().mean().backward()
    for p, q in zip(mixing_parameters(model), mixing_parameters(other)):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_one_liner_on_a_latent_thinner_than_the_block_grid():
    """2 x 32 tokens (64 x 1024 px without binning) under a one-liner with 4 x 4 blocks: the blocks holding
    tokens run (tests/models/test_apply.py checks those numbers against the dense formula), forward and backward
    finite, the layers' block grid unchanged."""
    model = tiny_sana(num_layers=2)
    model.set_attn_processor(MHLAProcessor(block_grid=(4, 4)))
    text, timestep = torch.randn(1, 6, 32), torch.tensor([500.0])
    latent = torch.randn(1, 4, 2, 32, requires_grad=True)
    out = model(latent, encoder_hidden_states=text, timestep=timestep).sample
    assert out.shape == (1, 4, 2, 32) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert torch.isfinite(latent.grad).all()
    assert all(tuple(a.mhla.mixing.block_grid) == (1, 4, 4) for a in sana_self_attn(model))


def test_gradient_checkpointing_two_grids_of_one_token_count():
    """Aspect-ratio buckets: 8 x 4 and 4 x 8 latents (same N) forwarded before one backward. Each
    checkpointed block is recomputed on the grid of its own forward (the grid is replayed), so every
    gradient equals the un-checkpointed model's (it differed by 1e-1 when the last grid was reused)."""
    model = tiny_sana(num_layers=2)
    apply_mhla(model, layers="all", num_blocks=4)
    randomize_mixing_(model, low=0.0, high=1.0)
    other = copy.deepcopy(model)
    other.enable_gradient_checkpointing()
    other.train(), model.train()
    gen = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(1, 4, 8, 4, generator=gen), torch.randn(1, 4, 4, 8, generator=gen)
    text, timestep = torch.randn(1, 6, 32, generator=gen), torch.tensor([500.0])
    for m in (model, other):
        loss = sum(m(x, encoder_hidden_states=text, timestep=timestep).sample.square().mean() for x in (x1, x2))
        loss.backward()
    named = dict(other.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_recomputation_without_a_replayed_grid_refuses_an_ambiguous_token_count():
    """A checkpointing scheme other than diffusers' (torch.utils.checkpoint around each block by hand):
    the layer's one grid for an N is reused in the backward; two grids for that N are an error, not a guess."""
    from torch.utils.checkpoint import checkpoint

    model = tiny_sana(num_layers=1)
    apply_mhla(model, layers="all", num_blocks=4)
    model.train()
    block = model.transformer_blocks[0]
    original = block.forward
    block.forward = lambda *a, **k: checkpoint(original, *a, use_reentrant=False, **k)
    text, timestep = torch.randn(1, 6, 32), torch.tensor([500.0])
    x1, x2 = torch.randn(1, 4, 8, 4), torch.randn(1, 4, 4, 8)
    model(x1, encoder_hidden_states=text, timestep=timestep).sample.sum().backward()  # one grid: fine
    assert model.transformer_blocks[0].attn1.mhla.mixing.weight.grad is not None
    loss = sum(model(x, encoder_hidden_states=text, timestep=timestep).sample.sum() for x in (x1, x2))
    with pytest.raises(RuntimeError, match="does not guess which"):
        loss.backward()


# -- pipelines end to end, conversion, generation ---------------------------------------------------
def _image(pipe, **kw):
    kwargs = dict(prompt="an astronaut riding a horse", height=64, width=32, num_inference_steps=3, output_type="np",
                  use_resolution_binning=False, complex_human_instruction=None)
    kwargs.update(kw)
    return torch.from_numpy(pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images)


def test_pipeline_end_to_end_all_hybrid_and_one_block():
    pipe = tiny_sana_pipeline(num_layers=3)
    stock = _image(pipe)
    pipe.transformer.set_attn_processor(MHLAProcessor(num_blocks=1))
    one = _image(pipe)
    assert (one - stock).abs().max() < 1e-4  # M = 1: the stock linear attention, image for image
    pipe.transformer.set_attn_processor(
        {k: stock_processor(FAMILIES["sana"], k[: -len(".processor")]) for k in pipe.transformer.attn_processors}
    )
    for attn in sana_self_attn(pipe.transformer):
        del attn.mhla
    assert torch.equal(_image(pipe), stock)
    pipe.transformer.set_attn_processor(MHLAProcessor())
    everything = _image(pipe)
    remove_mhla(pipe.transformer)
    pipe.transformer.set_attn_processor(
        {k: stock_processor(FAMILIES["sana"], k[: -len(".processor")]) for k in pipe.transformer.attn_processors}
    )
    apply_mhla(pipe.transformer, layers="hybrid")
    hybrid = _image(pipe)
    for image in (everything, hybrid):
        assert image.shape == (1, 64, 32, 3) and torch.isfinite(image).all()
        assert (image - stock).abs().max() > 1e-3
    assert (everything - hybrid).abs().max() > 1e-3


@pytest.fixture(scope="module")
def base_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sana") / "base"
    tiny_sana_pipeline(num_layers=3).save_pretrained(folder)
    return folder


def test_convert_folder_dtype_load_generate_and_refuse_again(base_pipeline, tmp_path, capsys):
    """convert.py on a local SanaPipeline folder (hybrid, bf16): the converted format, load_mhla_pipeline
    gives a ready SanaPipeline whose images equal the same conversion done in memory; generate.py
    --prompt writes the PNG; converting the result again is refused (C15)."""
    out = tmp_path / "mhla"
    code, err = run_main("conversion/convert.py", "--family", "sana", "--src", base_pipeline, "--out", out,
                      "--layers", "hybrid", "--dtype", "bf16", capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["family"] == "sana" and config["layers"] == [1, 2] and config["eps"] == 1e-15
    stored = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in stored.values())  # --dtype bf16: the written weights
    pipe = load_mhla_pipeline(out, torch_dtype=torch.bfloat16)
    assert type(pipe).__name__ == "SanaPipeline" and not pipe.transformer.training
    assert pipe.transformer.dtype == torch.bfloat16
    assert [type(a.processor).__name__ for a in sana_self_attn(pipe.transformer)] == [
        "SanaLinearAttnProcessor2_0", "MHLAProcessor", "MHLAProcessor"]
    from diffusers import SanaPipeline

    expected = SanaPipeline.from_pretrained(base_pipeline, dtype=torch.bfloat16)
    apply_mhla(expected.transformer, layers="hybrid")
    realign_(pipe.transformer), realign_(expected.transformer)
    assert torch.equal(_image(pipe), _image(expected))

    png = tmp_path / "out.png"
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", "a dog", "--height", "64",
                      "--width", "32", "--no-resolution-binning", "--steps", "2", "--out", png, capsys=capsys)
    assert code == 0, err
    from PIL import Image

    assert Image.open(png).size == (2 * 32, 64)

    code, err = run_main("conversion/convert.py", "--family", "sana", "--src", out, "--out", tmp_path / "again", capsys=capsys)
    assert code == 3 and "already an MHLA checkpoint" in err and not (tmp_path / "again").exists()


def test_generate_rejects_the_wrong_kind(base_pipeline, tmp_path, capsys):
    from helpers import tiny_dit_pipeline

    dit = tmp_path / "dit"
    tiny_dit_pipeline(num_layers=1).save_pretrained(dit)
    cases = [
        ((dit, "--prompt", "a cat"), "takes a prompt"),
        ((base_pipeline, "--class-labels", "1"), "it takes prompts: --prompt"),
        ((base_pipeline, "--class-labels", "1", "--height", "64"), "only apply to --prompt"),
        ((base_pipeline, "--prompt", "a cat", "--height", "48", "--no-resolution-binning"), "divisible by 32"),
    ]
    for (src, *extra), message in cases:
        code, err = run_main("pipelines/generate.py", "--checkpoint", src, *extra, "--steps", "1",
                          "--out", tmp_path / "g.png", capsys=capsys)
        assert code == 2 and message in err, (extra, err)
    assert not (tmp_path / "g.png").exists()


def test_convert_original_single_file(base_pipeline, tmp_path, capsys):
    """An original SANA checkpoint (original key layout, .safetensors and .pth) converts through
    from_single_file with a local config: a pipeline folder gives a whole pipeline, a transformer
    folder the transformer alone; the base weights are exactly the original ones."""
    from diffusers import SanaTransformer2DModel

    base = SanaTransformer2DModel.from_pretrained(base_pipeline / "transformer")
    original = original_sana_state_dict(base)
    assert "blocks.0.attn.qkv.weight" in original and "transformer_blocks.0.attn1.to_q.weight" not in original
    st, pth = tmp_path / "Sana_tiny.safetensors", tmp_path / "Sana_tiny.pth"
    save_file(original, st)
    torch.save({"state_dict": original}, pth)

    out = tmp_path / "from_st"
    code, err = run_main("conversion/convert.py", "--family", "sana", "--src", st, "--config", base_pipeline, "--out", out,
                      "--layers", "hybrid", capsys=capsys)
    assert code == 0, err
    assert (out / "model_index.json").is_file()
    pipe = load_mhla_pipeline(out)
    assert mhla_spec(pipe.transformer)["layers"] == [1, 2]
    got = {k: v for k, v in pipe.transformer.state_dict().items() if "mhla" not in k}
    want = base.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    out2 = tmp_path / "from_pth"
    code, err = run_main("conversion/convert.py", "--family", "sana", "--src", pth, "--config", base_pipeline / "transformer",
                      "--out", out2, "--dtype", "fp16", capsys=capsys)
    assert code == 0, err
    assert not (out2 / "model_index.json").exists() and (out2 / "mhla_config.json").is_file()
    stored = load_file(out2 / "diffusion_pytorch_model.safetensors")
    assert sorted(stored) == sorted(want) and all(torch.equal(stored[k], v.half()) for k, v in want.items())
    model = load_mhla_transformer(out2, torch_dtype=torch.float16)
    assert model.dtype == torch.float16 and mhla_spec(model)["layers"] == [0, 1, 2]

    cases = [
        (("--src", st), "pass config="),  # single file without --config
        (("--src", base_pipeline, "--config", base_pipeline), "only for single-file"),
        (("--src", out / "transformer" / "diffusion_pytorch_model.safetensors", "--config", base_pipeline),
         "belongs to an MHLA checkpoint"),
    ]
    for extra, message in cases:
        code, err = run_main("conversion/convert.py", "--family", "sana", *extra, "--out", tmp_path / "x", capsys=capsys)
        assert code in (2, 3) and message in err, (extra, err)
        assert not (tmp_path / "x").exists()


# -- the real SANA-600M architecture ---------------------------------------------------------------
def _real_attention(dtype=torch.float32):
    from diffusers.models.attention_processor import Attention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        attn = Attention(query_dim=1152, heads=36, dim_head=32, bias=False, processor=_stock_linear())
    return attn.eval().to(dtype)


def _mhla_call(attn, x, grid, **kw):
    layer = copy.deepcopy(attn)
    proc = MHLAProcessor(num_blocks=1, family="sana", **kw)
    proc.attach(layer, (1, 32, 32))
    layer.set_processor(proc)
    with torch.no_grad(), token_grid(grid):
        return layer(x)


def test_real_size_layer_one_block_matches_stock():
    """A SANA-600M self-attention layer (1152 = 36 heads x 32) on a 32 x 8 token grid with N(0, 30^2)
    inputs: M = 1 equals the stock processor in fp32 (1e-6 relative) and in fp16, where to_out is
    scaled so that part of the output overflows: identical clipping, within the stock's fp16 error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32 * 8, 1152, generator=g) * 30
    attn = _real_attention()
    with torch.no_grad():
        want = attn(x)
    got = _mhla_call(attn, x, (32, 8))
    assert _rel(got, want) < 1e-5

    attn16 = _real_attention(torch.float16)
    with torch.no_grad():
        attn16.to_out[0].weight.mul_(3e4)
        want = attn16(x.half())
        exact = copy.deepcopy(attn16).double()
        raw64 = exact(x.half().double())
        want64 = raw64.clamp(-FP16_MAX, FP16_MAX)
    got = _mhla_call(attn16, x.half(), (32, 8))
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    sat_got, sat_want = got.abs() == FP16_MAX, want.abs() == FP16_MAX
    assert sat_want.sum() > 0 and _same_clipping(got, want, raw64)
    inside = ~(sat_want | sat_got)
    err = (got.double() - want.double())[inside].abs().max()
    stock_err = (want.double() - want64)[inside].abs().max()
    assert err <= 1.5 * stock_err, (err.item(), stock_err.item())


@pytest.fixture(scope="module")
def sana600m():
    """SanaTransformer2DModel at the published SANA-600M config with random weights rounded to fp16
    values (so an fp16 checkpoint of it holds exactly these weights). ~2.4 GB: one per module."""
    from diffusers import SanaTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SanaTransformer2DModel(**SANA_600M).eval()
    model.half().float()
    yield model
    del model


FRESH_PROCESS = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file, save_file
    import mhla_diffusers as M
    folder, inputs_file, out_file = sys.argv[1:4]
    x = load_file(inputs_file)
    model = M.load_mhla_transformer(folder, torch_dtype=torch.float32)
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()
    with torch.no_grad():
        out = model(x["latent"], encoder_hidden_states=x["text"], timestep=x["timestep"]).sample
    res = {"output": out.contiguous(), "training": torch.tensor(int(model.training))}
    res.update({k: v for k, v in model.state_dict().items() if "mhla" in k})
    save_file(res, out_file)
    print(M.mhla_spec(model)["layers"])
    """
)


def test_real_size_600m_forward_conversion_round_trip(sana600m, tmp_path):
    """SANA-600M (28 layers, 36 x 32, cross 16 x 72, caption 2304): one forward at a 16 x 8 latent
    (512 x 256 px) with the one-liner at M = 1 equals the stock model; conversion of an fp16 folder
    (hybrid: 18 MHLA layers of 28), then a fresh process loads it and reproduces the in-memory
    output (C14) with the mixing matrices as saved."""
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    model = sana600m
    g = torch.Generator().manual_seed(0)
    x = {
        "latent": torch.randn(1, 32, 16, 8, generator=g),
        "text": torch.randn(1, 12, 2304, generator=g),
        "timestep": torch.tensor([600.0]),
    }

    def forward(m):
        with torch.no_grad():
            return m(x["latent"], encoder_hidden_states=x["text"], timestep=x["timestep"]).sample

    stock = forward(model)
    src = tmp_path / "src"
    model.half().save_pretrained(src)
    model.float()
    spec = convert_checkpoint(src, tmp_path / "out", family="sana", layers="hybrid")
    assert spec["layers"] == [i for i in range(28) if i % 3] and spec["block_grid"] == [1, 4, 4]
    assert (tmp_path / "out" / "mhla.safetensors").is_file()
    assert load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")["proj_out.weight"].dtype == torch.float16

    save_file(x, tmp_path / "inputs.safetensors")
    proc = subprocess.Popen(
        [sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "out"), str(tmp_path / "inputs.safetensors"),
         str(tmp_path / "res.safetensors")],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        apply_mhla(model, layers="hybrid")  # meanwhile, the same conversion in memory
        hybrid = forward(model)
        mixing = {k: v.clone() for k, v in model.state_dict().items() if "mhla" in k}
        remove_mhla(model)
        model.set_attn_processor(MHLAProcessor(num_blocks=1))  # the bare one-liner, one block
        one = forward(model)
    finally:
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert _rel(one, stock) < 1e-4, _rel(one, stock)
    assert _rel(hybrid, stock) > 1e-3  # MHLA with 16 blocks really changes the model
    res = load_file(tmp_path / "res.safetensors")
    assert int(res["training"]) == 0
    assert sorted(k for k in res if "mhla" in k) == sorted(mixing) and len(mixing) == 18
    assert all(torch.equal(res[k], v) for k, v in mixing.items())
    assert _rel(res["output"], hybrid) < 1e-6, _rel(res["output"], hybrid)


def test_one_liner_first_forward_under_inference_mode_gives_trainable_parameters():
    """Pipelines run under torch.inference_mode(): the matrices the bare one-liner creates there must
    still be ordinary parameters (not inference tensors) that a later fine-tuning step can update."""
    model = tiny_sana(num_layers=2)
    model.set_attn_processor(MHLAProcessor())
    inputs = sana_inputs(batch=1, size=(8, 8))
    with torch.inference_mode():
        first = run_sana(model, inputs)
    mixings = [a.mhla.mixing.weight for a in sana_self_attn(model)]
    assert mixings and not any(w.is_inference() for w in mixings)
    assert all(w.requires_grad for w in mixings)
    latent, text, timestep, mask = inputs
    out = model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
    torch.testing.assert_close(out.detach(), first)
    out.square().mean().backward()
    assert all(w.grad is not None and torch.isfinite(w.grad).all() for w in mixings)
