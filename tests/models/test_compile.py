"""torch.compile: MHLA layers trace into one graph (no graph break) and compute what eager mode computes.

While ``torch.compile`` traces, ``mhla_attention`` calls the ``mhla_diffusers::attention`` custom
operator (``mhla_diffusers/ops/compiled.py``) instead of the backend's autograd Function (which
is ``torch.compiler.disable``d: one graph break per layer). Checked here:
- ``torch.library.opcheck`` on both operators (schema, fake tensors, autograd registration, AOT dispatch);
- the operator in a ``fullgraph=True`` compiled function (aot_eager and inductor) against eager,
  outputs and gradients, in diffusers' ``[B, N, H, d]`` memory layout, with the RoPE variant;
- whole DiT / SANA / Wan transformers with MHLA: ``torch._dynamo.explain`` finds 1 graph and 0
  breaks; compiled outputs equal eager; a compiled DiT training step gives eager's gradients;
- a second call of the same shape never recompiles (in a fresh interpreter: compile_recompile_check.py);
- a model without MHLA (stock, or after ``remove_mhla``) carries nothing of ours and compiles with
  ``fullgraph=True``, also in a process where MHLA's process-wide pre-hook is registered.
The Triton kernels under compile (fused RoPE included) are checked in the interpreter subprocess
(``tests/ops/triton_interpret_check.py``'s extra checks).
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
from helpers import dit_inputs, tiny_dit
from helpers_wan import tiny_wan, wan_inputs

import mhla_diffusers
from mhla_diffusers import BlockLayout, InterleavedRotary, MHLAProcessor, mhla_attention
from mhla_diffusers.ops import compiled


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _inputs(dtype=torch.float64, grid=(3, 5, 7), block_grid=(2, 2, 3), heads=3, d=8, batch=2, seed=0):
    layout = BlockLayout(grid, block_grid)
    gen = torch.Generator().manual_seed(seed)
    # diffusers' memory layout: [B, N, H, d] viewed as [B, H, N, d]
    q, k, v = (torch.randn(batch, layout.num_tokens, heads, d, generator=gen, dtype=dtype).transpose(1, 2) for _ in range(3))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, generator=gen, dtype=dtype)
    return q, k, v, mixing, layout


def _rotary(n, d, seed=1):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return InterleavedRotary(angles.cos(), angles.sin())


def test_opcheck_forward_and_backward_operators():
    """Schema, fake tensors, autograd registration and AOT dispatch of both operators (torch backend;
    the Triton backend with fused rotary tables: tests/ops/triton_interpret_check.py's extra checks)."""
    q, k, v, mixing, layout = _inputs()
    for t in (q, k, v, mixing):
        t.requires_grad_(True)
    args = (q, k, v, mixing, list(layout.grid), list(layout.block_grid), True, 1e-6, True, "torch", None, None)
    torch.library.opcheck(compiled._attention_op, args)
    g = torch.randn(2, 3, layout.num_tokens, 8, dtype=torch.float64)
    back = (g, *[t.detach() for t in (q, k, v, mixing)], *args[4:], [True, False, True, True])
    torch.library.opcheck(compiled._attention_backward_op, back)
    r = _rotary(layout.num_tokens, 8)
    with pytest.raises(ValueError, match="fused by the 'triton' backend only"):
        compiled._attention_op(*args[:10], r.cos, r.sin)


@pytest.mark.parametrize(
    "backend,variant",
    [("aot_eager", v) for v in ("plain", "nonorm-nofm", "rotary-callable", "rotary-tables")] + [("inductor", "rotary-tables")],
)
def test_compiled_operator_matches_eager(backend, variant):
    """fullgraph=True (a graph break would raise): outputs and gradients of q, k, v, mixing equal eager's
    (inductor for one variant: each compile costs seconds on this CPU)."""
    q, k, v, mixing, layout = _inputs(dtype=torch.float32)
    kw = dict(normalize=variant != "nonorm-nofm", feature_map=None if variant == "nonorm-nofm" else "relu")
    if variant == "nonorm-nofm":
        q, k = q.abs(), k.abs()
    if variant == "rotary-tables":
        kw["rotary"] = _rotary(layout.num_tokens, 8)
    elif variant == "rotary-callable":
        table = _rotary(layout.num_tokens, 8)
        kw["rotary"] = lambda x: torch.stack(
            (x[..., 0::2] * table.cos - x[..., 1::2] * table.sin, x[..., 0::2] * table.sin + x[..., 1::2] * table.cos), -1
        ).flatten(-2).to(x.dtype)

    def f(q, k, v, mixing):
        return mhla_attention(q, k, v, mixing, layout, **kw) * 2.0

    g = torch.randn(2, 3, layout.num_tokens, 8)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend=backend)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, g)
        results.append((out, grads))
    (out_e, grads_e), (out_c, grads_c) = results
    assert out_c.shape == out_e.shape and out_c.dtype == out_e.dtype
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e):  # inductor fuses the backward's reductions its own way: fp32 at 1e-4
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_compiled_operator_keeps_diffusers_layout_and_no_grad():
    """Inference (no grad) through the operator: the output strides are the ones its fake promised."""
    q, k, v, mixing, layout = _inputs(dtype=torch.float32)
    f = torch.compile(lambda q, k, v, m: mhla_attention(q, k, v, m, layout).transpose(1, 2).reshape(2, -1, 24),
                      fullgraph=True, backend="inductor")
    with torch.no_grad():
        out = f(q, k, v, mixing)
    expected = mhla_attention(q, k, v, mixing, layout).transpose(1, 2).reshape(2, -1, 24)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _explain(fn, *args, **kwargs):
    with torch.no_grad():
        return dynamo.explain(fn)(*args, **kwargs)


