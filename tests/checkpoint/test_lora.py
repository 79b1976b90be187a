"""LoRA through peft: DiT (inject_adapter_in_model) and SANA (add_adapter), mixing matrices kept
trainable, merge / unload / save beside / load, and the exported folder against the in-memory model."""

import copy

import pytest
import torch

import mhla_diffusers
from mhla_diffusers import training
from mhla_diffusers.checkpoint import adapter, lora
from mhla_diffusers.training import load_config


def _models():
    from helpers import dit_inputs, run_dit, tiny_dit
    from helpers_sana import run_sana, sana_inputs, tiny_sana

    return [(tiny_dit(num_layers=2), dit_inputs(), run_dit), (tiny_sana(num_layers=2), sana_inputs(), run_sana)]


@torch.no_grad()
def _perturb_lora_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in lora.lora_parameters(model):
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("index", [0, 1], ids=["dit-inject", "sana-add_adapter"])
def test_add_lora_keeps_outputs_trains_only_lora_and_mixing(index):
    model, inputs, run = _models()[index]
    mhla_diffusers.apply_mhla(model, layers="hybrid", num_blocks=4)
    before = run(model, inputs)
    config = lora.add_lora(model, rank=4, alpha=8)
    assert config.r == 4 and config.lora_alpha == 8
    assert lora.has_lora(model) and torch.equal(run(model, inputs), before)  # B = 0 at init
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "mhla.mixing" in n for n in trainable)
    assert any("mhla.mixing" in n for n in trainable)  # add_adapter / inject froze them; unfrozen again
    assert any("attn2" in n for n in trainable) == (index == 1)  # SANA's cross-attention projections too
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.add_lora(model)
    frozen = copy.deepcopy(model)
    lora.unload_lora_(frozen)
    lora.add_lora(frozen, rank=2, train_mixing=False)
    assert not any(p.requires_grad for p in mhla_diffusers.mixing_parameters(frozen))


