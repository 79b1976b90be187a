"""The backend registry (``mhla_diffusers/ops/backends.py``): a backend registered from outside the
package is reached by every path that takes ``backend=``: ``mhla_attention`` eagerly and under
``torch.compile`` (the custom operator, one graph), ``MHLAProcessor`` in a tiny DiT, and a
save / load round trip of a converted checkpoint. Unknown and unavailable names are refused."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from helpers import dit_inputs, run_dit, self_attn, tiny_dit

import mhla_diffusers
from mhla_diffusers import BlockLayout, InterleavedRotary, MHLAProcessor, mhla_attention
from mhla_diffusers.ops import backends
from mhla_diffusers.ops.torch_ops import mhla_attention_torch


class CountingBackend(backends.Backend):
    """The torch backend under another name, counting its calls."""

    def __init__(self, name="fake", available=True, auto=False):
        self.name, self.available, self.auto, self.calls = name, available, auto, []

    def is_available(self) -> bool:
        return self.available

    def preferred_for_auto(self, device) -> bool:
        return self.auto

    def forward(self, q, k, v, mixing, layout, **kwargs):
        self.calls.append(dict(kwargs, compiling=torch.compiler.is_compiling(), grad=torch.is_grad_enabled()))
        return mhla_attention_torch(q, k, v, mixing, layout, **kwargs)


@pytest.fixture
def fake():
    backend = backends.register_backend(CountingBackend())
    dynamo.reset()
    yield backend
    dynamo.reset()
    backends.unregister_backend("fake")


def _inputs(dtype=torch.float32):
    layout = BlockLayout((3, 5, 7), (2, 2, 3))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, layout.num_tokens, 3, 8, generator=gen, dtype=dtype).transpose(1, 2) for _ in range(3))
    return q, k, v, torch.rand(layout.num_blocks, layout.num_blocks, generator=gen, dtype=dtype), layout


def _rotary(n, d):
    angles = torch.rand(n, d // 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 * math.pi
    return InterleavedRotary(angles.cos(), angles.sin())


def test_registered_backend_is_listed_and_resolved(fake):
    assert "fake" in mhla_diffusers.available_backends() and "fake" in backends.registered_backends()
    assert backends.get_backend("fake") is fake
    assert backends.resolve_backend("fake", torch.device("cpu")) == "fake"
    assert backends.resolve_backend("auto", torch.device("cpu")) == "torch"  # it does not ask for "auto"
    fake.auto = True
    assert backends.resolve_backend("auto", torch.device("cpu")) == "fake"


def test_eager_calls_go_to_the_registered_backend(fake):
    q, k, v, mixing, layout = _inputs()
    out = mhla_attention(q, k, v, mixing, layout, backend="fake")
    assert len(fake.calls) == 1 and not fake.calls[0]["compiling"]
    assert torch.equal(out, mhla_attention(q, k, v, mixing, layout, backend="torch"))
    # it fuses no rotary: mhla_attention composes it (numerator and denominator: two calls, no rotary= passed)
    rot = _rotary(layout.num_tokens, 8)
    out = mhla_attention(q, k, v, mixing, layout, backend="fake", rotary=rot)
    assert len(fake.calls) == 3 and all("rotary" not in c for c in fake.calls)
    assert torch.equal(out, mhla_attention(q, k, v, mixing, layout, backend="torch", rotary=rot))


def test_compiled_calls_go_to_the_registered_backend_in_one_graph(fake):
    """fullgraph=True (a graph break would raise): the custom operator runs the fake backend, forward
    and backward (which re-runs the forward), and computes what eager mode computes."""
    q, k, v, mixing, layout = _inputs()

    def f(q, k, v, mixing):
        return mhla_attention(q, k, v, mixing, layout, backend="fake") * 2.0

    ex = dynamo.explain(f)(q, k, v, mixing)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    g = torch.randn(2, 3, layout.num_tokens, 8)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        fake.calls.clear()
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mixing)]
        out = fn(*leaves)
        results.append((out, torch.autograd.grad(out, leaves, g), list(fake.calls)))
    (out_e, grads_e, calls_e), (out_c, grads_c, calls_c) = results
    assert len(calls_e) == 1
    assert len(calls_c) == 2 and calls_c[0]["grad"] is False  # the operator's forward, then its backward's re-run
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_processor_in_a_tiny_model_and_checkpoint_round_trip(fake, tmp_path):
    model = tiny_dit(num_layers=2)
    reference = copy.deepcopy(model)
    mhla_diffusers.apply_mhla(model, layers="all", backend="fake")
    mhla_diffusers.apply_mhla(reference, layers="all", backend="torch")
    assert all(isinstance(a.processor, MHLAProcessor) and a.processor.backend == "fake" for a in self_attn(model))
    inputs = dit_inputs()
    out = run_dit(model, inputs)
    assert len(fake.calls) == 2
    assert torch.equal(out, run_dit(reference, inputs))

    mhla_diffusers.save_mhla_transformer(model, tmp_path / "transformer")
    assert mhla_diffusers.read_mhla_config(tmp_path / "transformer")["backend"] == "fake"
    loaded = mhla_diffusers.load_mhla_transformer(tmp_path / "transformer")
    assert [a.processor.backend for a in self_attn(loaded)] == ["fake", "fake"]
    fake.calls.clear()
    loaded_out = run_dit(loaded, inputs)
    assert len(fake.calls) == 2
    torch.testing.assert_close(loaded_out, out, rtol=1e-6, atol=1e-6)  # memory-mapped weights: ~1 ulp (test_checkpoint.py)

    # the same checkpoint where the backend is not installed: loaded with "auto", and a warning
    fake.available = False
    with pytest.warns(UserWarning, match="MHLA backend 'fake', which is not available here"):
        loaded = mhla_diffusers.load_mhla_transformer(tmp_path / "transformer")
    assert [a.processor.backend for a in self_attn(loaded)] == ["auto", "auto"]


def test_unknown_name_is_refused():
    q, k, v, mixing, layout = _inputs()
    with pytest.raises(ValueError, match=r"unknown MHLA backend 'nope'; choose one of \['auto', 'torch'"):
        mhla_attention(q, k, v, mixing, layout, backend="nope")
    with pytest.raises(ValueError, match="unknown MHLA backend 'nope'"):
        backends.get_backend("nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        MHLAProcessor(backend="nope")


def test_registered_but_unavailable_backend_is_refused():
    backends.register_backend(CountingBackend("offline", available=False))
    try:
        assert "offline" not in backends.available_backends() and "offline" in backends.registered_backends()
        q, k, v, mixing, layout = _inputs()
        with pytest.raises(ValueError, match="MHLA backend 'offline' is not usable here: it is not available"):
            mhla_attention(q, k, v, mixing, layout, backend="offline")
        with pytest.raises(ValueError, match="unknown backend 'offline'"):
            MHLAProcessor(backend="offline")
    finally:
        backends.unregister_backend("offline")


def test_registration_is_checked():
    with pytest.raises(TypeError, match="Backend"):
        backends.register_backend(mhla_attention_torch)
    with pytest.raises(ValueError, match="registered already"):
        backends.register_backend(CountingBackend("torch"))
    for name in ("auto", "", None):
        with pytest.raises(ValueError, match="a backend needs a name"):
            backends.register_backend(CountingBackend(name))
    with pytest.raises(ValueError, match="cannot be unregistered"):
        backends.unregister_backend("torch")
    with pytest.raises(ValueError, match="unknown MHLA backend"):
        backends.unregister_backend("nope")


def test_deprecated_backends_dict_still_works():
    """The former ``BACKENDS`` dict: a live mapping name -> forward function; a new entry registers a backend."""
    with pytest.warns(DeprecationWarning, match="BACKENDS is deprecated"):
        table = backends.BACKENDS
    assert set(table) == set(backends.registered_backends())
    q, k, v, mixing, layout = _inputs()
    expected = mhla_attention_torch(q, k, v, mixing, layout, normalize=True, eps=1e-6, feature_map=True)
    assert torch.equal(table["torch"](q, k, v, mixing, layout, normalize=True, eps=1e-6, feature_map=True), expected)
    calls = []
    table["legacy"] = lambda *a, **kw: calls.append(kw) or mhla_attention_torch(*a, **kw)
    try:
        assert "legacy" in mhla_diffusers.available_backends()
        assert torch.equal(mhla_attention(q, k, v, mixing, layout, backend="legacy"), expected) and len(calls) == 1
    finally:
        del table["legacy"]
    assert "legacy" not in backends.registered_backends()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from mhla_diffusers.ops.backends import get_backend  # noqa: F401  (the new API warns nothing)
