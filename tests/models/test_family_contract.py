"""The contract every registered model family keeps, on its tiny model (tests/helpers_families.py):

* M = 1 MHLA is the stock self-attention where that is linear attention (SANA's
  ``SanaLinearAttnProcessor2_0``): the model output and every layer's, in fp32;
* with the diffusers one-liner on every attention module, cross-attention runs the family's stock
  processor on the same inputs, bit for bit, and the model equals ``apply_mhla``'s (self-attention only);
* the one-liner then :func:`~mhla_diffusers.materialize_mhla` is :func:`~mhla_diffusers.apply_mhla`:
  the same mixing matrices, the same output;
* ``save_mhla_transformer`` / ``load_mhla_transformer`` give back the same model, bit for bit;
* under context parallelism (ring, 2 and 3 CPU processes over gloo) the single-process output;
* the family modules import nothing that imports the families (no import cycle, function-level imports
  included), and every family has a tiny model here.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from helpers import CallCapture, no_grid_frames, randomize_mixing_, realign_
from helpers_families import TINY, install_one_liner

from mhla_diffusers import MHLAProcessor, apply_mhla, load_mhla_transformer, materialize_mhla, mhla_spec, save_mhla_transformer
from mhla_diffusers.families import FAMILIES, attention_modules, self_attention_modules

ROOT = Path(__file__).resolve().parents[2]
# M = 1 against the stock linear attention, fp32, relative to the largest output: measured <= 3e-7 on the
# tiny models (summation order only), bound well above it.
ONE_BLOCK_TOL = 1e-5
# context parallelism against one process (fp32, relative), as tests/models/test_context_parallel.py
CP_TOL = 1e-5

CASES = [pytest.param(f, v, id=f"{f}-{v}" if v else f) for f in FAMILIES for v in TINY[f].variants]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _mhla_state(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if "mhla" in k}


def test_every_family_has_a_tiny_model():
    assert sorted(TINY) == sorted(FAMILIES)


@pytest.mark.parametrize("name, variant", CASES)
def test_one_block_equals_stock_linear_attention(name, variant):
    """The one-liner with one block reproduces the stock model (every self-attention output and the model
    output) up to float summation order (SANA; with q/k norms over all heads, SANA-Sprint / 1.5, too)."""
    family, tiny = FAMILIES[name], TINY[name]
    if family.stock_attention != "linear":
        pytest.skip(f"the stock self-attention of {name} is softmax: MHLA with one block is not it")
    model = tiny.build(num_layers=3, **tiny.variants[variant])
    stock = copy.deepcopy(model)
    install_one_liner(model, MHLAProcessor(num_blocks=1))
    inputs = tiny.inputs(batch=2)
    with CallCapture(model, family.self_attention) as cap, no_grid_frames():
        out = tiny.run(model, inputs)
    ref = tiny.run(stock, inputs)
    assert _rel(out, ref) < ONE_BLOCK_TOL
    with torch.no_grad():
        for layer, attn in self_attention_modules(model, family):
            assert attn.mhla.mixing.block_grid == (1, 1, 1)
            ((args, kwargs, got),) = cap.calls[layer]  # the layer's own call (SANA-Video: with its rotary_emb)
            assert _rel(got, family.stock_self_processor()(attn, *args, **kwargs)) < ONE_BLOCK_TOL, layer


@pytest.mark.parametrize("name, variant", CASES)
def test_one_liner_cross_attention_is_stock_bit_identical(name, variant):
    """The one-liner puts MHLAProcessor on cross-attention too; there it runs the family's stock processor on
    the same inputs (the text mask included), bit for bit, and creates no mixing matrix; the whole model
    equals apply_mhla's (self-attention only)."""
    family, tiny = FAMILIES[name], TINY[name]
    if family.cross_attention is None:
        pytest.skip(f"{name} has no cross-attention")
    model = tiny.build(num_layers=3, **tiny.variants[variant])
    other = copy.deepcopy(model)
    proc = MHLAProcessor(block_grid=tiny.block_grid)
    install_one_liner(model, proc)
    modules = attention_modules(model)
    assert len(modules) == 2 * tiny.self_layers and all(a.processor is proc for a in modules.values())
    apply_mhla(other, block_grid=tiny.block_grid)
    inputs = tiny.inputs(batch=2)
    with CallCapture(model, family.cross_attention) as cap:
        out = tiny.run(model, inputs)
    assert len(cap.modules) == tiny.self_layers and torch.equal(out, tiny.run(other, inputs))
    with torch.no_grad():
        for layer, attn in cap.modules.items():
            ((args, kwargs, got),) = cap.calls[layer]
            if tiny.cross_mask:
                assert kwargs.get("attention_mask", args[2] if len(args) > 2 else None) is not None, layer
            attn.set_processor(family.make_stock_cross_processor())  # the module as diffusers builds it
            try:
                want = attn(*args, **kwargs)
            finally:
                attn.set_processor(proc)
            assert torch.equal(got, want), layer
            assert getattr(attn, "mhla", None) is None, layer


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_liner_then_materialize_equals_apply_mhla(name):
    """``set_attn_processor(MHLAProcessor())`` then ``materialize_mhla``: the mixing matrices apply_mhla creates
    (locality init on the same grid), the same output."""
    tiny = TINY[name]
    model = tiny.build(num_layers=3)
    other = copy.deepcopy(model)
    install_one_liner(model, MHLAProcessor(block_grid=tiny.block_grid))
    materialize_mhla(model)
    names = apply_mhla(other, block_grid=tiny.block_grid)
    got, want = _mhla_state(model), _mhla_state(other)
    assert sorted(got) == sorted(want) == sorted(f"{n}.mhla.mixing.weight" for n in names) and len(names) == tiny.self_layers
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert mhla_spec(model) == mhla_spec(other)
    inputs = tiny.inputs(batch=2)
    assert torch.equal(tiny.run(model, inputs), tiny.run(other, inputs))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_load_round_trip(name, tmp_path):
    """A hybrid with trained (random) mixing matrices written by save_mhla_transformer and read back by
    load_mhla_transformer: the same settings, matrices and output, bit for bit."""
    tiny = TINY[name]
    model = tiny.build(num_layers=3)
    apply_mhla(model, layers=[0, 2], block_grid=tiny.block_grid)
    randomize_mixing_(model)
    save_mhla_transformer(model, tmp_path / "transformer")
    loaded = load_mhla_transformer(tmp_path / "transformer")
    assert type(loaded) is type(model) and mhla_spec(loaded) == mhla_spec(model)
    got, want = _mhla_state(loaded), _mhla_state(model)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    inputs = tiny.inputs(batch=2)
    assert torch.equal(tiny.run(realign_(loaded), inputs), tiny.run(realign_(model), inputs))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_context_parallel_equals_one_process(name, results):
    """MHLA on every layer, ring mode over 2 and 3 processes: the single-process output (context_parallel_check.py,
    case_contract_<family>)."""
    if FAMILIES[name].context_parallel is None:
        pytest.skip(f"{name} has no context-parallel plan")
    world, all_results = results
    case = all_results[f"case_contract_{name}"]
    assert "exception" not in case, f"P={world}: {case.get('exception')}"
    assert case["output"] < CP_TOL, case["output"]
    assert any(e["direction"] == "forward" for e in case["exchanges"])  # the ranks did exchange summaries


# -- the import graph ------------------------------------------------------------------------------
def _module_file(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(name: str) -> set[str]:
    """The ``mhla_diffusers`` modules module ``name`` imports anywhere (function level included, TYPE_CHECKING
    blocks excluded), and the packages above each."""
    tree = ast.parse(_module_file(name).read_text())
    package = name if _module_file(name).name == "__init__.py" else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i]))}
    return {m for m in found if m.startswith("mhla_diffusers")}


def test_family_modules_import_nothing_that_imports_the_families():
    """families/* -> (their imports, transitively) never reaches a module importing mhla_diffusers.families
    (or the models.families shim): no import cycle through the family modules (the package-wide rules:
    tests/test_layering.py)."""
    start = ["mhla_diffusers.families.base"] + [f"mhla_diffusers.families.{n}" for n in FAMILIES]
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += sorted(_imports(module) - seen)
    outside = sorted(m for m in seen if not m.startswith("mhla_diffusers.families") and m != "mhla_diffusers")
    cyclic = [m for m in outside if any(i.startswith(("mhla_diffusers.families", "mhla_diffusers.models.families")) for i in _imports(m))]
    assert not cyclic, (outside, cyclic)
