"""MHLA under diffusers' and accelerate's offloading and casting hooks (CASES C13, C18).

A layer's MHLA runs its parameters through module calls (``attn.mhla.mixing()``, the output norm, gate and LePE), so
hooks put on those modules move them as they move stock weights:

* diffusers' group offloading at leaf and block level, in memory and to disk, enabled after MHLA is installed or
  before (the MHLA made later follows it): the output of the model without offloading;
* on a loaded pipeline (``load_mhla_pipeline`` then ``pipe.enable_group_offload``), DiT, SANA and Wan;
* accelerate's ``cpu_offload`` (weights on the meta device, restored around each module's forward);
* layerwise casting: stock weights stored in a low precision, MHLA's own parameters kept in float32.

On this CPU machine onload and offload devices are both the CPU: a parameter never onloaded shows as the placeholder
disk offloading leaves (before the fix: Wan NaN, SANA 10% off), or as a meta tensor under accelerate.
Tolerance: offloading to disk reloads the stock weights from safetensors (a stock model moves by 1.5e-7 relative
there); 5e-6 is over 20x that.
"""

from __future__ import annotations

import pytest
import torch
from helpers import dit_inputs, randomize_mixing_, run_dit, tiny_dit
from helpers_sana import run_sana, sana_inputs, tiny_sana, tiny_sana_pipeline
from helpers_wan import run_wan, tiny_wan, tiny_wan_pipeline, wan_inputs

from mhla_diffusers import apply_mhla, load_mhla_pipeline, save_mhla_pipeline

