"""Run by tests/models/test_context_parallel.py under ``torchrun --nproc_per_node P`` (CPU, gloo).

Each case builds a tiny model with MHLA, computes the single-process output (and, where asked, the
gradients of a training step) on every rank, then puts the model under diffusers' context parallelism
(:func:`mhla_diffusers.enable_context_parallel`) and runs the same inputs on this rank's shard. Rank 0
writes ``<out>/results.json``: per case the relative errors against the single-process run, the
measured exchange bytes and what the formulas say. Usage: ``context_parallel_check.py OUT_DIR``.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny-model helpers

from helpers import dit_inputs, randomize_mixing_, tiny_dit  # noqa: E402
from helpers_families import TINY  # noqa: E402
from helpers_sana import sana_inputs, tiny_sana  # noqa: E402
from helpers_wan import tiny_wan, wan_inputs  # noqa: E402

import mhla_diffusers  # noqa: E402
from mhla_diffusers.families import FAMILIES  # noqa: E402
from mhla_diffusers.models.parallel import communication_bytes, cpu_device_mesh, record_exchanges  # noqa: E402
from mhla_diffusers.ops import mhla_attention  # noqa: E402
from mhla_diffusers.ops.naive import relative_error  # noqa: E402

# phi = ReLU(x) ** p in the layer-option cases: 2 where the operator has feature_power (ops/), else 1
POWER = 2.0 if "feature_power" in inspect.signature(mhla_attention).parameters else 1.0


def _config(mode: str, world: int, anything: bool = False):
    from diffusers import ContextParallelConfig

    if mode == "ring":
        return ContextParallelConfig(ring_degree=world, ring_anything=anything)
    return ContextParallelConfig(ulysses_degree=world, ulysses_anything=anything)


def _trained(model) -> list[tuple[str, torch.Tensor]]:
    """The parameters a training step is checked on: q, k, v projections and mixing matrices of the MHLA layers."""
    names = ("to_q.weight", "to_k.weight", "to_v.weight", "mhla.mixing.weight", "mhla.gate.weight")
    return [(n, p) for n, p in model.named_parameters() if n.endswith(names) and "attn1" in n]


def _step(model, call, weight, parallel: bool):
    """Output and the gradients of ``sum(output * weight)`` for :func:`_trained` (summed over ranks when ``parallel``,
    as DDP / FSDP would: each rank holds the share of its own tokens)."""
    params = _trained(model)
    out = call(model)
    grads = torch.autograd.grad((out * weight).sum(), [p for _, p in params])
    if parallel:
        for g in grads:
            dist.all_reduce(g)
    return out.detach(), dict(zip([n for n, _ in params], grads))


def _compare(model, call, config, train: bool, plain: bool = False) -> dict:
    """Single-process run, then the same under context parallelism (``plain``: diffusers' own
    ``enable_parallelism`` with the model's ``_cp_plan``, no MHLA helper): relative errors (max over gradients)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        probe = call(model)
    weight = torch.randn(probe.shape, generator=g)
    if train:
        ref, ref_grads = _step(model, call, weight, parallel=False)
    else:
        with torch.no_grad():
            ref = call(model)
    if plain:
        with cpu_device_mesh():
            model.enable_parallelism(config=config)
    else:
        mhla_diffusers.enable_context_parallel(model, config)
    with record_exchanges() as log:
        if train:
            out, grads = _step(model, call, weight, parallel=True)
        else:
            with torch.no_grad():
                out = call(model)
    result = {"output": relative_error(out, ref), "exchanges": log}
    if train:
        result["grads"] = {name: relative_error(grads[name], ref_grads[name]) for name in ref_grads}
    return result


def _wan_call(inputs):
    return lambda model: model(**inputs, return_dict=False)[0]


def case_wan_oneliner_ring(world: int) -> dict:
    """Wan, MHLA on every layer by the one-liner, ring mode through diffusers' own enable_parallelism (Wan's
    _cp_plan), RoPE, a training step; exchange bytes."""
    model = tiny_wan(num_layers=2, heads=2, head_dim=12)
    model.set_attn_processor(mhla_diffusers.MHLAProcessor(block_grid=(2, 2, 3)))
    mhla_diffusers.materialize_mhla(model)
    randomize_mixing_(model, low=0.0, high=1.0)
    inputs = wan_inputs(batch=2, frames=3, size=(8, 12))  # 3 x 4 x 6 = 72 tokens
    result = _compare(model, _wan_call(inputs), _config("ring", world), train=True, plain=True)
    result["formula"] = communication_bytes(72, 2, 12, 12, world, batch=2)
    result["layers"] = 2
    return result


def case_wan_hybrid_ulysses(world: int) -> dict:
    """Wan hybrid by apply_mhla (softmax on layer 0: diffusers' Ulysses attention), a training step; stock bytes."""
    import torch.distributed._functional_collectives as funcol

    model = tiny_wan(num_layers=3, heads=6, head_dim=8)
    mhla_diffusers.apply_mhla(model, layers="hybrid", block_grid=(2, 2, 2))
    randomize_mixing_(model, low=0.0, high=1.0)
    inputs = wan_inputs(batch=1, frames=2, size=(12, 12))  # 2 x 6 x 6 = 72 tokens
    sent = []
    original = funcol.all_to_all_single

    def counting(x, *args, **kwargs):
        sent.append(x.numel() * x.element_size())
        return original(x, *args, **kwargs)

    funcol.all_to_all_single = counting
    try:
        result = _compare(model, _wan_call(inputs), _config("ulysses", world), train=True)
    finally:
        funcol.all_to_all_single = original
    result["alltoall_bytes"] = sent
    result["formula"] = communication_bytes(72, 6, 8, 8, world, batch=1, activation_bytes=4)
    return result


def case_wan_uneven_numerator(world: int) -> dict:
    """Wan by apply_mhla, numerator only + output norm, 175 tokens (no degree divides them), ring_anything,
    gradient checkpointing (the exchange runs again in the recomputation)."""
    model = tiny_wan(num_layers=2, heads=2, head_dim=12)
    model.enable_gradient_checkpointing()
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 2, 2), normalize=False)
    randomize_mixing_(model, low=0.0, high=1.0)
    inputs = wan_inputs(batch=1, frames=5, size=(10, 14))  # 5 x 5 x 7 = 175 tokens
    return _compare(model, _wan_call(inputs), _config("ring", world, anything=True), train=True)


