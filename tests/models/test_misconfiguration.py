"""No silent misconfiguration (issue 11, section 2, and the bare one-liner's lazy matrices of section 3).

* A processor whose explicit block spec contradicts a layer's existing mixing matrix is refused
  (``remove_mhla`` first), wherever it was put on the layer; one without a spec reuses the matrix.
* A ``num_blocks`` the native token grid cannot give (``M^2 <= N``) warns with the block grid chosen.
* The bare one-liner (diffusers' own ``set_attn_processor(MHLAProcessor())``, matrices created at the
  first forward): the matrices follow the layer's ``requires_grad``; an optimizer / EMA built before
  that forward, ``load_state_dict`` into a fresh one-liner model, ``torch.compile(fullgraph=True)``
  and ``torch.export`` before it end in a warning or an error naming ``materialize_mhla``.
* A converted folder loaded by diffusers' own ``from_pretrained`` runs without MHLA: diffusers logs the
  marker key of its ``config.json``, and our code warns wherever it meets such a model.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import (
    WarningLog,
    dit_inputs,
    load_script,
    no_grid_frames,
    realign_,
    run_dit,
    self_attn,
    tiny_dit,
    tiny_dit_pipeline,
)
from helpers_sana import run_sana, sana_inputs, sana_self_attn, tiny_sana
from helpers_wan import run_wan, tiny_wan, wan_inputs, wan_self_attn

import mhla_diffusers
from mhla_diffusers import (
    MHLAProcessor,
    apply_mhla,
    materialize_mhla,
    mhla_spec,
    mixing_parameters,
    remove_mhla,
    save_mhla_pipeline,
    save_mhla_transformer,
)
from mhla_diffusers.checkpoint.format import CONFIG_MARKER_KEY, load_mhla_pipeline, load_mhla_transformer


@pytest.fixture
def no_warnings():
    """Fail on any warning raised inside the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _sana_forward(model, inputs):
    latent, text, timestep, mask = inputs
    return model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample


# -- 1. a processor with another block spec over existing matrices ------------------------------------
def test_one_liner_with_another_block_grid_over_existing_matrices_is_refused():
    """diffusers' own set_attn_processor: an explicit block_grid contradicting the layers' is refused as the
    processor is set (the processor is not set), never the 1 x 1 matrices kept silently; remove_mhla then
    installs it afresh, exactly as on a fresh model."""
    inputs = sana_inputs(batch=1)
    model = tiny_sana()
    model.set_attn_processor(MHLAProcessor(num_blocks=1))
    before = run_sana(model, inputs)
    processors = [a.processor for a in sana_self_attn(model)]
    with pytest.raises(ValueError, match=r"block grid \(1, 1, 1\).*block_grid=\(1, 2, 4\).*remove_mhla"):
        model.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 4)))
    assert [a.processor for a in sana_self_attn(model)] == processors  # nothing half-changed
    assert [a.mhla.mixing.block_grid for a in sana_self_attn(model)] == [(1, 1, 1)] * 2
    assert torch.equal(run_sana(model, inputs), before) and mhla_spec(model)["block_grid"] == [1, 1, 1]

    remove_mhla(model)
    model.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 4)))
    fresh = tiny_sana()
    fresh.set_attn_processor(MHLAProcessor(block_grid=(1, 2, 4)))
    assert torch.equal(run_sana(model, inputs), run_sana(fresh, inputs))
    assert [a.mhla.mixing.block_grid for a in sana_self_attn(model)] == [(1, 2, 4)] * 2


def test_num_blocks_over_existing_matrices_compares_the_block_grid_a_fresh_install_gives():
    """num_blocks is a target: it agrees with a matrix exactly when a fresh install would build that
    block grid (4 on the 32 x 32 grid: 2 x 2; 16: 4 x 4), on set_processor loops too (DiT)."""
    inputs = sana_inputs(batch=1)
    model = tiny_sana()
    apply_mhla(model, num_blocks=4)
    before = run_sana(model, inputs)
    model.set_attn_processor(MHLAProcessor(num_blocks=4))
    assert torch.equal(run_sana(model, inputs), before)
    model.set_attn_processor(MHLAProcessor(num_blocks=16))
    with pytest.raises(ValueError, match=r"num_blocks=16 \(block grid \(1, 4, 4\)\).*remove_mhla"):
        run_sana(model, inputs)

    dit = tiny_dit(num_layers=2)
    apply_mhla(dit, block_grid=(1, 4))
    for attn in self_attn(dit):
        attn.set_processor(MHLAProcessor(num_blocks=4))  # 4 blocks on 4 x 4 tokens: 2 x 2, not 1 x 4
    with pytest.raises(ValueError, match="remove_mhla"):
        run_dit(dit, dit_inputs(batch=1))


