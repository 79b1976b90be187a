"""Importing the authors' released Wan MHLA weights (DAGroup-PKU/MHLA) into a diffusers WanTransformer3DModel.

No real file is available here: a tiny checkpoint with THEIR key names and shapes is built from a tiny
diffusers Wan (original Wan key layout, tests/helpers_wan.py) plus their MHLA parameters, imported, and
the imported layers are compared with an independent implementation of their attention layer written
below from their formulas (their ``MHLA_Video_Uni`` forward with the released configuration:
numerator only, ``g_norm``, no gate, no LePE, blocks (3, 5, 10), ``relu(x) + 1e-6`` features, Wan's
complex RoPE on the features, mixing never clamped).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import run_main
from helpers_wan import original_wan_state_dict, tiny_t5_tokenizer, tiny_umt5, tiny_wan, tiny_wan_vae
from safetensors.torch import save_file

HEADS, HEAD_DIM, LAYERS = 2, 16, 3
MHLA_LAYERS = [1, 2]  # their hybrid pattern on three layers: softmax kept on layer 0
BLOCKS = (3, 5, 10)
EPS = 1e-6
GRID = (3, 10, 20)  # latent 3 x 20 x 40: 600 tokens, blocks of 1 x 2 x 2 tokens


# -- an independent implementation of their layer (from their formulas, not from our code) -------------
def authors_rope_freqs(head_dim: int, max_len: int = 64) -> torch.Tensor:
    """Their ``rope_params`` table: complex128 ``[max_len, head_dim / 2]``, parts t, h, w."""

    def params(dim):
        angles = torch.outer(
            torch.arange(max_len, dtype=torch.float64),
            1.0 / torch.pow(10000.0, torch.arange(0, dim, 2, dtype=torch.float64) / dim),
        )
        return torch.polar(torch.ones_like(angles), angles)

    d = head_dim
    return torch.cat([params(d - 4 * (d // 6)), params(2 * (d // 6)), params(2 * (d // 6))], dim=1)


def authors_rope(x: torch.Tensor, grid, freqs: torch.Tensor) -> torch.Tensor:
    """Their ``rope_apply``: x ``[B, N, heads, d]`` -> rotated (adjacent channel pairs as complex numbers, fp64)."""
    f, h, w = grid
    c = x.shape[-1] // 2
    ft, fh, fw = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    table = torch.cat(
        [
            ft[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            fh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
            fw[:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)
    xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * table).flatten(-2).float()


def authors_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Their ``WanRMSNorm`` (eps 1e-6) over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * weight


def authors_normaliser(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, grid) -> torch.Tensor:
    """Their ``normalize_out`` normaliser ``block_attn(q @ k_sum) + eps`` ``[B, N, heads]`` on the UN-rotated features
    ``q``, ``k`` ``[B, N, heads, d]``: tokens to ``(fb hb wb) (p1 p2 p3)`` as their ``rearrange`` (blocks of equal size),
    each block's queries dotted with that block's key sum, then mixed over blocks at each position (their 1 x 1 conv)."""
    b, n, heads, d = q.shape
    sizes = [g // blk for g, blk in zip(grid, BLOCKS)]

    def to_blocks(t):  # "b (fb p1 hb p2 wb p3) h c -> b h (fb hb wb) (p1 p2 p3) c"
        t = t.reshape(b, BLOCKS[0], sizes[0], BLOCKS[1], sizes[1], BLOCKS[2], sizes[2], heads, d)
        return t.permute(0, 7, 1, 3, 5, 2, 4, 6, 8).reshape(b, heads, len(w), -1, d)

    qb, kb = to_blocks(q), to_blocks(k)
    qz = torch.einsum("bhmld,bhmd->bhml", qb, kb.sum(dim=3))
    den = torch.einsum("ij,bhjl->bhil", w, qz) + EPS  # [B, heads, M, L]
    den = den.reshape(b, heads, *BLOCKS, *sizes).permute(0, 2, 5, 3, 6, 4, 7, 1)  # back to (t, h, w) token order
    return den.reshape(b, n, heads)


def authors_layer(x: torch.Tensor, p: dict, grid, heads: int, gate_fn=F.silu, norm_output: bool = False) -> torch.Tensor:
    """Their MHLA self-attention (numerator only, then g_norm per head, then o) on ``x`` ``[B, N, C]``.

    ``p``: their tensors of the layer, keyed as in their state dict without ``blocks.<i>.self_attn.``.
    Blocks by floor division: token (t, h, w) is in block (t // (T / 3), h // (H / 5), w // (W / 10)).
    ``norm_output``: their constructors' default, the numerator divided by :func:`authors_normaliser`.
    """
    b, n, c = x.shape
    d = c // heads
    q = F.linear(x, p["q.weight"], p["q.bias"]).float()
    k = F.linear(x, p["k.weight"], p["k.bias"]).float()
    v = F.linear(x, p["v.weight"], p["v.bias"]).float()
    q, k = authors_rms(q, p["norm_q.weight"]), authors_rms(k, p["norm_k.weight"])
    q, k = torch.relu(q) + EPS, torch.relu(k) + EPS
    q, k, v = (t.view(b, n, heads, d) for t in (q, k, v))
    freqs = authors_rope_freqs(d)
    q_rope, k_rope = authors_rope(q, grid, freqs), authors_rope(k, grid, freqs)
    # one-hot block membership [N, M] by floor division of the grid
    t_size, h_size, w_size = (g // blk for g, blk in zip(grid, BLOCKS))
    tt, hh, ww = torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij")
    block = ((tt // t_size) * BLOCKS[1] + hh // h_size) * BLOCKS[2] + ww // w_size
    member = F.one_hot(block.reshape(-1), BLOCKS[0] * BLOCKS[1] * BLOCKS[2]).float()
    kv = torch.einsum("nm,bnhd,bnhe->bhmde", member, k_rope, v)  # per-block summaries
    mixed = torch.einsum("ij,bhjde->bhide", p["block_attn.conv.weight"][:, :, 0, 0].float(), kv)
    out = torch.einsum("bnhd,nm,bhmde->bnhe", q_rope, member, mixed)
    if norm_output:
        out = out / authors_normaliser(q, k, p["block_attn.conv.weight"][:, :, 0, 0].float(), grid)[..., None]
    out = authors_rms(out, p["g_norm.weight"]).reshape(b, n, c)  # g_norm over the head dim
    if "g.weight" in p:  # their gated variant: g_norm(out) * SiLU(g(x))
        out = out * gate_fn(F.linear(x.float(), p["g.weight"], p["g.bias"]))
    if "lepe.weight" in p:  # their LePE: a depthwise 3 x 3 x 3 convolution of v over (frames, height, width), added
        grid_v = v.reshape(b, *grid, c).permute(0, 4, 1, 2, 3)
        lepe = F.conv3d(grid_v, p["lepe.weight"].float(), p["lepe.bias"].float(), padding=1, groups=c)
        out = out + lepe.permute(0, 2, 3, 4, 1).reshape(b, n, c)
    return F.linear(out, p["o.weight"], p["o.bias"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- a tiny checkpoint in their layout ---------------------------------------------------------------------
def authors_state_dict(transformer, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny diffusers Wan as their model's state dict: original Wan keys plus, on MHLA_LAYERS, their
    ``g_norm.weight`` [head_dim] and ``block_attn.conv.weight`` [150, 150, 1, 1] (negative entries included,
    as in their release). Layer 2's q/k norm weights are small (features ~1e-4), so that the feature epsilon
    1e-6 changes its output measurably."""
    g = torch.Generator().manual_seed(seed)
    state = original_wan_state_dict(transformer)
    m = BLOCKS[0] * BLOCKS[1] * BLOCKS[2]
    for i in MHLA_LAYERS:
        state[f"blocks.{i}.self_attn.g_norm.weight"] = 1.0 + 0.3 * torch.randn(HEAD_DIM, generator=g)
        state[f"blocks.{i}.self_attn.block_attn.conv.weight"] = (0.02 * torch.randn(m, m, 1, 1, generator=g)) + (
            torch.eye(m)[:, :, None, None] * 0.5)
    for name in ("norm_q", "norm_k"):
        state[f"blocks.2.self_attn.{name}.weight"] = state[f"blocks.2.self_attn.{name}.weight"] * 1e-4
    for name in ("v.weight", "v.bias"):  # the numerator well above g_norm's epsilon (1e-6 on its mean square)
        state[f"blocks.2.self_attn.{name}"] = state[f"blocks.2.self_attn.{name}"] * 1e4
    state["blocks.2.self_attn.o.bias"] = torch.zeros_like(state["blocks.2.self_attn.o.bias"])
    return state


def with_gate_and_lepe(state: dict, seed: int = 3, gate: bool = True, lepe: bool = True) -> dict[str, torch.Tensor]:
    """``state`` as their ``is_gated`` / ``is_lepe`` variant: ``g`` (``nn.Linear(dim, dim)``) and ``lepe`` (a depthwise
    ``Conv3d`` 3 x 3 x 3 with bias) on every MHLA layer, random values of their default inits' size."""
    g = torch.Generator().manual_seed(seed)
    c = HEADS * HEAD_DIM
    state = dict(state)
    for i in MHLA_LAYERS:
        if gate:
            state[f"blocks.{i}.self_attn.g.weight"] = torch.randn(c, c, generator=g) / c**0.5
            state[f"blocks.{i}.self_attn.g.bias"] = 0.5 + 0.1 * torch.randn(c, generator=g)
        if lepe:
            scale = 0.2 if i != 2 else 0.2e-4  # LePE of the order of the normed output (layer 2's v is 1e4 larger)
            state[f"blocks.{i}.self_attn.lepe.weight"] = scale * torch.randn(c, 1, 3, 3, 3, generator=g)
            state[f"blocks.{i}.self_attn.lepe.bias"] = 0.1 * torch.randn(c, generator=g)
    return state


def layer_params(state: dict, i: int) -> dict[str, torch.Tensor]:
    prefix = f"blocks.{i}.self_attn."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{"config": a tiny diffusers WanPipeline folder, "src": their checkpoint (.safetensors), "state": its dict}``."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    root = tmp_path_factory.mktemp("authors")
    transformer = tiny_wan(num_layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, seed=1)
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=tiny_umt5(),
        vae=tiny_wan_vae(),
        transformer=transformer,
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
        ),
    )
    pipe.save_pretrained(root / "wan21")
    state = authors_state_dict(transformer)
    save_file(state, str(root / "model.safetensors"))
    return {"config": root / "wan21", "src": root / "model.safetensors", "state": state}