def case_wan_uneven_ulysses(world: int) -> dict:
    """Wan by apply_mhla (normalised, RoPE), 175 tokens, ulysses_anything: MHLA per head after all-to-alls of
    uneven shards (6 heads: 2 and 3 divide them), the RoPE tables gathered once per forward; a training step
    with gradient checkpointing."""
    model = tiny_wan(num_layers=2, heads=6, head_dim=8)
    model.enable_gradient_checkpointing()
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 2, 2))
    randomize_mixing_(model, low=0.0, high=1.0)
    inputs = wan_inputs(batch=2, frames=5, size=(10, 14))  # 5 x 5 x 7 = 175 tokens
    return _compare(model, _wan_call(inputs), _config("ulysses", world, anything=True), train=True)


def case_wan_indivisible_refused(world: int) -> dict:
    """175 tokens under an even split: a clear error before any collective."""
    model = tiny_wan(num_layers=1, heads=2, head_dim=12)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 2, 2))
    mhla_diffusers.enable_context_parallel(model, _config("ring", world))
    try:
        with torch.no_grad():
            model(**wan_inputs(batch=1, frames=5, size=(10, 14)), return_dict=False)
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def case_ulysses_heads_refused(world: int) -> dict:
    """A hybrid whose softmax heads the Ulysses degree does not divide: refused at enable time."""
    model = tiny_wan(num_layers=3, heads=world + 1, head_dim=8)
    mhla_diffusers.apply_mhla(model, layers="hybrid", block_grid=(2, 2, 2))
    try:
        mhla_diffusers.enable_context_parallel(model, _config("ulysses", world))
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def case_hybrid_ring_native_refused(world: int) -> dict:
    """A Wan hybrid in ring mode on diffusers' default "native" backend, which cannot return the log-sum-exp ring
    attention needs: refused at enable time naming the fix (was diffusers' "Native attention does not support
    return_lse=True" at the first forward, from generate.py --context-parallel ring too)."""
    model = tiny_wan(num_layers=3, heads=2, head_dim=8)
    mhla_diffusers.apply_mhla(model, layers="hybrid", block_grid=(2, 2, 2))
    try:
        mhla_diffusers.enable_context_parallel(model, _config("ring", world))
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}

