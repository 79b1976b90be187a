"""MHLA on Wan 2.1 (WanTransformer3DModel, WanPipeline; text-to-video and image-to-video transformers).

What a Wan user is promised, as tests:

* the Wan rotary variant of the operator (RoPE after phi, rotated features in the numerator only)
  against a dense float64 oracle, outputs and gradients; ``WanRotary`` is diffusers' own rotation;
* the one-liner ``transformer.set_attn_processor(MHLAProcessor())`` survives Wan's positional call
  (C11), computes exactly MHLA on the layer's own q, k, v with its RoPE (changing ``rotary_emb``
  changes the output), and runs the stock ``WanAttnProcessor`` bit for bit on cross-attention,
  the image-to-video image branch included (C10); one shared processor, one mixing matrix per layer;
* ``normalize`` on / off and the per-head output RMSNorm (the authors' recipe);
* block grids: the paper's (3, 5, 7) by default, the authors' (3, 5, 10) preset, the general rule;
  the real 21 x 30 x 52 token grid (52 columns: blocks do not divide it) at model level, checked
  against the dense formula (C04); 1, 5, 17, 81 frames (C09), the empty blocks of a short clip
  dropping out exactly; a frame count that is not 4k + 1;
* hybrid selection through a complete processor dict (C12), dtypes (C08), ``.to`` and CPU offload
  (C13), gradient checkpointing;
* conversion from a pipeline folder and from an original single-file checkpoint, double conversion
  refused (C15), save / load in a fresh process bit for bit (C14), WanPipeline end to end to an mp4;
* the real Wan2.1-1.3B architecture (random weights): conversion, a forward, a fresh-process round trip.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import no_grid_frames, randomize_mixing_, realign_, run_main
from helpers_wan import (
    WAN_1_3B,
    original_wan_state_dict,
    random_wan,
    run_wan,
    stock_copy,
    tiny_wan,
    tiny_wan_pipeline,
    wan_cross_attn,
    wan_inputs,
    wan_self_attn,
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
    mhla_attention_reference,
    mhla_spec,
    mixing_parameters,
    remove_mhla,
    set_attn_processor,
    token_grid,
)
from mhla_diffusers.families import FAMILIES, WanRotary, family_of, self_attention_modules, stock_processor
from mhla_diffusers.models.processor import OutputRMSNorm, occupied_layout

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
EPS = 1e-6


def _stock():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return WanAttnProcessor()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _rope(head_dim: int, grid, max_seq_len: int = 64):
    """Wan's rotary embedding ``(cos, sin)`` for a token grid, from diffusers' own WanRotaryPosEmbed."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = WanRotaryPosEmbed(head_dim, (1, 1, 1), max_seq_len)
    return rope(torch.zeros(1, 1, *grid))


class Capture:
    """Forward hooks on Wan attention modules recording each call's positional arguments and output."""

    def __init__(self, model, which: str = "attn1"):
        self.modules = {f"blocks.{i}.{which}": getattr(b, which) for i, b in enumerate(model.blocks)}
        self.calls: dict[str, list] = {n: [] for n in self.modules}
        self._handles = []

    def __enter__(self):
        for name, module in self.modules.items():
            def hook(module, args, kwargs, output, name=name):
                self.calls[name].append(([a.clone() if isinstance(a, torch.Tensor) else a for a in args], output.clone()))

            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False


def _qkv(attn, hidden):
    """The layer's own q, k, v ``[B, heads, N, d]``: projections, RMSNorm over all heads, head split."""
    b, n, _ = hidden.shape
    q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    q, k = attn.norm_q(q), attn.norm_k(k)
    return [t.view(b, n, attn.heads, -1).transpose(1, 2) for t in (q, k, v)]


def by_hand(attn, hidden, rotary_emb, grid, normalize=True):
    """MHLA with Wan's RoPE on the layer's own q, k, v, its output norm if any, then to_out: nothing else."""
    b, n, _ = hidden.shape
    q, k, v = _qkv(attn, hidden)
    mixing = attn.mhla.mixing
    weight = mixing.weight.clamp(0.0, 1.0)
    if any(b > n for b, n in zip(mixing.block_grid, grid)):  # fewer tokens than blocks: the occupied ones
        layout, index = occupied_layout(grid, mixing.block_grid)
        weight = weight[index][:, index]
    else:
        layout = BlockLayout(grid, mixing.block_grid)
    out = mhla_attention(q, k, v, weight, layout, normalize=normalize, eps=EPS, rotary=WanRotary(rotary_emb))
    if getattr(getattr(attn, "mhla", None), "output_norm", None) is not None:
        out = attn.mhla.output_norm(out)
    return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1).to(hidden.dtype)))


