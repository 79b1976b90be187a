"""mhla_diffusers.diagnostics: attention matrices, rank / entropy and their bounds (MHLA paper, Fig. 3,
Sec. 3.2 and 4.3), q/k captured from a real forward, the pictures, and benchmarks/diagnose.py."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from helpers import AttnCapture, dit_inputs, load_script, randomize_mixing_, tiny_dit

from mhla_diffusers import BlockLayout, apply_mhla, mhla_attention, mhla_attention_reference, mixing_init
from mhla_diffusers import diagnostics as D

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _qk(n=64, d=4, heads=2, batch=1, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    return (q.abs(), k.abs()) if positive else (q, k)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# -- bounds ------------------------------------------------------------------------------------------
def test_rank_bound_formula():
    """min(N, sum_b min(N_b, d)) for MHLA, min(N, d) for linear attention, N for softmax, on even,
    uneven and 3D layouts."""
    even = BlockLayout((8, 8), (4, 4))  # 16 blocks of 4 tokens
    assert D.rank_bound(even, 4) == 64
    assert D.rank_bound(even, 2) == 32
    assert D.rank_bound(even, 8) == 64  # each block caps at N_b = 4
    assert D.rank_bound(even, 2, "linear") == 2 and D.rank_bound(even, 100, "linear") == 64
    assert D.rank_bound(even, 2, "softmax") == 64
    uneven = BlockLayout((5,), (2,))  # blocks of 3 and 2 tokens
    assert uneven.block_sizes.tolist() == [3, 2]
    assert D.rank_bound(uneven, 2) == 4 and D.rank_bound(uneven, 3) == 5 and D.rank_bound(uneven, 1) == 2
    video = BlockLayout((2, 3, 3), (2, 1, 1))  # 2 blocks of 9
    assert D.rank_bound(video, 4) == 8 and D.rank_bound(video, 4, "linear") == 4
    mixed = BlockLayout((3, 10), (2, 2))  # blocks of 10, 10, 5, 5 tokens: some above d, some below
    assert mixed.block_sizes.tolist() == [10, 10, 5, 5]
    assert D.rank_bound(mixed, 7) == 7 + 7 + 5 + 5  # not min(N, M d) = 28
    one = BlockLayout((4, 4), (1, 1))  # M = 1: MHLA is linear attention
    assert D.rank_bound(one, 3) == D.rank_bound(one, 3, "linear") == 3
    with pytest.raises(ValueError, match="unknown attention kind"):
        D.rank_bound(even, 4, "cosine")
    with pytest.raises(ValueError, match="head_dim"):
        D.rank_bound(even, 0)


def test_mhla_rank_exceeds_d_and_stays_within_bound():
    """N = 64, d = 4, 16 blocks, near-identity mixing: MHLA's rank goes far beyond d (the bound 64 is
    reached); with d = 2 the bound is 32 < N and is reached but never exceeded; over random mixing
    matrices and q, k (ReLU zeros included) the measured rank never exceeds the bound."""
    layout = BlockLayout((8, 8), (4, 4))
    mixing = 0.9 * torch.eye(16, dtype=torch.float64) + 0.1 / 16
    q, k = _qk(d=4, positive=True)
    A = D.attention_matrix(q, k, "mhla", mixing=mixing, layout=layout)
    ranks = D.matrix_rank(A)
    assert ranks.shape == (1, 2)
    assert (ranks > 4).all() and (ranks <= D.rank_bound(layout, 4)).all()
    assert (ranks == 64).all()
    q2, k2 = _qk(d=2, positive=True, seed=1)
    r2 = D.matrix_rank(D.attention_matrix(q2, k2, "mhla", mixing=mixing, layout=layout))
    assert D.rank_bound(layout, 2) == 32 and (r2 == 32).all()
    g = torch.Generator().manual_seed(2)
    for seed in range(6):
        d = 1 + seed % 3
        q, k = _qk(d=d, seed=10 + seed, heads=3)
        mix = torch.rand(16, 16, generator=g, dtype=torch.float64)
        rank = D.matrix_rank(D.attention_matrix(q, k, "mhla", mixing=mix, layout=layout))
        assert (rank <= D.rank_bound(layout, d)).all(), (d, rank)
        assert (rank > d).all()


def test_linear_rank_at_most_d():
    """Plain linear attention and MHLA with an all-ones mixing matrix (= linear attention) have rank <= d;
    softmax on the same q, k is full rank."""
    layout = BlockLayout((8, 8), (4, 4))
    for d in (1, 3, 4):
        q, k = _qk(d=d, seed=d, heads=3)
        lin = D.matrix_rank(D.attention_matrix(q, k, "linear"))
        assert (lin <= d).all() and (lin == d).all(), lin
        ones = D.matrix_rank(D.attention_matrix(q, k, "mhla", mixing=torch.ones(16, 16), layout=layout))
        assert (ones <= d).all(), ones
    soft = D.matrix_rank(D.attention_matrix(*_qk(d=4), "softmax"))
    assert (soft == 64).all()


def test_matrix_rank_tolerance():
    """rtol is relative to the largest singular value; an all-zero matrix has rank 0."""
    A = torch.diag(torch.tensor([1.0, 1e-3, 1e-9], dtype=torch.float64)) * 1e6  # relative, not absolute
    assert int(D.matrix_rank(A)) == 3
    assert int(D.matrix_rank(A, rtol=1e-6)) == 2
    assert int(D.matrix_rank(A, rtol=1e-2)) == 1
    assert int(D.matrix_rank(torch.zeros(4, 4))) == 0
    assert D.default_rtol(256) == pytest.approx(256 * 2.220446049250313e-16)
    with pytest.raises(ValueError):
        D.matrix_rank(torch.ones(3))
    with pytest.raises(ValueError):
        D.matrix_rank(A, rtol=-1.0)


# -- entropy -----------------------------------------------------------------------------------------
def test_row_entropy_uniform_one_hot_and_errors():
    n = 37
    uniform = torch.full((2, 3, n, n), 1.0 / n)
    assert torch.allclose(D.row_entropy(uniform), torch.full((2, 3), math.log(n), dtype=torch.float64))
    assert torch.allclose(D.row_entropy(uniform, normalized=True), torch.ones(2, 3, dtype=torch.float64))
    one_hot = torch.eye(n)[torch.randperm(n)]
    assert float(D.row_entropy(one_hot)) == 0.0
    assert float(D.row_entropy(one_hot, normalized=True)) == 0.0
    half = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    # the empty row is skipped: mean of log 2 and log 4
    assert float(D.row_entropy(half)) == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert math.isnan(float(D.row_entropy(torch.zeros(3, 3))))
    with pytest.raises(ValueError, match="negative"):
        D.row_entropy(torch.tensor([[1.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="sum to 1"):
        D.row_entropy(torch.tensor([[0.5, 0.4], [0.5, 0.5]]))


def test_linear_attention_is_flatter_than_mhla():
    """Fig. 3(a)'s ordering on a case built for it: MHLA with near-identity mixing concentrates each
    query on its own block (lower entropy than linear attention, which spreads over all N tokens)."""
    layout = BlockLayout((8, 8), (4, 4))
    q, k = _qk(d=4, positive=True)
    mixing = 0.9 * torch.eye(16, dtype=torch.float64) + 0.1 / 16
    lin = D.row_entropy(D.attention_matrix(q, k, "linear"))
    mhla = D.row_entropy(D.attention_matrix(q, k, "mhla", mixing=mixing, layout=layout))
    assert (mhla < lin - 0.5).all(), (mhla, lin)
    assert (lin > 0.9 * math.log(64)).all()


# -- the matrices --------------------------------------------------------------------------------------
def test_attention_rows_sum_to_one_and_match_the_operators():
    """Every non-empty row sums to 1; rows of queries with phi(q) = 0 are zero; A v reproduces SDPA
    (softmax) and plain linear attention."""
    q, k = _qk(n=48, d=3, heads=2, batch=2, seed=3)  # d = 3: some queries have phi(q) = 0
    v = torch.randn(2, 2, 48, 5, dtype=torch.float64)
    layout = BlockLayout((6, 8), (2, 3))
    mixing = mixing_init(layout, dtype=torch.float64)
    dead = torch.relu(q).sum(-1) == 0
    assert dead.any()
    for kind in D.KINDS:
        A = D.attention_matrix(q, k, kind, mixing=mixing, layout=layout)
        assert A.dtype == torch.float64 and A.shape == (2, 2, 48, 48)
        sums = A.sum(-1)
        expected_empty = dead if kind != "softmax" else torch.zeros_like(dead)
        assert torch.allclose(sums[~expected_empty], torch.ones_like(sums[~expected_empty]), atol=1e-12)
        assert (sums[expected_empty] == 0).all()
        assert (A >= 0).all()
    soft = D.attention_matrix(q, k, "softmax", scale=0.3)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert torch.allclose(soft @ v, sdpa, atol=1e-12)
    pq, pk = torch.relu(q), torch.relu(k)
    lin = (pq @ (pk.transpose(-1, -2) @ v)) / (pq @ pk.sum(-2, keepdim=True).transpose(-1, -2))
    alive = ~dead
    assert torch.allclose((D.attention_matrix(q, k, "linear") @ v)[alive], lin[alive], atol=1e-12)


def test_mhla_matrix_equals_the_reference_and_the_operator():
    """The MHLA matrix equals an explicit loop A[i, t] = Mc[b(i), b(t)] phi(q_i).phi(k_t) / row sum;
    A v equals the dense reference (eps = 0) and the torch backend."""
    layout = BlockLayout((5, 7), (2, 3))  # uneven blocks
    n, d = layout.num_tokens, 4
    q, k = _qk(n=n, d=d, heads=2, seed=4, positive=True)
    v = torch.randn(1, 2, n, 6, dtype=torch.float64)
    mixing = torch.rand(6, 6, dtype=torch.float64)
    A = D.attention_matrix(q, k, "mhla", mixing=mixing, layout=layout)
    idx = layout.block_index.tolist()
    explicit = torch.zeros(2, n, n, dtype=torch.float64)
    for h in range(2):
        for i in range(n):
            for t in range(n):
                explicit[h, i, t] = mixing[idx[i], idx[t]] * (torch.relu(q[0, h, i]) @ torch.relu(k[0, h, t]))
    explicit = explicit / explicit.sum(-1, keepdim=True)
    assert torch.allclose(A[0], explicit, atol=1e-14)
    ref = mhla_attention_reference(q, k, v, mixing, layout, eps=0.0)
    assert torch.allclose(A @ v, ref, atol=1e-12)
    fast = mhla_attention(q.float(), k.float(), v.float(), mixing.float(), layout, eps=0.0, backend="torch")
    assert torch.allclose((A @ v).float(), fast, atol=1e-5)


def test_attention_matrix_errors():
    q, k = _qk(n=16, d=2)
    layout = BlockLayout((4, 4), (2, 2))
    with pytest.raises(ValueError, match="unknown attention kind"):
        D.attention_matrix(q, k, "relu")
    with pytest.raises(ValueError, match="needs the layout"):
        D.attention_matrix(q, k, "mhla", mixing=torch.eye(4))
    with pytest.raises(ValueError, match="needs the mixing"):
        D.attention_matrix(q, k, "mhla", layout=layout)
    with pytest.raises(ValueError, match="tokens"):
        D.attention_matrix(q, k, "mhla", mixing=torch.eye(4), layout=BlockLayout((4, 5), (2, 2)))
    with pytest.raises(ValueError, match=r"\[4, 4\]"):
        D.attention_matrix(q, k, "mhla", mixing=torch.eye(3), layout=layout)
    with pytest.raises(ValueError, match="negative"):
        D.attention_matrix(q, k, "mhla", mixing=-torch.eye(4), layout=layout)
    with pytest.raises(ValueError, match="equal shapes"):
        D.attention_matrix(q, k[..., :1], "softmax")
    big = torch.zeros(1, 1, D.MAX_TOKENS + 1, 2)
    with pytest.raises(ValueError, match="at most 4096 tokens"):
        D.attention_matrix(big, big, "linear")


# -- real forwards ---------------------------------------------------------------------------------------
def test_captured_qk_reproduce_the_layer_output():
    """q, k, v captured in a real forward give back each layer's own output: softmax A v through to_out
    equals the stock layer's output, MHLA A v (the layer's clamped matrix) equals the MHLA layer's."""
    model = tiny_dit(num_layers=3, patch_size=1)  # 8 x 8 = 64 tokens, 2 heads x 8
    first = model.transformer_blocks[0].attn1  # per-head q/k norms, as AttnProcessor2_0 applies them
    first.norm_q, first.norm_k = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
    with torch.no_grad():
        for norm in (first.norm_q, first.norm_k):
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.normal_()
    latent, t, y = dit_inputs(batch=2)
    inputs = {"hidden_states": latent, "timestep": t, "class_labels": y}
    names = [f"transformer_blocks.{i}.attn1" for i in range(3)]
    with AttnCapture(model) as cap:
        captured = D.capture_query_key(model, names, inputs)
    for name in names:
        qk = captured[name]
        assert qk.grid == (1, 8, 8) and qk.query.shape == (2, 2, 64, 8)
        attn = model.get_submodule(name)
        A = D.attention_matrix(qk.query, qk.key, "softmax", scale=qk.scale)
        out = (A @ qk.value.double()).float().transpose(1, 2).reshape(2, 64, 16)
        assert torch.allclose(attn.to_out[0](out), cap.outputs[name][0], atol=1e-5)

    apply_mhla(model, layers=[1, 2], block_grid=(2, 2))
    randomize_mixing_(model, seed=1)
    with AttnCapture(model) as cap:
        captured = D.capture_query_key(model, names[1:], inputs)
    for name in names[1:]:
        qk, attn = captured[name], model.get_submodule(name)
        layout = BlockLayout(qk.grid, attn.mhla.mixing.block_grid)
        A = D.attention_matrix(qk.query, qk.key, "mhla", mixing=attn.mhla.mixing.clamped().detach(), layout=layout)
        out = (A @ qk.value.double()).float().transpose(1, 2).reshape(2, 64, 16)
        assert torch.allclose(attn.to_out[0](out), cap.outputs[name][0], atol=1e-4)
    with pytest.raises(ValueError, match="not an attention module"):
        D.capture_query_key(model, "transformer_blocks.0.ff", inputs)


