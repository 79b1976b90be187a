"""The per-layer options of MHLA beyond the paper's layer, from the authors' code (DAGroup-PKU/MHLA): LePE
(``lepe``), the output gate (``gate``), where RoPE goes (``rope``), ``phi = ReLU(x) ** p`` (``feature_power``) and
the mixing-matrix starts (``init``, ``"authors_constant"``).

* Neutral starts: a fresh install with ``gate="neutral"`` and ``lepe=True`` computes exactly (``torch.equal``)
  the model without them, on DiT, SANA and Wan.
* Each option on a layer against a float64 reference written here from the equations (q, k, v from the
  layer's own projections, MHLA by ``mhla_attention_reference``, the per-head RMSNorm, the gate, the
  depthwise convolution, ``to_out``): outputs and gradients (input, projections, mixing matrix, gate, LePE).
* The bare one-liner and ``apply_mhla`` agree (state, spec, outputs); errors for bad values; context parallelism
  refuses LePE; the summary exchange's features with ``feature_power``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import dit_inputs, randomize_mixing_, run_dit, tiny_dit
from helpers_sana import run_sana, sana_inputs, tiny_sana
from helpers_wan import run_wan, tiny_wan, wan_inputs

import mhla_diffusers
from mhla_diffusers import (
    BlockLayout,
    InterleavedRotary,
    MHLAProcessor,
    apply_mhla,
    materialize_mhla,
    mhla_attention,
    mhla_attention_reference,
    mhla_spec,
    remove_mhla,
    token_grid,
)
from mhla_diffusers.families import WanRotary
from mhla_diffusers.models import parallel
from mhla_diffusers.models.parallel import Shard
from mhla_diffusers.models.spec import AUTHORS_CONSTANT_VALUE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _rope(head_dim: int, grid, max_seq_len: int = 64):
    """Wan's rotary embedding ``(cos, sin)`` for a token grid, from diffusers' own WanRotaryPosEmbed."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    return WanRotaryPosEmbed(head_dim, (1, 1, 1), max_seq_len)(torch.zeros(1, 1, *grid))


@torch.no_grad()
def _randomize_options_(model, seed: int = 0, scale: float = 0.3) -> None:
    """Mixing matrices inside (0, 1) (the clamp's gradient is 1 there) and random gate, LePE and output-norm
    weights: a "trained" state where every option changes the output."""
    randomize_mixing_(model, seed=seed, low=0.05, high=0.95)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if any(part in name for part in (".mhla.gate.", ".mhla.lepe.")):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        elif ".mhla.output_norm." in name:
            p.copy_(1.0 + torch.randn(p.shape, generator=g) * scale)


def _float64_copy(attn):
    """A float64 copy of an attention module without its processor (a copied MHLAProcessor would wait for a model)."""
    processor = attn._modules.pop("processor", None)
    try:
        return copy.deepcopy(attn).double()
    finally:
        if processor is not None:
            attn._modules["processor"] = processor


def _mhla_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".mhla." in k}