def _block_ids(grid, block_grid) -> torch.Tensor:
    """Block id of every token by DESIGN.md's formula (t*bt//T, h*bh//H, w*bw//W), row-major; blocks may be empty."""
    (t, h, w), (bt, bh, bw) = grid, block_grid
    it, ih, iw = (torch.arange(n) * m // n for n, m in ((t, bt), (h, bh), (w, bw)))
    return ((it[:, None, None] * bh + ih[None, :, None]) * bw + iw[None, None, :]).reshape(-1)


def dense(q, k, v, mixing, grid, block_grid, rotary_emb, normalize=True, rows=None):
    """The O(N^2) float64 formula of the Wan variant (DESIGN.md), from scratch:
    out_i = sum_t Mc[b(i), b(t)] (R phi q_i).(R phi k_t) v_t / (sum_t Mc[b(i), b(t)] phi q_i . phi k_t + eps).
    ``rows``: only these query tokens (for large N)."""
    q, k, v, mixing = (t.double() for t in (q, k, v, mixing))
    cos, sin = (t.double()[0, :, 0] for t in rotary_emb)  # [N, d]

    def rot(x):  # interleaved pairs, as diffusers' apply_rotary_emb
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., 0::2], sin[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    ids = _block_ids(grid, block_grid)
    rows = torch.arange(q.shape[2]) if rows is None else rows
    pq, pk = torch.relu(q), torch.relu(k)
    weights = mixing.clamp(0, 1)[ids[rows]][:, ids]  # [rows, N]
    num = (rot(pq)[:, :, rows] @ rot(pk).transpose(-1, -2)) * weights
    out = num @ v
    if normalize:
        out = out / ((pq[:, :, rows] @ pk.transpose(-1, -2)) * weights).sum(-1, keepdim=True).add(EPS)
    return out


# -- the family, the rotation ---------------------------------------------------------------------
def test_wan_family_facts():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model = tiny_wan(num_layers=3)
    family = family_of(model)
    assert family is FAMILIES["wan"] and family.default_eps == 1e-6 and family.processor_call == "positional"
    assert [n for n, _ in self_attention_modules(model)] == [f"blocks.{i}.attn1" for i in range(3)]
    assert family.reference_grid(model.config) == (21, 30, 52)  # 81 frames at 480 x 832 px
    assert family.grid_from_latent(torch.zeros(1, 16, 21, 60, 104), model.config) == (21, 30, 52)
    assert family.grid_from_latent(torch.zeros(1, 16, 1, 8, 14), model.config) == (1, 4, 7)
    assert family.preset("paper") == (3, 5, 7) and family.preset("authors") == (3, 5, 10)
    with pytest.raises(ValueError, match="no block-grid preset 'big'"):
        family.preset("big")
    # the general rule reproduces both on the native grid (M^2 <= N: 150^2 < 32,760)
    assert mhla_diffusers.choose_block_grid((21, 30, 52), 105) == (3, 5, 7)
    assert mhla_diffusers.choose_block_grid((21, 30, 52), 150) == (3, 5, 10)
    assert isinstance(stock_processor(family, "blocks.2.attn1"), WanAttnProcessor)
    assert isinstance(stock_processor(family, "blocks.2.attn2"), WanAttnProcessor)
    assert all(isinstance(a.processor, WanAttnProcessor) for a in wan_self_attn(model) + wan_cross_attn(model))
    # Wan2.1-1.3B's hybrid: softmax kept on 0, 3, ..., 27; MHLA on the other 20 of 30
    chosen = mhla_diffusers.select_layers(30, "hybrid")
    assert len(chosen) == 20 and sorted(set(range(30)) - set(chosen)) == list(range(0, 30, 3))


def test_wan_rotary_is_diffusers_rotation():
    """Stock WanAttnProcessor == SDPA on q, k rotated by WanRotary (same projections): our map is diffusers'
    rotation (interleaved pairs, the (1, S, 1, D) float32 tables), and it accepts non-contiguous views."""
    import torch.nn.functional as F

    model = tiny_wan(num_layers=1)
    attn = wan_self_attn(model)[0]
    g = torch.Generator().manual_seed(1)
    grid = (2, 3, 4)
    hidden = torch.randn(2, 24, 24, generator=g)
    rotary_emb = _rope(12, grid)
    assert rotary_emb[0].shape == (1, 24, 1, 12) and rotary_emb[0].dtype == torch.float32
    with torch.no_grad():
        want = _stock()(attn, hidden, None, None, rotary_emb)
        q, k, v = _qkv(attn, hidden)  # non-contiguous [B, heads, N, d] views
        rot = WanRotary(rotary_emb)
        out = F.scaled_dot_product_attention(rot(q), rot(k), v).transpose(1, 2).flatten(2)
        got = attn.to_out[0](out)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(rot(q), q)
    with pytest.raises(ValueError, match="do not match"):
        rot(q[:, :, :5])
    # the complex-multiplication path (float32 / float64) and the slice path (other dtypes) agree, views too
    x = torch.randn(2, 2, 25, 12, generator=g, dtype=torch.float64)[:, :, 1:]  # a view at an offset
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s_ = rotary_emb[0][..., 0::2].transpose(1, 2).double(), rotary_emb[1][..., 1::2].transpose(1, 2).double()
    want = torch.stack((x1 * c - x2 * s_, x1 * s_ + x2 * c), dim=-1).flatten(-2)
    # bf16: a few roundings of 2^-8 each (observed 4.2e-3); a wrong rotation is O(1)
    assert _rel(rot(x), want) < 1e-13 and _rel(rot(x.bfloat16()).double(), want) < 6e-2


# -- the operator: the Wan rotary variant against the dense float64 oracle ---------------------------
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_variant_matches_dense_reference(normalize, dtype):
    """Wan's RoPE (from diffusers' WanRotaryPosEmbed on a 3 x 5 x 7 grid, blocks 2 x 2 x 3 that do not
    divide it): the operator's output and gradients in q, k, v and the mixing matrix equal the dense
    reference of the rotary variant (lead's oracle) and our from-scratch formula, in float64."""
    grid, block_grid, d = (3, 5, 7), (2, 2, 3), 12
    n = 3 * 5 * 7
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    mixing = torch.rand(12, 12, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    layout = BlockLayout(grid, block_grid)
    rotary_emb = _rope(d, grid)
    rot = WanRotary(rotary_emb)
    out = mhla_attention(q, k, v, mixing, layout, normalize=normalize, eps=EPS, rotary=rot)
    ref = mhla_attention_reference(q, k, v, mixing, layout, normalize=normalize, eps=EPS, rotary=rot)
    mine = dense(q, k, v, mixing, grid, block_grid, rotary_emb, normalize=normalize)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert out.dtype == dtype and _rel(out, ref) < tol and _rel(ref, mine) < 1e-12
    seed = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * seed).sum(), (q, k, v, mixing))
    grads_ref = torch.autograd.grad((ref * seed).sum(), (q, k, v, mixing), retain_graph=True)
    grads_mine = torch.autograd.grad((mine * seed).sum(), (q, k, v, mixing))  # slice-form rotation, no complex
    for name, a, b, c in zip("qkvM", grads, grads_ref, grads_mine):
        assert _rel(a, b) < (1e-10 if dtype == torch.float64 else 1e-4) and _rel(b, c) < (1e-10 if dtype == torch.float64 else 1e-6), name
    # the RoPE matters: without it the numerator is another function
    plain = mhla_attention(q, k, v, mixing, layout, normalize=normalize, eps=EPS)
    assert _rel(plain, out) > 1e-3