def _run_layers(model, grid=GRID, seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (input hidden states, output)}`` of every self-attention layer in one forward of ``model``."""
    seen, handles = {}, []
    for i, block in enumerate(model.blocks):
        handles.append(block.attn1.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out))))
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.randn(1, 16, t, 2 * h, 2 * w, generator=gen),
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
            )
    finally:
        for handle in handles:
            handle.remove()
    return seen


# -- the tests -------------------------------------------------------------------------------------------------
def test_imported_layers_equal_the_authors_layer(files, tmp_path, capsys):
    """convert.py --from authors writes our format; the loaded model's MHLA layers equal the independent
    implementation of their layer (fp32, <= 1e-5 relative), its softmax layer and every stock weight are
    the file's, and the test sees the details: clamping the mixing matrix or dropping the feature epsilon
    changes the output far beyond the tolerance."""
    from mhla_diffusers import load_mhla_pipeline

    out = tmp_path / "imported"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", out, capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["layers"] == MHLA_LAYERS and config["block_grid"] == list(BLOCKS) and config["num_blocks"] == 150
    assert config["normalize"] is False and config["output_norm"] is True
    assert config["feature_eps"] == EPS and config["mixing_clamp"] is False
    pipe = load_mhla_pipeline(out)
    model = pipe.transformer
    assert model.config["_mhla_native_size"] == {"height": 480, "width": 800, "frames": 81}
    assert [type(b.attn1.processor).__name__ for b in model.blocks] == ["WanAttnProcessor", "MHLAProcessor", "MHLAProcessor"]

    # the stock weights are the file's, through diffusers' key mapping
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    stock = {k: v for k, v in files["state"].items() if ".g_norm." not in k and ".block_attn." not in k}
    expected = convert_wan_transformer_to_diffusers(dict(stock))
    got = {k: v for k, v in model.state_dict().items() if ".mhla." not in k}
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    seen = _run_layers(model)
    for i in MHLA_LAYERS:
        x, y = seen[i]
        assert _rel(y, authors_layer(x, layer_params(files["state"], i), GRID, HEADS)) <= 1e-5, i

    # the comparison can fail: the clamp on the mixing matrix, the feature epsilon
    attn = model.blocks[2].attn1
    attn.mhla.mixing.clamp = True
    x, y = _run_layers(model)[2]
    assert _rel(y, authors_layer(x, layer_params(files["state"], 2), GRID, HEADS)) > 1e-2
    attn.mhla.mixing.clamp = False
    attn.mhla.feature_eps = 0.0
    x, y = _run_layers(model)[2]
    assert _rel(y, authors_layer(x, layer_params(files["state"], 2), GRID, HEADS)) > 1e-2


def test_pipeline_runs_and_defaults_to_the_native_size(files, tmp_path, monkeypatch):
    """The imported model runs through WanPipeline (here at 3 x 5 x 10 tokens, one per block); video
    generation defaults to its native 480 x 800 px, 81 frames (a plain Wan checkpoint: 480 x 832)."""
    from diffusers import WanPipeline

    import mhla_diffusers.generation as generation
    from mhla_diffusers import import_authors_wan, load_mhla_pipeline

    spec = import_authors_wan(files["src"], tmp_path / "imported", config=files["config"])
    assert spec["native_size"] == {"height": 480, "width": 800, "frames": 81} and spec["layers"] == MHLA_LAYERS
    pipe = load_mhla_pipeline(tmp_path / "imported")
    assert isinstance(pipe, WanPipeline)
    video = pipe(prompt="a cat walking in the snow", height=80, width=160, num_frames=9, num_inference_steps=2,
                 output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 9, 80, 160, 3) and bool(torch.isfinite(torch.from_numpy(video)).all())

    asked = {}

    def fake_run(pipe, device, seed, **kwargs):
        asked.update(kwargs)
        return type("Result", (), {"frames": [None]})()

    monkeypatch.setattr(generation, "_run", fake_run)
    generation.generate_videos(tmp_path / "imported", ["a prompt"], steps=1)
    assert (asked["height"], asked["width"], asked["num_frames"]) == (480, 800, 81)
    generation.generate_videos(tmp_path / "imported", ["a prompt"], steps=1, width=832)
    assert (asked["height"], asked["width"], asked["num_frames"]) == (480, 832, 81)
    generation.generate_videos(files["config"], ["a prompt"], steps=1)
    assert (asked["height"], asked["width"], asked["num_frames"]) == (480, 832, 81)


def test_training_checkpoint_nested_prefixed_bf16(files, tmp_path):
    """A .pth training checkpoint of their trainer (model and EMA state dicts, a DDP "module." prefix, bf16):
    two candidates without a choice is a clear error naming them; the chosen one imports in bf16, its MHLA
    parameters as float32 copies of the stored values."""
    from mhla_diffusers import load_mhla_pipeline
    from mhla_diffusers.checkpoint.authors import AuthorsCheckpointError, read_authors_state_dict

    ema = {k: (v * 0.5 if k.endswith("conv.weight") else v) for k, v in files["state"].items()}
    bf16 = lambda sd: {f"module.{k}": v.to(torch.bfloat16) for k, v in sd.items()}  # noqa: E731
    path = tmp_path / "epoch_5_step_500.pth"
    torch.save({"state_dict": bf16(files["state"]), "state_dict_ema": bf16(ema), "step": 500}, path)
    with pytest.raises(AuthorsCheckpointError, match=r"several state dicts \['state_dict', 'state_dict_ema'\]"):
        read_authors_state_dict(path)
    with pytest.raises(AuthorsCheckpointError, match="no state dict under 'ema'"):
        read_authors_state_dict(path, "ema")
    assert sorted(read_authors_state_dict(path, "state_dict_ema")) == sorted(files["state"])

    from mhla_diffusers import import_authors_wan

    import_authors_wan(path, tmp_path / "out", config=files["config"], state_dict_key="state_dict_ema")
    from mhla_diffusers.checkpoint.conversion import stored_dtype

    assert stored_dtype(tmp_path / "out" / "transformer") == torch.bfloat16  # the file's dtype kept
    model = load_mhla_pipeline(tmp_path / "out").transformer
    mixing = model.blocks[1].attn1.mhla.mixing.weight
    assert mixing.dtype == torch.float32
    stored = ema["blocks.1.self_attn.block_attn.conv.weight"][:, :, 0, 0].to(torch.bfloat16).float()
    assert torch.equal(mixing.detach(), stored) and bool((mixing < 0).any())


def test_gated_lepe_variant_equals_the_authors_layer(files, tmp_path, capsys):
    """Their ``is_gated`` + ``is_lepe`` layers (and each alone) import onto ``gate="authors"`` and ``lepe`` with their
    weights and equal the independent implementation of their layer (fp32, <= 1e-5); the comparison can fail:
    the neutral gate form or LePE left out changes the output far beyond that."""
    from mhla_diffusers import load_mhla_pipeline

    errors = {}
    for gate, lepe in ((True, True), (True, False), (False, True)):
        state = with_gate_and_lepe(files["state"], gate=gate, lepe=lepe)
        src = _write(state, tmp_path / f"variant_{gate}_{lepe}.safetensors")
        out = tmp_path / f"imported_{gate}_{lepe}"
        code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", src,
                             "--config", files["config"], "--out", out, capsys=capsys)
        assert code == 0, err
        config = json.loads((out / "transformer" / "mhla_config.json").read_text())
        assert config.get("gate") == ("authors" if gate else None) and bool(config.get("lepe")) is lepe, config
        model = load_mhla_pipeline(out).transformer
        seen = _run_layers(model)
        for i in MHLA_LAYERS:
            x, y = seen[i]
            errors[f"gate={gate} lepe={lepe} layer {i}"] = err = _rel(y, authors_layer(x, layer_params(state, i), GRID, HEADS))
            assert err <= 1e-5, (gate, lepe, i, err)
    print({k: f"{v:.2e}" for k, v in errors.items()})
    # the comparison can fail: with LePE left out, or the neutral gate form 2 sigmoid(g) for SiLU
    state = with_gate_and_lepe(files["state"])
    model = load_mhla_pipeline(tmp_path / "imported_True_True").transformer
    x, y = _run_layers(model)[1]
    without_lepe = {k: v for k, v in layer_params(state, 1).items() if not k.startswith("lepe.")}
    assert _rel(y, authors_layer(x, without_lepe, GRID, HEADS)) > 1e-2
    assert _rel(y, authors_layer(x, layer_params(state, 1), GRID, HEADS, gate_fn=lambda g: 2 * torch.sigmoid(g))) > 1e-2


def _write(state: dict, path) -> str:
    save_file(state, str(path))
    return str(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update({"blocks.1.self_attn.extra.weight": torch.ones(2)}), r"unknown keys \['blocks.1.self_attn.extra.weight'\]"),
        (lambda s: s.pop("blocks.0.ffn.0.weight"), r"missing keys \(diffusers names\) \['blocks.0.ffn.net.0.proj.weight'\]"),
        (lambda s: s.pop("blocks.2.self_attn.g_norm.weight"), r"missing keys \['blocks.2.self_attn.g_norm.weight'\]"),
        (lambda s: s.update({"blocks.1.self_attn.block_attn.conv.weight": torch.ones(149, 149, 1, 1)}),
         r"blocks.1.self_attn.block_attn.conv.weight has shape \(149, 149, 1, 1\), expected \(150, 150, 1, 1\)"),
        (lambda s: s.update({"blocks.1.self_attn.block_attn.conv.weight": torch.ones(150, 150)}),
         r"shape \(150, 150\), expected \(150, 150, 1, 1\)"),
        (lambda s: s.update({"blocks.1.self_attn.g_norm.weight": torch.ones(HEADS * HEAD_DIM)}),
         r"g_norm.weight has shape \(32,\), expected \(16,\)"),
        (lambda s: s.update({"blocks.1.self_attn.g.weight": torch.ones(32, 32)}),
         r"missing keys \['blocks.1.self_attn.g.bias'\]: layer 1 has only part of its gate"),
        (lambda s: s.update({"blocks.1.self_attn.g.weight": torch.ones(32, 32), "blocks.1.self_attn.g.bias": torch.ones(32)}),
         r"MHLA layers \[1\] have the gate weights \(g.weight\) and layers \[2\] do not"),
        (lambda s: s.update({f"blocks.{i}.self_attn.lepe.{k}": torch.ones(shape) for i in MHLA_LAYERS
                             for k, shape in (("weight", (32, 1, 3, 3)), ("bias", (32,)))}),
         r"blocks.1.self_attn.lepe.weight has shape \(32, 1, 3, 3\), expected \(32, 1, 3, 3, 3\)"),
        (lambda s: s.update({"blocks.7.self_attn.g_norm.weight": torch.ones(HEAD_DIM)}), r"layers \[7\], but the config has 3"),
        (lambda s: s.update({"blocks.0.ffn.0.weight": torch.ones(5, 5)}), r"shape mismatches \['blocks.0.ffn.0.weight: \(5, 5\)"),
        (lambda s: s.update({"blocks.1.self_attn.g_norm.weight": torch.full((HEAD_DIM,), float("nan"))}), "NaN"),
    ],
)
def test_bad_files_are_clear_errors(files, tmp_path, capsys, edit, message):
    """Unknown, missing or mis-shaped keys, half an MHLA layer, a gated variant, a layer the config lacks:
    exit code 2 with a message naming the keys; nothing is written."""
    state = dict(files["state"])
    edit(state)
    src = _write(state, tmp_path / "bad.safetensors")
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", src,
                         "--config", files["config"], "--out", tmp_path / "out", capsys=capsys)
    assert code == 2 and __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()


def test_cli_settings_that_are_the_authors_are_refused(files, tmp_path, capsys):
    """--from authors takes its settings from the file: --layers, --no-normalize, ... are refused, as are a family
    other than wan, a missing --config and a plain Wan file (no MHLA layer)."""
    base = ("conversion/convert.py", "--from", "authors", "--src", files["src"], "--out", tmp_path / "o")
    cases = [
        (("--family", "wan", "--config", files["config"], "--layers", "hybrid"), "--layers cannot be set with --from authors"),
        (("--family", "wan", "--config", files["config"], "--no-normalize", "--eps", "1e-3"), "--no-normalize, --eps cannot"),
        (("--family", "sana", "--config", files["config"]), "(--family wan) or a DiT"),
        (("--family", "wan",), "needs --config"),
    ]
    for extra, message in cases:
        code, err = run_main(*base, *extra, capsys=capsys)
        assert code == 2 and message in err, err
    plain = {k: v for k, v in files["state"].items() if ".g_norm." not in k and ".block_attn." not in k}
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src",
                         _write(plain, tmp_path / "plain.safetensors"), "--config", files["config"], "--out",
                         tmp_path / "o", capsys=capsys)
    assert code == 2 and "no MHLA layer" in err
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", files["config"], "--out", tmp_path / "o",
                         "--state-dict-key", "ema", capsys=capsys)
    assert code == 2 and "only applies with --from authors" in err


def test_recorded_settings_cannot_be_edited(files, tmp_path):
    """feature_eps and mixing_clamp are recorded beside the weights: editing them in mhla_config.json is refused."""
    from mhla_diffusers import import_authors_wan, load_mhla_transformer
    from mhla_diffusers.checkpoint.format import MHLACheckpointError

    import_authors_wan(files["src"], tmp_path / "t", config=files["config"] / "transformer")
    path = tmp_path / "t" / "mhla_config.json"
    original = path.read_text()
    for key, value in (("feature_eps", 0.0), ("mixing_clamp", True)):
        config = json.loads(original)
        config[key] = value
        path.write_text(json.dumps(config))
        with pytest.raises(MHLACheckpointError, match=key):
            load_mhla_transformer(tmp_path / "t")
    path.write_text(original)
    model = load_mhla_transformer(tmp_path / "t")
    assert not model.blocks[1].attn1.mhla.mixing.clamp and model.blocks[1].attn1.mhla.feature_eps == EPS


def test_single_file_with_a_pipeline_config_keeps_the_files_weights(files, tmp_path, capsys):
    """convert.py --src <original Wan file> --config <pipeline folder>: the written pipeline holds the FILE's
    transformer, not the config folder's (diffusers' DiffusionPipeline.from_pretrained silently drops a passed
    WanPipeline transformer; the conversion loads through the pipeline's own class)."""
    from safetensors.torch import load_file

    other = tiny_wan(num_layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, seed=7)
    src = _write(original_wan_state_dict(other), tmp_path / "finetuned.safetensors")
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", src, "--config", files["config"],
                         "--out", tmp_path / "out", "--layers", "1", capsys=capsys)
    assert code == 0, err
    written = load_file(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(written["proj_out.weight"], other.proj_out.weight)


def test_feature_eps_operator_and_unclamped_mixing():
    """mhla_attention's feature_eps (phi = ReLU + eps, rotated in the numerator) equals the dense reference,
    with and without the normaliser; bad values are refused. clamp_mixing_ leaves unclamped matrices alone."""
    from mhla_diffusers import BlockLayout, MHLAProcessor, MixingMatrix, clamp_mixing_, mhla_attention
    from mhla_diffusers.families import WanRotary
    from mhla_diffusers.ops import mhla_attention_reference

    g = torch.Generator().manual_seed(0)
    layout = BlockLayout((3, 4, 6), (3, 2, 2))
    # float64: a signed mixing matrix with the normaliser on brings denominators near zero, so the
    # comparison is ill-conditioned (fp32 errs by up to ~1.4e-5 depending on the CPU's kernels)
    q, k, v = (torch.randn(2, 2, 72, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mixing = torch.randn(12, 12, generator=g, dtype=torch.float64)  # negative entries: used as given
    angles = torch.rand(1, 72, 1, 4, generator=g, dtype=torch.float64).repeat_interleave(2, dim=-1) * 6.0
    rotary = WanRotary((angles.cos(), angles.sin()))
    for normalize in (False, True):
        for rot in (None, rotary):
            got = mhla_attention(q, k, v, mixing, layout, normalize=normalize, rotary=rot, feature_eps=0.3, backend="torch")
            ref = mhla_attention_reference(q, k, v, mixing, layout, normalize=normalize, rotary=rot, feature_eps=0.3)
            plain = mhla_attention_reference(q, k, v, mixing, layout, normalize=normalize, rotary=rot)
            assert _rel(got, ref) < 1e-10 and _rel(plain, ref) > 1e-2
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="feature_eps"):
            mhla_attention(q, k, v, mixing, layout, feature_eps=bad)
        with pytest.raises(ValueError, match="feature_eps"):
            MHLAProcessor(feature_eps=bad)
    model = torch.nn.ModuleList([MixingMatrix((1, 2, 2)), MixingMatrix((1, 2, 2), clamp=False)])
    for m in model:
        m.weight.data.fill_(-0.5)
    assert clamp_mixing_(model) == 1
    assert float(model[0].weight.detach().min()) == 0.0 and float(model[1].weight.detach().min()) == -0.5
    assert torch.equal(model[1].clamped(), model[1].weight) and float(model[0].clamped().detach().min()) == 0.0


def test_ddp_training_checkpoint_with_numpy_rng_state(files, tmp_path, capsys):
    """Their DDP trainer pickles numpy's RNG state beside the weights ({"state_dict", "epoch", "rng_state": {"numpy":
    np.random.get_state(), ...}}): refused before (weights_only). Imported now, with exactly the numpy globals
    np.random.get_state() needs allowed for the call only: torch's allow-list is unchanged afterwards and a plain
    torch.load(weights_only=True) of the file still refuses it."""
    import random

    import numpy as np

    from mhla_diffusers import load_mhla_pipeline

    path = tmp_path / "epoch_3_step_300.pth"
    state = {"model": files["state"], "rng": np.random.get_state(), "epoch": 3, "step": 300,
             "rng_state": {"numpy": np.random.get_state(), "python": random.getstate(), "torch": torch.get_rng_state()}}
    torch.save(state, path)
    before = torch.serialization.get_safe_globals()
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", path, "--config",
                         files["config"], "--out", tmp_path / "out", capsys=capsys)
    assert code == 0, err
    # our numpy allow-list is gone again; torch registers its own classes when a module of it is first
    # imported (torch.distributed.tensor's DTensorSpec, ...), which depends on what ran before this test
    added = [g for g in torch.serialization.get_safe_globals() if g not in before]
    assert not [g for g in added if not getattr(g, "__module__", "").startswith("torch.")], added
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=True)
    mixing = load_mhla_pipeline(tmp_path / "out").transformer.blocks[1].attn1.mhla.mixing.weight
    assert torch.equal(mixing.detach(), files["state"]["blocks.1.self_attn.block_attn.conv.weight"][:, :, 0, 0])


