"""MHLA on SANA-Video (SanaVideoTransformer3DModel; its pipelines: tests/cli/test_sana_video_cli.py).

What a SANA-Video user is promised, as tests (the family contract, tests/models/test_family_contract.py,
already checks M = 1 in fp32 on one input, cross-attention bit for bit, the one-liner, save / load and
context parallelism):

* one block (M = 1) is the stock ``SanaLinearAttnProcessor3_0`` (ReLU linear attention, RoPE on the
  numerator's features only) in fp32, bf16 and fp16, whole model and every layer, over seeds and sizes;
* M > 1 is MHLA with Wan's RoPE form on the spatiotemporal block grid read from the latent (frames x
  H/2 x W/2), uneven grids and grids with fewer tokens than blocks included; it changes the model, and
  its mixing matrices are trainable and get gradients;
* ``apply_mhla`` with ``"all"``, a hybrid, ``"auto"`` (calibration through the pipeline's own prompt
  encoding; a cost budget is refused, as on SANA: the stock layer is linear already);
* the diagnostics on a SANA-Video layer; bad inputs get clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_sana_video import SanaAttnProcessor2_0, SanaLinearAttnProcessor3_0
from helpers import CallCapture, no_grid_frames, randomize_mixing_
from helpers_sana_video import run_sana_video, sana_video_inputs, tiny_sana_video, tiny_sana_video_pipeline

import mhla_diffusers
from mhla_diffusers import (
    BlockLayout,
    MHLAProcessor,
    apply_mhla,
    calibration_inputs,
    layer_sensitivity,
    mhla_attention,
    mhla_spec,
    mixing_parameters,
    remove_mhla,
    token_grid,
)
from mhla_diffusers import diagnostics as D
from mhla_diffusers.families import FAMILIES, WanRotary, family_of, self_attention_modules
from mhla_diffusers.ops.layout import occupied_layout

EPS = 1e-15  # SanaLinearAttnProcessor3_0's
SELF = r"transformer_blocks\.\d+\.attn1$"

# M = 1 against the stock processor: relative to the output's largest entry, worst over 6 seeds x 5 inputs
# (3 x 4 x 6, 5 x 6 x 10, 2 x 8 x 8 tokens at latent scale 3, 3 x 4 x 6 at scale 10, 1 x 4 x 4; 3 layers),
# measured on this CPU: whole model / one layer on its own captured input
#   fp32  3.0e-7 / 4.7e-7  (summation order)
#   bf16  7.6e-3 / 1.1e-2  (the stock divides by key.sum @ query computed in bf16; MHLA keeps it in fp32)
#   fp16  1.0e-3 / 1.2e-3  (where the stock output is finite, below)
# Against a float64 run of the same layer the stock is off by 9.8e-3 (bf16) and 1.6e-3 (fp16); MHLA at most
# 0.91x (bf16) and 1.02x (fp16) of that on every layer. Bounds: at least 10x the worst.
# fp16 only: the stock adds its eps 1e-15 in fp16, where it is 0, so a token whose ReLU query features are all
# zero in a head gets 0 * (1 / 0) = NaN (7 of those 30 fp16 models, 10 layer calls); MHLA's fp32 denominator
# gives what the stock gives in fp32 and fp64 there (measured within 2.8e-4 of the fp64 run).
ONE_BLOCK_TOL = {  # dtype -> (model, layer)
    torch.float32: (5e-6, 5e-6),
    torch.bfloat16: (8e-2, 1.2e-1),
    torch.float16: (1e-2, 1.5e-2),
}
AT_STOCK_NAN_TOL = 3e-3  # fp16, MHLA against the fp64 stock where the fp16 stock is NaN (measured 2.8e-4)
# M > 1 on the tiny model changes the output by >= 2.3e-2 of its largest entry (measured); required: > 1e-3
DIFFERS = 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def by_hand(attn, hidden: torch.Tensor, rotary_emb, grid) -> torch.Tensor:
    """MHLA on the layer's own q, k, v (RMSNorms across heads, then the head split), Wan's RoPE after phi in the
    numerator only, the layer's clamped mixing matrix on ``grid`` (occupied blocks only where an axis has fewer
    tokens than blocks), cast to the input dtype, to_out: nothing else."""
    b, n, _ = hidden.shape
    q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.view(b, n, attn.heads, -1).transpose(1, 2) for t in (q, k, v))
    mixing = attn.mhla.mixing
    weight = mixing.weight.clamp(0.0, 1.0)
    if any(blocks > tokens for blocks, tokens in zip(mixing.block_grid, grid)):
        layout, index = occupied_layout(grid, mixing.block_grid)
        weight = weight[index][:, index]
    else:
        layout = BlockLayout(grid, mixing.block_grid)
    out = mhla_attention(q, k, v, weight, layout, eps=EPS, rotary=WanRotary(rotary_emb))
    return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1).to(hidden.dtype)))


def _inputs_dict(inputs) -> dict:
    latent, text, timestep, mask = inputs
    return {"hidden_states": latent, "encoder_hidden_states": text, "timestep": timestep, "encoder_attention_mask": mask}


# -- the family ----------------------------------------------------------------------------------
def test_sana_video_family_facts():
    model = tiny_sana_video(num_layers=3)
    family = family_of(model)
    assert family is FAMILIES["sana_video"] and family.default_eps == EPS and family.stock_attention == "linear"
    assert [n for n, _ in self_attention_modules(model)] == [f"transformer_blocks.{i}.attn1" for i in range(3)]
    assert family.reference_grid(model.config) == (21, 30, 52)  # 81 frames at 480 x 832 px
    assert family.native_video_size(model.config) == {"height": 480, "width": 832, "frames": 81}
    assert family.grid_from_latent(torch.zeros(1, 4, 5, 12, 20), model.config) == (5, 6, 10)
    assert family.max_grid(model.config) == (32, 32, 32)  # the tiny model's rope_max_seq_len
    assert all(isinstance(b.attn1.processor, SanaLinearAttnProcessor3_0) for b in model.transformer_blocks)
    assert all(isinstance(b.attn2.processor, SanaAttnProcessor2_0) for b in model.transformer_blocks)
    apply_mhla(model)  # no block grid given: chosen on the native 21 x 30 x 52 grid, M = 90 targeted
    assert mhla_spec(model)["block_grid"] == [3, 4, 7] and mhla_spec(model)["eps"] == EPS


# -- M = 1 is the stock layer, per dtype ------------------------------------------------------------
def _stock64(attn, args, kwargs) -> torch.Tensor:
    """The stock processor on a float64 copy of the layer (the layer's weights and inputs, exactly)."""
    exact = copy.deepcopy(attn).double()
    exact.set_processor(SanaLinearAttnProcessor3_0())
    return exact(args[0].double(), rotary_emb=tuple(t.double() for t in kwargs["rotary_emb"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_one_block_equals_stock(dtype):
    """The one-liner with one block against the stock model, whole model and every self-attention layer on its
    own captured call (rotary table included), over seeds, clip lengths, sizes and input scales; the output
    keeps the input dtype (the stock casts back; there is no fp16 clip). Where the fp16 stock is NaN (a token
    with an all-zero ReLU query in a head, seed 0 here), MHLA is finite and is the float64 stock."""
    model_tol, layer_tol = ONE_BLOCK_TOL[dtype]
    compared = 0
    for seed, (frames, size, scale) in ((0, (3, (8, 12), 1.0)), (1, (5, (12, 20), 3.0)), (2, (2, (8, 8), 10.0))):
        model = tiny_sana_video(num_layers=3, seed=seed, dtype=dtype)
        stock = copy.deepcopy(model)
        model.set_attn_processor(MHLAProcessor(num_blocks=1))
        latent, text, timestep, mask = sana_video_inputs(batch=2, frames=frames, size=size, seed=seed)
        inputs = ((latent * scale).to(dtype), text.to(dtype), timestep, mask)
        with CallCapture(model, SELF) as cap, no_grid_frames():
            out = run_sana_video(model, inputs)
        ref = run_sana_video(stock, inputs)
        assert out.dtype == dtype and torch.isfinite(out).all()
        if torch.isfinite(ref).all():
            compared += 1
            assert _rel(out, ref) < model_tol, (seed, _rel(out, ref))
        with torch.no_grad():
            for name, [(args, kwargs, got)] in cap.calls.items():
                attn = model.get_submodule(name)
                assert attn.mhla.mixing.block_grid == (1, 1, 1) and got.dtype == dtype
                want = SanaLinearAttnProcessor3_0()(attn, *args, **kwargs)
                finite = torch.isfinite(want)
                assert _rel(got[finite], want[finite]) < layer_tol, (seed, name, _rel(got[finite], want[finite]))
                if not finite.all():
                    assert dtype == torch.float16, (seed, name)
                    exact = _stock64(attn, args, kwargs)
                    err = ((got.double() - exact)[~finite].abs().max() / exact.abs().max()).item()
                    assert err < AT_STOCK_NAN_TOL, (seed, name, err)
    assert compared >= 2


def test_fp16_zero_query_token_is_finite():
    """A token whose ReLU query features are all zero (its hidden state solves to_q(h) = -1: every feature negative
    before and after the RMSNorm): the fp16 stock returns NaN for it (its eps 1e-15 is 0 in fp16: 0 / 0), MHLA with
    one block the fp32 stock's value there (to_out's bias), and elsewhere the stock's output."""
    model = tiny_sana_video(num_layers=1, dtype=torch.float16)
    apply_mhla(model, num_blocks=1)  # its processor knows the family: the layer is called alone below
    inputs = sana_video_inputs(batch=1, frames=3, size=(8, 12), dtype=torch.float16)
    with CallCapture(model, SELF) as cap:
        run_sana_video(model, inputs)
    [(args, kwargs, _)] = cap.calls["transformer_blocks.0.attn1"]
    attn = model.transformer_blocks[0].attn1
    hidden = args[0].clone()
    weight = attn.to_q.weight.double()
    target = -torch.ones(weight.shape[0], dtype=torch.float64)
    if attn.to_q.bias is not None:
        target -= attn.to_q.bias.double()
    hidden[:, 5] = torch.linalg.solve(weight, target).half()
    assert (attn.norm_q(attn.to_q(hidden[:, 5:6])) < 0).all()
    with torch.no_grad():
        want = SanaLinearAttnProcessor3_0()(attn, hidden, rotary_emb=kwargs["rotary_emb"])
        with token_grid((3, 4, 6)):
            got = attn(hidden, rotary_emb=kwargs["rotary_emb"])
        want32 = SanaLinearAttnProcessor3_0()(copy.deepcopy(attn).float(), hidden.float(),
                                              rotary_emb=kwargs["rotary_emb"])
    assert torch.isnan(want[:, 5]).all() and torch.isfinite(want[:, :5]).all() and torch.isfinite(got).all()
    torch.testing.assert_close(want32[:, 5], attn.to_out[0].bias.float().expand_as(want32[:, 5]))
    torch.testing.assert_close(got[:, 5].float(), want32[:, 5], rtol=0, atol=1e-3)
    other = torch.ones_like(want, dtype=torch.bool)
    other[:, 5] = False
    assert _rel(got[other], want[other]) < ONE_BLOCK_TOL[torch.float16][1]


def test_real_width_layer_one_block_equals_stock():
    """A self-attention layer at SANA-Video 2B's width (2240 = 20 heads x 112, RMSNorms across heads, its RoPE
    table for 112 channels) on a 2 x 8 x 12 grid, inputs N(0, 1) and N(0, 30^2): M = 1 is the stock processor
    within the layer bounds (measured over 3 seeds: 3.8e-7 fp32, 5.6e-3 bf16, 7.0e-4 fp16; and 2.6e-7, 4.9e-3,
    6.2e-4 on a 3 x 16 x 26 grid)."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_sana_video import WanRotaryPosEmbed

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        attn = Attention(query_dim=2240, heads=20, dim_head=112, kv_heads=20, qk_norm="rms_norm_across_heads", bias=False,
                         cross_attention_dim=None, processor=SanaLinearAttnProcessor3_0()).eval()
    grid = (2, 8, 12)
    rotary = WanRotaryPosEmbed(112, (1, 2, 2), 1024)(torch.zeros(1, 1, grid[0], 2 * grid[1], 2 * grid[2]))
    x = torch.randn(1, grid[0] * grid[1] * grid[2], 2240, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (1.0, 30.0):
            layer, hidden = copy.deepcopy(attn).to(dtype), (x * scale).to(dtype)
            with torch.no_grad():
                want = layer(hidden, rotary_emb=rotary)
                processor = MHLAProcessor(num_blocks=1, family="sana_video")
                processor.attach(layer, (21, 30, 52))
                layer.set_processor(processor)
                with token_grid(grid):
                    got = layer(hidden, rotary_emb=rotary)
            assert got.dtype == dtype and torch.isfinite(want).all()
            assert _rel(got, want) < ONE_BLOCK_TOL[dtype][1], (dtype, scale, _rel(got, want))


# -- M > 1 on the spatiotemporal grid ----------------------------------------------------------------
@pytest.mark.parametrize(
    "frames, size, block_grid",
    [(3, (8, 12), (1, 2, 3)), (5, (12, 20), (2, 3, 4)), (1, (8, 8), (2, 3, 4))],
    ids=["even-3x4x6", "uneven-5x6x10", "empty-blocks-1x4x4"],
)
def test_blocks_on_the_latent_grid_are_mhla_with_rope(frames, size, block_grid):
    """M > 1: the grid is read from the latent (frames x H/2 x W/2, never guessed from N); each layer's output is
    MHLA by hand with its own (trained: random) matrix and the model's rotary table on that grid, block sizes
    uneven (6 rows in 3, 10 columns in 4) or blocks empty (1 frame under 2 time blocks, 4 x 4 tokens under 3 x 4);
    the model differs from the stock one."""
    model = tiny_sana_video(num_layers=2)
    stock = copy.deepcopy(model)
    apply_mhla(model, block_grid=block_grid)
    randomize_mixing_(model)
    inputs = sana_video_inputs(batch=2, frames=frames, size=size)
    grid = (frames, size[0] // 2, size[1] // 2)
    with CallCapture(model, SELF) as cap, no_grid_frames():
        out = run_sana_video(model, inputs)
    assert torch.isfinite(out).all() and _rel(out, run_sana_video(stock, inputs)) > DIFFERS
    with torch.no_grad():
        for name, [(args, kwargs, got)] in cap.calls.items():
            attn = model.get_submodule(name)
            n = grid[0] * grid[1] * grid[2]
            assert attn.mhla.seen_grids == {n: {grid}}, name
            want = by_hand(attn, args[0], kwargs["rotary_emb"], grid)
            assert torch.equal(got, want), name  # the same operations: bit for bit
            rotated = by_hand(attn, args[0], tuple(t.roll(1, dims=1) for t in kwargs["rotary_emb"]), grid)
            assert not torch.allclose(got, rotated, atol=1e-4), name  # the RoPE is really used
    if size == (12, 20):
        assert BlockLayout(grid, block_grid).block_sizes.unique().numel() > 1  # uneven blocks


def test_mixing_matrices_are_trainable_and_get_gradients():
    """One [M, M] parameter per layer (M = 2 * 2 * 3 = 12), saved in the state dict; a backward on the model
    reaches every matrix (finite, non-zero) and the projections, with and without gradient checkpointing
    (the same gradients)."""
    model = tiny_sana_video(num_layers=2)
    apply_mhla(model, block_grid=(2, 2, 3))
    params = mixing_parameters(model)
    assert len(params) == 2 and all(p.requires_grad and p.shape == (12, 12) for p in params)
    assert sorted(k for k in model.state_dict() if "mhla" in k) == [
        f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in range(2)
    ]
    randomize_mixing_(model, low=0.1, high=0.9)  # inside the clamp: every entry gets a gradient
    latent, text, timestep, mask = sana_video_inputs(batch=2, frames=4, size=(8, 12))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        out = model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
        out.square().mean().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0 for p in params)
        assert model.transformer_blocks[0].attn1.to_q.weight.grad.abs().max() > 0
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


# -- apply_mhla: all, hybrid, auto -------------------------------------------------------------------
def test_apply_all_hybrid_and_remove():
    """layers="all": MHLA on every self-attention layer, cross-attention untouched; layers=[0, 2]: layer 1 keeps
    the stock linear attention object; each changes the model, differently; remove_mhla restores it bit for bit."""
    model = tiny_sana_video(num_layers=3)
    stock = copy.deepcopy(model)
    inputs = sana_video_inputs(batch=2)
    ref = run_sana_video(stock, inputs)
    cross = [b.attn2.processor for b in model.transformer_blocks]
    everything = copy.deepcopy(model)
    assert apply_mhla(everything, layers="all", block_grid=(1, 2, 3)) == [f"transformer_blocks.{i}.attn1" for i in range(3)]
    assert [b.attn2.processor for b in model.transformer_blocks] == cross
    kept = model.transformer_blocks[1].attn1.processor
    assert apply_mhla(model, layers=[0, 2], block_grid=(1, 2, 3)) == ["transformer_blocks.0.attn1", "transformer_blocks.2.attn1"]
    assert model.transformer_blocks[1].attn1.processor is kept and mhla_spec(model)["layers"] == [0, 2]
    assert isinstance(model.transformer_blocks[0].attn1.processor, MHLAProcessor)
    hybrid, full = run_sana_video(model, inputs), run_sana_video(everything, inputs)
    assert _rel(hybrid, ref) > DIFFERS and _rel(full, ref) > DIFFERS and _rel(full, hybrid) > DIFFERS
    remove_mhla(model)
    assert not mhla_diffusers.is_mhla_model(model) and torch.equal(run_sana_video(model, inputs), ref)


def test_auto_selection_from_the_pipeline_calibration():
    """layers="auto": calibration inputs made from a SanaVideoPipeline (its Gemma-2 prompt encoding, a small video
    latent), every score float rounding (the stock layer is MHLA with all-ones mixing, where the fit starts);
    keep_softmax=K keeps K stock linear layers; an attention-cost budget is refused (MHLA is not cheaper than
    SANA-Video's linear attention), nothing installed."""
    pipe = tiny_sana_video_pipeline(num_layers=3)
    calibration = calibration_inputs(pipe, num_samples=2, latent_size=(2, 8, 8))
    assert [tuple(c["hidden_states"].shape) for c in calibration] == [(1, 16, 2, 8, 8)] * 2
    assert sorted(calibration[0]) == ["encoder_attention_mask", "encoder_hidden_states", "hidden_states", "timestep"]
    model = pipe.transformer
    scores = layer_sensitivity(model, calibration, block_grid=(1, 2, 2), fit_steps=5, progress=False)
    assert sorted(scores) == [0, 1, 2] and all(scores.init[i] == "ones" for i in scores)
    assert max(scores.values()) < 1e-5, dict(scores)  # measured <= 1.5e-7
    chosen = apply_mhla(copy.deepcopy(model), "auto", keep_softmax=1, sensitivity=scores, block_grid=(1, 2, 2))
    assert len(chosen) == 2 and f"transformer_blocks.{scores.ranking()[0]}.attn1" not in chosen
    with pytest.raises(ValueError, match="already linear.*keep_softmax"):
        apply_mhla(model, "auto", max_attention_cost=0.9, sensitivity=scores, block_grid=(1, 2, 2))
    assert not mhla_diffusers.is_mhla_model(model)


# -- diagnostics -------------------------------------------------------------------------------------
def test_diagnostics_on_a_sana_video_layer(tmp_path):
    """capture_query_key reads the 3-D token grid and the layer's q, k, v (norms across heads): with the rotary
    table at identity (cos 1, sin 0) the stock layer is exactly the linear-attention matrix times v, and an MHLA
    layer exactly its MHLA matrix (layer's clamped mixing) times v; layer_statistics stays within the bounds
    (linear rank <= d = 12); the 3-D mixing matrix draws; a cross-attention layer is refused."""
    model = tiny_sana_video(num_layers=2)
    inputs = _inputs_dict(sana_video_inputs(batch=1, frames=3, size=(8, 12)))
    names = ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    apply_mhla(model, layers=[1], block_grid=(1, 2, 3))
    randomize_mixing_(model, low=0.0, high=1.0)
    captured = D.capture_query_key(model, names, inputs)
    with CallCapture(model, SELF) as cap:
        D.capture_query_key(model, names, inputs)
    for name in names:
        qk, attn = captured[name], model.get_submodule(name)
        assert qk.grid == (3, 4, 6) and qk.query.shape == (1, 2, 72, 12)
        (args, kwargs, _), = cap.calls[name]
        cos, sin = kwargs["rotary_emb"]
        identity = (torch.ones_like(cos), torch.zeros_like(sin))
        mixing = getattr(getattr(attn, "mhla", None), "mixing", None)
        with torch.no_grad(), token_grid(qk.grid):
            if mixing is None:
                A = D.attention_matrix(qk.query, qk.key, "linear")
                got = SanaLinearAttnProcessor3_0()(attn, args[0], rotary_emb=identity)
            else:
                layout = BlockLayout(qk.grid, mixing.block_grid)
                A = D.attention_matrix(qk.query, qk.key, "mhla", mixing=mixing.clamped(), layout=layout)
                got = attn(args[0], rotary_emb=identity)
            want = attn.to_out[0]((A @ qk.value.double()).float().transpose(1, 2).reshape(1, 72, 24))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    stats = D.layer_statistics(model, names[0], inputs, block_grid=(1, 2, 3))
    assert stats["mixing_source"] == "locality_init" and stats["grid"] == [3, 4, 6] and stats["num_tokens"] == 72
    assert stats["rank_bound"] == {"softmax": 72, "linear": 12, "mhla": 72}
    assert stats["kinds"]["linear"]["rank"]["max"] <= 12 < stats["kinds"]["mhla"]["rank"]["min"]
    stats = D.layer_statistics(model, names[1], inputs)
    assert stats["mixing_source"] == "layer" and stats["block_grid"] == [1, 2, 3]
    assert stats["kinds"]["mhla"]["rank"]["max"] <= stats["rank_bound"]["mhla"]
    png = D.plot_mixing_matrix(model.transformer_blocks[1].attn1.mhla.mixing.clamped(), (1, 2, 3), tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="called as cross-attention"):
        D.capture_query_key(model, "transformer_blocks.0.attn2", inputs)


# -- bad inputs --------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors():
    """A 4-D (image) latent: refused by the model's forward before any attention runs (diffusers' own shape
    check, MHLA or not), and by the family's grid hook with the layout it expects (what calibration and the
    diagnostics read); calibration sizes that are not (F, H, W); an MHLA layer called outside its transformer
    (names token_grid), or with a grid of another token count; block grids of the wrong rank or size."""
    model = tiny_sana_video(num_layers=1)
    stock = copy.deepcopy(model)
    apply_mhla(model, block_grid=(1, 2, 3))
    latent, text, timestep, mask = sana_video_inputs(batch=1)
    image = latent[:, :, 0]
    projected = []
    model.transformer_blocks[0].attn1.to_q.register_forward_hook(lambda *_: projected.append(1))
    for m in (model, stock):
        with pytest.raises(ValueError, match="expected 5, got 4"), no_grid_frames():
            run_sana_video(m, (image, text, timestep, mask))
    assert not projected
    with pytest.raises(ValueError, match=r"expected a video latent \[batch, channels, frames, height, width\]"):
        FAMILIES["sana_video"].grid_from_latent(image, model.config)
    with pytest.raises(ValueError, match="latent_size must be 3 positive integers for a sana_video model"):
        calibration_inputs(model, num_samples=1, embeddings={"encoder_hidden_states": text}, latent_size=(8, 8))
    attn = model.transformer_blocks[0].attn1
    hidden = torch.randn(1, 72, 24)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"never guesses it.*token_grid"):
            attn(hidden)
        with pytest.raises(RuntimeError, match=r"token grid \(3, 4, 5\) of this forward has 60 tokens but"), token_grid((3, 4, 5)):
            attn(hidden)
        # without rotary_emb the stock layer fails (UnboundLocalError inside diffusers); MHLA refuses rather than
        # computing without RoPE
        with pytest.raises(UnboundLocalError):
            SanaLinearAttnProcessor3_0()(attn, hidden)
        with pytest.raises(ValueError, match="SANA-Video self-attention was called without rotary_emb"), token_grid((3, 4, 6)):
            attn(hidden)
    for block_grid, message in (((2, 2, 2, 2), "1, 2 or 3 axes"), ((0, 1, 1), ">= 1"), ("paper", "no block-grid preset")):
        with pytest.raises(ValueError, match=message):
            apply_mhla(copy.deepcopy(stock), block_grid=block_grid)