# -- the processor: C11, processor == op, one shared processor --------------------------------------
def test_positional_call_processor_equals_op_per_layer():
    """C11: Wan calls its processor positionally (attn, hs, ehs, mask, rotary_emb): no TypeError; every
    attn1 output equals MHLA by hand on the layer's own q, k, v with Wan's RoPE and its OWN mixing matrix,
    bit for bit; one shared processor object on all 6 attention layers, three mixing matrices."""
    model = tiny_wan(num_layers=3)
    proc = MHLAProcessor(block_grid=(2, 2, 3))
    model.set_attn_processor(proc)
    assert all(p is proc for p in model.attn_processors.values()) and len(model.attn_processors) == 6
    inputs = wan_inputs(batch=2, frames=3, size=(8, 12))  # tokens 3 x 4 x 6
    run_wan(model, inputs)  # the bare one-liner creates the matrices at the first forward
    params = mixing_parameters(model)
    assert len(params) == 3 and len({id(p) for p in params}) == 3
    randomize_mixing_(model)
    with Capture(model) as cap, no_grid_frames():
        run_wan(model, inputs)
    with torch.no_grad():
        for i, attn in enumerate(wan_self_attn(model)):
            ((args, got),) = cap.calls[f"blocks.{i}.attn1"]
            hidden, ehs, mask, rotary_emb = args
            assert ehs is None and mask is None and rotary_emb[0].shape == (1, 72, 1, 12)
            assert torch.equal(got, by_hand(attn, hidden, rotary_emb, (3, 4, 6))), i
            other = copy.deepcopy(attn)
            other.mhla.mixing = copy.deepcopy(wan_self_attn(model)[(i + 1) % 3].mhla.mixing)
            assert not torch.allclose(got, by_hand(other, hidden, rotary_emb, (3, 4, 6)))