# -- the float64 reference, from the equations -------------------------------------------------------
def reference(attn, hidden, grid, *, eps, normalize=True, rope="after", rotary_emb=None, power=1.0, feature_eps=0.0,
              gate=None, output_norm=False, lepe=False):
    """The layer's output ``[B, N, dim]`` in float64: q, k, v = the layer's projections (q / k RMSNorms over all
    heads where it has them), ``phi(x) = ReLU(x) ** power + feature_eps``, RoPE after phi (numerator only), before
    it, or none; dense MHLA; then ``g_norm`` (per-head RMSNorm, eps 1e-6), ``* gate(x)`` (``2 sigmoid`` or SiLU of
    ``W x + b``), ``+ conv(v)`` (depthwise, zero padding, over the grid), ``to_out``."""
    a = attn if attn.to_q.weight.dtype == torch.float64 else _float64_copy(attn)  # float64 modules: their own
    x = hidden.double()
    b, n, _ = x.shape
    heads = a.heads
    q, k, v = a.to_q(x), a.to_k(x), a.to_v(x)
    if getattr(a, "norm_q", None) is not None:
        q, k = a.norm_q(q), a.norm_k(k)
    q, k, v3 = (t.reshape(b, n, heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
    rot = None if rotary_emb is None or rope == "none" else WanRotary(rotary_emb)
    if rot is not None and rope == "before":
        q, k, rot = rot(q), rot(k), None
    phi_q, phi_k = (torch.relu(t) ** power + feature_eps for t in (q, k))
    mixing = a.mhla.mixing.weight.clamp(0.0, 1.0)
    layout = BlockLayout(grid, a.mhla.mixing.block_grid)
    out = mhla_attention_reference(phi_q, phi_k, v3, mixing, layout, normalize=normalize, eps=eps, feature_map=None,
                                   rotary=rot)  # [B, heads, N, d]
    if output_norm:
        w = a.mhla.output_norm.weight  # [heads, d]
        out = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * w[None, :, None, :]
    out = out.permute(0, 2, 1, 3).reshape(b, n, -1)  # [B, N, C], channel = head * d + i
    if gate is not None:
        z = x @ a.mhla.gate.weight.T + a.mhla.gate.bias
        out = out * (2.0 * torch.sigmoid(z) if gate == "neutral" else z * torch.sigmoid(z))
    if lepe:
        c, (t, h, w) = v.shape[-1], grid
        image = v.transpose(1, 2).reshape(b, c, t, h, w)  # to_v's output on the token grid
        weight, bias = a.mhla.lepe.weight, a.mhla.lepe.bias
        if weight.ndim == 5:
            conv = F.conv3d(image, weight, bias, padding=1, groups=c)
        else:
            assert t == 1
            conv = F.conv2d(image[:, :, 0], weight, bias, padding=1, groups=c)[:, :, None]
        out = out + conv.reshape(b, c, n).transpose(1, 2)
    return a.to_out[0](out)


GRAD_NAMES = ("to_q.weight", "to_v.weight", "mhla.mixing.weight", "mhla.gate.weight", "mhla.gate.bias", "mhla.lepe.weight",
              "mhla.lepe.bias", "mhla.output_norm.weight")


def _output_and_grads(attn, hidden, call, cotangent):
    """``call(attn, hidden)`` and the gradients of ``sum(out * cotangent)`` in the input and the parameters of GRAD_NAMES."""
    hidden = hidden.detach().clone().requires_grad_()
    params = [(n, p) for n, p in attn.named_parameters() if n.endswith(GRAD_NAMES)]
    out = call(attn, hidden)
    grads = torch.autograd.grad((out * cotangent.to(out.dtype)).sum(), [hidden] + [p for _, p in params])
    return out.detach(), dict(zip(["input"] + [n for n, _ in params], grads))


def _check_layer(attn, hidden, grid, call, want, expect_grads, tol=1e-5, grad_tol=1e-5) -> dict:
    """The processor's output and gradients against :func:`reference` (``want(module, hidden)``): relative errors."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        probe = want(attn, hidden)
    cotangent = torch.randn(probe.shape, generator=g, dtype=torch.float64)
    with token_grid(grid):
        out, grads = _output_and_grads(attn, hidden, call, cotangent)
    ref_attn = _float64_copy(attn)
    ref_out, ref_grads = _output_and_grads(ref_attn, hidden.double(), lambda m, x: want(m, x), cotangent)
    assert set(grads) == set(ref_grads) and expect_grads <= set(grads), (sorted(grads), expect_grads)
    errors = {"output": _rel(out, ref_out), **{name: _rel(grads[name], ref_grads[name]) for name in grads}}
    assert errors["output"] < tol, errors
    assert max(v for k, v in errors.items() if k != "output") < grad_tol, errors
    for name in expect_grads:
        assert grads[name].abs().max() > 0, name
    return errors


def _wan_call(rotary_emb):
    return lambda attn, x: attn(x, None, None, rotary_emb)


def _plain_call(attn, x):
    return attn(x)


# -- neutral starts: exactly the plain MHLA output -------------------------------------------------
@pytest.mark.parametrize("family", ["dit", "sana", "wan"])
def test_neutral_gate_and_zero_lepe_start_exactly_as_plain_mhla(family):
    """A fresh install with the neutral gate (``2 sigmoid(0) = 1``) and a zero-initialised LePE computes
    exactly (torch.equal) what the install without them computes, on a mixing matrix in a trained state."""
    build = {
        "dit": (lambda: tiny_dit(num_layers=2), dict(num_blocks=4), lambda m: run_dit(m, dit_inputs())),
        "sana": (lambda: tiny_sana(num_layers=2, qk_norm="rms_norm_across_heads"), dict(block_grid=(2, 2)),
                 lambda m: run_sana(m, sana_inputs(size=(6, 8)))),
        "wan": (lambda: tiny_wan(num_layers=2), dict(block_grid=(2, 2, 2)),
                lambda m: run_wan(m, wan_inputs(batch=2, frames=3, size=(8, 12)))),
    }
    make, settings, run = build[family]
    plain, extra = make(), make()
    apply_mhla(plain, **settings)
    apply_mhla(extra, gate="neutral", lepe=True, **settings)
    randomize_mixing_(plain, seed=3)
    randomize_mixing_(extra, seed=3)
    assert torch.equal(run(plain), run(extra))
    # True is the neutral gate; the gate and LePE do change a trained model
    spec = mhla_spec(extra)
    assert spec["gate"] == "neutral" and spec["lepe"] is True and "gate" not in mhla_spec(plain)
    _randomize_options_(extra, seed=3)
    assert _rel(run(extra), run(plain)) > 1e-3


def test_neutral_start_is_exact_in_bfloat16():
    """The gate and LePE are computed in float32: the neutral start rounds back to the very same bfloat16 output."""
    plain, extra = tiny_wan(num_layers=1, dtype=torch.bfloat16), tiny_wan(num_layers=1, dtype=torch.bfloat16)
    apply_mhla(plain, block_grid=(1, 2, 2), normalize=False)
    apply_mhla(extra, block_grid=(1, 2, 2), normalize=False, gate=True, lepe=True)
    inputs = wan_inputs(batch=1, frames=2, size=(8, 8), dtype=torch.bfloat16)
    assert torch.equal(run_wan(plain, inputs), run_wan(extra, inputs))


# -- each option on a layer, against the float64 reference -----------------------------------------
def test_dit_lepe_and_gate_layer_against_reference():
    """DiT (2D, softmax family): LePE (3 x 3 Conv2d on a 4 x 6 grid: not square, so H and W cannot swap) and the
    neutral gate, with trained (random) weights: outputs and gradients."""
    model = tiny_dit(num_layers=1)
    apply_mhla(model, block_grid=(2, 2), gate="neutral", lepe=True)
    _randomize_options_(model)
    attn = model.transformer_blocks[0].attn1
    assert attn.mhla.lepe.weight.shape == (16, 1, 3, 3) and attn.mhla.gate.weight.shape == (16, 16)
    hidden = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1))
    errors = _check_layer(
        attn, hidden, (1, 4, 6), _plain_call,
        lambda m, x: reference(m, x, (1, 4, 6), eps=1e-6, gate="neutral", lepe=True),
        {"input", "to_v.weight", "mhla.mixing.weight", "mhla.gate.weight", "mhla.lepe.weight", "mhla.lepe.bias"},
    )
    print("dit lepe + neutral gate", errors)


def test_sana_authors_gate_lepe_and_output_norm_layer_against_reference():
    """SANA (2D, the linear-attention family; q / k norms over all heads, eps 1e-15): the authors' gate
    ``g_norm(out) * SiLU(W x + b)`` (per-head output RMSNorm on, normaliser on) and LePE."""
    model = tiny_sana(num_layers=1, qk_norm="rms_norm_across_heads")
    apply_mhla(model, block_grid=(2, 2), gate="authors", lepe=True, lepe_init="authors", output_norm=True)
    _randomize_options_(model)
    attn = model.transformer_blocks[0].attn1
    hidden = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(2))
    errors = _check_layer(
        attn, hidden, (1, 4, 6), _plain_call,
        lambda m, x: reference(m, x, (1, 4, 6), eps=1e-15, gate="authors", lepe=True, output_norm=True),
        {"input", "to_q.weight", "mhla.mixing.weight", "mhla.gate.weight", "mhla.lepe.weight", "mhla.output_norm.weight"},
    )
    print("sana authors gate + lepe + output norm", errors)


@pytest.mark.parametrize("rope", ["after", "before", "none"])
def test_wan_rope_modes_layer_against_reference(rope):
    """Wan (3D, RoPE): each RoPE placement with LePE (3 x 3 x 3 Conv3d) and the authors' gate, numerator only + the
    per-head output norm (the authors' layer): "after" rotates phi(q), phi(k) in the numerator, "before" is the
    reference on pre-rotated q, k with no rotary, "none" ignores the rotary embedding."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2), normalize=False, rope=rope, gate="authors", lepe=True)
    _randomize_options_(model)
    attn = model.blocks[0].attn1
    assert attn.mhla.lepe.weight.shape == (24, 1, 3, 3, 3) and attn.mhla.output_norm is not None
    grid = (3, 4, 6)
    rotary_emb = _rope(12, grid)
    hidden = torch.randn(2, 72, 24, generator=torch.Generator().manual_seed(3))
    errors = _check_layer(
        attn, hidden, grid, _wan_call(rotary_emb),
        lambda m, x: reference(m, x, grid, eps=1e-6, normalize=False, rope=rope, rotary_emb=rotary_emb, gate="authors",
                               lepe=True, output_norm=True),
        {"input", "to_q.weight", "mhla.mixing.weight", "mhla.gate.weight", "mhla.lepe.weight", "mhla.output_norm.weight"},
    )
    print(f"wan rope={rope}", errors)
    assert (mhla_spec(model).get("rope") or "after") == rope


@pytest.mark.parametrize("rope", ["after", "before", "none"])
def test_wan_rope_modes_processor_is_the_operator(rope):
    """The processor on a Wan layer is exactly (torch.equal) the operator on the layer's own q, k, v: "after" with
    ``rotary=WanRotary(rotary_emb)``, "before" on ``R q``, ``R k`` with no rotary, "none" with no rotary."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2), rope=rope)
    randomize_mixing_(model, seed=4)
    attn = model.blocks[0].attn1
    grid, rotary_emb = (3, 4, 6), _rope(12, (3, 4, 6))
    hidden = torch.randn(2, 72, 24, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), token_grid(grid):
        got = attn(hidden, None, None, rotary_emb)
        q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(-1, (2, 12)).transpose(1, 2) for t in (q, k, v))
        rot = WanRotary(rotary_emb)
        options = {"rotary": rot} if rope == "after" else {}
        if rope == "before":
            q, k = rot(q), rot(k)
        out = mhla_attention(q, k, v, attn.mhla.mixing.weight.clamp(0, 1), BlockLayout(grid, (1, 2, 2)), eps=1e-6, **options)
        want = attn.to_out[0](out.transpose(1, 2).flatten(2))
    assert torch.equal(got, want)


def test_wan_rope_modes_differ_and_before_with_normaliser():
    """The three placements compute different layers (same weights); "before" with the normaliser uses the
    rotated features in the numerator and the denominator alike (the reference's form)."""
    grid, rotary_emb = (2, 4, 6), _rope(12, (2, 4, 6))
    hidden = torch.randn(1, 48, 24, generator=torch.Generator().manual_seed(4))
    outs = {}
    for rope in ("after", "before", "none"):
        model = tiny_wan(num_layers=1)
        apply_mhla(model, block_grid=(2, 2, 2), rope=rope)
        randomize_mixing_(model, seed=1, low=0.05, high=0.95)
        attn = model.blocks[0].attn1
        with torch.no_grad(), token_grid(grid):
            outs[rope] = attn(hidden, None, None, rotary_emb)
            want = reference(attn, hidden, grid, eps=1e-6, rope=rope, rotary_emb=rotary_emb)
        assert _rel(outs[rope], want) < 1e-5, rope
    assert min(_rel(outs["after"], outs["before"]), _rel(outs["after"], outs["none"]), _rel(outs["before"], outs["none"])) > 1e-3


@pytest.mark.parametrize("power", [2.0, 0.5])
def test_feature_power_layer_against_reference(power):
    """``phi = ReLU(x) ** p + feature_eps`` on Wan (RoPE after phi) against the reference; outputs and gradients."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2), feature_power=power, feature_eps=1e-3)
    randomize_mixing_(model, seed=2, low=0.05, high=0.95)
    attn = model.blocks[0].attn1
    grid = (3, 4, 6)
    rotary_emb = _rope(12, grid)
    hidden = torch.randn(2, 72, 24, generator=torch.Generator().manual_seed(5))
    errors = _check_layer(
        attn, hidden, grid, _wan_call(rotary_emb),
        lambda m, x: reference(m, x, grid, eps=1e-6, rotary_emb=rotary_emb, power=power, feature_eps=1e-3),
        {"input", "to_q.weight", "mhla.mixing.weight"}, tol=1e-5, grad_tol=1e-4,
    )
    print(f"wan feature_power={power}", errors)
    assert mhla_spec(model)["feature_power"] == power


def test_feature_power_reaches_the_operator(monkeypatch):
    """The processor gives its ``feature_power`` to ``mhla_attention``."""
    seen = []

    def spy(q, k, v, mixing, layout, **kwargs):
        seen.append(kwargs)
        return torch.zeros_like(v)

    monkeypatch.setattr(mhla_diffusers.models.layer, "mhla_attention", spy)
    for power in (1.0, 3.0):
        model = tiny_dit(num_layers=1)
        apply_mhla(model, num_blocks=4, feature_power=power)
        run_dit(model, dit_inputs(batch=1))
    assert seen[0]["feature_power"] == 1.0 and seen[1]["feature_power"] == 3.0


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_summary_exchange_features_with_feature_power(monkeypatch, power):
    """Context parallelism's summary exchange (models/parallel.py) with ``feature_power`` and ``feature_eps``,
    RoPE after phi: two shards of 72 tokens, their summaries summed as the all-reduce would, against the dense
    reference on all tokens."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 72, 12, generator=g, dtype=torch.float64) for _ in range(3))
    layout = BlockLayout((3, 4, 6), (1, 2, 2))
    mixing = torch.rand(4, 4, generator=g, dtype=torch.float64)
    rotary_emb = _rope(12, (3, 4, 6))
    cos, sin = rotary_emb[0][0, :, 0, 0::2], rotary_emb[1][0, :, 0, 1::2]
    shards = [Shard(None, r, 2, offset, 36, 72) for r, offset in enumerate((0, 36))]

    def run():
        return [
            parallel.sharded_mhla_attention(
                *(t[:, :, s.offset:s.offset + s.length] for t in (q, k, v)), mixing, layout, s, feature_eps=1e-3,
                feature_power=power, rotary=InterleavedRotary(cos[s.offset:s.offset + s.length], sin[s.offset:s.offset + s.length]),
            )
            for s in shards
        ]

    sent = []
    monkeypatch.setattr(parallel, "_all_reduce", lambda packed, group: sent.append(packed) or packed)
    run()
    total = sent[0] + sent[1]
    monkeypatch.setattr(parallel, "_all_reduce", lambda packed, group: total)
    got = torch.cat(run(), dim=2)
    phi_q, phi_k = (torch.relu(t) ** power + 1e-3 for t in (q, k))
    want = mhla_attention_reference(phi_q, phi_k, v, mixing, layout, feature_map=None, rotary=WanRotary(rotary_emb))
    assert got.dtype == torch.float64 and _rel(got, want) < 1e-12


# -- the one-liner and apply_mhla agree ------------------------------------------------------------
@pytest.mark.parametrize("family", ["sana", "wan"])
def test_one_liner_and_apply_mhla_agree(family):
    """diffusers' own ``set_attn_processor(MHLAProcessor(gate=..., lepe=True, ...))`` creates at its first forward
    (or ``materialize_mhla``) the same layer state as ``apply_mhla`` with those settings: same keys and shapes, same
    ``mhla_spec``, and with the same weights the same outputs, bit for bit."""
    if family == "sana":
        make = lambda: tiny_sana(num_layers=2)  # noqa: E731
        settings, run = dict(block_grid=(2, 2), gate="authors", lepe=True), lambda m: run_sana(m, sana_inputs(size=(6, 8)))
    else:
        make = lambda: tiny_wan(num_layers=2)  # noqa: E731
        settings = dict(block_grid=(1, 2, 2), gate="neutral", lepe=True, rope="before", normalize=False)
        run = lambda m: run_wan(m, wan_inputs(batch=1, frames=3, size=(8, 12)))  # noqa: E731
    applied, liner, early = make(), make(), make()
    apply_mhla(applied, **settings)
    _randomize_options_(applied)
    liner.set_attn_processor(MHLAProcessor(**settings))
    assert materialize_mhla(liner)
    state = _mhla_state(applied)
    assert {k: v.shape for k, v in _mhla_state(liner).items()} == {k: v.shape for k, v in state.items()}
    liner.load_state_dict(state, strict=False)
    assert mhla_spec(liner) == mhla_spec(applied)
    assert torch.equal(run(liner), run(applied))
    # a state dict loaded before the first forward (explicit block grid): gate and LePE are created to receive it
    early.set_attn_processor(MHLAProcessor(**settings))
    early.load_state_dict({**early.state_dict(), **state}, strict=True)
    assert torch.equal(run(early), run(applied))


def test_a_layer_keeps_its_gate_and_lepe_unless_told_otherwise():
    """An ``MHLAProcessor()`` without ``gate`` / ``lepe`` runs a layer's gate and LePE as they are (as a loaded
    checkpoint runs); one asking otherwise is refused with the fix (remove_mhla first)."""
    model = tiny_dit(num_layers=1)
    apply_mhla(model, num_blocks=4, gate="authors", lepe=True)
    _randomize_options_(model)
    inputs = dit_inputs(batch=1)
    before = run_dit(model, inputs)
    mhla_diffusers.set_attn_processor(model, MHLAProcessor())
    assert torch.equal(run_dit(model, inputs), before)
    for proc, message in (
        (MHLAProcessor(gate=False), "made with gate='authors' but the processor asks for gate=False"),
        (MHLAProcessor(gate="neutral"), "asks for gate='neutral'"),
        (MHLAProcessor(lepe=False), "made with lepe=True but the processor asks for lepe=False"),
    ):
        with pytest.raises(ValueError, match=message):
            mhla_diffusers.set_attn_processor(model, proc)
    remove_mhla(model)
    assert not [n for n, _ in model.named_modules() if ".mhla." in n]


# -- starts: the authors' constant, LePE's and the gate's PyTorch inits ----------------------------
def test_authors_constant_start():
    """``init="authors_constant"``: the mixing matrix and the output RMSNorm's weight at 1e-6 everywhere (their Wan
    run's start); on a layer without output norm only the matrix."""
    wan = tiny_wan(num_layers=1)
    apply_mhla(wan, block_grid=(1, 2, 2), normalize=False, init="authors_constant", mixing_clamp=False)
    attn = wan.blocks[0].attn1
    assert torch.all(attn.mhla.mixing.weight == AUTHORS_CONSTANT_VALUE)
    assert torch.all(attn.mhla.output_norm.weight == AUTHORS_CONSTANT_VALUE)
    assert torch.isfinite(run_wan(wan, wan_inputs(batch=1, frames=2, size=(8, 8)))).all()
    dit = tiny_dit(num_layers=1)
    apply_mhla(dit, num_blocks=4, init="authors_constant")
    assert torch.all(dit.transformer_blocks[0].attn1.mhla.mixing.weight == 1e-6)
    assert dit.transformer_blocks[0].attn1.mhla.output_norm is None


def test_lepe_and_gate_authors_inits_are_pytorchs():
    """``lepe_init="authors"``: PyTorch's default depthwise-conv init (kaiming uniform, a = sqrt(5): bounds
    1 / sqrt(fan_in), fan_in = the kernel's size); ``gate="authors"``: nn.Linear's (bound 1 / sqrt(dim)); the
    neutral forms start at zero."""
    model = tiny_wan(num_layers=1)
    apply_mhla(model, block_grid=(1, 2, 2), gate="authors", lepe=True, lepe_init="authors")
    attn = model.blocks[0].attn1
    bound = 1 / math.sqrt(27)
    for p in (attn.mhla.lepe.weight, attn.mhla.lepe.bias):
        assert p.dtype == torch.float32 and p.abs().max() <= bound and p.abs().max() > bound / 2
    assert attn.mhla.gate.weight.abs().max() <= 1 / math.sqrt(24) and attn.mhla.gate.weight.std() > 0.05
    remove_mhla(model)
    apply_mhla(model, block_grid=(1, 2, 2), gate="neutral", lepe=True)
    attn = model.blocks[0].attn1
    assert all(torch.count_nonzero(p) == 0 for n, p in attn.named_parameters() if "mhla.gate" in n or "mhla.lepe" in n)


def test_mixing_init_names_come_from_the_operator():
    """Every name MixingMatrix knows passes through apply_mhla; an unknown one is refused with its list."""
    from mhla_diffusers.ops.mixing import MixingMatrix

    names = [name for name in ("locality", "uniform", "cos", "exp", "gaussian", "local", "constant")
             if _known(MixingMatrix, name)]
    assert {"locality", "uniform"} <= set(names)
    for name in names:
        model = tiny_dit(num_layers=1)
        apply_mhla(model, block_grid=(2, 2), init=name)
        assert torch.equal(model.transformer_blocks[0].attn1.mhla.mixing.weight, MixingMatrix((2, 2), init=name).weight)
    with pytest.raises(ValueError, match=r"unknown mixing-matrix init 'paper'.*locality.*authors_constant"):
        apply_mhla(tiny_dit(num_layers=1), init="paper")


def _known(cls, name) -> bool:
    try:
        cls((2, 2), init=name)
    except ValueError:
        return False
    return True


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gate="sigmoid"), r"gate must be one of \['neutral', 'authors'\]"),
        (dict(gate=1), "gate must be one of"),
        (dict(lepe="yes"), "lepe must be True, False or None"),
        (dict(rope="sideways"), r"rope must be one of \['after', 'before', 'none'\]"),
        (dict(feature_power=0), "feature_power must be a finite number > 0"),
        (dict(feature_power=-1.0), "feature_power must be a finite number > 0"),
        (dict(feature_power=float("inf")), "feature_power must be a finite number > 0"),
        (dict(feature_power=True), "feature_power must be a finite number > 0"),
    ],
)
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MHLAProcessor(**kwargs)
    model = tiny_dit(num_layers=1)
    with pytest.raises(ValueError, match=match):
        apply_mhla(model, **kwargs)
    assert not mhla_diffusers.is_mhla_model(model)  # nothing installed


