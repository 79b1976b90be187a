"""Installing and removing MHLA on DiT: apply_mhla / remove_mhla, set_attn_processor for a model that
lacks the method (CASES C12), the bare one-liner through the process-wide hook, gradient checkpointing,
errors, mhla_spec."""

from __future__ import annotations

import pytest
import torch
from helpers import AttnCapture, dit_inputs, no_grid_frames, randomize_mixing_, run_dit, self_attn, stock_copy, tiny_dit

from mhla_diffusers import (
    MHLAProcessor,
    apply_mhla,
    attention_modules,
    is_mhla_model,
    mhla_spec,
    mixing_parameters,
    remove_mhla,
    set_attn_processor,
)
from mhla_diffusers.models import grid as grid_module


def _mhla_keys(model):
    return sorted(k for k in model.state_dict() if "mhla" in k)


def test_dit_lacks_set_attn_processor():
    # the premise of our helper (FACTS 2): if diffusers adds the method, the tests below still hold
    model = tiny_dit(num_layers=1)
    assert not hasattr(model, "set_attn_processor")
    assert sorted(attention_modules(model)) == ["transformer_blocks.0.attn1.processor"]


def test_set_attn_processor_single_matches_apply_mhla():
    model = tiny_dit(num_layers=3)
    other = stock_copy(model)
    set_attn_processor(model, MHLAProcessor(num_blocks=4))
    assert all(isinstance(a.processor, MHLAProcessor) for a in self_attn(model))
    assert _mhla_keys(model) == [f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in range(3)]  # eager
    assert grid_module.has_grid_hooks(model)
    apply_mhla(other, num_blocks=4)
    inputs = dit_inputs(batch=2)
    assert torch.equal(run_dit(model, inputs), run_dit(other, inputs))


