"""MHLA combined with the tools users stack on diffusers (docs/tools.md): caches, a GGUF base, float8 layerwise casting,
regional compile.

Elsewhere: offloading and bfloat16 layerwise casting in tests/models/test_offloading.py; model offloading in
test_pipeline_cpu_offload_and_to of tests/models/test_wan.py and test_sana.py; quanto / torchao in
tests/checkpoint/test_quantized.py; context parallelism in tests/models/test_context_parallel.py.

* diffusers' caches (``transformer.enable_cache(config)``, diffusers 0.42: FirstBlockCache, PyramidAttentionBroadcast,
  FasterCache, TaylorSeer, MagCache, SeaCache, TextKVCache) hook blocks and attention modules, never the processor:
  on the tiny Wan pipeline with MHLA (output norm, gate and LePE, all away from their neutral start), a config that
  never reuses gives the uncached output bit for bit with every MHLA layer called; one that reuses calls the MHLA
  layers fewer times (counted with a forward hook on ``attn.mhla``) and stays finite; after ``disable_cache`` the
  output is the uncached one again, and no parameter moved. FasterCache's skipping of the unconditional batch on
  SANA's batched classifier-free guidance. The order (cache first, MHLA after, either way of installing) does not
  matter. cache-dit (``pip install cache-dit``, optional: skipped when missing) on Wan, SANA and DiT pipelines.
* GGUF: a tiny Wan written as a Q8_0 GGUF file (``gguf``, optional: skipped when missing), loaded by
  ``from_single_file(..., quantization_config=GGUFQuantizationConfig(...))``, MHLA installed from a converted
  folder's ``mhla_config.json`` and ``load_mhla_weights``: the float32 model whose stock weights hold the values
  diffusers dequantizes; MHLA's parameters float32 and exactly as saved.
* Layerwise casting with float8 storage: MHLA's parameters stay float32; the output is the rounded model's.
* Regional compile: ``compile_repeated_blocks(fullgraph=True)`` on a Wan hybrid compiles two graphs (stock and MHLA
  block), an all-MHLA model one (SANA, which has no ``_repeated_blocks``: each block's ``.compile``, two graphs for a
  hybrid); a second call does not recompile; outputs equal eager's to float rounding.

Tolerances: bit for bit wherever the same computation runs on the same weights in the same tensors. GGUF (the
dequantized Linear against float32 weights holding the same values) and float8 layerwise casting (against the rounded
model): observed 0.0, checked to 1e-6 relative, since the weights are fresh tensors each call and CPU BLAS may differ
by an ulp with the operands' alignment. Compile: aot_eager against eager (observed 1.8e-7 relative, max |diff| /
max |eager|), checked at 10x (2e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from helpers import tiny_dit_pipeline
from helpers_sana import run_sana, sana_inputs, tiny_sana, tiny_sana_pipeline
from helpers_wan import original_wan_state_dict, run_wan, tiny_wan, tiny_wan_pipeline, wan_inputs

from mhla_diffusers import MHLAProcessor, apply_mhla, save_mhla_transformer

STEPS = 6
WAN_SETTINGS = dict(normalize=False, gate="neutral", lepe=True)  # output norm, gate and LePE: every MHLA part


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def _train_(model, seed: int = 1) -> None:
    """A trained state: every MHLA parameter moved away from its (partly neutral) start."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".mhla." in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _count_mhla_calls(model) -> list[int]:
    """A list that grows by the batch size of every MHLA layer call of ``model`` (a forward hook on ``attn.mhla``)."""
    seen: list[int] = []
    for name, module in model.named_modules():
        if name.endswith(".attn1.mhla"):
            module.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    assert seen == [] and any(n.endswith(".attn1.mhla") for n, _ in model.named_modules())
    return seen


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, snapshot: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return sorted(now) == sorted(snapshot) and all(
        now[k].dtype == v.dtype and torch.equal(now[k], v) for k, v in snapshot.items())


def _wan_pipe(settings=WAN_SETTINGS):
    pipe = tiny_wan_pipeline(num_layers=3)
    apply_mhla(pipe.transformer, **settings)
    _train_(pipe.transformer)
    return pipe


