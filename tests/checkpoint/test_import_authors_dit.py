"""Importing a DiT of the authors' ``mhla_dit`` code (DAGroup-PKU/MHLA) into diffusers' DiTTransformer2DModel.

No file of theirs is available here: a tiny checkpoint in THEIR layout (the original DiT keys, ``MHLA4DiT`` attention
with ``norm``, ``to_qkv``, ``lepe``, ``piece_attn.conv``, ``to_out.0``; their ``train.py`` checkpoint dict with
``model``, ``ema``, ``opt``, ``args``) is written from a tiny diffusers DiT by the inverse key mapping below, imported,
and each imported MHLA layer is compared with an independent implementation of their layer written here from their
equations (``MHLA4DiT.forward``): input LayerNorm, fused qkv, ``relu(x) + 1e-6`` features, square pieces,
summaries mixed by ``piece_attn``, their normaliser ``piece_attn(q . z) + 1e-6``, ``+ lepe(v)``, ``to_out``.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import run_main, tiny_dit, tiny_vae

HEADS, HEAD_DIM, LAYERS = 2, 8, 3
SAMPLE, PATCH = 16, 2
SIDE = SAMPLE // PATCH  # 8 x 8 tokens
PIECES = 2  # 2 x 2 pieces of 4 x 4 tokens (their block_size = 16)
EPS = 1e-6
MHLA_LAYERS = [1, 2]  # layer 0 keeps the stock timm attention (softmax)


# -- an independent implementation of their layer (from their equations, not from our code) ---------------------
def to_pieces(x: torch.Tensor) -> torch.Tensor:
    """Row-major tokens ``[B, N, C]`` of the SIDE x SIDE grid -> ``[B, pieces, tokens per piece, C]`` (their
    ``rearrange_patches``: piece-major, row-major inside a piece)."""
    b, _, c = x.shape
    ps = SIDE // PIECES
    return x.view(b, PIECES, ps, PIECES, ps, c).permute(0, 1, 3, 2, 4, 5).reshape(b, PIECES * PIECES, ps * ps, c)


def from_pieces(x: torch.Tensor) -> torch.Tensor:
    b, _, _, c = x.shape
    ps = SIDE // PIECES
    return x.view(b, PIECES, PIECES, ps, ps, c).permute(0, 1, 3, 2, 4, 5).reshape(b, SIDE * SIDE, c)


def authors_layer(x: torch.Tensor, p: dict, eps: float = EPS) -> torch.Tensor:
    """Their ``MHLA4DiT`` on row-major tokens ``x`` ``[B, N, C]`` (their model feeds it piece-major tokens; the
    permutation is undone here). ``p``: their tensors without ``blocks.<i>.attn.``; ``eps``: their layer's
    (``kwargs.get("eps", 1e-6)``); the mixing matrix as stored (their forward never clamps it)."""
    b, n, c = x.shape
    x = F.layer_norm(x, (c,), p["norm.weight"], p["norm.bias"], eps=1e-5)
    q, k, v = F.linear(x, p["to_qkv.weight"], p["to_qkv.bias"]).chunk(3, dim=-1)
    image_v = v.transpose(1, 2).reshape(b, c, SIDE, SIDE)
    lepe = F.conv2d(image_v, p["lepe.weight"], p["lepe.bias"], padding=1, groups=c).flatten(2).transpose(1, 2)
    q, k = torch.relu(q) + eps, torch.relu(k) + eps
    w = p["piece_attn.conv.weight"][:, :, 0, 0]  # [M, M], rows = output pieces
    heads = []
    for h in range(HEADS):
        cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        qp, kp, vp = (to_pieces(t[..., cols]) for t in (q, k, v))  # [B, M, L, d]
        kv = torch.einsum("bmld,bmle->bmde", kp, vp)
        kv = torch.einsum("im,bmde->bide", w, kv)  # piece_attn on the summaries
        k_sum = kp.sum(dim=2)  # [B, M, d]
        qz = torch.einsum("bmld,bmd->bml", qp, k_sum)  # each piece's queries . its own key sum
        normalizer = torch.einsum("im,bml->bil", w, qz) + eps  # piece_attn on those products
        out = torch.einsum("bild,bide->bile", qp, kv) / normalizer[..., None]
        heads.append(from_pieces(out))
    out = torch.cat(heads, dim=-1) + lepe
    return F.linear(out, p["to_out.0.weight"], p["to_out.0.bias"])


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- a tiny checkpoint in their layout -------------------------------------------------------------------------
def authors_dit_state(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny diffusers DiT written back as their ``DiT_MHLA`` state dict (original DiT keys), with random
    ``MHLA4DiT`` parameters on MHLA_LAYERS (mixing in [0, 1], as their clamped training keeps it)."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    c = HEADS * HEAD_DIM
    state = {
        "x_embedder.proj.weight": sd["pos_embed.proj.weight"], "x_embedder.proj.bias": sd["pos_embed.proj.bias"],
        "pos_embed": model.pos_embed.pos_embed.clone(),
        "t_embedder.mlp.0.weight": sd["transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight"],
        "t_embedder.mlp.0.bias": sd["transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.bias"],
        "t_embedder.mlp.2.weight": sd["transformer_blocks.0.norm1.emb.timestep_embedder.linear_2.weight"],
        "t_embedder.mlp.2.bias": sd["transformer_blocks.0.norm1.emb.timestep_embedder.linear_2.bias"],
        "y_embedder.embedding_table.weight": sd["transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"],
        "final_layer.adaLN_modulation.1.weight": sd["proj_out_1.weight"], "final_layer.adaLN_modulation.1.bias": sd["proj_out_1.bias"],
        "final_layer.linear.weight": sd["proj_out_2.weight"], "final_layer.linear.bias": sd["proj_out_2.bias"],
    }
    for i in range(LAYERS):
        ours, theirs = f"transformer_blocks.{i}.", f"blocks.{i}."
        for a, b in (("norm1.linear", "adaLN_modulation.1"), ("ff.net.0.proj", "mlp.fc1"), ("ff.net.2", "mlp.fc2")):
            for t in ("weight", "bias"):
                state[f"{theirs}{b}.{t}"] = sd[f"{ours}{a}.{t}"]
        qkv, out = ("attn.to_qkv", "attn.to_out.0") if i in MHLA_LAYERS else ("attn.qkv", "attn.proj")
        for t in ("weight", "bias"):
            state[f"{theirs}{qkv}.{t}"] = torch.cat([sd[f"{ours}attn1.to_{x}.{t}"] for x in "qkv"])
            state[f"{theirs}{out}.{t}"] = sd[f"{ours}attn1.to_out.0.{t}"]
        if i in MHLA_LAYERS:
            state[f"{theirs}attn.norm.weight"] = 1.0 + 0.2 * torch.randn(c, generator=g)
            state[f"{theirs}attn.norm.bias"] = 0.1 * torch.randn(c, generator=g)
            state[f"{theirs}attn.lepe.weight"] = 0.3 * torch.randn(c, 1, 3, 3, generator=g)
            state[f"{theirs}attn.lepe.bias"] = 0.1 * torch.randn(c, generator=g)
            state[f"{theirs}attn.piece_attn.conv.weight"] = torch.rand(PIECES**2, PIECES**2, 1, 1, generator=g)
    return state


def _training_checkpoint(state: dict, **model_kwargs) -> dict:
    """Their train.py's checkpoint dict (model, ema, opt, the run's argparse arguments, epoch, steps); ``model_kwargs``
    (their ``--model-kwargs``, e.g. ``eps=1e-4``) beside ``block_size``."""
    ema = {k: v + 0.0 for k, v in state.items()}
    return {"model": state, "ema": ema, "opt": {"state": {}, "param_groups": []},
            "args": argparse.Namespace(model="DiT-S/2", model_kwargs={"block_size": 16, **model_kwargs}), "epoch": 3,
            "train_steps": 120}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{"config": a tiny DiTPipeline folder, "src": their training checkpoint (.pt), "state": its ema dict, "base"}``."""
    from diffusers import DDIMScheduler, DiTPipeline

    import mhla_diffusers.autoencoder  # noqa: F401  (the tiny VAE's class, for DiTPipeline.from_pretrained)

    root = tmp_path_factory.mktemp("authors_dit")
    base = tiny_dit(num_layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, sample_size=SAMPLE, patch_size=PATCH, seed=1)
    DiTPipeline(transformer=base, vae=tiny_vae(0), scheduler=DDIMScheduler(num_train_timesteps=1000)).save_pretrained(root / "dit")
    state = authors_dit_state(base)
    checkpoint = _training_checkpoint(state)
    torch.save(checkpoint, root / "epoch-0003.pt")
    return {"config": root / "dit", "src": root / "epoch-0003.pt", "state": checkpoint["ema"], "base": base}