def test_rope_is_applied_and_changes_the_output():
    """C11: the layer called directly (positionally, as WanAttention does) with Wan's rotary embedding: a
    different rotary_emb (the rope of a 4 x 6 grid vs a 6 x 4 grid, same N) changes the output, no
    rotary_emb at all too; each equals the dense formula with that rotation."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2))
    attn = wan_self_attn(model)[0]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 24, 24, generator=g)
    outs = {}
    with torch.no_grad(), token_grid((1, 4, 6)):
        for name, grid in (("4x6", (1, 4, 6)), ("6x4", (1, 6, 4))):
            rotary_emb = _rope(12, grid)
            outs[name] = attn(hidden, None, None, rotary_emb)  # WanAttention.forward -> positional processor call
            q, k, v = _qkv(attn, hidden)
            want = dense(q, k, v, attn.mhla.mixing.weight, (1, 4, 6), (1, 2, 2), rotary_emb)
            want = attn.to_out[0](want.float().transpose(1, 2).flatten(2))
            assert _rel(outs[name], want) < 1e-5, name
        outs["none"] = attn(hidden, None, None, None)
    assert _rel(outs["4x6"], outs["6x4"]) > 1e-3 and _rel(outs["4x6"], outs["none"]) > 1e-3
    # the denominator is the un-rotated one: with M = 1 and normalize the whole layer is
    # R phi(q) (R phi(K))^T V / (phi(q) . sum phi(k) + eps), per query
    with torch.no_grad(), token_grid((1, 4, 6)):
        one = tiny_wan(num_layers=1)
        apply_mhla(one, num_blocks=1)
        a1 = wan_self_attn(one)[0]
        rotary_emb = _rope(12, (1, 4, 6))
        got = a1(hidden, None, None, rotary_emb)
        q, k, v = (t.double() for t in _qkv(a1, hidden))
        rot = WanRotary(rotary_emb)
        num = rot(torch.relu(q)) @ (rot(torch.relu(k)).transpose(-1, -2) @ v)
        den = torch.relu(q) @ torch.relu(k).sum(2, keepdim=True).transpose(-1, -2) + EPS
        want = a1.to_out[0]((num / den).float().transpose(1, 2).flatten(2))
    assert _rel(got, want) < 1e-5


def test_normalize_off_output_norm():
    """normalize=False: the authors' recipe gets a per-head output RMSNorm (weight ones at install, one
    per layer, in state_dict, recorded in the spec); explicit output_norm=False has none; the layer
    equals numerator -> RMSNorm per head -> to_out; the norm makes the layer invariant to the scale of
    V (the raw numerator grows with N), and its weight acts."""
    model = tiny_wan(num_layers=3)
    apply_mhla(model, layers="hybrid", normalize=False)
    norms = [getattr(getattr(a, "mhla", None), "output_norm", None) for a in wan_self_attn(model)]
    assert norms[0] is None and all(isinstance(n, OutputRMSNorm) for n in norms[1:])
    assert all(torch.equal(n.weight, torch.ones(2, 12)) for n in norms[1:])
    assert sorted(k for k in model.state_dict() if "mhla.output_norm" in k) == [
        "blocks.1.attn1.mhla.output_norm.weight", "blocks.2.attn1.mhla.output_norm.weight"]
    spec = mhla_spec(model)
    assert spec["normalize"] is False and spec["output_norm"] is True and spec["block_grid"] == [3, 5, 7]

    attn = wan_self_attn(model)[1]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 24, 24, generator=g)
    rotary_emb = _rope(12, (1, 4, 6))
    with torch.no_grad(), token_grid((1, 4, 6)):
        got = attn(hidden, None, None, rotary_emb)
        assert torch.equal(got, by_hand(attn, hidden, rotary_emb, (1, 4, 6), normalize=False))
        scaled = copy.deepcopy(attn)
        scaled.to_v.weight.mul_(1000), scaled.to_v.bias.mul_(1000)
        assert _rel(scaled(hidden, None, None, rotary_emb), got) < 5e-3  # up to the norm's eps (1e-6)
        attn.mhla.output_norm.weight.uniform_(0.5, 1.5, generator=g)
        assert _rel(attn(hidden, None, None, rotary_emb), got) > 1e-3

    plain = tiny_wan(num_layers=2)
    apply_mhla(plain, normalize=False, output_norm=False)
    assert not any(a.mhla.output_norm is not None for a in wan_self_attn(plain)) and "output_norm" not in mhla_spec(plain)
    normed = tiny_wan(num_layers=2)
    apply_mhla(normed, output_norm=True)  # with the normaliser too, when asked
    assert mhla_spec(normed)["output_norm"] is True and mhla_spec(normed)["normalize"] is True
    with pytest.raises(ValueError, match="output_norm"):
        set_attn_processor(normed, MHLAProcessor(output_norm=False))
    assert remove_mhla(normed) and not any(hasattr(a, "mhla") for a in wan_self_attn(normed))


# -- block grids on real and small token grids (C04, C09) -------------------------------------------
@pytest.mark.parametrize("preset", ["paper", "authors"])
def test_native_grid_21x30x52_model_level(preset):
    """C04 at model level: a Wan transformer at the native token grid of 81 frames x 480 x 832 px
    (21 x 30 x 52 = 32,760 tokens; 52 columns, which neither 7 nor 10 block columns divide): the grid
    comes from the latent, the layer is exactly MHLA by hand with the preset's block grid, and 48 query
    rows spread over the grid match the dense float64 formula on the true coordinates."""
    model = tiny_wan(num_layers=1, rope_max_seq_len=64)
    model.set_attn_processor(MHLAProcessor(block_grid=preset))
    attn = wan_self_attn(model)[0]
    inputs = wan_inputs(batch=1, frames=21, size=(60, 104), text_len=4)
    grids = []
    attn.register_forward_pre_hook(lambda m, a: grids.append(mhla_diffusers.models.grid.current_grid()))
    with Capture(model) as cap:
        run_wan(model, inputs)
    expected = FAMILIES["wan"].preset(preset)
    assert grids == [(21, 30, 52)] and attn.mhla.mixing.block_grid == expected
    ((args, got),) = cap.calls["blocks.0.attn1"]
    hidden, _, _, rotary_emb = args
    with torch.no_grad():
        assert torch.equal(got, by_hand(attn, hidden, rotary_emb, (21, 30, 52)))
        rows = torch.linspace(0, 32759, 48).long()
        q, k, v = _qkv(attn, hidden)
        want = dense(q, k, v, attn.mhla.mixing.weight, (21, 30, 52), expected, rotary_emb, rows=rows)
        want = attn.to_out[0](want.float().transpose(1, 2).flatten(2))
    assert _rel(got[:, rows], want) < 1e-5


def test_occupied_layout_is_mhla_with_empty_blocks():
    """A token grid with fewer tokens than blocks on some axes (1 frame, 2 x 5 tokens under (3, 5, 7)):
    the kept blocks and their ids follow DESIGN.md's formula, and MHLA there equals the dense formula with
    the FULL mixing matrix and the full block grid (empty blocks contribute nothing)."""
    layout, index = occupied_layout((1, 2, 5), (3, 5, 7))
    assert layout.block_grid == (1, 2, 5)
    ids = _block_ids((1, 2, 5), (3, 5, 7))
    assert torch.equal(index[layout.block_index], ids)  # token -> kept block -> its id in the full grid
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 10, 12, generator=g, dtype=torch.float64) for _ in range(3))
    mixing = torch.rand(105, 105, generator=g, dtype=torch.float64)
    rotary_emb = _rope(12, (1, 2, 5))
    out = mhla_attention(q, k, v, mixing[index][:, index], layout, eps=EPS, rotary=WanRotary(rotary_emb))
    assert _rel(out, dense(q, k, v, mixing, (1, 2, 5), (3, 5, 7), rotary_emb)) < 1e-12
    # every family allows it (tests/models/test_apply.py and tests/models/test_sana.py run DiT and SANA there)
    assert all(FAMILIES[name].empty_blocks for name in ("wan", "sana", "dit"))


@pytest.mark.parametrize("video_frames", [1, 5, 17, 81])
def test_frames_1_5_17_81_transformer(video_frames):
    """C09: latent frames (F - 1) / 4 + 1 = 1, 2, 5, 21 at 64 x 64 px (4 x 4 tokens a frame), the default
    (3, 5, 7) block grid: every layer equals the dense formula with the full mixing matrix, empty blocks
    included (1 frame: only blocks t = 0 hold tokens)."""
    latent_frames = (video_frames - 1) // 4 + 1
    model = tiny_wan(num_layers=2)
    model.set_attn_processor(MHLAProcessor())
    inputs = wan_inputs(batch=1, frames=latent_frames, size=8, text_len=4)
    run_wan(model, inputs)
    randomize_mixing_(model, low=0.0, high=1.0)
    with Capture(model) as cap:
        out = run_wan(model, inputs)
    assert out.shape == (1, 16, latent_frames, 8, 8) and torch.isfinite(out).all()
    grid = (latent_frames, 4, 4)
    with torch.no_grad():
        for i, attn in enumerate(wan_self_attn(model)):
            assert attn.mhla.mixing.block_grid == (3, 5, 7)
            ((args, got),) = cap.calls[f"blocks.{i}.attn1"]
            hidden, _, _, rotary_emb = args
            q, k, v = _qkv(attn, hidden)
            want = dense(q, k, v, attn.mhla.mixing.weight, grid, (3, 5, 7), rotary_emb)
            want = attn.to_out[0](want.float().transpose(1, 2).flatten(2))
            assert _rel(got, want) < 1e-5, (video_frames, i)


def test_frames_pipeline_and_not_4k_plus_1(caplog, tmp_path):
    """C09 through WanPipeline: 1, 5, 17 and 81 frames come out with that many frames; a count that is not
    4k + 1 is what diffusers itself rounds down with a warning (6 -> 5; MHLA does not change that), while
    our generate_videos refuses it with the nearest valid counts."""
    from mhla_diffusers.generation import GenerationError, generate_videos

    pipe = tiny_wan_pipeline(num_layers=2)
    pipe.transformer.set_attn_processor(MHLAProcessor())
    kwargs = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="np")
    for frames in (1, 5, 17, 81):
        video = pipe(**kwargs, num_frames=frames, generator=torch.Generator().manual_seed(0)).frames
        assert video.shape == (1, frames, 32, 32, 3) and torch.isfinite(torch.from_numpy(video)).all()
    with caplog.at_level(logging.WARNING):
        video = pipe(**kwargs, num_frames=6, generator=torch.Generator().manual_seed(0)).frames
    assert video.shape[1] == 5 and "divisible by 4" in caplog.text
    with pytest.raises(GenerationError, match="Nearest valid counts: 5 or 9"):
        generate_videos(None, ["a cat"], frames=6, height=32, width=32, steps=1, pipe=pipe)
    with pytest.raises(GenerationError, match="got 0"):
        generate_videos(None, ["a cat"], frames=0, height=32, width=32, steps=1, pipe=pipe)


# -- cross-attention (C10), hybrid (C12) -----------------------------------------------------------
def test_i2v_cross_attention_bitwise_stock():
    """C10: the image-to-video transformer (image_dim set: cross-attention reads 257 image + 512 text
    tokens through an added image branch) with the one-liner: every attn2 call equals WanAttnProcessor on
    the same positional arguments bit for bit (also after set_attention_backend, which reaches the stock
    processor through ours); the whole model equals apply_mhla's (self-attention only); no mixing on attn2."""
    model = tiny_wan(num_layers=2, image_dim=16)
    assert wan_cross_attn(model)[0].add_k_proj is not None
    other = stock_copy(model)
    proc = MHLAProcessor(block_grid=(1, 2, 2))
    model.set_attn_processor(proc)
    apply_mhla(other, block_grid=(1, 2, 2))
    inputs = wan_inputs(batch=1, frames=2, size=8, text_len=512, image_dim=16)
    model.set_attention_backend("native")
    assert proc._attention_backend is not None
    with Capture(model, "attn2") as cap:
        out = run_wan(model, inputs)
    assert torch.equal(out, run_wan(other, inputs))
    with torch.no_grad():
        for name, attn in cap.modules.items():
            ((args, got),) = cap.calls[name]
            hidden, ehs, mask, rotary_emb = args
            assert ehs.shape[1] == 257 + 512 and rotary_emb is None
            stock = _stock()
            stock._attention_backend = proc._attention_backend
            assert torch.equal(got, stock(attn, hidden, ehs, mask, rotary_emb)), name
            assert torch.equal(got, _stock()(attn, hidden, ehs, mask, rotary_emb)), name
            assert not hasattr(attn, "mhla")
    assert [type(a.processor).__name__ for a in wan_self_attn(model)] == ["MHLAProcessor"] * 2