def _wan_generate(pipe, guidance: float = 1.0) -> torch.Tensor:
    """Latents of a 6-step generation (guidance 1: one transformer call per step)."""
    return pipe("a cat", height=64, width=64, num_frames=5, num_inference_steps=STEPS, guidance_scale=guidance,
                output_type="latent", generator=torch.Generator().manual_seed(0)).frames


# -- diffusers' caches -----------------------------------------------------------------------------------------------
def _caches(pipe) -> dict:
    """``{name: (a config that never reuses, one that reuses or None)}`` for the tiny Wan pipeline (6 steps, timesteps
    999 ... 376)."""
    from diffusers.hooks import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        SeaCacheConfig,
        TaylorSeerCacheConfig,
        TextKVCacheConfig,
    )

    now = lambda: pipe.current_timestep  # noqa: E731
    wan_attn1 = [r"blocks\.\d+\.attn1"]  # TaylorSeer's default patterns match no Wan module (see below)
    return {
        "first_block": (FirstBlockCacheConfig(threshold=0.0), FirstBlockCacheConfig(threshold=10.0)),
        "pyramid_attention_broadcast": tuple(
            PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=n, spatial_attention_timestep_skip_range=(
                -1, 1000), current_timestep_callback=now) for n in (1, 2)),
        # the range leaves out the first step: diffusers 0.42's FasterCache fails there otherwise (stock models too)
        "faster": tuple(
            FasterCacheConfig(spatial_attention_block_skip_range=n, spatial_attention_timestep_skip_range=(-1, 990),
                              current_timestep_callback=now, is_guidance_distilled=True) for n in (1, 2)),
        "taylorseer": (
            TaylorSeerCacheConfig(disable_cache_before_step=100, cache_identifiers=wan_attn1, taylor_factors_dtype=torch.float32),
            TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, cache_identifiers=wan_attn1,
                                  taylor_factors_dtype=torch.float32)),
        "mag": (MagCacheConfig(calibrate=True, num_inference_steps=STEPS),
                MagCacheConfig(mag_ratios=[1.0] * STEPS, threshold=10.0, max_skip_steps=STEPS, num_inference_steps=STEPS)),
        "sea": (SeaCacheConfig(threshold=0.0), SeaCacheConfig(threshold=100.0, max_consecutive_cached=0, cache_end_steps=0)),
        "text_kv": (TextKVCacheConfig(), None),  # hooks NucleusMoE-Image blocks only: nothing to reuse on Wan
    }


CACHE_NAMES = ["first_block", "pyramid_attention_broadcast", "faster", "taylorseer", "mag", "sea", "text_kv"]


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_diffusers_cache_runs_mhla_layers_as_stock_ones(name, capsys):
    pipe = _wan_pipe()
    calls = _count_mhla_calls(pipe.transformer)
    snapshot = _snapshot(pipe.transformer)
    want = _wan_generate(pipe)
    assert len(calls) == 3 * STEPS
    never, reuse = _caches(pipe)[name]

    calls.clear()
    pipe.transformer.enable_cache(never)
    got = _wan_generate(pipe)
    pipe.transformer.disable_cache()
    assert torch.equal(got, want) and len(calls) == 3 * STEPS, (len(calls), _rel(got, want))

    if reuse is not None:
        calls.clear()
        pipe.transformer.enable_cache(reuse)
        got = _wan_generate(pipe)
        pipe.transformer.disable_cache()
        assert 0 < len(calls) < 3 * STEPS and torch.isfinite(got).all() and not torch.equal(got, want), len(calls)

    calls.clear()
    assert torch.equal(_wan_generate(pipe), want) and len(calls) == 3 * STEPS  # disabled: the uncached model again
    assert _same_state(pipe.transformer, snapshot)
    assert all(p.dtype == torch.float32 for n, p in pipe.transformer.named_parameters() if ".mhla." in n)
    capsys.readouterr()  # MagCache's calibration prints its ratios


def test_taylorseer_default_patterns_match_no_wan_module():
    """TaylorSeer's default patterns (``^blocks.*attn``, by ``re.fullmatch``) match no Wan module name
    (``blocks.0.attn1``): without ``cache_identifiers`` nothing is hooked, MHLA or not (the page says to pass them)."""
    from diffusers.hooks import TaylorSeerCacheConfig

    model = tiny_wan(num_layers=2)
    apply_mhla(model)
    model.enable_cache(TaylorSeerCacheConfig())
    hooked = [n for n, m in model.named_modules()
              if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("taylorseer_cache")]
    assert hooked == []
    model.disable_cache()
    model.enable_cache(TaylorSeerCacheConfig(cache_identifiers=[r"blocks\.\d+\.attn1"]))
    hooked = [n for n, m in model.named_modules()
              if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("taylorseer_cache")]
    assert hooked == ["blocks.0.attn1", "blocks.1.attn1"]  # the attention modules; their MHLA is not matched