class _RunsCode:
    """Unpickling it would run ``exec`` (writing a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.mark.parametrize("extra", ["code", "path", "float64 array"])
def test_pickles_holding_other_objects_are_refused_and_never_run(files, tmp_path, extra):
    """A pickle that runs code never runs (the numpy allow-list does not open that door), nor is any other object
    unpickled (``argparse.Namespace``, the run's arguments their DiT trainer saves, is the one class allowed beside
    numpy's RNG state): the error names what was refused and says how to extract the state dict from a trusted file."""
    import pathlib

    import numpy as np

    from mhla_diffusers.checkpoint.authors import AuthorsCheckpointError, read_authors_state_dict

    marker = tmp_path / "ran.txt"
    value, named = {"code": (_RunsCode(marker), "builtins.exec"), "path": (pathlib.PurePosixPath("runs/x"), "pathlib.PurePosixPath"),
                    "float64 array": (np.zeros(3), "numpy.dtypes.Float64DType")}[extra]
    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": files["state"], "rng_state": {"numpy": np.random.get_state()}, "extra": value}, path)
    with pytest.raises(AuthorsCheckpointError, match=rf"holds pickled objects .*\({re.escape(named)}\).*weights_only=False"):
        read_authors_state_dict(path)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["text", "truncated", "random"])