def test_dit_with_mhla_compiles_to_one_graph():
    model = tiny_dit(num_layers=2)
    mhla_diffusers.apply_mhla(model, layers="all")
    latent, t, y = dit_inputs()
    ex = _explain(lambda a, b, c: model(a, timestep=b, class_labels=c).sample, latent, t, y)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]


def test_wan_one_liner_compiles_to_one_graph_and_matches_eager():
    """Wan (positional processor call, RoPE, empty blocks dropped at this small size): 1 graph, output == eager."""
    model = tiny_wan(num_layers=2)
    model.set_attn_processor(MHLAProcessor())
    inputs = wan_inputs()
    with torch.no_grad():
        expected = model(**inputs).sample
    ex = _explain(lambda **kw: model(**kw).sample, **inputs)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    model.compile(backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = model(**inputs).sample
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sana_with_mhla_compiles_to_one_graph():
    from helpers_sana import sana_inputs, tiny_sana

    model = tiny_sana()
    mhla_diffusers.apply_mhla(model, layers="hybrid")
    latent, text, timestep, mask = sana_inputs()
    ex = _explain(lambda a, b, c, d: model(a, encoder_hidden_states=b, timestep=c, encoder_attention_mask=d).sample,
                  latent, text, timestep, mask)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]


def test_compiled_dit_training_step_matches_eager():
    """module.compile() (inductor): loss and every gradient (mixing matrices included) equal eager's."""
    model = tiny_dit(num_layers=2)
    mhla_diffusers.apply_mhla(model, layers="hybrid")
    other = copy.deepcopy(model)
    other.compile()
    latent, t, y = dit_inputs()
    losses = []
    for m in (model, other):
        loss = m(latent, timestep=t, class_labels=y).sample.square().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
    named = dict(other.named_parameters())
    mixing_seen = 0
    for name, p in model.named_parameters():
        q = named[name]  # module.compile() compiles in place: same names
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
        mixing_seen += "mhla.mixing" in name and p.grad.abs().max() > 0
    assert mixing_seen == 1  # the hybrid's one MHLA layer of two got a mixing gradient


def test_backend_resolution_traces_without_a_break(monkeypatch):
    """On a GPU, "auto" / "triton" check the Triton driver: under torch.compile that check runs while
    tracing (it cannot be traced: Triton's driver probing is marked untraceable), never splitting the graph."""
    from mhla_diffusers import ops

    monkeypatch.setenv("MHLA_AUTO_TRITON", "1")

    def f(x):
        return x + (1.0 if ops.resolve_backend("auto", torch.device("cuda")) == "torch" else 2.0)

    # no CUDA driver here: "auto" falls back to torch, decided at trace time, in one graph
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2)), torch.ones(2))