def test_processor_without_spec_reuses_existing_matrices():
    """No num_blocks / block_grid: the layer's own matrix and block grid, as a loaded checkpoint runs."""
    inputs = sana_inputs(batch=1)
    model = tiny_sana()
    apply_mhla(model, block_grid=(1, 2, 4))
    with torch.no_grad():
        for p in mixing_parameters(model):
            p.uniform_(0, 1)
    matrices = [a.mhla.mixing for a in sana_self_attn(model)]
    before = run_sana(model, inputs)
    model.set_attn_processor(MHLAProcessor())
    assert torch.equal(run_sana(model, inputs), before)
    assert [a.mhla.mixing for a in sana_self_attn(model)] == matrices
    assert mhla_spec(model)["block_grid"] == [1, 2, 4]
    mhla_diffusers.set_attn_processor(model, MHLAProcessor())  # ours: the same
    assert torch.equal(run_sana(model, inputs), before)


def test_explicit_output_norm_against_the_layer_is_refused_when_set():
    model = tiny_wan()
    model.set_attn_processor(MHLAProcessor(normalize=False, block_grid=(1, 2, 2)))  # Wan: output norm on
    run_wan(model, wan_inputs(batch=1))
    with pytest.raises(ValueError, match="output_norm=True but the processor asks for output_norm=False.*remove_mhla"):
        model.set_attn_processor(MHLAProcessor(normalize=False, output_norm=False))


def test_apply_mhla_over_a_one_liner_model_is_refused():
    model = tiny_sana()
    model.set_attn_processor(MHLAProcessor())
    materialize_mhla(model)
    with pytest.raises(ValueError, match=r"already installed.*remove_mhla"):
        apply_mhla(model, num_blocks=4)
    with pytest.raises(ValueError, match=r"remove_mhla"):
        mhla_diffusers.set_attn_processor(model, MHLAProcessor(num_blocks=4))


# -- 2. num_blocks the grid cannot give ------------------------------------------------------------
def test_num_blocks_above_the_cost_rule_warns_with_the_chosen_grid(no_warnings):
    model = tiny_dit(num_layers=2)  # 4 x 4 tokens: M <= 4
    with pytest.warns(UserWarning, match=r"num_blocks=1000: .*M\^2 <= N.*4 x 4 \(N = 16\) allows at most M = 4; "
                      r"using block grid \(1, 2, 2\) \(M = 4\)") as record:
        apply_mhla(model, num_blocks=1000)
    assert len(record) == 1 and mhla_spec(model)["num_blocks"] == 4
    apply_mhla(tiny_dit(num_layers=2), num_blocks=4)  # exactly what was asked: quiet

    one_liner = tiny_sana()  # one warning per processor, not one per layer
    one_liner.set_attn_processor(MHLAProcessor(num_blocks=5000))
    with pytest.warns(UserWarning, match="num_blocks=5000") as record:
        run_sana(one_liner, sana_inputs(batch=1))
    assert len([w for w in record if "num_blocks=5000" in str(w.message)]) == 1