def test_damaged_pickled_file_is_a_clear_error(files, tmp_path, kind):
    from mhla_diffusers.checkpoint.authors import AuthorsCheckpointError, read_authors_state_dict

    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": files["state"]}, path)
    data = path.read_bytes()
    path.write_bytes({"text": b"not a checkpoint\n" * 8, "truncated": data[: len(data) // 2],
                      "random": bytes(range(256)) * 16}[kind])
    with pytest.raises(AuthorsCheckpointError, match="is not a readable torch checkpoint .*damaged, truncated"):
        read_authors_state_dict(path)


# -- settings of their constructors the weights do not hold (issue 32, item 4) ----------------------------------
def test_norm_output_imports_their_normaliser(files, tmp_path, capsys):
    """Their layer built with ``norm_output=True`` (their constructors' default; the file cannot tell): ``--norm-output``
    imports their normaliser (``normalize``, ``denominator="authors_dit"``, eps 1e-6) and equals their layer (<= 1e-5);
    the default import (numerator only, their release) is far off that layer: the assumption matters."""
    from mhla_diffusers import import_authors_wan, load_mhla_pipeline

    out = tmp_path / "normalised"
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", out, "--norm-output", capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["normalize"] is True and config["denominator"] == "authors_dit" and config["eps"] == EPS
    assert config["feature_eps"] == EPS and config["output_norm"] is True and config["mixing_clamp"] is False
    seen = _run_layers(load_mhla_pipeline(out).transformer)
    errors = {i: _rel(seen[i][1], authors_layer(seen[i][0], layer_params(files["state"], i), GRID, HEADS, norm_output=True))
              for i in MHLA_LAYERS}
    import_authors_wan(files["src"], tmp_path / "numerator", config=files["config"])  # the default: their release
    plain = _run_layers(load_mhla_pipeline(tmp_path / "numerator").transformer)
    apart = {i: _rel(plain[i][1], authors_layer(plain[i][0], layer_params(files["state"], i), GRID, HEADS, norm_output=True))
             for i in MHLA_LAYERS}
    print("norm_output=True: --norm-output", errors, "numerator only", apart)
    assert max(errors.values()) <= 1e-5 and min(apart.values()) > 1e-2, (errors, apart)


def test_norm_output_with_the_gated_lepe_variant(files, tmp_path):
    """``norm_output=True`` with their gate and LePE: the normaliser, then g_norm, the gate, LePE (<= 1e-5)."""
    from mhla_diffusers import load_authors_wan

    state = with_gate_and_lepe(files["state"])
    _, model = load_authors_wan(state, files["config"], norm_output=True)
    seen = _run_layers(model)
    for i in MHLA_LAYERS:
        x, y = seen[i]
        assert _rel(y, authors_layer(x, layer_params(state, i), GRID, HEADS, norm_output=True)) <= 1e-5, i


def test_norm_output_needs_blocks_of_equal_size(files, tmp_path):
    """Their normaliser pairs tokens of different blocks by position, as their code needs the grid divisible by
    (3, 5, 10): a grid it does not divide is a clear error naming the fix (the numerator-only import runs there)."""
    from mhla_diffusers import load_authors_wan

    _, model = load_authors_wan(files["state"], files["config"], norm_output=True)
    with pytest.raises(ValueError, match="needs blocks of equal size"):
        _run_layers(model, grid=(3, 10, 21))
    _, plain = load_authors_wan(files["state"], files["config"])
    assert _run_layers(plain, grid=(3, 10, 21))[1][1].isfinite().all()


def test_norm_output_flag_outside_the_authors_import_is_refused(files, tmp_path, capsys):
    code, err = run_main("conversion/convert.py", "--family", "wan", "--src", files["config"], "--out", tmp_path / "o",
                         "--norm-output", capsys=capsys)
    assert code == 2 and "--norm-output only applies with --from authors" in err, err
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", tmp_path / "o", "--eps", "1e-4", capsys=capsys)
    assert code == 2 and "--eps cannot be set with --from authors" in err, err


def test_src_may_be_a_folder_holding_the_file(files, tmp_path, capsys):
    """``--src <folder>`` (their Hub download: model.safetensors beside a README) takes the one weights file in it;
    a folder with several, or the diffusers folder given as --src, is a clear error (before: "... does not exist")."""
    import shutil

    folder = tmp_path / "MHLA"
    folder.mkdir()
    shutil.copy(files["src"], folder / "model.safetensors")
    (folder / "README.md").write_text("weights")
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", folder, "--config",
                         files["config"], "--out", tmp_path / "out", capsys=capsys)
    assert code == 0, err
    shutil.copy(files["src"], folder / "model_ema.safetensors")
    for src, message in ((folder, r"holds the weights files \['model.safetensors', 'model_ema.safetensors'\]: give the"),
                         (files["config"], r"is a diffusers model folder .* give it as --config")):
        code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", src, "--config",
                             files["config"], "--out", tmp_path / "o", capsys=capsys)
        assert code == 2 and re.search(message, err), err