def test_faster_cache_skips_the_unconditional_batch_of_sana():
    """SANA batches classifier-free guidance ([uncond, cond]); FasterCache (``apply_faster_cache``: SANA's transformer
    has no ``enable_cache``) runs the conditional half alone on its skipped steps: the MHLA layers then see batch 1.
    Never skipping (ranges 1) gives the uncached images bit for bit."""
    from diffusers.hooks import FasterCacheConfig, HookRegistry, apply_faster_cache

    pipe = tiny_sana_pipeline(num_layers=2)
    apply_mhla(pipe.transformer)
    _train_(pipe.transformer)
    now = {}
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: now.__setitem__("t", float(k["timestep"][0])), with_kwargs=True)
    calls = _count_mhla_calls(pipe.transformer)

    def generate():
        calls.clear()
        return pipe("a cat", height=64, width=64, num_inference_steps=STEPS, guidance_scale=4.5, use_resolution_binning=False,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images

    def cached(uncond_every: int):
        config = FasterCacheConfig(
            spatial_attention_block_skip_range=1, spatial_attention_timestep_skip_range=(-1, 990),
            unconditional_batch_skip_range=uncond_every, unconditional_batch_timestep_skip_range=(-1, 990),
            current_timestep_callback=lambda: now["t"], tensor_format="BCHW")
        apply_faster_cache(pipe.transformer, config)
        try:
            return generate()
        finally:
            for module in pipe.transformer.modules():
                registry = getattr(module, "_diffusers_hook", None)
                if registry is not None:
                    for hook in ("faster_cache_denoiser", "faster_cache_block"):
                        if registry.get_hook(hook) is not None:
                            registry.remove_hook(hook, recurse=False)
            HookRegistry.check_if_exists_or_initialize(pipe.transformer).invalidate_child_registries_cache()

    want = generate()
    assert calls == [2] * 2 * STEPS
    assert torch.equal(cached(1), want) and calls == [2] * 2 * STEPS
    got = cached(2)
    assert 1 in calls and sum(calls) < 2 * 2 * STEPS, calls
    assert torch.isfinite(got).all() and not torch.equal(got, want)


@pytest.mark.parametrize("install", ["apply_mhla", "one_liner"])
def test_cache_enabled_before_mhla_is_installed(install):
    """Caches hook blocks, MHLA lives inside their attention modules: a cache enabled first and MHLA installed after
    (``apply_mhla``, or the one-liner whose layers are made at the first forward) gives what the other order gives,
    bit for bit, reusing as much."""
    from diffusers.hooks import FirstBlockCacheConfig

    def run(cache_first: bool):
        pipe = tiny_wan_pipeline(num_layers=3)
        if cache_first:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        if install == "apply_mhla":
            apply_mhla(pipe.transformer)
        else:
            pipe.transformer.set_attn_processor(MHLAProcessor())
        if not cache_first:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        calls = _count_mhla_calls(pipe.transformer) if install == "apply_mhla" else None
        out = _wan_generate(pipe)
        return out, calls

    (first, calls_first), (after, calls_after) = run(True), run(False)
    assert torch.equal(first, after)
    if calls_first is not None:
        assert len(calls_first) == len(calls_after) < 3 * STEPS  # first-block changes here are 0.06-0.15: 0.2 reuses


# -- cache-dit (optional) --------------------------------------------------------------------------------------------
def _cache_dit_case(family: str):
    if family == "wan":
        pipe = tiny_wan_pipeline(num_layers=3)
        apply_mhla(pipe.transformer, **WAN_SETTINGS)
        run = lambda: _wan_generate(pipe)  # noqa: E731
    elif family == "sana":
        pipe = tiny_sana_pipeline(num_layers=3)
        apply_mhla(pipe.transformer)
        run = lambda: pipe("a cat", height=64, width=64, num_inference_steps=STEPS, guidance_scale=1.0,  # noqa: E731
                           use_resolution_binning=False, output_type="latent",
                           generator=torch.Generator().manual_seed(0)).images
    else:
        pipe = tiny_dit_pipeline(num_layers=3)
        apply_mhla(pipe.transformer, lepe=True, gate="neutral")
        run = lambda: torch.as_tensor(pipe(class_labels=[1], num_inference_steps=STEPS, guidance_scale=1.0,  # noqa: E731
                                           output_type="latent", generator=torch.Generator().manual_seed(0)).images)
    _train_(pipe.transformer)
    return pipe, run


@pytest.mark.parametrize("family", ["wan", "sana", "dit"])
def test_cache_dit_runs_mhla_layers_as_stock_ones(family):
    """cache-dit's DBCache (``cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))``; F1B0: the first block
    always computed): threshold 0 gives the uncached output bit for bit; a huge threshold after one warm-up step
    calls the MHLA layers fewer times; ``cache_dit.disable_cache`` restores the uncached model, parameters untouched
    (on DiT once the alias cache-dit leaves is deleted)."""
    cache_dit = pytest.importorskip("cache_dit")
    from cache_dit import DBCacheConfig

    pipe, run = _cache_dit_case(family)
    calls = _count_mhla_calls(pipe.transformer)
    snapshot = _snapshot(pipe.transformer)
    want = run()
    assert len(calls) == 3 * STEPS
    for threshold in (0.0, 10.0):
        calls.clear()
        cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold, max_warmup_steps=1))
        got = run()
        cache_dit.disable_cache(pipe)
        if threshold == 0.0:
            assert torch.equal(got, want) and len(calls) == 3 * STEPS, (len(calls), _rel(got, want))
        else:
            assert 0 < len(calls) < 3 * STEPS and torch.isfinite(got).all() and not torch.equal(got, want), len(calls)
    calls.clear()
    assert torch.equal(run(), want) and len(calls) == 3 * STEPS
    if family == "dit":  # cache-dit's DiT patch leaves an alias of block 0's norm1.emb on the transformer, stock too:
        # saving (ours, or diffusers' save_pretrained) then refuses shared tensors until it is deleted
        assert pipe.transformer._norm1_emb is pipe.transformer.transformer_blocks[0].norm1.emb
        del pipe.transformer._norm1_emb
    assert _same_state(pipe.transformer, snapshot)