def test_convert_cli_num_blocks_above_the_cost_rule_warns(tmp_path, capsys):
    src = tmp_path / "base"
    tiny_dit_pipeline(num_layers=2).save_pretrained(src)
    convert = load_script("conversion/convert.py")
    with pytest.warns(UserWarning, match=r"num_blocks=1000: .*using block grid \(1, 2, 2\) \(M = 4\)"):
        code = convert.main(["--family", "dit", "--src", str(src), "--out", str(tmp_path / "out"), "--num-blocks", "1000"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 4


# -- 3. the bare one-liner's matrices, created at the first forward ---------------------------------
def test_frozen_model_gets_frozen_matrices_quietly_in_inference(no_warnings):
    model = tiny_sana().requires_grad_(False)
    model.set_attn_processor(MHLAProcessor(normalize=False))
    run_sana(model, sana_inputs(batch=1))  # eval mode, no grad: a pipeline's call
    assert all(not p.requires_grad for p in mixing_parameters(model))

    wan = tiny_wan().requires_grad_(False)
    wan.set_attn_processor(MHLAProcessor(normalize=False))
    materialize_mhla(wan)  # what the first forward would do: output norms frozen too
    assert all(not p.requires_grad for a in wan_self_attn(wan) for p in a.parameters())


def test_optimizer_built_before_the_first_forward_is_warned():
    model = tiny_sana().train()
    model.set_attn_processor(MHLAProcessor())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"at its first forward.*optimizer.*materialize_mhla") as record:
        _sana_forward(model, sana_inputs(batch=1)).mean().backward()
        _sana_forward(model, sana_inputs(batch=1))
    assert len([w for w in record if "materialize_mhla" in str(w.message)]) == 1  # once per model
    assert all(p.requires_grad and p.grad is not None for p in mixing_parameters(model))
    assert not {id(p) for p in mixing_parameters(model)} & {id(p) for g in optimizer.param_groups for p in g["params"]}


def test_ema_built_before_the_first_forward_is_warned_and_materialize_fixes_it():
    from diffusers.training_utils import EMAModel

    inputs = sana_inputs(batch=1)
    model = tiny_sana().train()
    model.set_attn_processor(MHLAProcessor())
    ema = EMAModel(model.parameters())
    with pytest.warns(UserWarning, match=r"EMA.*materialize_mhla"):
        _sana_forward(model, inputs).mean().backward()
    assert len(ema.shadow_params) < len(list(model.parameters()))  # what EMAModel.step then trips over

    fixed = tiny_sana().train()
    fixed.set_attn_processor(MHLAProcessor())
    assert len(materialize_mhla(fixed)) == 2
    ema = EMAModel(fixed.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sana_forward(fixed, inputs).mean().backward()
    ema.step(fixed.parameters())
    assert len(ema.shadow_params) == len(list(fixed.parameters()))


def test_load_state_dict_into_a_fresh_one_liner_model():
    """Without an explicit block grid the error names materialize_mhla (strict or not: trained matrices
    are never dropped); with one, the matrices are created from the state dict's layer and loaded."""
    inputs = sana_inputs(batch=1)
    trained = tiny_sana()
    trained.set_attn_processor(MHLAProcessor(block_grid=(4, 4)))
    run_sana(trained, inputs)
    with torch.no_grad():
        for p in mixing_parameters(trained):
            p.uniform_(0, 1)
    state = trained.state_dict()
    expected = run_sana(trained, inputs)

    for strict in (True, False):
        fresh = tiny_sana()
        fresh.set_attn_processor(MHLAProcessor())
        with pytest.raises(RuntimeError, match=r"attn1\.mhla.mixing\.weight: this layer runs MHLAProcessor.*materialize_mhla"):
            fresh.load_state_dict(state, strict=strict)

    fresh = tiny_sana()
    fresh.set_attn_processor(MHLAProcessor(block_grid=(4, 4)))
    fresh.load_state_dict(state)
    assert torch.equal(run_sana(fresh, inputs), expected)

    fresh = tiny_sana()
    fresh.set_attn_processor(MHLAProcessor())
    materialize_mhla(fresh)
    fresh.load_state_dict(state)  # the default M = 16 on 32 x 32 tokens is 4 x 4 too
    assert torch.equal(run_sana(fresh, inputs), expected)


def test_remove_mhla_takes_the_load_hook_off():
    model = tiny_sana()
    stock_hooks = {n: len(m._load_state_dict_pre_hooks) for n, m in model.named_modules()}
    model.set_attn_processor(MHLAProcessor())
    assert all(len(a._load_state_dict_pre_hooks) == stock_hooks[f"transformer_blocks.{i}.attn1"] + 1
               for i, a in enumerate(sana_self_attn(model)))
    remove_mhla(model)
    assert {n: len(m._load_state_dict_pre_hooks) for n, m in model.named_modules()} == stock_hooks


def test_fullgraph_compile_before_the_matrices_exist_names_materialize_mhla():
    model = tiny_wan()
    model.set_attn_processor(MHLAProcessor())
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on global module hooks
        with no_grid_frames(), pytest.raises(Exception, match="materialize_mhla"):
            run_wan(compiled, wan_inputs(batch=1))
    torch._dynamo.reset()


def test_export_before_the_matrices_exist_names_materialize_mhla():
    model = tiny_sana()
    model.set_attn_processor(MHLAProcessor())
    latent, text, timestep, mask = sana_inputs(batch=1)
    with no_grid_frames():  # torch.export runs no always_call hook on the error: the processor closes the frame
        with pytest.raises(RuntimeError, match="torch.export.*materialize_mhla"):
            torch.export.export(model, (latent,), dict(encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask))


# -- 4. a converted folder loaded by diffusers' own from_pretrained ----------------------------------


def test_stock_loaded_converted_transformer_is_never_silent(tmp_path):
    from diffusers import DiTTransformer2DModel

    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    folder = save_mhla_transformer(model, tmp_path / "converted")

    with WarningLog() as log:
        plain = DiTTransformer2DModel.from_pretrained(folder)
    assert any("load_mhla_transformer" in m and "WITHOUT MHLA" in m for m in log.messages), log.messages
    with pytest.warns(UserWarning, match=r"loaded from .*converted MHLA checkpoint.*fresh locality-init.*load_mhla_transformer"):
        apply_mhla(plain, num_blocks=4)
    remove_mhla(plain)
    for attn in self_attn(plain):
        attn.set_processor(MHLAProcessor())
    with pytest.warns(UserWarning, match="converted MHLA checkpoint"):
        run_dit(plain, dit_inputs(batch=1))

    with WarningLog() as log, warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_mhla_transformer(folder)  # ours: quiet, and the marker is not in the model's config
    assert log.messages == [] and CONFIG_MARKER_KEY not in loaded.config
    # weights out of the mmapped file sit at other alignments: realigned, the GEMMs are the same computation
    assert torch.equal(run_dit(realign_(loaded), dit_inputs(batch=1)), run_dit(model, dit_inputs(batch=1)))


def test_marker_is_written_only_for_mhla_models_and_old_checkpoints_load(tmp_path):
    from diffusers import DiTTransformer2DModel

    model = tiny_dit(num_layers=2)
    apply_mhla(model, num_blocks=4)
    folder = save_mhla_transformer(model, tmp_path / "converted")
    plain = DiTTransformer2DModel.from_pretrained(folder)  # its config now carries the marker
    assert CONFIG_MARKER_KEY in plain.config
    stock = save_mhla_transformer(plain, tmp_path / "stock")  # no MHLA: a plain folder, no marker
    assert CONFIG_MARKER_KEY not in json.loads((stock / "config.json").read_text())
    assert not (stock / "mhla_config.json").exists()

    config = json.loads((folder / "config.json").read_text())  # as written before the marker existed
    del config[CONFIG_MARKER_KEY]
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_mhla_transformer(folder)
    # weights out of the mmapped file sit at other alignments: realigned, the GEMMs are the same computation
    assert torch.equal(run_dit(realign_(loaded), dit_inputs(batch=1)), run_dit(model, dit_inputs(batch=1)))


def test_stock_loaded_converted_pipeline_warns_in_the_generation_helpers(tmp_path):
    from diffusers import DiffusionPipeline

    from mhla_diffusers.generation import generate_class_images

    pipe = tiny_dit_pipeline(num_layers=2)
    apply_mhla(pipe.transformer, num_blocks=4)
    folder = save_mhla_pipeline(pipe, tmp_path / "converted")
    with WarningLog() as log:
        stock = DiffusionPipeline.from_pretrained(folder)
    assert any("load_mhla_pipeline" in m for m in log.messages), log.messages
    with pytest.warns(UserWarning, match=r"converted MHLA checkpoint.*generates with the stock attention"):
        generate_class_images(folder, [1], steps=1, pipe=stock, device="cpu")

    with WarningLog() as log, warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = load_mhla_pipeline(folder)
        generate_class_images(folder, [1], steps=1, pipe=ours, device="cpu")
    assert log.messages == []


# -- call arguments and unknown transformers (issue 19, section 3) ------------------------------------


def _layer_calls(attn, *args, **kwargs):
    """``attn.processor(attn, *args, **kwargs)``'s exception type (or ``None``) and message."""
    try:
        attn.processor(attn, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the type is what is compared
        return type(err), str(err)
    return None, ""


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda hs, r: ((hs,), {"rotary_emb": r, "attention_maks": None}), id="misspelt-keyword"),
        pytest.param(lambda hs, r: ((hs, None, None, r, 5), {}), id="extra-positional"),
        pytest.param(lambda hs, r: ((hs, None, None, r), {"rotary_emb": r}), id="rotary-twice"),
    ],
)
def test_wan_processor_refuses_what_the_stock_processor_refuses(call):
    model = tiny_wan(num_layers=1)
    inputs = wan_inputs(batch=1, frames=1)
    stock_attn = wan_self_attn(model)[0]
    hidden = torch.randn(1, 16, 24)
    rotary = model.rope(inputs["hidden_states"])
    args, kwargs = call(hidden, rotary)
    stock_type, _ = _layer_calls(stock_attn, *args, **kwargs)
    apply_mhla(model, num_blocks=4)
    with torch.no_grad(), mhla_diffusers.token_grid((1, 4, 4)):
        mhla_type, message = _layer_calls(wan_self_attn(model)[0], *args, **kwargs)
        assert _layer_calls(wan_self_attn(model)[0], hidden, None, None, rotary) == (None, "")  # the stock call
    assert stock_type is TypeError and mhla_type is TypeError, message
    assert "WanAttnProcessor.__call__" in message