def test_bad_init_names_refused_before_anything_is_installed():
    model = tiny_dit(num_layers=2)
    with pytest.raises(ValueError, match=r"lepe_init must be one of \['zeros', 'authors'\]"):
        apply_mhla(model, lepe=True, lepe_init="kaiming")
    with pytest.raises(ValueError, match="unknown mixing-matrix init"):
        apply_mhla(model, init="Locality")
    assert not mhla_diffusers.is_mhla_model(model)


def test_rope_on_a_family_without_rope():
    """DiT / SANA have no RoPE: ``rope="before"`` / ``"after"`` are refused with the fix (install, the one-liner's
    first forward); ``"none"`` says what they compute and is the default, exactly."""
    inputs = sana_inputs(size=(6, 8))
    for rope in ("before", "after"):
        with pytest.raises(ValueError, match=rf"rope='{rope}'.*the SANA family has no RoPE.*Wan.*leave rope unset"):
            apply_mhla(tiny_sana(num_layers=1), rope=rope)
        model = tiny_sana(num_layers=1)
        model.set_attn_processor(MHLAProcessor(rope=rope))
        with pytest.raises(ValueError, match="has no RoPE"):
            run_sana(model, inputs)
        # a state dict loaded before the first forward creates the state without the model: checked at that forward
        source = tiny_sana(num_layers=1)
        apply_mhla(source, block_grid=(2, 2))
        model = tiny_sana(num_layers=1)
        model.set_attn_processor(MHLAProcessor(block_grid=(2, 2), rope=rope))
        model.load_state_dict(source.state_dict())
        with pytest.raises(ValueError, match="has no RoPE"):
            run_sana(model, inputs)
    plain, none = tiny_sana(num_layers=1), tiny_sana(num_layers=1)
    apply_mhla(plain, block_grid=(2, 2))
    apply_mhla(none, block_grid=(2, 2), rope="none")
    assert mhla_spec(none) == mhla_spec(plain) and "rope" not in mhla_spec(none)
    assert torch.equal(run_sana(none, inputs), run_sana(plain, inputs))