def test_layer_statistics_on_a_dit():
    """Per-head rank / entropy of the three kinds on a real forward: within their bounds, the layer's
    own mixing matrix for an MHLA layer, the locality init otherwise; N > 4096 refused."""
    model = tiny_dit(num_layers=2, patch_size=1)
    latent, t, y = dit_inputs(batch=2)
    inputs = {"hidden_states": latent, "timestep": t, "class_labels": y}
    stats = D.layer_statistics(model, "transformer_blocks.0.attn1", inputs, num_blocks=16)
    assert stats["layer"] == "transformer_blocks.0.attn1" and stats["num_tokens"] == 64 and stats["head_dim"] == 8
    assert stats["mixing_source"] == "locality_init" and stats["block_grid"] == [1, 2, 4]  # M capped at sqrt(64)
    assert stats["rank_bound"] == {"softmax": 64, "linear": 8, "mhla": 64}
    kinds = stats["kinds"]
    assert len(kinds["linear"]["rank"]["per_head"]) == 2
    assert kinds["linear"]["rank"]["max"] <= 8
    assert kinds["mhla"]["rank"]["max"] <= 64 and kinds["mhla"]["rank"]["mean"] > 8
    assert kinds["softmax"]["rank"]["min"] > 8
    for kind in D.KINDS:
        for key in ("rank", "entropy", "normalized_entropy"):
            s = kinds[kind][key]
            assert s["min"] <= s["mean"] <= s["max"]
        assert 0 < kinds[kind]["entropy"]["max"] <= math.log(64) + 1e-9
        assert kinds[kind]["normalized_entropy"]["mean"] == pytest.approx(kinds[kind]["entropy"]["mean"] / math.log(64))

    apply_mhla(model, layers=[1], block_grid=(2, 2))
    with torch.no_grad():
        model.transformer_blocks[1].attn1.mhla.mixing.weight.copy_(torch.eye(4) * 2 - 0.5)  # clamps to the identity
    stats = D.layer_statistics(model, "transformer_blocks.1.attn1", inputs)
    assert stats["mixing_source"] == "layer" and stats["block_grid"] == [1, 2, 2]
    assert stats["rank_bound"]["mhla"] == 32  # 4 blocks x min(16, 8)
    assert stats["kinds"]["mhla"]["rank"]["max"] <= 32

    qk = D.QueryKey(*(torch.zeros(1, 1, 4100, 2),) * 3, grid=(1, 41, 100), scale=1.0)
    with pytest.raises(ValueError, match="at most 4096 tokens"):
        D.qk_statistics(qk)


