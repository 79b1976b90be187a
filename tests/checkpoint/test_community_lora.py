"""Community LoRAs (trained on the stock model, diffusers' ``pytorch_lora_weights.safetensors``) on MHLA pipelines.

The LoRA is built here as a user's trainer would: peft adapters on the STOCK tiny transformer (random,
non-zero B), saved with the pipeline class's own ``save_lora_weights``. On SANA and Wan:

* ``pipe.load_lora_weights`` onto a converted pipeline loaded with ``load_mhla_pipeline`` equals LoRA-then-
  convert (stock pipeline + LoRA, then ``apply_mhla``), unfused and fused, within fp32 tolerance; the LoRA
  changes the output;
* Wan 2.2 A14B: a LoRA of the low-noise expert (``load_into_transformer_2=True``) likewise;
* ``load_lora_weights``, ``fuse_lora``, ``unfuse_lora``, ``set_adapters`` and ``unload_lora_weights`` leave
  every MHLA processor and mixing matrix in place (the same objects, the same values); after unloading,
  the pipeline computes the converted model without the LoRA again.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import randomize_mixing_
from helpers_sana import tiny_sana_pipeline
from helpers_wan import tiny_wan22_pipeline, tiny_wan_pipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from mhla_diffusers import apply_mhla, is_mhla_model, load_mhla_pipeline, save_mhla_pipeline

CASES = {
    "sana": (
        lambda: tiny_sana_pipeline(num_layers=2),
        dict(height=64, width=64, use_resolution_binning=False),
        "images",
    ),
    "wan": (lambda: tiny_wan_pipeline(num_layers=2), dict(height=64, width=64, num_frames=5), "frames"),
}


def community_lora(pipe, folder, component: str = "transformer") -> None:
    """A LoRA (rank 4, alpha 8, on every attention projection) trained on the stock transformer (``component``),
    written in diffusers' format by the pipeline class (``pytorch_lora_weights.safetensors``)."""
    stock = copy.deepcopy(getattr(pipe, component))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        stock.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(stock))


def mhla_state(pipe, component: str = "transformer") -> dict:
    """``{attention path: (processor, mixing module, mixing weight copy)}`` of the MHLA layers."""
    return {
        name: (attn.processor, attn.mhla.mixing, attn.mhla.mixing.weight.detach().clone())
        for name, attn in getattr(pipe, component).named_modules()
        if getattr(attn, "mhla", None) is not None
    }


def assert_same_mhla(pipe, state: dict, component: str = "transformer") -> None:
    model = getattr(pipe, component)
    assert is_mhla_model(model)
    now = {name: attn for name, attn in model.named_modules() if getattr(attn, "mhla", None) is not None}
    assert sorted(now) == sorted(state)
    for name, (processor, mixing, weight) in state.items():
        assert now[name].processor is processor and now[name].mhla.mixing is mixing
        torch.testing.assert_close(mixing.weight, weight, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(CASES))
def test_community_lora_on_a_converted_pipeline(family, tmp_path):
    build, size, field = CASES[family]
    pipe = build()
    community_lora(pipe, tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()

    def run(p):
        out = p("a cat", generator=torch.Generator().manual_seed(0), num_inference_steps=2, guidance_scale=1.0,
                output_type="pt", **size)
        return getattr(out, field)

    converted = copy.deepcopy(pipe)
    apply_mhla(converted.transformer, block_grid=(1, 2, 2))
    randomize_mixing_(converted.transformer)  # a fine-tuned state, partly outside [0, 1]
    save_mhla_pipeline(converted, tmp_path / "mhla")
    no_lora = run(converted)

    # LoRA then convert: the stock pipeline takes the LoRA, then MHLA with the converted matrices
    reference = copy.deepcopy(pipe)
    reference.load_lora_weights(tmp_path / "lora")
    apply_mhla(reference.transformer, block_grid=(1, 2, 2))
    reference.transformer.load_state_dict(
        {k: v for k, v in converted.transformer.state_dict().items() if ".mhla." in k}, strict=False
    )
    expected = run(reference)

    # convert then LoRA: the converted checkpoint as a user loads it, then the community LoRA
    mhla = load_mhla_pipeline(tmp_path / "mhla")
    state = mhla_state(mhla)
    mhla.load_lora_weights(tmp_path / "lora")
    assert_same_mhla(mhla, state)
    got = run(mhla)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (got - no_lora).abs().max() > 1e-3  # the LoRA does change the output

    mhla.fuse_lora()
    reference.fuse_lora()
    assert_same_mhla(mhla, state)
    torch.testing.assert_close(run(mhla), got, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run(mhla), run(reference), rtol=1e-4, atol=1e-5)
    mhla.unfuse_lora()
    assert_same_mhla(mhla, state)
    torch.testing.assert_close(run(mhla), got, rtol=1e-4, atol=1e-5)

    (adapter,) = mhla.get_active_adapters()
    mhla.set_adapters([adapter], [0.0])  # weight 0: the converted model alone
    assert_same_mhla(mhla, state)
    torch.testing.assert_close(run(mhla), no_lora, rtol=1e-4, atol=1e-5)
    mhla.set_adapters([adapter], [1.0])
    torch.testing.assert_close(run(mhla), got, rtol=1e-4, atol=1e-5)

    mhla.unload_lora_weights()
    assert_same_mhla(mhla, state)
    torch.testing.assert_close(run(mhla), no_lora, rtol=1e-4, atol=1e-5)


def test_community_lora_on_the_low_noise_expert_of_wan22(tmp_path):
    """Wan 2.2 A14B: a LoRA of the stock low-noise expert, loaded with diffusers' ``load_into_transformer_2=True``
    onto a converted two-expert pipeline, equals LoRA-then-convert; both experts keep their MHLA state."""
    pipe = tiny_wan22_pipeline("t2v")
    community_lora(pipe, tmp_path / "lora", component="transformer_2")

    def run(p):
        return p("a cat", generator=torch.Generator().manual_seed(0), num_inference_steps=2, guidance_scale=1.0,
                 output_type="pt", height=64, width=64, num_frames=5).frames

    for t in (pipe.transformer, pipe.transformer_2):
        apply_mhla(t, block_grid=(1, 2, 2))
        randomize_mixing_(t)
    save_mhla_pipeline(pipe, tmp_path / "mhla")
    no_lora = run(pipe)
    mhla = load_mhla_pipeline(tmp_path / "mhla")
    states = {name: mhla_state(mhla, name) for name in ("transformer", "transformer_2")}
    mhla.load_lora_weights(tmp_path / "lora", load_into_transformer_2=True)
    for name, state in states.items():
        assert_same_mhla(mhla, state, name)
    got = run(mhla)
    assert (got - no_lora).abs().max() > 1e-3

    reference = tiny_wan22_pipeline("t2v")  # LoRA then convert, with the same matrices
    reference.load_lora_weights(tmp_path / "lora", load_into_transformer_2=True)
    for name in ("transformer", "transformer_2"):
        apply_mhla(getattr(reference, name), block_grid=(1, 2, 2))
        getattr(reference, name).load_state_dict(
            {k: v for k, v in getattr(pipe, name).state_dict().items() if ".mhla." in k}, strict=False)
    torch.testing.assert_close(got, run(reference), rtol=1e-4, atol=1e-5)
    mhla.unload_lora_weights()
    for name, state in states.items():
        assert_same_mhla(mhla, state, name)
    torch.testing.assert_close(run(mhla), no_lora, rtol=1e-4, atol=1e-5)