@pytest.mark.parametrize("index", [0, 1], ids=["dit", "sana"])
def test_merge_unload_save_load(index, tmp_path):
    model, inputs, run = _models()[index]
    mhla_diffusers.apply_mhla(model, layers="all", num_blocks=4)
    base = run(model, inputs)
    lora.add_lora(model, rank=4)
    _perturb_lora_(model)
    adapted = run(model, inputs)
    assert (adapted - base).abs().max() > 1e-3
    lora.save_lora(model, tmp_path / "adapter")
    merged = copy.deepcopy(model)
    assert lora.merge_lora_(merged) == len(adapter._tuner_layers(model))
    assert not lora.has_lora(merged) and not any("lora_" in k or "base_layer" in k for k in merged.state_dict())
    torch.testing.assert_close(run(merged, inputs), adapted, rtol=1e-5, atol=1e-5)
    unloaded = copy.deepcopy(model)
    lora.unload_lora_(unloaded)
    assert torch.equal(run(unloaded, inputs), base)
    lora.load_lora(unloaded, tmp_path / "adapter")
    torch.testing.assert_close(run(unloaded, inputs), adapted, rtol=1e-4, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_lora(copy.deepcopy(merged), tmp_path)


def test_load_lora_is_strict(tmp_path):
    from helpers import tiny_dit

    model = tiny_dit(num_layers=2)
    lora.add_lora(model, rank=2)
    lora.save_lora(model, tmp_path / "a")
    other = tiny_dit(num_layers=3)  # a layer more: the adapter file lacks its weights
    with pytest.raises(ValueError, match="does not match the model"):
        lora.load_lora(other, tmp_path / "a")


@pytest.mark.parametrize("mode", ["merge", "separate"])
def test_exported_folder_computes_what_the_trained_model_computes(tmp_path, mode):
    """The trainer's export (export_model) of a LoRA + MHLA DiT loads with the ordinary loaders and
    gives the in-memory model's outputs (merged: up to float rounding of W + BA)."""
    from helpers_train import TINY_DIT, tiny_config

    config = load_config(tiny_config(tmp_path / "run", mhla={"layers": "all", "num_blocks": 4}),
                         ["train.trainable=lora", "lora.rank=4", f"lora.export={mode}"])
    parts = training.build_models(config)
    model = parts.transformer.eval()
    _perturb_lora_(model)
    with torch.no_grad():
        mhla_diffusers.mixing_parameters(model)[0].mul_(0.5)  # a "trained" mixing matrix
    x = torch.randn(2, TINY_DIT["in_channels"], 8, 8)
    kwargs = dict(timestep=torch.tensor([5, 900]), class_labels=torch.tensor([1, 2]))
    with torch.no_grad():
        expected = model(x, **kwargs).sample
    training.export_model(parts, model, tmp_path / "final", sampler="ddim", id2label={0: "a", 1: "b", 2: "c"}, lora_export=mode)
    loaders = {"merge": mhla_diffusers.load_mhla_pipeline, "separate": lora.load_mhla_pipeline_with_lora}
    pipe = loaders[mode](tmp_path / "final")
    with torch.no_grad():
        got = pipe.transformer(x, **kwargs).sample
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    assert (tmp_path / "final" / lora.LORA_DIR_NAME).is_dir() == (mode == "separate")
    transformer = (lora.load_mhla_transformer_with_lora if mode == "separate" else mhla_diffusers.load_mhla_transformer)(tmp_path / "final")
    with torch.no_grad():
        torch.testing.assert_close(transformer(x, **kwargs).sample, expected, rtol=1e-5, atol=2e-6)
    # The ordinary loaders apply an adapter saved beside the checkpoint too (never silently drop it);
    # lora=False gives the base weights alone.
    for load in (mhla_diffusers.load_mhla_transformer, lambda p, **kw: mhla_diffusers.load_mhla_pipeline(p, **kw).transformer):
        with torch.no_grad():
            torch.testing.assert_close(load(tmp_path / "final")(x, **kwargs).sample, expected, rtol=1e-5, atol=2e-6)
            bare = load(tmp_path / "final", lora=False)(x, **kwargs).sample
        assert (mode == "merge") == bool(torch.allclose(bare, expected, rtol=1e-5, atol=2e-6))


def test_trainer_lora_run_trains_only_adapters_and_mixing(tmp_path):
    from diffusers import DDPMScheduler, DiTTransformer2DModel
    from helpers_train import TINY_DIT, tiny_config
    from safetensors.torch import load_file

    torch.manual_seed(0)  # a saved base, so that the frozen weights can be compared after training
    base = DiTTransformer2DModel(**TINY_DIT)
    vae = mhla_diffusers.SpaceToDepthAutoencoder(factor=2, scaling_factor=1.8)
    training.export_pipeline(base, vae, DDPMScheduler(), tmp_path / "base", sampler="ddim")
    cfg = tiny_config(tmp_path / "lora", model={"init": None, "pretrained": str(tmp_path / "base")},
                      mhla={"layers": "all", "num_blocks": 4})
    summary = training.train(load_config(cfg, ["train.trainable=lora", "lora.export=separate", "train.mixing_lr=1e-2"]))
    assert summary["trainable"] == "lora" and summary["num_trainable_parameters"] < summary["num_parameters"] / 4
    a = load_file(tmp_path / "base" / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "lora" / "final" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # separate export: the base weights untouched
    mixing = load_file(tmp_path / "lora" / "final" / "transformer" / "mhla.safetensors")
    fresh = DiTTransformer2DModel(**TINY_DIT)
    mhla_diffusers.apply_mhla(fresh, layers="all", num_blocks=4)
    init = {n: p for n, p in fresh.state_dict().items() if "mhla.mixing" in n}
    assert any(not torch.equal(mixing[k], init[k]) for k in mixing)  # the mixing matrices trained


@pytest.mark.parametrize("kind", ["truncated", "huge_length", "text"])
def test_load_lora_refuses_a_damaged_weights_file_naming_it(tmp_path, kind):
    """safetensors' own SafetensorError (or a read of the claimed header length) before; now one
    MHLACheckpointError naming the file, before any weight is touched."""
    from helpers import tiny_dit

    model = tiny_dit(num_layers=2)
    lora.add_lora(model, rank=2)
    folder = lora.save_lora(model, tmp_path / "a")
    weights = next(folder.glob("*.safetensors"))
    data = weights.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "huge_length": (1 << 63).to_bytes(8, "little") + data[8:],
               "text": b"not weights\n" * 8}[kind]
    weights.write_bytes(damaged)
    with pytest.raises(mhla_diffusers.MHLACheckpointError, match=str(weights).replace(".", r"\.")):
        lora.load_lora(tiny_dit(num_layers=2), folder)