@pytest.mark.parametrize("family", ["sana", "wan"])
def test_bare_one_liner_compiled_before_any_eager_forward(family):
    """The one-liner creates its parameters (and the stock cross-attention processors) at the first
    forward: when that forward is compiled they are built eagerly (a break on that call only); the
    outputs equal an eager twin's, on the first and the next call."""
    if family == "sana":
        from helpers_sana import sana_inputs, tiny_sana

        model = tiny_sana(num_layers=2, sample_size=8)
        latent, text, timestep, mask = sana_inputs(size=8)

        def call(m):
            return m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
    else:
        model = tiny_wan(num_layers=2)
        inputs = wan_inputs()

        def call(m):
            return m(**inputs).sample
    model.set_attn_processor(MHLAProcessor())
    twin = copy.deepcopy(model)
    model.compile(backend="aot_eager")
    with torch.no_grad():
        expected = call(twin)
        first, second = call(model), call(model)
    assert len(mhla_diffusers.mixing_parameters(model)) == 2
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_compiled_model_follows_the_latent_grid_across_resolutions(dynamic):
    """Several latent sizes in sequence (a size seen before included), compiled with and without dynamic
    shapes: every output equals eager's on that size, i.e. the block layout is the current latent's."""
    model = tiny_dit(num_layers=2, sample_size=16)
    mhla_diffusers.apply_mhla(model, layers="all", num_blocks=4)
    twin = copy.deepcopy(model)
    model.compile(backend="aot_eager", dynamic=dynamic)
    for size in (16, 8, 24, 16):
        latent, t, y = dit_inputs(size=size)
        with torch.no_grad():
            got = model(latent, timestep=t, class_labels=y).sample
            want = twin(latent, timestep=t, class_labels=y).sample
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"size {size}")


def test_gradient_checkpointing_under_compile_is_one_graph_and_matches_eager():
    """Checkpointed blocks under torch.compile: no graph break (the recomputation is part of the compiled
    graph, with the forward's grid), gradients equal the eager un-checkpointed model's."""
    from helpers_sana import sana_inputs, tiny_sana

    model = tiny_sana(num_layers=2, sample_size=8).train()
    mhla_diffusers.apply_mhla(model, layers="all", num_blocks=4)
    twin = copy.deepcopy(model)
    model.enable_gradient_checkpointing()
    latent, text, timestep, mask = sana_inputs(size=(8, 4))

    def loss(m):
        return m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample.square().mean()

    ex = dynamo.explain(lambda: loss(model))()
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager")
    compiled(model).backward()
    loss(twin).backward()
    named = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_model_ignores_other_mhla_models_coming_and_going():
    """Another MHLA model created, run and garbage-collected next to a compiled one (a teacher, an EMA
    copy, a reloaded pipeline) neither recompiles it nor breaks its tracing."""
    import gc

    from torch._dynamo.utils import counters

    model = tiny_dit(num_layers=2)
    mhla_diffusers.apply_mhla(model, layers="all", num_blocks=4)
    model.compile(backend="eager")
    latent, t, y = dit_inputs(size=8)

    def run(m):
        with torch.no_grad():
            return m(latent, timestep=t, class_labels=y).sample

    counters.clear()
    run(model), run(model)
    assert counters["stats"]["unique_graphs"] == 1
    other = tiny_dit(num_layers=1)
    mhla_diffusers.apply_mhla(other)
    run(other)
    run(model)
    del other
    gc.collect()
    run(model)
    assert counters["stats"]["unique_graphs"] == 1


def test_bare_one_liner_materialized_before_compile_is_one_graph():
    """The README's recipe: materialize_mhla before .compile() -> the bare one-liner traces to one graph."""
    model = tiny_wan(num_layers=2)
    model.set_attn_processor(MHLAProcessor())
    assert mhla_diffusers.materialize_mhla(model)
    ex = _explain(lambda **kw: model(**kw).sample, **wan_inputs())
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]