def test_hybrid_via_complete_dict():
    """C12: a complete processor dict built from attn_processors (what diffusers' own set_attn_processor
    demands), our helper's partial dict and apply_mhla(layers="hybrid") give the same model; the kept
    layers run the stock WanAttnProcessor bit for bit."""
    model = tiny_wan(num_layers=6)
    stock = stock_copy(model)
    chosen = mhla_diffusers.select_layers(6, "hybrid")
    assert chosen == [1, 2, 4, 5]
    proc = MHLAProcessor(block_grid="paper")
    partial = {f"blocks.{i}.attn1.processor": proc for i in chosen}
    a = stock_copy(stock)
    set_attn_processor(a, partial)
    b = stock_copy(stock)
    b.set_attn_processor({k: partial.get(k, v) for k, v in b.attn_processors.items()})  # no count error
    c = stock_copy(stock)
    assert apply_mhla(c, layers="hybrid") == [f"blocks.{i}.attn1" for i in chosen]
    inputs = wan_inputs(batch=2, frames=2, size=(8, 12))
    with Capture(a) as cap:
        out = run_wan(a, inputs)
    assert torch.equal(out, run_wan(b, inputs)) and torch.equal(out, run_wan(c, inputs))
    assert _rel(out, run_wan(stock, inputs)) > 1e-4
    with torch.no_grad():
        for i, attn in enumerate(wan_self_attn(a)):
            ((args, got),) = cap.calls[f"blocks.{i}.attn1"]
            if i in chosen:
                assert isinstance(attn.processor, MHLAProcessor)
            else:
                assert type(attn.processor).__name__ == "WanAttnProcessor" and not hasattr(attn, "mhla")
                assert torch.equal(got, wan_self_attn(stock)[i](*args)), i


def test_remove_mhla_restores_stock_bitwise():
    model = tiny_wan(num_layers=3, image_dim=16)
    stock = stock_copy(model)
    inputs = wan_inputs(batch=1, frames=2, size=8, text_len=512, image_dim=16)
    model.set_attn_processor(MHLAProcessor(normalize=False))
    run_wan(model, inputs)
    assert is_mhla_model(model) and wan_self_attn(model)[0].mhla.output_norm is not None
    assert remove_mhla(model) == [f"blocks.{i}.attn{j}" for i in range(3) for j in (1, 2)]
    assert not is_mhla_model(model) and not any(hasattr(a, "mhla") for a in wan_self_attn(model))
    assert all(type(p).__name__ == "WanAttnProcessor" for p in model.attn_processors.values())
    assert torch.equal(run_wan(model, inputs), run_wan(stock, inputs))


def test_fused_projections():
    """diffusers' fuse_qkv_projections (one to_qkv on self-attention, to_kv on cross-attention): MHLA reads
    the fused projection; the output stays the same."""
    model = tiny_wan(num_layers=2)
    apply_mhla(model, block_grid=(1, 2, 2))
    inputs = wan_inputs(batch=1, frames=2, size=8)
    ref = run_wan(model, inputs)
    model.fuse_qkv_projections()
    assert all(a.fused_projections and hasattr(a, "to_qkv") for a in wan_self_attn(model))
    assert torch.allclose(run_wan(model, inputs), ref, atol=1e-6, rtol=1e-5)