def test_context_parallelism_refuses_lepe(monkeypatch):
    """LePE needs each token's grid neighbours, which another rank holds: ``enable_context_parallel`` refuses it
    naming the layers (before anything else), and a layer given a shard (diffusers' own enable_parallelism) refuses
    at its call."""
    from diffusers import ContextParallelConfig

    model = tiny_wan(num_layers=2)
    apply_mhla(model, layers=[1], block_grid=(1, 2, 2), lepe=True)
    with pytest.raises(ValueError, match=r"\['blocks.1.attn1'\] have a LePE convolution.*not supported under context parallelism"):
        mhla_diffusers.enable_context_parallel(model, ContextParallelConfig(ring_degree=2))
    liner = tiny_wan(num_layers=1)
    liner.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 2), lepe=True))  # pending: refused too
    with pytest.raises(ValueError, match="LePE"):
        mhla_diffusers.enable_context_parallel(liner, ContextParallelConfig(ring_degree=2))
    remove_mhla(liner)  # it never ran: no layer left waiting for its model
    monkeypatch.setattr(mhla_diffusers.models.layer, "context_shard", lambda n, total, heads: Shard(None, 0, 2, 0, n, total))
    attn = model.blocks[1].attn1
    with pytest.raises(RuntimeError, match="holds only this rank's 12 of the 24 tokens: LePE is not supported"):
        with torch.no_grad(), token_grid((2, 3, 4)):
            attn(torch.randn(1, 12, 24), None, None, None)