def case_sana_oneliner_ring(world: int) -> dict:
    """SANA, the one-liner, ring mode, forward (SANA's plan: the MHLA layers alone are split)."""
    model = tiny_sana(num_layers=2, heads=2, head_dim=8)
    model.set_attn_processor(mhla_diffusers.MHLAProcessor(block_grid=(3, 2)))
    mhla_diffusers.materialize_mhla(model)
    randomize_mixing_(model, low=0.0, high=1.0)
    latent, text, timestep, mask = sana_inputs(batch=2, size=(6, 8))  # 48 tokens

    def call(m):
        return m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask, return_dict=False)[0]

    return _compare(model, call, _config("ring", world), train=False)


def case_dit_ulysses(world: int) -> dict:
    """DiT, apply_mhla on every layer, Ulysses mode (MHLA's own exchange), a training step."""
    model = tiny_dit(num_layers=2, heads=2, head_dim=8, sample_size=12)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 3))
    randomize_mixing_(model, low=0.0, high=1.0)
    latent, timestep, labels = dit_inputs(batch=2, size=12)  # 6 x 6 = 36 tokens

    def call(m):
        return m(latent, timestep=timestep, class_labels=labels, return_dict=False)[0]

    return _compare(model, call, _config("ulysses", world), train=True)


def case_wan_pipeline_generate(world: int) -> dict:
    """generate_videos(context_parallel="ring") through a tiny WanPipeline with MHLA (all layers, the one-liner):
    the same video as the single-process run."""
    import copy

    from helpers_wan import tiny_wan_pipeline

    from mhla_diffusers.generation import generate_videos

    pipe = tiny_wan_pipeline(num_layers=2)
    pipe.transformer.set_attn_processor(mhla_diffusers.MHLAProcessor(block_grid=(1, 2, 3)))
    mhla_diffusers.materialize_mhla(pipe.transformer)
    randomize_mixing_(pipe.transformer, low=0.0, high=1.0)
    other = copy.deepcopy(pipe)
    kwargs = dict(frames=5, height=48, width=64, steps=2, seed=3)  # 2 x 3 x 4 = 24 tokens
    ref = generate_videos(None, ["a cat"], pipe=pipe, **kwargs)[0]
    with record_exchanges() as log:
        out = generate_videos(None, ["a cat"], pipe=other, context_parallel="ring", **kwargs)[0]
    return {"output": relative_error(torch.from_numpy(out), torch.from_numpy(ref)), "exchanges": log}


def case_processor_changed_after_enable(world: int) -> dict:
    """remove_mhla after enable_context_parallel. Wan: the stock processors put back run diffusers' context-parallel
    attention (they get the config enable_parallelism gave the others), the stock model's output exactly. DiT: its
    stock attention has no context parallelism and would see one shard: the next forward is refused."""
    wan = tiny_wan(num_layers=2, heads=6, head_dim=8)  # Ulysses over 2 or 3 ranks (diffusers' CPU ring lacks the lse)
    inputs = wan_inputs(batch=1, frames=2, size=(4, 6))  # 2 x 2 x 3 = 12 tokens
    with torch.no_grad():
        stock = _wan_call(inputs)(wan)
    mhla_diffusers.apply_mhla(wan, layers="all", block_grid=(1, 2, 3))
    mhla_diffusers.enable_context_parallel(wan, _config("ulysses", world))
    mhla_diffusers.remove_mhla(wan)
    with torch.no_grad():
        wan_error = relative_error(_wan_call(inputs)(wan), stock)
    dit = tiny_dit(num_layers=2, heads=2, head_dim=8, sample_size=12)
    mhla_diffusers.apply_mhla(dit, layers="all", block_grid=(2, 3))
    mhla_diffusers.enable_context_parallel(dit, _config("ring", world))
    mhla_diffusers.remove_mhla(dit)
    latent, timestep, labels = dit_inputs(batch=1, size=12)
    try:
        with torch.no_grad():
            dit(latent, timestep=timestep, class_labels=labels, return_dict=False)
        dit_error = None
    except ValueError as err:
        dit_error = str(err)
    return {"output": wan_error, "error": dit_error}


@torch.no_grad()
def _random_gates_(model) -> None:
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if ".mhla.gate." in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def case_wan_options_ring(world: int) -> dict:
    """Wan with the authors' layer options under the summary exchange (ring): RoPE before the feature map, the
    authors' gate (its input: this rank's tokens), numerator only + output norm, feature_eps, feature_power (POWER);
    a training step."""
    model = tiny_wan(num_layers=2, heads=2, head_dim=12)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 2, 3), rope="before", gate="authors", normalize=False,
                              feature_eps=1e-3, feature_power=POWER)
    randomize_mixing_(model, low=0.0, high=1.0)
    _random_gates_(model)  # the same on every rank (nn.Linear's init draws from the global RNG, which ranks advance apart)
    inputs = wan_inputs(batch=2, frames=3, size=(8, 12))  # 3 x 4 x 6 = 72 tokens
    return {**_compare(model, _wan_call(inputs), _config("ring", world), train=True), "power": POWER}


