"""A model that carries LoRA adapters is never saved broken, and no loader returns a model without values.

* ``save_mhla_transformer`` / ``save_mhla_pipeline`` of a model with peft layers (``add_adapter``,
  ``peft.inject_adapter_in_model`` on DiT, ``pipe.load_lora_weights``; fused or not) refuse before
  anything is written, naming the calls that fix it; those calls then give a folder that loads and
  computes what the adapted model computed; ``merge_lora=True`` writes it merged and leaves the model
  as it was, bit for bit.
* A folder written the broken way (peft-wrapped keys ``to_q.base_layer.weight``), or whose base weights
  lack keys, is refused by every loader (``MHLACheckpointError`` naming the file), never returned with
  tensors on the meta device; ``load_mhla_weights`` never copies into meta tensors silently.
* diffusers' own ``set_attn_processor(<stock processor>)`` after MHLA: the model is stock
  (``is_mhla_model`` False, ``mhla_spec`` None) and saves as it computes; MHLAProcessor back runs the
  same matrices again.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import dit_inputs, randomize_mixing_, run_dit, tiny_dit, tiny_dit_pipeline
from helpers_sana import run_sana, sana_inputs, tiny_sana, tiny_sana_pipeline
from helpers_wan import run_wan, tiny_wan, tiny_wan_pipeline, wan_inputs
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from mhla_diffusers import (
    MHLAProcessor,
    apply_mhla,
    is_mhla_model,
    load_mhla_pipeline,
    load_mhla_transformer,
    mhla_spec,
    remove_mhla,
    save_mhla_pipeline,
    save_mhla_transformer,
    set_attn_processor,
)
from mhla_diffusers.checkpoint import adapter
from mhla_diffusers.checkpoint.format import MHLACheckpointError, load_mhla_weights
from mhla_diffusers.families import family_of, stock_processor
from mhla_diffusers.models.installer import idle_mhla_layers

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, W + BA folded into W: observed <= 1e-6


def _lora_config(seed: int = 1) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS)


def _models():
    """``{family: (build, inputs, run)}``; the builders return a converted model (random mixing)."""

    def converted(build):
        def make():
            model = build()
            apply_mhla(model, block_grid=(1, 2, 2))
            randomize_mixing_(model)
            return model

        return make

    return {
        "dit": (converted(lambda: tiny_dit(num_layers=2)), dit_inputs(), run_dit),
        "sana": (converted(lambda: tiny_sana(num_layers=2)), sana_inputs(), run_sana),
        "wan": (converted(lambda: tiny_wan(num_layers=2)), wan_inputs(), run_wan),
    }


def _add_lora(model) -> None:
    """LoRA with random (non-zero) B as a user adds it: ``add_adapter`` (SANA, Wan) or peft's
    ``inject_adapter_in_model`` (DiT, which has no ``add_adapter``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if hasattr(model, "add_adapter"):
            model.add_adapter(_lora_config())
        else:
            inject_adapter_in_model(_lora_config(), model)


def _fuse(model) -> None:
    """diffusers' ``fuse_lora`` where the model has it, else peft's own merge on every adapter layer (DiT)."""
    if hasattr(model, "fuse_lora"):
        model.fuse_lora()
    else:
        for _, layer in adapter._tuner_layers(model):
            layer.merge()


def _keep_fix(model, fused: bool) -> None:
    """The call the refusal names to keep the LoRA in the weights."""
    if hasattr(model, "unload_lora"):
        if not fused:
            model.fuse_lora()
        model.unload_lora()
    elif fused:
        adapter.unload_lora_(model)
    else:
        adapter.merge_lora_(model)


def _no_meta(model) -> None:
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- saving -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("family", ["dit", "sana", "wan"])
def test_saving_a_transformer_with_lora_is_refused_and_the_named_fix_works(family, fused, tmp_path):
    build, inputs, run = _models()[family]
    model = build()
    _add_lora(model)
    if fused:
        _fuse(model)
    adapted = run(model, inputs)
    keep = {  # (the fix the message names, unfused / fused)
        "dit": ("merge_lora_(transformer)", "unload_lora_(transformer) (the fused weights stay)"),
        "sana": ("transformer.fuse_lora() then transformer.unload_lora()", "transformer.unload_lora() (the fused weights stay)"),
    }
    keep["wan"] = keep["sana"]
    with pytest.raises(MHLACheckpointError, match=rf"peft-wrapped keys.*nothing was written.*{re.escape(keep[family][fused])}"
                                                  r".*merge_lora=True"):
        save_mhla_transformer(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # not even a temporary folder
    _keep_fix(model, fused)
    save_mhla_transformer(model, tmp_path / "out")
    loaded = load_mhla_transformer(tmp_path / "out")
    _no_meta(loaded)
    assert is_mhla_model(loaded)
    torch.testing.assert_close(run(loaded, inputs), adapted, **TOL)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("family", ["dit", "sana", "wan"])
def test_merge_lora_saves_the_adapted_model_and_leaves_it_as_it_was(family, fused, tmp_path):
    build, inputs, run = _models()[family]
    model = build()
    _add_lora(model)
    if fused:
        _fuse(model)
    adapted, before, tuners = run(model, inputs), _state(model), adapter._tuner_layers(model)
    save_mhla_transformer(model, tmp_path / "out", merge_lora=True)
    after = _state(model)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)  # bit for bit
    assert [m for _, m in adapter._tuner_layers(model)] == [m for _, m in tuners]  # the same adapter layers
    torch.testing.assert_close(run(model, inputs), adapted, rtol=0, atol=0)
    loaded = load_mhla_transformer(tmp_path / "out")
    assert not adapter.has_lora(loaded)
    torch.testing.assert_close(run(loaded, inputs), adapted, **TOL)
    assert (run(loaded, inputs) - run(build(), inputs)).abs().max() > 1e-3  # the LoRA is in the saved weights


def test_merge_lora_refuses_disabled_adapters(tmp_path):
    build, _, _ = _models()["sana"]
    model = build()
    _add_lora(model)
    model.disable_lora()
    with pytest.raises(MHLACheckpointError, match=r"disabled.*enable_lora\(\).*nothing was written"):
        save_mhla_transformer(model, tmp_path / "out", merge_lora=True)
    assert list(tmp_path.iterdir()) == []


def _community_lora(pipe, folder) -> None:
    """A LoRA trained on the stock transformer, in diffusers' file format (``pytorch_lora_weights.safetensors``)."""
    stock = copy.deepcopy(pipe.transformer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        stock.add_adapter(_lora_config())
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(stock))


PIPELINES = {
    "sana": (lambda: tiny_sana_pipeline(num_layers=2),
             lambda t: sana_inputs(in_channels=t.config.in_channels, caption_channels=t.config.caption_channels), run_sana),
    "wan": (lambda: tiny_wan_pipeline(num_layers=2), lambda t: wan_inputs(in_channels=t.config.in_channels), run_wan),
}


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("family", sorted(PIPELINES))
def test_saving_a_pipeline_with_a_loaded_lora_is_refused_and_the_named_fix_works(family, fused, tmp_path):
    build, make_inputs, run = PIPELINES[family]
    pipe = build()
    _community_lora(pipe, tmp_path / "lora")
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    randomize_mixing_(pipe.transformer)
    pipe.load_lora_weights(tmp_path / "lora")
    if fused:
        pipe.fuse_lora()
    inputs = make_inputs(pipe.transformer)
    adapted = run(pipe.transformer, inputs)
    keep = "pipe.unload_lora_weights() (the fused weights stay)" if fused else "pipe.fuse_lora() then pipe.unload_lora_weights()"
    drop = "pipe.unfuse_lora() then pipe.unload_lora_weights()" if fused else "pipe.unload_lora_weights()"
    with pytest.raises(MHLACheckpointError, match=rf"pipe\.transformer carries LoRA adapters.*{re.escape(keep)}.*merge_lora=True"
                                                  rf".*without it: {re.escape(drop)}"):
        save_mhla_pipeline(pipe, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]

    save_mhla_pipeline(pipe, tmp_path / "merged", merge_lora=True)  # the explicit option
    torch.testing.assert_close(run(load_mhla_pipeline(tmp_path / "merged").transformer, inputs), adapted, **TOL)
    if not fused:
        pipe.fuse_lora()
    pipe.unload_lora_weights()  # the named fix
    save_mhla_pipeline(pipe, tmp_path / "out")
    loaded = load_mhla_pipeline(tmp_path / "out")
    _no_meta(loaded.transformer)
    torch.testing.assert_close(run(loaded.transformer, inputs), adapted, **TOL)


def test_saving_a_dit_pipeline_with_lora_names_the_functions_that_fix_it(tmp_path):
    """DiTPipeline has no LoRA loader: the fix is mhla_diffusers' merge_lora_ / unload_lora_ on its transformer."""
    pipe = tiny_dit_pipeline(num_layers=2)
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    _add_lora(pipe.transformer)
    with pytest.raises(MHLACheckpointError, match=r"merge_lora_\(pipe\.transformer\).*without it: .*unload_lora_\(pipe\.transformer\)"):
        save_mhla_pipeline(pipe, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# -- loading ------------------------------------------------------------------------------------------
def _wrap_keys_as_peft_(file) -> None:
    """Rewrite a base weights file as saving a model with peft layers wrote it (the broken folders
    saved before the refusal existed): ``<m>.weight`` -> ``<m>.base_layer.weight`` plus ``<m>.lora_A.default.weight``."""
    tensors = load_file(str(file))
    out = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")):
            out[f"{module}.base_layer.{leaf}"] = value
            if leaf == "weight":
                out[f"{module}.lora_A.default.weight"] = torch.zeros(4, value.shape[1])
                out[f"{module}.lora_B.default.weight"] = torch.zeros(value.shape[0], 4)
        else:
            out[key] = value
    save_file(out, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["dit", "sana", "wan"])
def test_loaders_refuse_peft_wrapped_base_weights(family, tmp_path):
    build, _, _ = _models()[family]
    save_mhla_transformer(build(), tmp_path / "t")
    file = tmp_path / "t" / "diffusion_pytorch_model.safetensors"
    _wrap_keys_as_peft_(file)
    for kwargs in ({}, {"low_cpu_mem_usage": False}):  # meta tensors, or silently fresh weights
        with pytest.raises(MHLACheckpointError, match=rf"{re.escape(str(file))} holds peft-wrapped keys .*base_layer"):
            load_mhla_transformer(tmp_path / "t", **kwargs)


@pytest.mark.parametrize("family", ["sana", "wan"])
def test_pipeline_loader_refuses_peft_wrapped_base_weights(family, tmp_path):
    build, _, _ = PIPELINES[family]
    pipe = build()
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    save_mhla_pipeline(pipe, tmp_path / "p")
    file = tmp_path / "p" / "transformer" / "diffusion_pytorch_model.safetensors"
    _wrap_keys_as_peft_(file)
    with pytest.raises(MHLACheckpointError, match=rf"{re.escape(str(file))} holds peft-wrapped keys"):
        load_mhla_pipeline(tmp_path / "p")


def test_loaders_never_return_meta_tensors(tmp_path):
    """Base weights that simply lack keys: an error naming the file, for the transformer and the pipeline loader."""
    pipe = tiny_sana_pipeline(num_layers=2)
    apply_mhla(pipe.transformer, block_grid=(1, 2, 2))
    save_mhla_pipeline(pipe, tmp_path / "p")
    file = tmp_path / "p" / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(file))
    save_file({k: v for k, v in tensors.items() if ".attn1.to_q." not in k}, str(file), metadata={"format": "pt"})
    for load in (load_mhla_transformer, load_mhla_pipeline):
        with pytest.raises(MHLACheckpointError, match=rf"{re.escape(str(file))} left 2 tensors of SanaTransformer2DModel "
                                                      r"without values \(on the meta device: \['transformer_blocks.0.attn1.to_q"):
            load(tmp_path / "p")


def test_load_mhla_weights_refuses_meta_parameters(tmp_path):
    model = tiny_sana(num_layers=2)
    apply_mhla(model, block_grid=(1, 2, 2))
    save_mhla_transformer(model, tmp_path / "t")
    with torch.device("meta"):
        empty = type(model).from_config(model.config)
    apply_mhla(empty, block_grid=(1, 2, 2))  # mixing matrices on the meta device, as the layer's weights
    with pytest.raises(MHLACheckpointError, match=r"mhla.safetensors: the model's transformer_blocks.0.attn1.mhla.mixing.weight "
                                                  r"\(and 1 more\) are on the meta device"):
        load_mhla_weights(empty, tmp_path / "t")


def test_convert_refuses_a_source_saved_with_peft_layers(tmp_path):
    """A stock folder written by diffusers' own save_pretrained of a model with LoRA layers."""
    from mhla_diffusers.checkpoint.conversion import convert_checkpoint

    model = tiny_sana(num_layers=2)
    model.save_pretrained(tmp_path / "src")
    _wrap_keys_as_peft_(tmp_path / "src" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(MHLACheckpointError, match="peft-wrapped keys"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", block_grid=(1, 2, 2))
    assert not (tmp_path / "out").exists()


# -- diffusers' own set_attn_processor(<stock>) after MHLA ---------------------------------------------
def _set_stock(model, only: str | None = None) -> None:
    """The stock processor on every attention layer (or on the self-attention ``only``): diffusers' own
    ``set_attn_processor`` (a complete dict), ours on DiT, which lacks it."""
    family = family_of(model)
    current = dict(model.attn_processors) if hasattr(model, "attn_processors") else None
    keys = current or {f"{n}.processor": None for n, m in model.named_modules() if hasattr(m, "set_processor")}
    mapping = {k: stock_processor(family, k[: -len(".processor")]) if only in (None, k[: -len(".processor")]) else current[k]
               for k in keys}
    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(mapping)
    else:
        set_attn_processor(model, mapping)


@pytest.mark.parametrize("family", ["dit", "sana", "wan"])
def test_stock_processors_after_mhla_give_a_stock_model(family, tmp_path):
    build, inputs, run = _models()[family]
    model = build()
    mhla_out = run(model, inputs)
    mixing = {n: m.mhla.mixing for n, m in model.named_modules() if getattr(m, "mhla", None) is not None}
    _set_stock(model)
    stock_out = run(model, inputs)
    assert (stock_out - mhla_out).abs().max() > 1e-3
    assert not is_mhla_model(model) and mhla_spec(model) is None and sorted(idle_mhla_layers(model)) == sorted(mixing)
    with pytest.warns(UserWarning, match=r"keep MHLA mixing matrices but run .*model as it computes"):
        save_mhla_transformer(model, tmp_path / "stock")
    assert not (tmp_path / "stock" / "mhla_config.json").exists()
    loaded = load_mhla_transformer(tmp_path / "stock")
    assert not is_mhla_model(loaded)
    torch.testing.assert_close(run(loaded, inputs), stock_out, **TOL)

    with pytest.raises(ValueError, match=r"keep the mixing matrices of an earlier MHLA install.*remove_mhla.*MHLAProcessor"):
        apply_mhla(model, block_grid=(1, 2, 2))
    set_attn_processor(model, MHLAProcessor())  # back: the same matrices run again
    assert is_mhla_model(model) and idle_mhla_layers(model) == {}
    assert all(m.mhla.mixing is mixing[n] for n, m in model.named_modules() if n in mixing)
    torch.testing.assert_close(run(model, inputs), mhla_out, rtol=0, atol=0)
    remove_mhla(model)
    assert idle_mhla_layers(model) == {} and not is_mhla_model(model)


def test_a_stock_processor_on_one_layer_saves_the_others_as_mhla(tmp_path):
    build, inputs, run = _models()["wan"]
    model = build()
    _set_stock(model, only="blocks.0.attn1")
    out = run(model, inputs)
    assert is_mhla_model(model) and mhla_spec(model)["layers"] == [1]
    with pytest.warns(UserWarning, match=r"\['blocks.0.attn1'\] keep MHLA mixing matrices but run \['WanAttnProcessor'\]"):
        save_mhla_transformer(model, tmp_path / "t")
    loaded = load_mhla_transformer(tmp_path / "t")
    assert mhla_spec(loaded)["layers"] == [1] and idle_mhla_layers(loaded) == {}
    torch.testing.assert_close(run(loaded, inputs), out, **TOL)