@pytest.mark.parametrize("norm_output", [False, True])
def test_the_one_liner_over_the_imported_model_runs_it_as_imported(files, tmp_path, capsys, norm_output):
    """The imported model's settings (feature_eps 1e-6, no normaliser or their normaliser, unclamped mixing) are its
    layers' own: diffusers' set_attn_processor with a fresh MHLAProcessor() on its MHLA layers computes bit for bit
    the same, and a save after it reloads to that model (CASE C17 on the authors' weights)."""
    from mhla_diffusers import MHLAProcessor, load_mhla_transformer, mhla_spec, save_mhla_transformer

    out = tmp_path / "imported"
    flags = ["--norm-output"] if norm_output else []
    code, err = run_main("conversion/convert.py", "--family", "wan", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", out, *flags, capsys=capsys)
    assert code == 0, err
    model = load_mhla_transformer(out)
    before, spec = _run_layers(model), mhla_spec(model)
    mhla = {f"{name}.processor" for name, m in model.named_modules() if hasattr(m, "mhla")}  # the hybrid's MHLA layers
    model.set_attn_processor({k: MHLAProcessor() if k in mhla else p for k, p in model.attn_processors.items()})
    again = _run_layers(model)
    assert all(torch.equal(again[i][1], before[i][1]) for i in before) and mhla_spec(model) == spec
    save_mhla_transformer(model, tmp_path / "again")
    reloaded = load_mhla_transformer(tmp_path / "again")
    assert mhla_spec(reloaded) == spec
    assert all(_rel(_run_layers(reloaded)[i][1], before[i][1]) < 1e-6 for i in before)  # loaded weights: alignment ulps