# -- pictures ------------------------------------------------------------------------------------------------
def test_plots_write_valid_pngs(tmp_path):
    path = D.plot_mixing_matrix(mixing_init((4, 4)), (4, 4), tmp_path / "m.png", title="init")
    w, h = _png_size(path)
    assert w > 100 and h > 100 and path.stat().st_size > 1000
    path3 = D.plot_mixing_matrix(mixing_init((3, 2, 4)), (3, 2, 4), tmp_path / "m3.png")
    assert _png_size(path3)[0] > _png_size(path3)[1]  # strips of 3 time slices: wide
    with pytest.raises(ValueError, match=r"\[16, 16\]"):
        D.plot_mixing_matrix(torch.eye(8), (4, 4), tmp_path / "bad.png")
    with pytest.raises(ValueError, match="time_slice"):
        D.plot_mixing_matrix(mixing_init((3, 2, 4)), (3, 2, 4), tmp_path / "bad.png", time_slice=3)

    model = tiny_dit(num_layers=2, patch_size=1)
    latent, t, y = dit_inputs(batch=1)
    captured = D.capture_query_key(model, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"],
                                   {"hidden_states": latent, "timestep": t, "class_labels": y})
    stats = [D.qk_statistics(qk, num_blocks=4) for qk in captured.values()]
    one = D.plot_rank_entropy(stats[0], tmp_path / "re1.png")
    many = D.plot_rank_entropy(stats, tmp_path / "re.png")
    for p in (one, many):
        assert min(_png_size(p)) > 100 and p.stat().st_size > 1000
    with pytest.raises(ValueError, match="empty"):
        D.plot_rank_entropy([], tmp_path / "none.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png", "m3.png", "re.png", "re1.png"]  # no temporaries left