TOL = 5e-6
CPU = torch.device("cpu")
FAMILIES = {
    "sana": (tiny_sana, run_sana, sana_inputs, {}),
    "wan": (tiny_wan, run_wan, wan_inputs, {"normalize": False, "gate": "neutral"}),  # an output norm and a gate too
    "dit": (tiny_dit, run_dit, dit_inputs, {"lepe": True}),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def _train_(model) -> None:
    """A trained state: mixing inside and outside [0, 1], every MHLA part away from its neutral start."""
    randomize_mixing_(model)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if ".mhla." in name and ".mixing." not in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _offload(model, level: str, disk, **extra) -> None:
    kwargs = dict(onload_device=CPU, offload_device=CPU, offload_type=level, offload_to_disk_path=disk, **extra)
    if level == "block_level":
        kwargs["num_blocks_per_group"] = 1
    model.enable_group_offload(**kwargs)


@pytest.mark.parametrize("family", ["sana", "wan"])
@pytest.mark.parametrize("level", ["leaf_level", "block_level"])
@pytest.mark.parametrize("to_disk", [False, True], ids=["memory", "disk"])
@pytest.mark.parametrize("order", ["mhla_first", "offloading_first"])
def test_group_offloading_gives_the_output_without_it(family, level, to_disk, order, tmp_path):
    make, run, inputs, settings = FAMILIES[family]
    x = inputs(batch=1)
    plain = make(num_layers=2).eval()
    apply_mhla(plain, **settings)
    model = make(num_layers=2).eval()
    disk = str(tmp_path) if to_disk else None
    if order == "mhla_first":  # a trained state, then offloading
        _train_(plain)
        apply_mhla(model, **settings)
        model.load_state_dict(plain.state_dict())
        _offload(model, level, disk)
    else:  # the fresh MHLA of an offloaded model (disk offloading keeps the values its hooks first saw)
        _offload(model, level, disk)
        apply_mhla(model, **settings)
    want = run(plain, x)
    got = run(model, x)
    assert torch.isfinite(got).all() and _rel(got, want) < TOL, _rel(got, want)
    assert _rel(run(model, x), want) < TOL  # a second call: onloaded again


def _group_hook(module):
    registry = getattr(module, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook("group_offloading")


def test_mhla_made_after_group_offloading_follows_it(tmp_path):
    """Leaf level to disk, then MHLA: every MHLA part gets diffusers' hook, each layer in a folder of its own (the
    part names repeat across layers, and diffusers names its files by them)."""
    model = tiny_wan(num_layers=2).eval()
    _offload(model, "leaf_level", str(tmp_path))
    apply_mhla(model, normalize=False)
    folders = set()
    for block in model.blocks:
        layer = block.attn1.mhla
        hooks = [_group_hook(m) for m in (layer.mixing, layer.output_norm)]
        assert all(h is not None for h in hooks)
        folders |= {h.group.offload_to_disk_path for h in hooks}
    assert len(folders) == 2 and all(f.startswith(str(tmp_path)) for f in folders)


def test_mhla_made_before_group_offloading_gets_no_second_hook(tmp_path):
    """MHLA first: diffusers' own hooks cover it (leaf level: one per part; block level: the block's group)."""
    for level in ("leaf_level", "block_level"):
        model = tiny_wan(num_layers=2).eval()
        apply_mhla(model, normalize=False)
        _offload(model, level, None)
        layer = model.blocks[0].attn1.mhla
        assert (_group_hook(layer.mixing) is not None) == (level == "leaf_level")
        from mhla_diffusers.models.offload import follow_group_offloading

        assert follow_group_offloading(model, [("blocks.0.attn1", model.blocks[0].attn1)]) == []


@pytest.mark.parametrize("family", ["sana", "wan"])
def test_group_offloading_on_a_loaded_pipeline(family, tmp_path):
    """The common path: a converted pipeline loaded with load_mhla_pipeline, then its transformer's group offloading
    at leaf level to disk: the pipeline's output without offloading. (The transformer alone: the stock tiny Wan
    pipeline moves by 2% with all its components offloaded to disk, with or without MHLA. DiT: diffusers refuses
    group offloading for DiTTransformer2DModel.)"""
    make = {"sana": tiny_sana_pipeline, "wan": tiny_wan_pipeline}[family]
    pipe = make(num_layers=2)
    apply_mhla(pipe.transformer, **({"normalize": False} if family == "wan" else {}))
    with torch.no_grad():
        _train_(pipe.transformer)
    save_mhla_pipeline(pipe, tmp_path / "converted")

    def generate(p):
        p.set_progress_bar_config(disable=True)
        common = dict(num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
        if family == "sana":
            return torch.from_numpy(p("a cat", height=64, width=64, use_resolution_binning=False, **common).images)
        return torch.from_numpy(p("a cat", height=64, width=64, num_frames=5, **common).frames)

    want = generate(load_mhla_pipeline(tmp_path / "converted"))
    pipe = load_mhla_pipeline(tmp_path / "converted")
    pipe.transformer.enable_group_offload(onload_device=CPU, offload_device=CPU, offload_type="leaf_level",
                                          offload_to_disk_path=str(tmp_path / "offload"))
    got = generate(pipe)
    assert torch.isfinite(got).all() and _rel(got, want) < TOL, _rel(got, want)


def test_accelerate_cpu_offload_runs_mhla_from_its_modules():
    """accelerate's cpu_offload keeps every weight on the meta device and restores it around its module's forward:
    the MHLA parts too (before: the mixing matrix was read as a meta tensor)."""
    from accelerate import cpu_offload

    model = tiny_wan(num_layers=2).eval()
    apply_mhla(model, normalize=False, gate="neutral", lepe=True)
    _train_(model)
    x = wan_inputs(batch=1)
    want = run_wan(model, x)
    cpu_offload(model, execution_device=CPU)
    assert model.blocks[0].attn1.mhla.mixing.weight.is_meta
    got = run_wan(model, x)
    assert _rel(got, want) < TOL, _rel(got, want)


def test_layerwise_casting_keeps_mhla_parameters_float32():
    """diffusers' layerwise casting stores the stock Linear / Conv weights in a low precision: MHLA's own parameters
    stay float32, and the output is the model whose stock weights were rounded the same way."""
    model = tiny_dit(num_layers=2).eval()
    apply_mhla(model, lepe=True, gate="neutral")
    _train_(model)
    rounded = tiny_dit(num_layers=2).eval()
    apply_mhla(rounded, lepe=True, gate="neutral")
    rounded.load_state_dict(model.state_dict())
    model.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    mhla = [p for n, p in model.named_parameters() if ".mhla." in n]
    assert mhla and all(p.dtype == torch.float32 for p in mhla)
    cast = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert cast and not any(".mhla." in n for n in cast)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name in cast:
                p.copy_(p.to(torch.bfloat16).float())
    x = dit_inputs(batch=1)
    assert _rel(run_dit(model, x), run_dit(rounded, x)) < TOL