def case_wan_options_ulysses(world: int) -> dict:
    """The same options in heads mode (Ulysses: all-to-alls to heads / P heads of all tokens): no RoPE, the neutral
    gate (trained weights), feature_power; a training step."""
    model = tiny_wan(num_layers=2, heads=6, head_dim=8)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(2, 2, 2), rope="none", gate="neutral", feature_power=POWER)
    randomize_mixing_(model, low=0.0, high=1.0)
    _random_gates_(model)
    inputs = wan_inputs(batch=1, frames=2, size=(12, 12))  # 2 x 6 x 6 = 72 tokens
    return {**_compare(model, _wan_call(inputs), _config("ulysses", world), train=True), "power": POWER}


def case_lepe_refused(world: int) -> dict:
    """LePE needs grid neighbours other ranks hold: enable_context_parallel refuses it, and under diffusers' own
    enable_parallelism the layer refuses at its first call (every rank alike, before any collective)."""
    model = tiny_wan(num_layers=1, heads=2, head_dim=12)
    mhla_diffusers.apply_mhla(model, layers="all", block_grid=(1, 2, 2), lepe=True)
    errors = {"enable": None, "call": None}
    try:
        mhla_diffusers.enable_context_parallel(model, _config("ring", world))
    except ValueError as err:
        errors["enable"] = str(err)
    with cpu_device_mesh():
        model.enable_parallelism(config=_config("ring", world))
    try:
        with torch.no_grad():
            model(**wan_inputs(batch=1, frames=2, size=(8, 12)), return_dict=False)  # 2 x 4 x 6 = 48 tokens
    except RuntimeError as err:
        errors["call"] = str(err)
    return errors


def case_wan_vace_hybrid_ulysses(world: int) -> dict:
    """Wan VACE, a hybrid over both kinds of layers by apply_mhla (softmax on main layer 0 and VACE layer 3:
    diffusers' Ulysses attention; MHLA on 1, 2, 4), the family's own plan (Family.cp_plan), a training step."""
    from helpers_wan_vace import tiny_wan_vace, wan_vace_inputs

    model = tiny_wan_vace(num_layers=3, vace_layers=(0, 2), heads=6, head_dim=8)
    mhla_diffusers.apply_mhla(model, layers="hybrid", block_grid=(1, 2, 3))
    randomize_mixing_(model, low=0.0, high=1.0)
    inputs = wan_vace_inputs(batch=1, frames=2, size=(12, 12))  # 2 x 6 x 6 = 72 tokens
    return _compare(model, _wan_call(inputs), _config("ulysses", world), train=True)


def _contract_case(family: str):
    """The family contract (tests/models/test_family_contract.py): the family's tiny model (helpers_families.TINY)
    with MHLA on every layer by apply_mhla, ring mode, forward: the single-process output."""

    def case(world: int) -> dict:
        tiny = TINY[family]
        model = tiny.build(num_layers=3)
        mhla_diffusers.apply_mhla(model, layers="all", block_grid=tiny.block_grid)
        randomize_mixing_(model, low=0.0, high=1.0)
        inputs = tiny.inputs(batch=2)
        return _compare(model, lambda m: tiny.call(m, inputs), _config("ring", world), train=False)

    case.__name__ = f"case_contract_{family}"
    return case


CASES = [
    case_wan_oneliner_ring, case_wan_hybrid_ulysses, case_wan_uneven_numerator, case_wan_uneven_ulysses, case_wan_indivisible_refused,
    case_ulysses_heads_refused, case_sana_oneliner_ring, case_dit_ulysses, case_wan_pipeline_generate, case_processor_changed_after_enable,
    case_hybrid_ring_native_refused, case_wan_options_ring, case_wan_options_ulysses, case_lepe_refused,
    case_wan_vace_hybrid_ulysses,
] + [_contract_case(name) for name, family in FAMILIES.items() if family.context_parallel is not None]


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    for case in CASES:
        try:
            results[case.__name__] = case(world)
        except Exception as err:  # reported per case, so one failure does not hide the others
            results[case.__name__] = {"exception": f"{type(err).__name__}: {err}"}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "results.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