# -- GGUF (optional) -------------------------------------------------------------------------------------------------
GGUF_TOLERANCE = 1e-6  # observed 0.0


def test_gguf_base_with_mhla_weights(tmp_path):
    """A Q8_0 GGUF file of a tiny Wan (the original key layout, as GGUF releases of Wan are; head_dim 16 and ffn 64 so
    rows are whole 32-value Q8_0 blocks), loaded by diffusers' ``from_single_file`` with ``GGUFQuantizationConfig``;
    MHLA put on it from a converted folder by ``load_mhla_weights`` (installed as its ``mhla_config.json`` records,
    then its weights), as docs/tools.md shows: MHLA's parameters float32 and exactly as saved; the output is the float32 model's whose stock
    weights hold the values diffusers dequantizes (within Q8_0 rounding of the originals)."""
    gguf = pytest.importorskip("gguf")
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    import mhla_diffusers

    size = dict(num_layers=2, head_dim=16, ffn_dim=64)
    converted = tiny_wan(**size)
    apply_mhla(converted, **WAN_SETTINGS)
    _train_(converted)
    folder = tmp_path / "wan-mhla"
    save_mhla_transformer(converted, folder)

    # the GGUF file: 2-D weights whose rows are whole Q8_0 blocks quantized, the rest float32
    writer = gguf.GGUFWriter(str(tmp_path / "wan-Q8_0.gguf"), "wan")
    for key, value in original_wan_state_dict(tiny_wan(**size)).items():
        array = value.float().numpy()
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            writer.add_tensor(key, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # what docs/tools.md shows
    transformer = WanTransformer3DModel.from_single_file(
        str(tmp_path / "wan-Q8_0.gguf"), config=str(folder),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    mhla_diffusers.load_mhla_weights(transformer, folder)  # MHLA installed as recorded, then its weights

    mhla = {n: p for n, p in transformer.named_parameters() if ".mhla." in n}
    saved = {n: p for n, p in converted.named_parameters() if ".mhla." in n}
    assert sorted(mhla) == sorted(saved) and all(p.dtype == torch.float32 and torch.equal(p, saved[n]) for n, p in mhla.items())

    # the reference: float32 weights holding what diffusers dequantizes (its Q8_0 scales are float16, the product too)
    values = {k: (dequantize_gguf_tensor(v) if isinstance(v, GGUFParameter) else v).float()
              for k, v in transformer.state_dict().items()}
    quantized = [k for k, v in transformer.state_dict().items() if isinstance(v, GGUFParameter)]
    assert len(quantized) >= 20 and "blocks.0.attn1.to_q.weight" in quantized
    original = converted.state_dict()
    assert all(0 < (values[k] - original[k]).abs().max() <= original[k].abs().max() / 127 for k in quantized)
    reference = tiny_wan(**size)
    apply_mhla(reference, **WAN_SETTINGS)
    reference.load_state_dict(values)
    x = wan_inputs(batch=1)
    got = run_wan(transformer, x)
    assert _rel(got, run_wan(reference, x)) < GGUF_TOLERANCE, _rel(got, run_wan(reference, x))
    assert _rel(got, run_wan(converted, x)) > 1e-4  # the weights really are the quantized ones


# -- regional compile ------------------------------------------------------------------------------------------------
COMPILE_TOLERANCE = 2e-6  # observed 1.8e-7 (Wan all), 1.5e-7 (Wan hybrid), 0.0 (SANA)


@pytest.fixture
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("family,layers,graphs", [("wan", "hybrid", 2), ("wan", "all", 1), ("sana", "hybrid", 2)])
def test_regional_compile_needs_a_graph_per_block_kind(family, layers, graphs, _fresh_dynamo):
    """``compile_repeated_blocks(fullgraph=True)`` (Wan; SANA has no ``_repeated_blocks``: each block's ``.compile``)
    on a hybrid compiles the block twice, once with its stock attention and once with MHLA; with every layer MHLA,
    once. A second call recompiles nothing; the output is eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if family == "wan":
        model, run, x = tiny_wan(num_layers=3), run_wan, wan_inputs(batch=1)
    else:
        model, run, x = tiny_sana(num_layers=3), run_sana, sana_inputs(batch=1)
    apply_mhla(model, layers=layers)
    _train_(model)
    want = run(model, x)
    counter = CompileCounterWithBackend("aot_eager")
    if family == "wan":
        model.compile_repeated_blocks(fullgraph=True, backend=counter)
    else:
        with pytest.raises(ValueError, match="_repeated_blocks"):
            model.compile_repeated_blocks(fullgraph=True, backend=counter)
        for block in model.transformer_blocks:
            block.compile(fullgraph=True, backend=counter)
    got = run(model, x)
    assert counter.frame_count == graphs
    with dynamo.config.patch(error_on_recompile=True):
        again = run(model, x)
    assert counter.frame_count == graphs and torch.equal(again, got)
    assert _rel(got, want) < COMPILE_TOLERANCE, _rel(got, want)


# -- layerwise casting to float8 -------------------------------------------------------------------------------------
def test_float8_layerwise_casting_keeps_mhla_parameters_float32():
    """``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn)`` (tests/models/test_offloading.py checks bfloat16
    storage on DiT): the stock Linear / Conv weights stored in float8, MHLA's own parameters (mixing matrix, output
    norm, gate, LePE's convolution) float32; the output is the model whose stock weights were rounded the same way
    (observed 0.0; 1e-6 relative allowed: the weights are cast into fresh tensors each call, and CPU BLAS may differ
    by an ulp with the operands' alignment)."""
    model = tiny_wan(num_layers=2)
    apply_mhla(model, **WAN_SETTINGS)
    _train_(model)
    rounded = tiny_wan(num_layers=2)
    apply_mhla(rounded, **WAN_SETTINGS)
    rounded.load_state_dict(model.state_dict())
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    cast = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert cast and not any(".mhla." in n for n in cast)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".mhla." in n)
    x = wan_inputs(batch=1)
    unrounded = run_wan(rounded, x)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name in cast:
                p.copy_(p.to(torch.float8_e4m3fn).float())
    got = run_wan(model, x)
    assert _rel(got, run_wan(rounded, x)) < 1e-6, _rel(got, run_wan(rounded, x))
    assert _rel(got, unrounded) > 1e-3  # the stock weights really are stored in float8