def test_no_grid_raises_naming_the_fix():
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2))
    attn = wan_self_attn(model)[0]
    hidden, rotary_emb = torch.randn(1, 24, 24), _rope(12, (1, 4, 6))
    with pytest.raises(RuntimeError, match="token_grid"), torch.no_grad():
        attn(hidden, None, None, rotary_emb)
    with torch.no_grad(), token_grid((1, 4, 6)):
        attn(hidden, None, None, rotary_emb)  # the named fix works
    with pytest.raises(ValueError, match="unknown block-grid preset"):
        MHLAProcessor(block_grid="papers")
    with pytest.raises(ValueError, match="no block-grid preset 'paper'"):
        from helpers import tiny_dit

        apply_mhla(tiny_dit(num_layers=1), block_grid="paper")  # a Wan preset on DiT


# -- dtypes, devices, offload, checkpointing (C08, C13) -------------------------------------------
@pytest.mark.parametrize("case", ["to_bf16", "to_fp16", "fp16_model_fp32_mixing", "fp32_model_bf16_mixing", "autocast_bf16"])
def test_dtypes(case):
    """C08: the model in bf16 / fp16 (MHLA parameters following, or kept in fp32 as fine-tuning does), an
    fp32 model with bf16 MHLA parameters, bf16 autocast with a backward: no dtype mismatch anywhere,
    outputs close to fp32. (An fp32 latent into a bf16 Wan fails in Wan's own patch embedding, stock or not.)"""
    model = tiny_wan(num_layers=3)
    apply_mhla(model, layers="hybrid", block_grid=(2, 2, 2), normalize=case not in ("to_fp16", "fp32_model_bf16_mixing"))
    inputs = wan_inputs(batch=2, frames=2, size=(8, 12))
    ref = run_wan(model, inputs)
    if case == "autocast_bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**inputs).sample
        out.float().square().mean().backward()
        for p in mixing_parameters(model):
            assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        out = out.detach()
    elif case == "fp32_model_bf16_mixing":
        for attn in wan_self_attn(model)[1:]:
            attn.mhla.mixing.bfloat16(), attn.mhla.output_norm.bfloat16()
        out = run_wan(model, inputs)
        assert out.dtype == torch.float32
    else:
        dtype = torch.float16 if "fp16" in case else torch.bfloat16
        model.to(dtype).to("cpu")
        if case == "fp16_model_fp32_mixing":  # trainable parameters upcast, as fine-tuning does
            for p in mixing_parameters(model):
                p.data = p.data.float()
        else:
            assert all(p.dtype == dtype for p in mixing_parameters(model))
        if case == "to_fp16":  # normalize off: the output norms follow too
            assert all(a.mhla.output_norm.weight.dtype == dtype for a in wan_self_attn(model)[1:])
        inputs = {k: v.to(dtype) if v.is_floating_point() and k != "timestep" else v for k, v in inputs.items()}
        out = run_wan(model, inputs)
        assert out.dtype == dtype
    assert torch.isfinite(out).all() and _rel(out, ref) < 0.15, _rel(out, ref)  # bf16 / autocast: ~1% measured