@pytest.mark.parametrize("init", ["cos", "exp", "gaussian", "local"])
def test_the_authors_mixing_inits_reach_every_layer(init, tmp_path):
    """``apply_mhla(init=...)`` with the authors' distance transforms: every layer's matrix is ``mixing_init`` of its
    block grid and kind (so the formula, tested in tests/ops/test_ops_features.py), and a conversion writes it."""
    from mhla_diffusers import mixing_init
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4, init=init)
    for block in model.transformer_blocks:
        mixing = block.attn1.mhla.mixing
        assert torch.equal(mixing.weight.detach(), mixing_init(mixing.block_grid, kind=init))
    assert not torch.equal(mixing.weight.detach(), mixing_init(mixing.block_grid))  # not the paper's locality start
    remove_mhla(model)
    src = tmp_path / "src"
    model.save_pretrained(src)
    convert_checkpoint(src, tmp_path / "out", family="dit", num_blocks=4, init=init)
    loaded = mhla_diffusers.load_mhla_transformer(tmp_path / "out")
    mixing = loaded.transformer_blocks[0].attn1.mhla.mixing
    assert torch.equal(mixing.weight.detach(), mixing_init(mixing.block_grid, kind=init))


def test_lepe_init_without_lepe_is_refused():
    """``lepe_init`` is LePE's start: without ``lepe=True`` it would be ignored, so it is refused (as convert.py does)."""
    with pytest.raises(ValueError, match="only applies with lepe=True"):
        apply_mhla(tiny_dit(num_layers=1), num_blocks=4, lepe_init="authors")