# -- the CLI -------------------------------------------------------------------------------------------------
def _diagnose_main():
    module = load_script("benchmarks/diagnose.py")
    return lambda *args: module.main([str(a) for a in args])


def _tiny_pixel_pipeline():
    """DiT, patch 1, sample 8, 12 channels, 2 heads x 8 + SpaceToDepthAutoencoder(2) (16-px crops) + DDIM."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    from mhla_diffusers import SpaceToDepthAutoencoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=12, out_channels=12, num_layers=3,
            sample_size=8, patch_size=1, num_embeds_ada_norm=1000, norm_num_groups=1,
        ).eval()
    return DiTPipeline(transformer=transformer, vae=SpaceToDepthAutoencoder(factor=2), scheduler=DDIMScheduler())


def test_cli_main_plain_and_converted(tmp_path, capsys):
    """benchmarks/diagnose.py runs in-process on a plain and a converted tiny DiT pipeline folder and
    writes the JSON, the markdown table and the PNGs; a bad layer index is exit code 2."""
    from mhla_diffusers import save_mhla_pipeline

    main = _diagnose_main()
    pipe = _tiny_pixel_pipeline()
    plain = tmp_path / "plain"
    pipe.save_pretrained(plain)
    out = tmp_path / "out"
    assert main("--checkpoint", plain, "--out", out, "--num-samples", 2, "--timesteps", 100, 800) == 0
    assert "| 2 | stock | 64 | 8 |" in capsys.readouterr().out
    result = json.loads((out / "diagnostics.json").read_text())
    assert result["resolution"] == 16 and result["timesteps"] == [100, 800, 100, 800]
    assert [s["index"] for s in result["layers"]] == [0, 1, 2]
    for s in result["layers"]:
        assert s["num_tokens"] == 64 and s["num_samples"] == 4 and s["mixing_source"] == "locality_init"
        assert s["kinds"]["linear"]["rank"]["max"] <= 8 < s["kinds"]["mhla"]["rank"]["mean"]
    assert "| timestep |" in (out / "diagnostics.md").read_text()
    for name in ("rank_entropy.png", "mixing_locality_init.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE

    apply_mhla(pipe.transformer, layers=[1, 2], block_grid=(2, 2))
    converted = tmp_path / "converted"
    save_mhla_pipeline(pipe, converted)
    out2 = tmp_path / "out2"
    assert main("--checkpoint", converted, "--out", out2, "--layer", 1, "--num-samples", 1) == 0
    result = json.loads((out2 / "diagnostics.json").read_text())
    (layer,) = result["layers"]
    assert layer["index"] == 1 and layer["mixing_source"] == "layer" and layer["block_grid"] == [1, 2, 2]
    assert layer["rank_bound"]["mhla"] == 32
    assert (out2 / "mixing_layer1.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (out2 / "mixing_locality_init.png").exists()

    capsys.readouterr()
    assert main("--checkpoint", converted, "--out", tmp_path / "out3", "--layer", 7) == 2
    assert "out of range" in capsys.readouterr().err