def test_pipeline_cpu_offload_and_to():
    """C13: enable_model_cpu_offload (execution device cpu here) and pipe.to(dtype) after installing MHLA."""
    pipe = tiny_wan_pipeline(num_layers=2)
    pipe.transformer.set_attn_processor(MHLAProcessor(normalize=False))
    kwargs = dict(prompt="a cat", height=64, width=64, num_frames=5, num_inference_steps=2, output_type="np")
    ref = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    pipe.enable_model_cpu_offload(device="cpu")
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert (out == ref).all()
    pipe.remove_all_hooks()
    pipe.to("cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in mixing_parameters(pipe.transformer))
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert abs(out - ref).max() < 0.1


def test_gradient_checkpointing_same_gradients():
    model = tiny_wan(num_layers=3)
    apply_mhla(model, layers="all", block_grid=(2, 2, 2), normalize=False)
    randomize_mixing_(model, low=0.1, high=1.0)
    other = copy.deepcopy(model)
    other.enable_gradient_checkpointing()
    other.train(), model.train()
    inputs = wan_inputs(batch=2, frames=2, size=(8, 12))
    for m in (model, other):
        m(**inputs).sample.square().mean().backward()
    for p, q in zip(mixing_parameters(model), mixing_parameters(other)):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    for a, b in zip(wan_self_attn(model), wan_self_attn(other)):
        assert torch.allclose(a.mhla.output_norm.weight.grad, b.mhla.output_norm.weight.grad, rtol=1e-5, atol=1e-7)


# -- conversion, save / load, generation (C14, C15) ---------------------------------------------------
@pytest.fixture(scope="module")
def base_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan") / "base"
    tiny_wan_pipeline(num_layers=3).save_pretrained(folder)
    return folder


def _video(pipe, **kw):
    kwargs = dict(prompt="an astronaut riding a horse", height=64, width=64, num_frames=5, num_inference_steps=2,
                  output_type="np")
    kwargs.update(kw)
    return torch.from_numpy(pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames)


FRESH_PROCESS = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file, save_file
    import mhla_diffusers as M
    folder, inputs_file, out_file, dtype = sys.argv[1:5]
    x = load_file(inputs_file)
    model = M.load_mhla_transformer(folder, torch_dtype=getattr(torch, dtype))
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()
    with torch.no_grad():
        out = model(**x).sample
    res = {"output": out.contiguous(), "training": torch.tensor(int(model.training))}
    res.update({k: v.contiguous() for k, v in model.state_dict().items() if "mhla" in k})
    save_file(res, out_file)
    print(M.mhla_spec(model))
    """
)


def _fresh_process(folder, inputs: dict, tmp_path, dtype="float32"):
    save_file({k: v.contiguous() for k, v in inputs.items()}, tmp_path / "inputs.safetensors")
    return subprocess.Popen(
        [sys.executable, "-c", FRESH_PROCESS, str(folder), str(tmp_path / "inputs.safetensors"),
         str(tmp_path / "res.safetensors"), dtype],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_convert_folder_load_generate_mp4_refuse_again(base_pipeline, tmp_path, capsys):
    """convert.py --family wan on a local WanPipeline folder (hybrid, authors' preset, normalize off: output
    norm on); load_mhla_pipeline gives a ready WanPipeline equal to the same conversion in memory; a fresh
    process reproduces the trained state bit for bit (C14, mixing matrices and output norms); a missing
    MHLA key is an error; generate.py --frames writes mp4s; converting again is refused (C15)."""
    import imageio.v3 as iio

    from mhla_diffusers.checkpoint.format import MHLACheckpointError

    out = tmp_path / "mhla"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", base_pipeline, "--out", out,
                         "--layers", "hybrid", "--block-grid", "authors", "--no-normalize", capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["family"] == "wan" and config["layers"] == [1, 2] and config["block_grid"] == [3, 5, 10]
    assert config["normalize"] is False and config["output_norm"] is True
    keys = sorted(load_file(out / "transformer" / "mhla.safetensors"))
    assert keys == [f"blocks.{i}.attn1.{m}.weight" for i in (1, 2) for m in ("mhla.mixing", "mhla.output_norm")]
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "WanPipeline" and not pipe.transformer.training
    assert [type(a.processor).__name__ for a in wan_self_attn(pipe.transformer)] == [
        "WanAttnProcessor", "MHLAProcessor", "MHLAProcessor"]
    from diffusers import WanPipeline

    expected = WanPipeline.from_pretrained(base_pipeline)
    apply_mhla(expected.transformer, layers="hybrid", block_grid="authors", normalize=False)
    realign_(pipe.transformer), realign_(expected.transformer)
    assert torch.equal(_video(pipe), _video(expected))

    # a "fine-tuned" state: save, load in a fresh process, identical (C14)
    model = pipe.transformer
    randomize_mixing_(model)
    with torch.no_grad():
        for attn in wan_self_attn(model)[1:]:
            attn.mhla.output_norm.weight.uniform_(0.5, 1.5)
    saved = tmp_path / "tuned"
    mhla_diffusers.save_mhla_transformer(model, saved)
    inputs = wan_inputs(batch=1, frames=2, size=(8, 12))
    proc = _fresh_process(saved, inputs, tmp_path)
    try:
        want = run_wan(model, inputs)
        state = {k: v.clone() for k, v in model.state_dict().items() if "mhla" in k}
    finally:
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    res = load_file(tmp_path / "res.safetensors")
    assert int(res["training"]) == 0 and sorted(k for k in res if "mhla" in k) == sorted(state)
    assert all(torch.equal(res[k], v) for k, v in state.items()) and torch.equal(res["output"], want)
    weights = load_file(saved / "mhla.safetensors")
    weights.pop("blocks.2.attn1.mhla.output_norm.weight")
    save_file(weights, saved / "mhla.safetensors")
    with pytest.raises(MHLACheckpointError, match="missing keys.*mhla.output_norm"):
        load_mhla_transformer(saved)

    clip = tmp_path / "clip.mp4"
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", "a dog", "--height", "64",
                         "--width", "48", "--frames", "5", "--steps", "2", "--out", clip, capsys=capsys)
    assert code == 0, err
    for i in (0, 1):
        frames = iio.imread(tmp_path / f"clip_{i}.mp4")
        assert frames.shape[0] == 5 and frames.shape[1:3] == (64, 48)
    assert not clip.exists()
    cases = [
        (("--frames", "6"), "Nearest valid counts: 5 or 9"),
        (("--frames", "5", "--height", "40"), "divisible by 16"),
        (("--frames", "5", "--rows", "2"), "only applies to image"),
        (("--frames", "5", "--no-resolution-binning"), "WanPipeline has no resolution binning"),
        (("--frames", "5", "--video", tmp_path), "takes no video: --video is for Wan VACE"),
    ]
    for extra, message in cases:
        code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", *extra, "--steps", "1",
                             "--out", tmp_path / "x.mp4", capsys=capsys)
        assert code == 2 and message in err, (extra, err)
    code, err = run_main("pipelines/generate.py", "--checkpoint", out, "--prompt", "a cat", "--steps", "1",
                         "--out", tmp_path / "x.png", capsys=capsys)
    assert code == 2 and "must end in .mp4" in err
    assert not (tmp_path / "x.mp4").exists()

    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", out, "--out", tmp_path / "again", capsys=capsys)
    assert code == 3 and "already an MHLA checkpoint" in err and not (tmp_path / "again").exists()


def test_pipeline_end_to_end_all_and_hybrid(tmp_path):
    """WanPipeline end to end with the one-liner (MHLA everywhere) and with the hybrid, to an mp4."""
    import imageio.v3 as iio

    from mhla_diffusers.generation import generate_videos, save_video

    pipe = tiny_wan_pipeline(num_layers=3)
    stock = _video(pipe)
    pipe.transformer.set_attn_processor(MHLAProcessor())
    everything = _video(pipe)
    remove_mhla(pipe.transformer)
    assert torch.equal(_video(pipe), stock)
    apply_mhla(pipe.transformer, layers="hybrid")
    hybrid = _video(pipe)
    for video in (everything, hybrid):
        assert video.shape == (1, 5, 64, 64, 3) and torch.isfinite(video).all()
        assert (video - stock).abs().max() > 1e-3
    assert (everything - hybrid).abs().max() > 1e-3
    (video,) = generate_videos(None, ["an astronaut riding a horse"], height=64, width=64, frames=5, steps=2, pipe=pipe)
    path = save_video(video, tmp_path / "hybrid.mp4")
    assert iio.imread(path).shape == (5, 64, 64, 3)


def test_convert_original_single_file(base_pipeline, tmp_path, capsys):
    """An original Wan checkpoint (original key layout: blocks.0.self_attn.q.weight, head.head.weight, ...;
    with and without the model.diffusion_model. prefix) converts through from_single_file with a local
    config: a pipeline folder gives a whole pipeline, a transformer folder the transformer alone (fp16
    here); the base weights are exactly the original ones. The I2V transformer's image branch too."""
    from diffusers import WanTransformer3DModel

    base = WanTransformer3DModel.from_pretrained(base_pipeline / "transformer")
    original = original_wan_state_dict(base)
    assert "blocks.0.self_attn.q.weight" in original and "head.head.weight" in original
    assert not any(k.startswith("condition_embedder") or ".attn1." in k for k in original)
    st = tmp_path / "wan_tiny.safetensors"
    save_file(original, st)
    out = tmp_path / "from_st"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", st, "--config", base_pipeline, "--out", out,
                         "--layers", "hybrid", capsys=capsys)
    assert code == 0, err
    assert (out / "model_index.json").is_file()
    pipe = load_mhla_pipeline(out)
    assert type(pipe).__name__ == "WanPipeline" and mhla_spec(pipe.transformer)["layers"] == [1, 2]
    got = {k: v for k, v in pipe.transformer.state_dict().items() if "mhla" not in k}
    want = base.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    i2v = tiny_wan(num_layers=2, image_dim=16)
    i2v.save_pretrained(tmp_path / "i2v")
    prefixed = tmp_path / "wan_i2v.safetensors"
    save_file(original_wan_state_dict(i2v, prefix="model.diffusion_model."), prefixed)
    assert "model.diffusion_model.blocks.0.cross_attn.k_img.weight" in load_file(prefixed)
    out2 = tmp_path / "from_i2v"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", prefixed, "--config", tmp_path / "i2v",
                         "--out", out2, "--dtype", "fp16", capsys=capsys)
    assert code == 0, err
    stored = load_file(out2 / "diffusion_pytorch_model.safetensors")
    want = i2v.state_dict()
    assert sorted(stored) == sorted(want) and all(torch.equal(stored[k], v.half()) for k, v in want.items())
    model = load_mhla_transformer(out2, torch_dtype=torch.float16)
    assert mhla_spec(model)["layers"] == [0, 1] and mhla_spec(model)["block_grid"] == [3, 5, 7]
    code, err = run_main("conversion/convert.py", "--family", "sana", "--src", prefixed, "--config", tmp_path / "i2v",
                         "--out", tmp_path / "x", capsys=capsys)
    assert code == 2 and "holds a WanTransformer3DModel (wan)" in err and not (tmp_path / "x").exists()