def test_misspelt_keyword_through_the_wan_attention_module():
    model = tiny_wan(num_layers=1)
    rotary = model.rope(wan_inputs(batch=1, frames=1)["hidden_states"])
    apply_mhla(model, num_blocks=4)
    with torch.no_grad(), mhla_diffusers.token_grid((1, 4, 4)), pytest.raises(TypeError, match="attention_maks"):
        wan_self_attn(model)[0](torch.randn(1, 16, 24), rotary_emb=rotary, attention_maks=None)


def test_sana_and_dit_processors_take_what_their_stock_processors_take():
    """SANA's stock processor has a fixed signature (a misspelt keyword or a ``temb`` is a TypeError);
    DiT's ``AttnProcessor2_0`` takes ``*args, **kwargs`` and ignores them: MHLA does the same."""
    sana, dit = tiny_sana(num_layers=1), tiny_dit(num_layers=1)
    hidden = {
        name: torch.randn(1, 16, attn.to_q.in_features)
        for name, attn in (("sana", sana_self_attn(sana)[0]), ("dit", self_attn(dit)[0]))
    }
    stock = {
        name: [_layer_calls(attn, hidden[name], **kw) for kw in ({"bogus": 1}, {"temb": None}, {"temb": hidden[name]})]
        for name, attn in (("sana", sana_self_attn(sana)[0]), ("dit", self_attn(dit)[0]))
    }
    apply_mhla(sana, num_blocks=4)
    apply_mhla(dit, num_blocks=4)
    with torch.no_grad(), mhla_diffusers.token_grid((4, 4)):
        for name, attn in (("sana", sana_self_attn(sana)[0]), ("dit", self_attn(dit)[0])):
            ours = [_layer_calls(attn, hidden[name], **kw) for kw in ({"bogus": 1}, {"temb": None}, {"temb": hidden[name]})]
            # temb=None is "not given" to MHLAProcessor (its own keyword, default None): the one call it takes more
            expected = [t for t, _ in stock[name]]
            assert [t for t, _ in ours] == expected[:1] + [None] + expected[2:], (name, ours, stock[name])
    assert [t for t, _ in stock["sana"]] == [TypeError, TypeError, TypeError]
    assert [t for t, _ in stock["dit"]] == [None, None, None]


