"""Converted checkpoints loaded quantized (diffusers' ``quantization_config=`` through ``load_mhla_transformer``),
saved with ``save_mhla_transformer`` and loaded back (issue 32, item 3).

optimum-quanto int8 and torchao int8 weight-only quantize the base model's ``nn.Linear`` weights only; MHLA's own
parameters (mixing matrix, output norm, gate, LePE) are made after ``from_pretrained`` and stay exact float32. A
quanto weight loaded from a quantized save reports ``is_meta`` (the wrapper's own device) while its int8 data and
scales are on the CPU: the loader's "no tensors on the meta device" check reads the inner tensors, and an MHLA
made on such a layer (its device taken from that weight) is moved to where the layer's values are.

optimum-quanto is in the ``dev`` extra. torchao is not (installed, 0.18 with torch 2.13 on a CPU, every diffusers
model import logs five lines to stderr): its cases skip without it; they passed here with torchao 0.18.0, before the
fix too (its quantized weights report their real device).

Tolerances: a quantized model against the float32 original errs by the int8 rounding of its weights (observed
DiT 7.7e-3, Wan 4.0e-3 with quanto; 6.6e-3, 4.1e-3 with torchao): checked at 10x, and above 1e-4 (the weights really
are quantized). A reload against the quantized model runs the same int8 weights: observed 0.0, checked to 1e-6
relative (CPU BLAS may differ by an ulp with the operands' alignment; tests/checkpoint/test_checkpoint.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import dit_inputs, randomize_mixing_, run_dit, tiny_dit
from helpers_wan import run_wan, tiny_wan, wan_inputs
from safetensors.torch import load_file

from mhla_diffusers import MHLACheckpointError, apply_mhla, load_mhla_transformer, save_mhla_transformer
from mhla_diffusers.checkpoint.format import check_loaded
from mhla_diffusers.checkpoint.spec import mhla_parameters

pytestmark = [
    pytest.mark.filterwarnings("ignore:`Quanto(Config|Quantizer)` is deprecated:FutureWarning"),  # diffusers 0.42: still works
    pytest.mark.filterwarnings("ignore:You passed `quantization_config`"),  # a quantized save keeps its own config
]

# family -> the quantized model's relative error against the float32 original, observed (quanto, torchao)
OBSERVED = {"dit": {"quanto": 7.7e-3, "torchao": 6.6e-3}, "wan": {"quanto": 4.0e-3, "torchao": 4.1e-3}}
RELOAD_TOLERANCE = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quantization(kind: str):
    """``(quantization_config, load kwargs, is_quantized(weight))`` of ``kind``; skips when its package is missing."""
    if kind == "quanto":
        pytest.importorskip("optimum.quanto")
        from diffusers import QuantoConfig
        from optimum.quanto import QTensor

        return QuantoConfig(weights_dtype="int8"), {}, lambda w: isinstance(w, QTensor)
    pytest.importorskip("torchao")
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.utils import TorchAOBaseTensor

    # float32 asked for: diffusers' torchao quantizer otherwise casts the layers it does not quantize to bf16
    return TorchAoConfig(Int8WeightOnlyConfig()), {"torch_dtype": torch.float32}, lambda w: isinstance(w, TorchAOBaseTensor)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{family: (folder, run, float32 output)}``: a hybrid DiT (mixing partly outside [0, 1]) and a Wan with MHLA on
    layers 1, 2 (gate, LePE, output norm: every MHLA part), saved with ``save_mhla_transformer``."""
    root = tmp_path_factory.mktemp("quantized")
    dit = tiny_dit(num_layers=3, seed=1)
    apply_mhla(dit, layers="hybrid", num_blocks=4)
    randomize_mixing_(dit, seed=1)
    inputs = dit_inputs(batch=2, seed=2)
    save_mhla_transformer(dit, root / "dit")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)  # the gate's and LePE's inits
        wan = tiny_wan(num_layers=3, seed=1)
        apply_mhla(wan, layers=[1, 2], block_grid=(1, 2, 2), normalize=False, output_norm=True, gate="authors",
                   lepe=True, lepe_init="authors")
    randomize_mixing_(wan, seed=2)
    wan_in = wan_inputs(batch=1, seed=2)
    save_mhla_transformer(wan, root / "wan")
    return {
        "dit": (root / "dit", lambda m: run_dit(m, inputs), run_dit(dit, inputs)),
        "wan": (root / "wan", lambda m: run_wan(m, wan_in), run_wan(wan, wan_in)),
    }