def test_set_attn_processor_partial_dict_keeps_stock_layers():
    """C12: a dict for 2/3 of the layers, no count error; the other layers keep their stock processor."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = tiny_dit(num_layers=6)
    stock = stock_copy(model)
    mhla_layers = [1, 2, 4, 5]
    proc = MHLAProcessor(num_blocks=4)
    set_attn_processor(model, {f"transformer_blocks.{i}.attn1.processor": proc for i in mhla_layers})
    assert _mhla_keys(model) == [f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in mhla_layers]
    inputs = dit_inputs(batch=2)
    with AttnCapture(model) as cap:
        run_dit(model, inputs)
    with torch.no_grad():
        for i, (attn, stock_attn) in enumerate(zip(self_attn(model), self_attn(stock))):
            name = f"transformer_blocks.{i}.attn1"
            same = torch.equal(cap.outputs[name][0], stock_attn(cap.inputs[name][0]))
            if i in mhla_layers:
                assert attn.processor is proc and not same, name
            else:
                assert type(attn.processor) is AttnProcessor2_0 and same, name

    with pytest.raises(ValueError, match="no attention layer named"):
        set_attn_processor(model, {"transformer_blocks.9.attn1.processor": proc})
    with pytest.raises(ValueError, match="no attention layer named"):
        set_attn_processor(model, {"transformer_blocks.0.attn1": proc})  # missing ".processor"


def test_remove_mhla_restores_stock_bitwise():
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = tiny_dit(num_layers=4)
    stock = stock_copy(model)
    inputs = dit_inputs(batch=2)
    expected = run_dit(stock, inputs)
    apply_mhla(model, layers="all", num_blocks=4)
    randomize_mixing_(model)
    assert not torch.allclose(run_dit(model, inputs), expected, atol=1e-3)
    removed = remove_mhla(model)
    assert removed == [f"transformer_blocks.{i}.attn1" for i in range(4)]
    assert all(type(a.processor) is AttnProcessor2_0 for a in self_attn(model))
    assert _mhla_keys(model) == [] and mixing_parameters(model) == []
    assert not is_mhla_model(model) and mhla_spec(model) is None
    assert not grid_module.has_grid_hooks(model)
    assert all(getattr(a, "mhla", None) is None for a in self_attn(model))  # and the grids it saw with it
    assert torch.equal(run_dit(model, inputs), expected)
    assert remove_mhla(model) == []  # idempotent
    # and MHLA can be installed again afterwards
    apply_mhla(model, layers=[0], num_blocks=4)
    assert _mhla_keys(model) == ["transformer_blocks.0.attn1.mhla.mixing.weight"]


def test_apply_twice_raises_clearly():
    model = tiny_dit(num_layers=3)
    apply_mhla(model, layers="hybrid", num_blocks=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for layers in ("hybrid", "all", [2]):
        with pytest.raises(ValueError, match=r"already installed.*remove_mhla"):
            apply_mhla(model, layers=layers, num_blocks=4)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layers="some"), "all"),
        (dict(layers=[4]), "out of range"),
        (dict(layers=[0, 0]), "twice"),
        (dict(block_grid=(5, 5)), r"does not fit.*\(1, 4, 4\)"),  # native token grid is 4 x 4
        (dict(block_grid=(1, 8)), "does not fit"),
        (dict(num_blocks=0), "positive integer"),
        (dict(num_blocks=4, block_grid=(3, 3)), "contradicts"),
        (dict(backend="cuda-magic"), "backend"),
        (dict(init="random"), "init"),
    ],
)
def test_apply_bad_arguments_raise_and_leave_model_untouched(kwargs, match):
    model = tiny_dit(num_layers=4)
    inputs = dit_inputs(batch=1)
    expected = run_dit(model, inputs)
    with pytest.raises(ValueError, match=match):
        apply_mhla(model, **kwargs)
    assert _mhla_keys(model) == [] and not is_mhla_model(model)
    assert not any(isinstance(a.processor, MHLAProcessor) for a in self_attn(model))
    assert torch.equal(run_dit(model, inputs), expected)


def test_apply_on_unsupported_model_raises():
    with pytest.raises(ValueError, match="not a supported transformer"):
        apply_mhla(torch.nn.Linear(4, 4))
    from helpers import tiny_dit_pipeline

    pipe = tiny_dit_pipeline(num_layers=1)
    with pytest.raises((ValueError, TypeError), match="pipe.transformer"):
        apply_mhla(pipe)


def test_resolution_with_fewer_tokens_than_blocks_uses_the_occupied_blocks():
    """A latent with fewer tokens than blocks on an axis (2 x 2 tokens, 4 x 4 blocks): MHLA on the blocks that
    hold tokens, with their rows / columns of the mixing matrix: exactly the dense formula on the full
    block grid (DESIGN.md's token -> block map; empty blocks contribute nothing)."""
    from mhla_diffusers import BlockLayout
    from mhla_diffusers.ops import mhla_attention_reference

    model = tiny_dit(num_layers=1, sample_size=8)
    apply_mhla(model, block_grid=(4, 4))  # 16 blocks on the native 4 x 4 tokens
    randomize_mixing_(model, low=0.05, high=0.95)
    with AttnCapture(model) as cap, no_grid_frames():
        out = run_dit(model, dit_inputs(batch=1, size=4))  # 2 x 2 tokens
    assert out.shape == (1, 4, 4, 4) and torch.isfinite(out).all()
    attn = self_attn(model)[0]
    (hidden,), (got,) = cap.inputs["transformer_blocks.0.attn1"], cap.outputs["transformer_blocks.0.attn1"]
    with torch.no_grad():
        q, k, v = (t.view(1, 4, attn.heads, -1).transpose(1, 2).double() for t in (attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)))
        # token (h, w) of the 2 x 2 grid is alone in block (2h, 2w) of the 4 x 4 block grid (h * 4 // 2 = 2h):
        # block ids 0, 2, 8, 10; the others are empty
        ids = torch.tensor([0, 2, 8, 10])
        mixing = attn.mhla.mixing.weight.clamp(0, 1).double()[ids][:, ids]
        want = mhla_attention_reference(q, k, v, mixing, BlockLayout((2, 2), (2, 2)), dtype=torch.float64)
        want = attn.to_out[0](want.float().transpose(1, 2).reshape(1, 4, -1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mhla_spec_contents():
    model = tiny_dit(num_layers=6)
    assert mhla_spec(model) is None
    apply_mhla(model, layers="hybrid", num_blocks=4, eps=1e-5, normalize=False)
    assert mhla_spec(model) == {
        "family": "dit",
        "model_class": "DiTTransformer2DModel",
        "num_layers": 6,
        "layers": [1, 2, 4, 5],
        "block_grid": [1, 2, 2],
        "num_blocks": 4,
        "normalize": False,
        "eps": 1e-5,
        "backend": "auto",
    }
    default = tiny_dit(num_layers=2)
    apply_mhla(default)  # num_blocks=None: round(sqrt(16) / 2) = 2 blocks on 4 x 4 tokens
    spec = mhla_spec(default)
    assert spec["eps"] == 1e-6 and spec["normalize"] is True and spec["num_blocks"] == 2
    assert spec["block_grid"] in ([1, 1, 2], [1, 2, 1]) and spec["layers"] == [0, 1]

    mixed = tiny_dit(num_layers=2)
    apply_mhla(mixed, layers=[0], block_grid=(2, 2))
    apply_mhla(mixed, layers=[1], block_grid=(1, 1))  # two settings: not one config
    with pytest.raises(ValueError, match="different settings"):
        mhla_spec(mixed)


def test_gradient_checkpointing_same_gradients():
    """The recomputation (inside the backward, after the forward returned) runs on the grid of its own
    forward, replayed around each checkpointed block: same output and bitwise the same gradients
    (mixing matrices included) as without checkpointing."""
    base = tiny_dit(num_layers=3)
    apply_mhla(base, layers="all", num_blocks=4)
    randomize_mixing_(base, low=0.05, high=0.95)
    ckpt = stock_copy(base)
    ckpt.enable_gradient_checkpointing()  # eval mode: in train mode DiT drops class labels at random
    latent, timestep, labels = dit_inputs(batch=2, size=16)  # not the native size: the grid must be 8 x 8

    def grads(model):
        model.zero_grad()
        with no_grid_frames():
            out = model(latent, timestep=timestep, class_labels=labels).sample
            out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out_a, grads_a = grads(base)
    calls = []
    for attn in self_attn(ckpt):
        attn.register_forward_pre_hook(lambda m, a: calls.append(grid_module.current_grid()))
    out_b, grads_b = grads(ckpt)
    assert calls == [(1, 8, 8)] * 6  # 3 forwards, 3 recomputations with the forward's grid replayed
    assert torch.equal(out_a, out_b)
    assert sorted(grads_a) == sorted(grads_b)
    assert any("mhla.mixing" in n for n in grads_a)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
        assert grads_a[name].abs().max() > 0 or "mhla" not in name


def test_bare_one_liner_on_fresh_dit():
    """The diffusers-style one-liner, bypassing our helpers: set_processor on each layer of a model that
    never met apply_mhla. The process-wide hook must install the grid hooks on the first forward and
    the mixing matrices must be created lazily (locality init on the native grid)."""
    model = tiny_dit(num_layers=3)
    twin = stock_copy(model)
    for attn in self_attn(model):
        attn.set_processor(MHLAProcessor(num_blocks=4))
    assert not grid_module.has_grid_hooks(model) and _mhla_keys(model) == []
    inputs = dit_inputs(batch=2)
    with no_grid_frames():
        out = run_dit(model, inputs)
    assert grid_module.has_grid_hooks(model)
    assert _mhla_keys(model) == [f"transformer_blocks.{i}.attn1.mhla.mixing.weight" for i in range(3)]
    apply_mhla(twin, num_blocks=4)
    assert torch.equal(out, run_dit(twin, inputs))
    with no_grid_frames():  # later calls, other resolutions: through the model's own hooks
        assert torch.equal(run_dit(model, inputs), out)
        big = dit_inputs(batch=1, size=16)
        assert torch.equal(run_dit(model, big), run_dit(twin, big))
    # the one-liner model can be removed like any other
    assert len(remove_mhla(model)) == 3 and _mhla_keys(model) == []


def test_bare_one_liner_first_forward_failing_leaks_no_frame():
    """The process-wide hook opens the first frame by hand; a first forward that raises must close it."""
    model = tiny_dit(num_layers=2)
    for attn in self_attn(model):
        attn.set_processor(MHLAProcessor(block_grid=(4, 4)))
    with no_grid_frames():
        with pytest.raises(RuntimeError):  # 3 latent channels for a 4-channel patch embedding
            run_dit(model, dit_inputs(batch=1, in_channels=3))
        assert run_dit(model, dit_inputs(batch=1)).shape == (1, 4, 8, 8)


def test_processor_contradicting_existing_mixing_raises():
    """A processor asking for another M than the layer's existing mixing matrix is refused, not ignored."""
    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    with pytest.raises(ValueError, match="remove_mhla"):
        set_attn_processor(model, MHLAProcessor(num_blocks=1))
    with pytest.raises(ValueError, match="remove_mhla"):
        set_attn_processor(model, MHLAProcessor(block_grid=(4, 1)))
    set_attn_processor(model, MHLAProcessor(num_blocks=4))  # the same M is fine
    assert mhla_spec(model)["num_blocks"] == 4


def test_model_with_mhla_pickles_and_deep_copies():
    """Hooks are plain objects: torch.save / deepcopy of an MHLA model work, the copy publishes its own
    grid (no double hooks), and remove_mhla on it leaves no hook behind."""
    import copy
    import io

    from mhla_diffusers.models.grid import _PublishGrid

    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    inputs = dit_inputs()
    expected = run_dit(model, inputs)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        with no_grid_frames():
            assert torch.equal(run_dit(clone, inputs), expected)
        publishers = [h for m in clone.modules() for h in m._forward_pre_hooks.values() if isinstance(h, _PublishGrid)]
        assert len(publishers) == 1
        remove_mhla(clone)
        assert not any(isinstance(h, _PublishGrid) for m in clone.modules() for h in m._forward_pre_hooks.values())
        assert not clone._forward_pre_hooks and not clone._forward_hooks