def test_unknown_transformer_is_refused_before_any_computation():
    """The bare one-liner on a class MHLA does not know (PixArt-alpha): refused at the first forward, naming
    the supported classes, before the layer's projections run."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1, cross_attention_dim=16,
        caption_channels=8, sample_size=8, patch_size=2,
    ).eval()
    model.set_attn_processor(MHLAProcessor(num_blocks=1))
    projected = []
    model.transformer_blocks[0].attn1.to_q.register_forward_hook(lambda *_: projected.append(1))
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 3, 8), timestep=torch.tensor([1.0]),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"outside a supported transformer.*SanaVideoTransformer3DModel"):
        model(**inputs)
    assert not projected
    with pytest.raises(ValueError, match="PixArtTransformer2DModel is not a supported transformer"):
        materialize_mhla(model)


def test_assigning_a_stock_processor_is_refused_by_torch_and_set_processor_works():
    """What the README says of ``attn.processor = <stock>``: torch's TypeError; ``set_processor`` replaces it."""
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    model = tiny_sana(num_layers=1)
    apply_mhla(model, num_blocks=4)
    attn = sana_self_attn(model)[0]
    with pytest.raises(TypeError, match="cannot assign"):
        attn.processor = SanaLinearAttnProcessor2_0()
    attn.set_processor(SanaLinearAttnProcessor2_0())
    assert not mhla_diffusers.is_mhla_model(model)