def _check_quantized(model, folder, is_quantized) -> None:
    """The base Linear weights quantized; MHLA's own parameters plain float32 Parameters equal to ``folder``'s file."""
    stored = load_file(folder / "mhla.safetensors")
    weights = [m.weight for name, m in model.named_modules() if name.endswith(("to_q", "to_k", "to_v", "to_out.0"))]
    assert weights and all(is_quantized(w) for w in weights)
    params = mhla_parameters(model)
    assert sorted(params) == sorted(stored) and any(k.endswith("mixing.weight") for k in params)
    for key, param in params.items():
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32 and param.device.type == "cpu", key
        assert torch.equal(param.detach(), stored[key]), key


@pytest.mark.parametrize("kind", ["quanto", "torchao"])
@pytest.mark.parametrize("family", ["dit", "wan"])
def test_quantized_load_saves_and_loads_back(saved, tmp_path, family, kind):
    """Load quantized, run, save, load back (with and without the quantization config): the same int8 weights and the
    same MHLA parameters, the same output. Before the fix, the quanto save was refused ("tensors ... on the meta
    device ... save again from a complete copy")."""
    folder, run, reference = saved[family]
    config, kwargs, is_quantized = _quantization(kind)
    model = load_mhla_transformer(folder, quantization_config=config, **kwargs)
    _check_quantized(model, folder, is_quantized)
    output = run(model)
    error = _rel(output, reference)
    print(f"{family} {kind} int8 vs float32: {error:.2e}")
    assert 1e-4 < error <= 10 * OBSERVED[family][kind]

    save_mhla_transformer(model, tmp_path / "saved")
    for again in ({}, {"quantization_config": config}):
        loaded = load_mhla_transformer(tmp_path / "saved", **kwargs, **again)
        _check_quantized(loaded, folder, is_quantized)
        assert _rel(run(loaded), output) <= RELOAD_TOLERANCE, (family, kind, again)
    save_mhla_transformer(loaded, tmp_path / "twice")  # a reloaded quantized model saves again
    assert _rel(run(load_mhla_transformer(tmp_path / "twice", **kwargs)), output) <= RELOAD_TOLERANCE


def test_a_quantized_weight_without_values_is_still_refused(saved, tmp_path):
    """A quanto weight whose int8 data is on the meta device has no values, whatever the wrapper says: refused by the
    loaders' check, as a plain meta tensor is; its MHLA (on the meta device too) is not loaded into."""
    pytest.importorskip("optimum.quanto")
    from diffusers import QuantoConfig

    from mhla_diffusers.checkpoint.loading import load_mhla_weights

    folder, _, _ = saved["dit"]
    model = load_mhla_transformer(folder, quantization_config=QuantoConfig(weights_dtype="int8"))
    save_mhla_transformer(model, tmp_path / "saved")
    model = load_mhla_transformer(tmp_path / "saved")
    check_loaded(model, tmp_path / "saved")  # complete: passes
    attn = model.transformer_blocks[1].attn1
    assert attn.to_q.weight.is_meta  # quanto's wrapper reports meta on a complete model
    _empty_quantized(attn.to_q.weight)
    with pytest.raises(MHLACheckpointError, match=r"on the meta device: \['transformer_blocks.1.attn1.to_q.weight'\]"):
        check_loaded(model, tmp_path / "saved")
    for name in ("to_k", "to_v", "to_out.0"):  # the whole layer without values, its MHLA too
        _empty_quantized(attn.get_submodule(name).weight)
    attn.to("meta")  # the plain tensors (quanto's weights do not move)
    with pytest.raises(MHLACheckpointError, match=r"transformer_blocks.1.attn1.mhla.mixing.weight \(and 0 more\) are on the meta"):
        load_mhla_weights(model, tmp_path / "saved")


def _empty_quantized(weight) -> None:
    """Put a quanto weight's int8 data and scales on the meta device (its values gone)."""
    for name in ("_data", "_scale"):
        setattr(weight, name, torch.empty_like(getattr(weight, name), device="meta"))