# -- the real Wan2.1-1.3B architecture ---------------------------------------------------------------
def test_real_size_1_3b_conversion_forward_round_trip(tmp_path):
    """Wan2.1-T2V-1.3B (30 layers, 12 x 128, dim 1536, ffn 8960, text 4096; random weights, bf16 with
    diffusers' fp32 modules): one forward at 1 frame x 64 x 64 px (16 tokens) with the stock model, the
    one-liner (paper's 3 x 5 x 7 blocks, all empty but 1 x 4 x 4 of them here) and the hybrid; conversion
    of a bf16 folder (hybrid: 20 MHLA layers of 30, softmax on 0, 3, ..., 27); a fresh process loads it
    and reproduces the in-memory hybrid output with the mixing matrices as saved (C14)."""
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    model = random_wan(WAN_1_3B, dtype=torch.bfloat16)
    assert len(self_attention_modules(model)) == 30 and wan_self_attn(model)[0].heads == 12
    g = torch.Generator().manual_seed(0)
    x = {
        "hidden_states": torch.randn(1, 16, 1, 8, 8, generator=g).bfloat16(),
        "timestep": torch.tensor([600.0]),
        "encoder_hidden_states": torch.randn(1, 8, 4096, generator=g).bfloat16(),
    }
    stock = run_wan(model, x)
    src = tmp_path / "src"
    model.save_pretrained(src)
    spec = convert_checkpoint(src, tmp_path / "out", family="wan", layers="hybrid")
    assert spec["layers"] == [i for i in range(30) if i % 3] and spec["block_grid"] == [3, 5, 7]
    stored = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert stored["proj_out.weight"].dtype == torch.bfloat16 and stored["scale_shift_table"].dtype == torch.float32
    del stored
    import shutil

    shutil.rmtree(src)
    proc = _fresh_process(tmp_path / "out", x, tmp_path, dtype="bfloat16")
    try:
        apply_mhla(model, layers="hybrid")  # meanwhile, the same conversion in memory
        hybrid = run_wan(model, x)
        mixing = {k: v.clone() for k, v in model.state_dict().items() if "mhla" in k}
        remove_mhla(model)
        model.set_attn_processor(MHLAProcessor())  # the bare one-liner on all 30 layers
        everything = run_wan(model, x)
    finally:
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert len(mixing_parameters(model)) == 30
    for out in (hybrid, everything):
        assert out.shape == (1, 16, 1, 8, 8) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert _rel(out, stock) > 1e-3
    res = load_file(tmp_path / "res.safetensors")
    assert sorted(k for k in res if "mhla" in k) == sorted(mixing) and len(mixing) == 20
    assert all(torch.equal(res[k], v) for k, v in mixing.items())
    assert _rel(res["output"], hybrid) < 1e-6, _rel(res["output"], hybrid)


def test_single_file_with_a_config_of_another_size_is_a_clear_error(tmp_path, capsys):
    """An original file whose layers do not match the --config: exit 2 with a message, nothing written."""
    small = tiny_wan(num_layers=2)
    save_file(original_wan_state_dict(small), tmp_path / "two_layers.safetensors")
    tiny_wan(num_layers=3).save_pretrained(tmp_path / "three_layers")
    out = tmp_path / "out"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", tmp_path / "two_layers.safetensors",
                         "--config", tmp_path / "three_layers", "--out", out, capsys=capsys)
    assert code == 2 and "does not match the config" in err, err
    assert not out.exists()