def _run_layers(model, seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    seen, handles = {}, []
    for i, block in enumerate(model.transformer_blocks):
        handles.append(block.attn1.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out))))
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            model(torch.randn(2, 4, SAMPLE, SAMPLE, generator=gen), timestep=torch.tensor([300, 700]),
                  class_labels=torch.tensor([3, 1000]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _layer(state: dict, i: int) -> dict:
    prefix = f"blocks.{i}.attn."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _convert(files, tmp_path, capsys, src=None, *extra):
    out = tmp_path / "imported"
    code, err = run_main("conversion/convert.py", "--family", "dit", "--from", "authors", "--src", src or files["src"],
                         "--state-dict-key", "ema", "--config", files["config"], "--out", out, *extra, capsys=capsys)
    return code, err, out


# -- the tests -------------------------------------------------------------------------------------------------
def test_imported_layers_equal_the_authors_layer(files, tmp_path, capsys):
    """convert.py --family dit --from authors on their training checkpoint (EMA weights): our format, the stock
    weights the file's, each MHLA layer equal to the independent implementation of theirs (fp32, <= 1e-5); the
    comparison can fail: the paper's normaliser, or LePE left out, change the output far beyond that."""
    from mhla_diffusers import load_mhla_pipeline

    code, err, out = _convert(files, tmp_path, capsys)
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["layers"] == MHLA_LAYERS and config["block_grid"] == [1, PIECES, PIECES]
    assert config["input_norm"] is True and config["lepe"] is True and config["denominator"] == "authors_dit"
    assert config["feature_eps"] == EPS and config["eps"] == EPS and config["normalize"] is True
    assert config.get("mixing_clamp", True) is True  # their training keeps the matrices in [0, 1]: the clamp changes nothing
    pipe = load_mhla_pipeline(out)
    model = pipe.transformer
    # stock weights: the file's (ema), through the mapping (q, k, v split from the fused projection; their one
    # timestep / label embedder in every block, as diffusers' DiT holds it)
    base = dict(files["base"].state_dict())
    for k in [k for k in base if ".norm1.emb." in k]:
        base[k] = base[k.replace(k.split(".")[1], "0", 1)]
    got = {k: v for k, v in model.state_dict().items() if ".mhla." not in k}
    assert sorted(got) == sorted(base)
    assert [k for k in base if not torch.equal(got[k], base[k])] == []

    seen = _run_layers(model)
    errors = {}
    for i in MHLA_LAYERS:
        x, y = seen[i]
        errors[i] = _rel(y, authors_layer(x, _layer(files["state"], i)))
        assert errors[i] <= 1e-5, errors
    print("authors' DiT layer vs imported:", {i: f"{e:.2e}" for i, e in errors.items()})
    x, y = seen[1]
    assert model.transformer_blocks[1].attn1.mhla.denominator == "authors_dit"
    without_lepe = {**_layer(files["state"], 1), "lepe.weight": torch.zeros(HEADS * HEAD_DIM, 1, 3, 3),
                    "lepe.bias": torch.zeros(HEADS * HEAD_DIM)}
    assert _rel(y, authors_layer(x, without_lepe)) > 1e-2
    # the paper's normaliser on the same weights: another output (a processor cannot ask for it: the layer's record)
    from mhla_diffusers import MHLAProcessor

    attn = model.transformer_blocks[1].attn1
    with pytest.raises(ValueError, match="denominator='authors_dit' but the processor asks for denominator='paper'"):
        attn.set_processor(MHLAProcessor(denominator="paper"))
    attn.mhla.denominator = "paper"
    y_paper = _run_layers(model)[1][1]
    assert _rel(y_paper, authors_layer(x, _layer(files["state"], 1))) > 1e-3


def test_pipeline_generates(files, tmp_path, capsys):
    """The imported pipeline samples through DiTPipeline (its layers' LePE and input norm on the call's grid)."""
    from mhla_diffusers import load_mhla_pipeline

    code, err, out = _convert(files, tmp_path, capsys)
    assert code == 0, err
    pipe = load_mhla_pipeline(out)
    images = pipe(class_labels=[1, 2], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape[0] == 2 and images.shape[-1] == 3 and torch.isfinite(torch.as_tensor(images)).all()


def _edited(files, tmp_path, edit) -> str:
    state = {k: v.clone() for k, v in files["state"].items()}
    edit(state)
    path = tmp_path / "edited.pt"
    torch.save(_training_checkpoint(state), path)
    return str(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update({"blocks.1.attn.q_norm.weight": torch.ones(16)}), "qk_norm variant"),
        (lambda s: s.pop("blocks.2.attn.lepe.bias"), r"missing keys \['blocks.2.attn.lepe.bias'\]"),
        (lambda s: s.update({"blocks.0.attn.extra.weight": torch.ones(2)}), r"unknown keys \['blocks.0.attn.extra.weight'\]"),
        (lambda s: s.update({"blocks.1.attn.qkv.weight": torch.ones(48, 16)}), "both a softmax"),
        (lambda s: s.update({f"blocks.{i}.attn.piece_attn.conv.weight": torch.ones(3, 3, 1, 1) for i in MHLA_LAYERS}),
         r"M = s\^2 square pieces"),
        (lambda s: s.update({"blocks.1.attn.piece_attn.conv.weight": torch.ones(16, 16, 1, 1)}), "differ in shape"),
        (lambda s: s.update({"blocks.1.attn.lepe.weight": torch.ones(16, 1, 3, 3, 3)}), r"lepe.weight has shape"),
        (lambda s: s.update({"pos_embed": s["pos_embed"] + 0.5}), "not the fixed sin-cos table"),
        (lambda s: s.update({"blocks.7.mlp.fc1.weight": torch.ones(2)}), r"blocks \[7\] beyond the config's 3 layers"),
        (lambda s: s.update({"blocks.2.attn.norm.weight": torch.full((16,), float("nan"))}), "NaN"),
        (lambda s: s.update({"blocks.0.mlp.fc1.weight": torch.ones(5, 5)}), r"shape mismatches|mlp.fc1|ff.net.0.proj.weight"),
    ],
)
def test_bad_files_are_clear_errors(files, tmp_path, capsys, edit, message):
    src = _edited(files, tmp_path, edit)
    code, err, out = _convert(files, tmp_path, capsys, src)
    assert code == 2 and __import__("re").search(message, err), err
    assert not out.exists()


def test_block_grid_and_a_wan_config_are_refused(files, tmp_path, capsys):
    code, err, out = _convert(files, tmp_path, capsys, None, "--block-grid", "2,2")
    assert code == 2 and "--block-grid cannot be set with --from authors" in err, err
    code, err = run_main("conversion/convert.py", "--family", "sana", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", tmp_path / "o", capsys=capsys)
    assert code == 2 and "--family dit" in err, err


def test_several_state_dicts_need_a_choice(files, tmp_path, capsys):
    code, err = run_main("conversion/convert.py", "--family", "dit", "--from", "authors", "--src", files["src"],
                         "--config", files["config"], "--out", tmp_path / "o", capsys=capsys)
    assert code == 2 and "several state dicts" in err and "model" in err and "ema" in err, err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_files_import(files, tmp_path, capsys, dtype):
    """A checkpoint stored in fp16 / bf16 (its pos_embed rounded to that precision) imports; the weights keep the file's
    values (cast to the file's dtype, then the MHLA parameters to float32)."""
    state = {k: v.to(dtype) for k, v in files["state"].items()}
    path = tmp_path / "half.pt"
    torch.save(_training_checkpoint(state), path)
    code, err, out = _convert(files, tmp_path, capsys, str(path))
    assert code == 0, err
    from mhla_diffusers import load_mhla_transformer

    model = load_mhla_transformer(out / "transformer")
    attn = model.transformer_blocks[1].attn1
    assert torch.equal(attn.mhla.lepe.weight.detach(), state["blocks.1.attn.lepe.weight"].float())


def test_integer_tensors_and_a_flat_file_with_a_key_are_clear_errors(files, tmp_path, capsys):
    state = {k: v.clone() for k, v in files["state"].items()}
    state["blocks.1.attn.lepe.weight"] = torch.ones(16, 1, 3, 3, dtype=torch.int64)
    path = tmp_path / "ints.pt"
    torch.save({**_training_checkpoint(state), "ema": state}, path)
    code, err, out = _convert(files, tmp_path, capsys, str(path))
    assert code == 2 and "holds torch.int64 values, not floating point weights" in err, err
    flat = tmp_path / "flat.pt"
    torch.save(files["state"], flat)
    code, err, out = _convert(files, tmp_path, capsys, str(flat))  # with --state-dict-key ema
    assert code == 2 and "the file is itself a state dict: leave out" in err, err


# -- settings of their constructors the weights do not hold (issue 32, item 4) ----------------------------------
def _layer_errors(model, state: dict, eps: float) -> dict[int, float]:
    """``{layer: relative error}`` of each imported MHLA layer against their layer at ``eps`` (same inputs)."""
    seen = _run_layers(model)
    return {i: _rel(seen[i][1], authors_layer(seen[i][0], _layer(state, i), eps)) for i in MHLA_LAYERS}


def test_the_runs_eps_is_recorded(files, tmp_path, capsys):
    """Their layer built with eps=1e-4 (``--model-kwargs eps=1e-4``, saved in the checkpoint's ``args.model_kwargs``)
    imports with that eps, features and normaliser: it equals their layer at 1e-4 (<= 1e-5), which differs from their
    layer at 1e-6 by far more (before: imported at 1e-6)."""
    from mhla_diffusers import load_mhla_transformer

    path = tmp_path / "eps.pt"
    torch.save(_training_checkpoint(files["state"], eps=1e-4), path)
    code, err, out = _convert(files, tmp_path, capsys, str(path))
    assert code == 0, err
    config = json.loads((out / "transformer" / "mhla_config.json").read_text())
    assert config["eps"] == 1e-4 and config["feature_eps"] == 1e-4
    model = load_mhla_transformer(out / "transformer")
    assert model.transformer_blocks[1].attn1.mhla.eps == 1e-4
    errors = _layer_errors(model, files["state"], 1e-4)
    apart = _layer_errors(model, files["state"], EPS)
    print("eps 1e-4: against their layer at 1e-4", errors, "at 1e-6", apart)
    assert max(errors.values()) <= 1e-5 and min(apart.values()) > 5e-5, (errors, apart)  # apart: 2.3-3.8e-4 seen


def test_a_file_without_the_run_arguments_assumes_their_default_eps(files, tmp_path, capsys):
    """A bare state dict (.safetensors) has no ``args``: eps 1e-6 is assumed, with a warning saying so; ``eps=``
    (``--eps``) gives the run's; an ``eps`` contradicting a training checkpoint's is refused, naming both."""
    from safetensors.torch import save_file

    from mhla_diffusers import import_authors_dit

    flat = tmp_path / "flat.safetensors"
    save_file({k: v.contiguous() for k, v in files["state"].items()}, str(flat))
    with pytest.warns(UserWarning, match=r"holds no run arguments .* eps is taken as their default 1e-06"):
        spec = import_authors_dit(flat, tmp_path / "assumed", config=files["config"])
    assert spec["eps"] == EPS and spec["feature_eps"] == EPS
    code, err = run_main("conversion/convert.py", "--family", "dit", "--from", "authors", "--src", flat, "--config",
                         files["config"], "--out", tmp_path / "given", "--eps", "1e-4", capsys=capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "given" / "transformer" / "mhla_config.json").read_text())["eps"] == 1e-4
    code, err, out = _convert(files, tmp_path, capsys, None, "--eps", "1e-4")  # their run: the default 1e-6
    assert code == 2 and "eps=0.0001 contradicts the run's eps=1e-06" in err and not out.exists(), err
    code, err = run_main("conversion/convert.py", "--family", "dit", "--from", "authors", "--src", flat, "--config",
                         files["config"], "--out", tmp_path / "o", "--norm-output", capsys=capsys)
    assert code == 2 and "--norm-output cannot be set with --from authors" in err, err


def test_mixing_outside_unit_interval_runs_as_stored(files, tmp_path, capsys):
    """Their forward uses the mixing matrix as stored (only their training clamps it): a file with values outside
    [0, 1] imports unclamped (``mixing_clamp: false``, with a warning) and equals their layer (<= 1e-5); clamped, as
    before, it is far off."""
    from mhla_diffusers import load_mhla_transformer

    g = torch.Generator().manual_seed(5)
    state = {k: v.clone() for k, v in files["state"].items()}
    for i in MHLA_LAYERS:
        state[f"blocks.{i}.attn.piece_attn.conv.weight"] = torch.empty(PIECES**2, PIECES**2, 1, 1).uniform_(-0.3, 1.3, generator=g)
    path = tmp_path / "signed.pt"
    torch.save(_training_checkpoint(state), path)
    with pytest.warns(UserWarning, match=r"hold values outside \[0, 1\] .* unclamped \(mixing_clamp=False"):
        code, err, out = _convert(files, tmp_path, capsys, str(path))
    assert code == 0, err
    assert json.loads((out / "transformer" / "mhla_config.json").read_text())["mixing_clamp"] is False
    model = load_mhla_transformer(out / "transformer")
    errors = _layer_errors(model, state, EPS)
    for i in MHLA_LAYERS:
        model.transformer_blocks[i].attn1.mhla.mixing.clamp = True
    clamped = _layer_errors(model, state, EPS)
    print("mixing outside [0, 1]: as stored", errors, "clamped", clamped)
    assert max(errors.values()) <= 1e-5 and min(clamped.values()) > 1e-2, (errors, clamped)


def test_src_may_be_a_folder_holding_the_file(files, tmp_path, capsys):
    """``--src <folder>`` (a Hub download) takes the one weights file in it; a folder with none or several, or a
    diffusers model folder, is a clear error naming what to give (before: "... does not exist")."""
    import shutil

    folder = tmp_path / "download"
    folder.mkdir()
    shutil.copy(files["src"], folder / "epoch-0003.pt")
    (folder / "README.md").write_text("their run")
    code, err, out = _convert(files, tmp_path, capsys, str(folder))
    assert code == 0, err
    assert json.loads((out / "transformer" / "mhla_config.json").read_text())["layers"] == MHLA_LAYERS
    shutil.copy(files["src"], folder / "epoch-0004.pt")
    for src, message in ((folder, r"is a folder and holds the weights files \['epoch-0003.pt', 'epoch-0004.pt'\]: give"),
                         (tmp_path / "empty", "is a folder and holds no weights file"),
                         (files["config"], "is a diffusers model folder"),
                         (tmp_path / "missing", "missing does not exist")):
        if src.name == "empty":
            src.mkdir()
        code, err = run_main("conversion/convert.py", "--family", "dit", "--from", "authors", "--src", src,
                             "--state-dict-key", "ema", "--config", files["config"], "--out", tmp_path / "o", capsys=capsys)
        assert code == 2 and __import__("re").search(message, err), err


def test_our_set_attn_processor_over_the_imported_model_runs_it_as_imported(files, tmp_path, capsys):
    """The imported DiT's settings (their normaliser, the input LayerNorm, LePE, eps) are its layers' own: a plain
    MHLAProcessor() through mhla_diffusers.set_attn_processor computes bit for bit the same, and a save after it
    reloads to that model (CASE C17 on the authors' weights)."""
    from mhla_diffusers import MHLAProcessor, load_mhla_transformer, mhla_spec, save_mhla_transformer, set_attn_processor


    code, err, out = _convert(files, tmp_path, capsys)
    assert code == 0, err
    model = load_mhla_transformer(out)
    before, spec = _run_layers(model), mhla_spec(model)
    assert spec["denominator"] == "authors_dit" and spec["input_norm"] is True
    mhla = {f"{name}.processor": MHLAProcessor() for name, m in model.named_modules() if hasattr(m, "mhla")}
    set_attn_processor(model, mhla)  # the MHLA layers of the hybrid (a partial dict: the others keep theirs)
    again = _run_layers(model)
    assert all(torch.equal(again[i][1], before[i][1]) for i in before) and mhla_spec(model) == spec
    save_mhla_transformer(model, tmp_path / "again")
    reloaded = load_mhla_transformer(tmp_path / "again")
    assert mhla_spec(reloaded) == spec
    assert all(_rel(_run_layers(reloaded)[i][1], before[i][1]) < 1e-6 for i in before)  # loaded weights: alignment ulps