# every family and every mode (a case costs ~3 s of tracing): all, hybrid, the one-liner + materialize_mhla,
# all + gradient checkpointing enabled afterwards (training)
RECOMPILE_CASES = ["dit:hybrid", "dit:materialized", "sana:all", "sana:checkpointed", "wan:all", "wan:hybrid", "wan:materialized"]


def test_second_call_of_the_same_shape_never_recompiles_in_a_fresh_process():
    """diffusers' test_torch_compile_recompilation_and_graph_break: compile (fullgraph), call twice with
    the same input under error_on_recompile. In a fresh interpreter (each case in a fresh thread), where
    no state MHLA creates on first use exists yet; with gradient checkpointing enabled after MHLA too."""
    cases = RECOMPILE_CASES
    script = Path(__file__).with_name("compile_recompile_check.py")
    proc = subprocess.run([sys.executable, str(script), *cases], capture_output=True, text=True, timeout=600)
    report = {line.split(" ")[0]: line for line in proc.stdout.splitlines() if line.split(" ")[0] in cases}
    bad = [report.get(case, f"{case}: no result") for case in cases if report.get(case) != f"{case} ok"]
    assert proc.returncode == 0 and not bad, "\n".join(bad) + "\n" + proc.stderr[-3000:]


def _assert_untouched(model, checkpointing_func) -> None:
    """Nothing of MHLA's on ``model``: no hook of any kind on any module (tiny stock models have none of
    their own), no MHLA attribute or submodule, the checkpointing function the very object diffusers set."""
    from mhla_diffusers.models.grid import has_grid_hooks

    assert not has_grid_hooks(model)
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called", "_backward_hooks",
             "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
             "_load_state_dict_post_hooks")
    for name, module in model.named_modules():
        hooks = {kind: getattr(module, kind) for kind in kinds if getattr(module, kind)}
        assert not hooks, f"{name or 'model'} has hooks {hooks}"
        assert not [key for key in vars(module) if "mhla" in key], name
        assert not [key for key in module._modules if key == "mhla"], name
    assert model._gradient_checkpointing_func is checkpointing_func


@pytest.mark.parametrize("history", ["stock", "one-liner-removed"])
def test_model_without_mhla_is_untouched_and_compiles_fullgraph(history):
    """MHLA's process-wide pre-hook (registered by any MHLAProcessor) never touches a model with no
    MHLAProcessor: a stock Wan, or one that ran the bare one-liner (hooked by that pre-hook, checkpointing
    wrapped) and then remove_mhla. Eager forwards with gradient checkpointing leave nothing behind, and
    torch.compile(fullgraph=True) traces it as stock, without a recompile on the second call."""
    MHLAProcessor()  # registers the process-wide pre-hook
    model = tiny_wan(num_layers=2).train()
    model.enable_gradient_checkpointing()
    func = model._gradient_checkpointing_func
    inputs = wan_inputs()
    if history == "one-liner-removed":
        model.set_attn_processor(MHLAProcessor())
        model(**inputs).sample.square().mean().backward()  # hooked at the first forward, checkpointing wrapped
        from mhla_diffusers.models.grid import has_grid_hooks

        assert has_grid_hooks(model) and model._gradient_checkpointing_func is not func
        assert mhla_diffusers.remove_mhla(model)  # self- and cross-attention processors put back
    model(**inputs).sample.square().mean().backward()
    _assert_untouched(model, func)
    model.eval()
    with torch.no_grad():
        expected = model(**inputs).sample
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), dynamo.config.patch(error_on_recompile=True):
        first, second = compiled(**inputs).sample, compiled(**inputs).sample
    torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second, expected, rtol=1e-6, atol=1e-6)
    _assert_untouched(model, func)


def test_torch_export_of_wan_with_mhla_matches_eager():
    """torch.export (non-strict, as diffusers' test_compile_works_with_aot) runs the hooks and the forward
    on different clones of the model: the grid still reaches MHLA; the exported program computes eager's output."""
    model = tiny_wan(num_layers=2)
    mhla_diffusers.apply_mhla(model, layers="all")
    inputs = wan_inputs(batch=1)
    with torch.no_grad():
        expected = model(**inputs).sample
        exported = torch.export.export(model, args=(), kwargs=inputs)
        out = exported.module()(**inputs).sample
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
