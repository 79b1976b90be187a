"""Context parallelism for MHLA under diffusers' ``enable_parallelism``.

On a token shard an MHLA self-attention layer is exact in one of two ways: the summary exchange (each
rank's partial block summaries combined by ONE ``all_reduce`` of ``B * heads * M * d * (dv + 1)``
float32 numbers, whatever the token count) or, in Ulysses mode when the degree divides the heads,
heads mode (all-to-alls to ``heads / P`` heads of all tokens). Both give the single-process outputs
and gradients, for uneven shards too. Softmax layers of a hybrid keep diffusers' own path;
cross-attention stays stock. Plans per family: :func:`context_parallel_plan`.

Why an all-reduce, the plans and the byte counts: ``docs/processor.md`` (Context parallelism).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
    ContextParallelGatherHook,
    _get_submodule_by_name,
)
from torch import nn

from mhla_diffusers.families import attention_modules, family_of, self_attention_modules
from mhla_diffusers.models.grid import GridReader, current_model
from mhla_diffusers.ops import InterleavedRotary, mhla_attention
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.sharded import shard_attention, shard_blocks, shard_summaries

__all__ = [
    "Shard",
    "context_shard",
    "shard_sizes",
    "sharded_mhla_attention",
    "record_exchanges",
    "context_parallel_plan",
    "enable_context_parallel",
    "check_context_parallel",
    "cpu_device_mesh",
    "communication_bytes",
]


@dataclass(frozen=True)
class Shard:
    """This rank's contiguous shard of the flattened tokens.

    Attributes:
        group: the context-parallel process group (diffusers' flattened ring x Ulysses mesh).
        rank, world: this rank's index in the group and the group's size ``P``.
        offset, length: the shard is tokens ``[offset, offset + length)`` of ``total``.
        heads_mode: exchange heads (all-to-all, Ulysses) instead of block summaries (all-reduce).
    """

    group: object
    rank: int
    world: int
    offset: int
    length: int
    total: int
    heads_mode: bool = False


def shard_sizes(total: int, world: int) -> list[int]:
    """Tokens per rank as diffusers splits ``total`` tokens over ``world`` ranks (``torch.tensor_split``:
    the first ``total % world`` ranks get one more; equal to ``torch.chunk`` when ``world`` divides ``total``)."""
    return [total // world + (1 if r < total % world else 0) for r in range(world)]


def _context_config(model: nn.Module | None):
    """The model's ``ContextParallelConfig`` once ``enable_parallelism`` has set it up, else ``None``."""
    config = getattr(model, "_parallel_config", None) if model is not None else None
    cp = getattr(config, "context_parallel_config", None)
    return cp if cp is not None and getattr(cp, "_flattened_mesh", None) is not None else None


def context_shard(num_tokens: int, total: int, heads: int = 0) -> Shard | None:
    """This rank's shard for an MHLA layer of the running transformer, or ``None`` when it holds all ``total`` tokens.

    Heads mode in Ulysses mode when the degree divides ``heads``; the summary exchange otherwise.

    Raises:
        RuntimeError: a token count that is neither ``total`` nor this rank's shard of it.
    """
    cp = _context_config(current_model())
    if cp is None or num_tokens == total:
        return None
    group = cp._flattened_mesh.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = shard_sizes(total, world)
    if num_tokens != sizes[rank]:
        raise RuntimeError(
            f"MHLA under context parallelism: rank {rank} of {world} received {num_tokens} of the {total} tokens, but a "
            f"contiguous split gives it {sizes[rank]}; MHLA supports plans that split the flattened tokens evenly "
            "(diffusers' chunk / tensor_split) at the model input (mhla_diffusers.context_parallel_plan)"
        )
    heads_mode = cp.ring_degree == 1 and heads > 0 and heads % world == 0
    return Shard(group, rank, world, sum(sizes[:rank]), num_tokens, total, heads_mode)


_logs: list[list[dict]] = []


@contextlib.contextmanager
def record_exchanges() -> Iterator[list[dict]]:
    """Record every collective MHLA runs under context parallelism inside the block (forward and backward), for measurements.

    Yields a list that receives one dict per collective: ``{"kind": "all_reduce" | "all_to_all" | "all_gather",
    "direction": "forward" | "backward", "shape": tuple, "dtype": torch.dtype, "bytes": payload bytes}`` (the
    tensor handed to the collective: for an all-to-all the whole local tensor, of which ``(P - 1) / P`` leaves).
    """
    log: list[dict] = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def _record(direction: str, tensor: torch.Tensor, kind: str = "all_reduce") -> None:
    for log in _logs:
        log.append({
            "kind": kind, "direction": direction, "shape": tuple(tensor.shape), "dtype": tensor.dtype,
            "bytes": tensor.numel() * tensor.element_size(),
        })


def _all_reduce(packed: torch.Tensor, group) -> torch.Tensor:
    """Sum ``packed`` over the group, differentiably (the backward is the same all-reduce of the gradient)."""
    # function-level import: torch.distributed.nn pulls in RPC modules; only context-parallel runs need it
    from torch.distributed.nn.functional import all_reduce

    _record("forward", packed)
    total = all_reduce(packed.contiguous(), group=group)
    if total.requires_grad and _logs:
        total.register_hook(lambda grad: _record("backward", grad))
    return total


def sharded_mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    shard: Shard,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    rotary: InterleavedRotary | None = None,
    rotary_key: object = None,
    feature_eps: float = 0.0,
    feature_power: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """MHLA of this rank's queries over the whole sequence, from its shard of q, k, v (heads mode or summary exchange).

    Args:
        q, k: ``[B, heads, n, d]``, v: ``[B, heads, n, dv]`` (``n = shard.length``). mixing: ``[M, M]``.
        layout: the :class:`BlockLayout` of all ``shard.total`` tokens. shard: from :func:`context_shard`.
        normalize, eps, feature_eps, feature_power, backend: as :func:`~mhla_diffusers.mhla_attention`.
        rotary: the shard's RoPE (Wan's :class:`~mhla_diffusers.ops.InterleavedRotary`), or the RoPE of all
            ``shard.total`` tokens (a plan splitting the layer alone, SANA-Video's, leaves the tables whole), or ``None``.
        rotary_key: one object per forward, so heads mode all-gathers the tables once per forward.

    Returns:
        ``[B, heads, n, dv]`` in ``q``'s dtype: rows ``[offset, offset + n)`` of the single-process output.
    """
    power = {} if feature_power == 1.0 else {"feature_power": feature_power}  # p = 1: the plain ReLU path
    whole = rotary is not None and rotary.num_tokens == shard.total != shard.length  # tables of every token
    if shard.heads_mode:
        to_heads = [_to_heads(x, shard) for x in (q, k, v)]
        full = rotary if whole or rotary is None else _full_rotary(rotary, rotary_key, shard)
        out = mhla_attention(
            *to_heads, mixing, layout, normalize=normalize, eps=eps, rotary=full, feature_eps=feature_eps, backend=backend,
            **power,
        )
        return _to_tokens(out, shard)
    dtype = q.dtype
    if whole:  # this rank's rows of the tables
        rows = slice(shard.offset, shard.offset + shard.length)
        rotary = InterleavedRotary(rotary.cos[rows], rotary.sin[rows])
    features = {}
    if power:  # phi = ReLU(x) ** p + feature_eps, computed here in the accumulation dtype (the shard ops take features)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        q, k = (torch.relu(x.to(acc)) ** feature_power + feature_eps for x in (q, k))
        features, feature_eps = {"feature_map": None}, 0.0
    kwargs = dict(offset=shard.offset, normalize=normalize, rotary=rotary, feature_eps=feature_eps, **features)
    summaries = _all_reduce(shard_summaries(k, v, layout, **kwargs), shard.group)
    return shard_attention(q, summaries, mixing, layout, eps=eps, **kwargs).to(dtype)


def _all_to_all(flat: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of a 1-D tensor (the backward is the reverse exchange)."""
    from torch.distributed.nn.functional import all_to_all_single  # function-level: see _all_reduce

    _record("forward", flat, "all_to_all")
    out = flat.new_empty(sum(output_sizes))
    out = all_to_all_single(out, flat.contiguous(), output_sizes, input_sizes, group=group)
    if out.requires_grad and _logs:
        out.register_hook(lambda grad: _record("backward", grad, "all_to_all"))
    return out


def _to_heads(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """``[B, H, n, w]`` (this rank's tokens, all heads) -> ``[B, H / P, N, w]`` (all tokens, this rank's heads)."""
    b, h, n, w = x.shape
    g = h // shard.world
    sizes = shard_sizes(shard.total, shard.world)
    send = x.reshape(b, shard.world, g, n, w).transpose(0, 1).reshape(-1)  # head group j goes to rank j
    got = _all_to_all(send, [b * g * m * w for m in sizes], [b * g * n * w] * shard.world, shard.group)
    parts = got.split([b * g * m * w for m in sizes])
    return torch.cat([p.view(b, g, m, w) for p, m in zip(parts, sizes)], dim=2)


def _to_tokens(y: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``[B, H / P, N, w]`` -> ``[B, H, n, w]``."""
    b, g, _, w = y.shape
    sizes = shard_sizes(shard.total, shard.world)
    send = torch.cat([p.reshape(-1) for p in y.split(sizes, dim=2)])  # rank j gets its tokens of my heads
    got = _all_to_all(send, [b * g * shard.length * w] * shard.world, [b * g * m * w for m in sizes], shard.group)
    return got.view(shard.world, b, g, shard.length, w).transpose(0, 1).reshape(b, g * shard.world, shard.length, w)


class _RotaryCache(threading.local):
    """The rotary tables of all tokens of the current forward (one entry per thread: the key and the tables)."""

    def __init__(self):
        self.key, self.full = None, None


_rotary_cache = _RotaryCache()


def _full_rotary(rotary, key, shard: Shard) -> InterleavedRotary:
    """The :class:`InterleavedRotary` of all ``shard.total`` tokens from every rank's tables (one all-gather per
    forward: cached under ``key``, which every layer of one forward passes; the same on every rank)."""
    if not isinstance(rotary, InterleavedRotary):
        raise TypeError(f"context parallelism in heads mode needs an InterleavedRotary; got {type(rotary).__name__}")
    if key is not None and _rotary_cache.key is key:
        return _rotary_cache.full
    half = rotary.cos.shape[-1]
    both = _all_gather_tokens(torch.cat((rotary.cos, rotary.sin), dim=-1).detach(), shard)  # one collective
    full = InterleavedRotary(both[:, :half], both[:, half:])
    _rotary_cache.key, _rotary_cache.full = key, full
    return full


def _all_gather_tokens(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """``[n, ...]`` of every rank -> ``[N, ...]`` in rank order (padded to the longest shard: gloo's all_gather
    needs equal sizes)."""
    sizes = shard_sizes(shard.total, shard.world)
    padded = torch.cat((x, x.new_zeros(max(sizes) - x.shape[0], *x.shape[1:]))).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    _record("forward", padded, "all_gather")
    dist.all_gather(parts, padded, group=shard.group)
    return torch.cat([p[:m] for p, m in zip(parts, sizes)])


# -- plans ----------------------------------------------------------------------------------------
def _mhla_self_attention(model: nn.Module, family) -> list[tuple[str, bool]]:
    """``[(module name, runs MHLA)]`` of the model's self-attention layers."""
    return [(name, isinstance(getattr(attn, "processor", None), GridReader)) for name, attn in self_attention_modules(model, family)]


def context_parallel_plan(model: nn.Module) -> dict:
    """The ``cp_plan`` for ``model.enable_parallelism(config=..., cp_plan=...)`` of an MHLA model, per ``Family.context_parallel``.

    Wan: its own ``_cp_plan`` (Wan VACE: the family's, ``Family.cp_plan``); DiT: the trunk ``transformer_blocks.0`` ..
    ``proj_out_2`` (all layers MHLA); SANA, SANA-Video: each MHLA layer alone (inference only). Build it after
    installing MHLA.

    Raises:
        ValueError: unsupported model or no plan, no MHLA layer, or softmax self-attention left in a trunk plan.
    """
    # function-level import: diffusers' parallel classes import torch.distributed's device mesh
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    family = family_of(model)
    layers = _mhla_self_attention(model, family)
    if family.context_parallel is None:
        raise ValueError(f"MHLA has no context-parallel plan for {type(model).__name__}")
    if not any(mhla for _, mhla in layers):
        raise ValueError(f"this {type(model).__name__} has no MHLA layer; install MHLA before building its context-parallel plan")
    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    if family.context_parallel == "model":
        return family.cp_plan(model) if family.cp_plan is not None else dict(type(model)._cp_plan)
    if family.context_parallel == "trunk":
        softmax = [name for name, mhla in layers if not mhla]
        if softmax:
            raise ValueError(
                f"the stock self-attention of {type(model).__name__} has no context parallelism, and {softmax} run it: "
                "install MHLA on every layer (apply_mhla(model, layers='all')) to run it under context parallelism"
            )
        first, last = family.cp_trunk
        return {first: {"hidden_states": split}, last: gather}
    plan: dict = {}
    for name, mhla in layers:
        if mhla:
            plan[name] = {"hidden_states": split}
            plan[f"{name}.to_out.0"] = gather
    return plan


@contextlib.contextmanager
def cpu_device_mesh() -> Iterator[None]:
    """Let diffusers build its device mesh on a machine without an accelerator (CPU processes over gloo).

    diffusers' ``enable_parallelism`` places rank ``r`` on device ``r % torch.accelerator.device_count()``,
    which divides by zero without an accelerator. Inside this block, and only when no accelerator exists,
    ``torch.accelerator.device_count()`` answers 1 (the CPU); with an accelerator it does nothing.
    :func:`enable_context_parallel` uses it around ``enable_parallelism`` only.
    """
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def _token_count_check(degree: int, anything: bool, planned: frozenset[str] = frozenset()):
    """Forward pre-hook refusing unsplittable token counts and planned layers that no longer run MHLA."""

    def check(model, args, kwargs):
        # a processor installed after enable_parallelism (remove_mhla putting the stock one back, a new processor)
        # never got diffusers' config and would attend over this rank's tokens alone: give it, as enable_parallelism does
        config = getattr(model, "_parallel_config", None)
        if config is not None and not planned:
            for attn in attention_modules(model).values():
                processor = getattr(attn, "processor", None)
                if hasattr(processor, "_parallel_config") and processor._parallel_config is None:
                    processor._parallel_config = config
        if planned:
            lost = sorted(name for name, mhla in _mhla_self_attention(model, family_of(model)) if name in planned and not mhla)
            if lost:
                raise ValueError(
                    f"{lost} ran MHLA when context parallelism was enabled and now run the stock attention, which would "
                    "see only this rank's share of the tokens (a silently wrong output): put MHLA back on them "
                    "(remove_mhla / a processor change after enable_context_parallel is not supported under it)"
                )
        latent = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(latent, torch.Tensor):
            return
        grid = family_of(model).grid_from_latent(latent, model.config)
        tokens = math.prod(grid)
        if tokens < degree:
            raise ValueError(f"context parallelism over {degree} ranks needs >= {degree} tokens; this input has {tokens} {grid}")
        if tokens % degree and not anything:
            raise ValueError(
                f"the token grid {grid} has {tokens} tokens, which {degree} ranks cannot split evenly: use "
                "ContextParallelConfig(..., ring_anything=True) or (..., ulysses_anything=True) for uneven shards, "
                "or a size whose token count divides by the degree"
            )

    return check


def _has_lepe(attn: nn.Module) -> bool:
    """The layer runs MHLA with a LePE convolution, or will (a pending one-liner layer whose processor asks for one)."""
    processor = getattr(attn, "processor", None)
    if not isinstance(processor, GridReader):
        return False
    layer = getattr(attn, "mhla", None)
    return bool(getattr(processor, "lepe", None)) if layer is None else layer.lepe is not None


def _denominator(attn: nn.Module) -> str:
    """The normaliser the layer runs with MHLA (its own, or a pending one-liner layer's processor's), else ``"paper"``."""
    processor = getattr(attn, "processor", None)
    if not isinstance(processor, GridReader):
        return "paper"
    layer = getattr(attn, "mhla", None)
    return (getattr(processor, "denominator", None) if layer is None else layer.denominator) or "paper"


# diffusers 0.42 backends whose attention refuses return_lse=True (ring attention needs it); "native" is the default
_NO_LSE_BACKENDS = frozenset({"native", "_native_efficient", "_native_math", "_native_npu", "_native_xla", "xformers"})


def _attention_backend(attn: nn.Module) -> str:
    """The name of the diffusers attention backend ``attn``'s processor dispatches to (its own, else the active one)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = getattr(getattr(attn, "processor", None), "_attention_backend", None)
    if backend is None:
        backend, _ = _AttentionBackendRegistry.get_active_backend()
    return getattr(backend, "value", backend)


def check_context_parallel(model: nn.Module) -> None:
    """``ValueError`` for MHLA layers that cannot run on a rank's share of the tokens: a LePE convolution, the authors'
    DiT normaliser (both need tokens other ranks hold). Needs no process group; :func:`enable_context_parallel`
    runs it first."""
    lepe = [name for name, attn in self_attention_modules(model, family_of(model)) if _has_lepe(attn)]
    if lepe:
        raise ValueError(
            f"{lepe} have a LePE convolution (lepe=True), which needs each token's neighbours on the token grid, but under "
            "context parallelism a rank holds only its share of the tokens: LePE is not supported under context "
            "parallelism; run this model in one process, or convert without lepe"
        )
    positional = [name for name, attn in self_attention_modules(model, family_of(model)) if _denominator(attn) != "paper"]
    if positional:
        raise ValueError(
            f"{positional} use the authors' DiT normaliser (denominator='authors_dit'), which pairs each query with the "
            "queries at its position in every other block, but under context parallelism a rank holds only its share of "
            "the tokens: not supported under context parallelism; run this model in one process"
        )


def enable_context_parallel(model: nn.Module, config) -> None:
    """Put an MHLA transformer under diffusers' context parallelism, checked (``torch.distributed`` initialised).

    Calls ``model.enable_parallelism`` with :func:`context_parallel_plan` inside :func:`cpu_device_mesh`, and
    adds a pre-hook refusing token counts the degree cannot split.

    Args:
        config (ContextParallelConfig): diffusers' ``ContextParallelConfig`` (``ring_degree=P`` or ``ulysses_degree=P``).

    Raises:
        ValueError: no plan; an MHLA layer with LePE (its convolution needs neighbouring tokens other ranks hold);
            hybrid softmax layers whose heads the Ulysses degree does not divide, or in ring mode on a backend
            without log-sum-exp; a degree above the world size.
        RuntimeError: torch.distributed not initialised.
    """
    check_context_parallel(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised (run under torchrun, then init_process_group)")
    plan = context_parallel_plan(model)
    degree = config.ring_degree * config.ulysses_degree
    if degree > dist.get_world_size():
        raise ValueError(f"a context-parallel degree of {degree} needs {degree} processes; the world has {dist.get_world_size()}")
    family = family_of(model)
    softmax = [attn for _, attn in self_attention_modules(model, family) if not isinstance(getattr(attn, "processor", None), GridReader)]
    ulysses = config.ulysses_degree > 1 and not config.ulysses_anything
    if family.context_parallel == "model" and softmax and ulysses and softmax[0].heads % config.ulysses_degree:
        raise ValueError(
            f"Ulysses attention splits the {softmax[0].heads} heads of the softmax layers over ulysses_degree="
            f"{config.ulysses_degree}, which does not divide them: choose a degree that divides {softmax[0].heads}, "
            "ulysses_anything=True, or ring_degree"
        )
    if family.context_parallel == "model" and softmax and config.ring_degree > 1:
        backend = _attention_backend(softmax[0])
        if backend in _NO_LSE_BACKENDS:
            raise ValueError(
                f"ring attention of the softmax layers (hybrid: {len(softmax)} of them) needs an attention backend that "
                f"returns the log-sum-exp, and they use {backend!r}, which does not: call "
                "transformer.set_attention_backend('_native_cudnn') (or 'flash') first, use ulysses_degree (Ulysses "
                "mode; generate.py --context-parallel ulysses), or MHLA on every layer"
            )
    with cpu_device_mesh():
        model.enable_parallelism(config=config, cp_plan=plan)
    if family.context_parallel == "layers":
        _keep_stock_attention_local(model)
    if (config.ring_anything or config.ulysses_anything) and dist.get_backend(config._flattened_mesh.get_group()) == "gloo":
        _pad_uneven_gathers(model, plan)
    # DiT ("trunk") and SANA ("layers") plans shard tokens around layers that must keep running MHLA
    planned = frozenset() if family.context_parallel == "model" else frozenset(
        name for name, mhla in _mhla_self_attention(model, family) if mhla
    )
    model.register_forward_pre_hook(
        _token_count_check(degree, config.ring_anything or config.ulysses_anything, planned), with_kwargs=True
    )


def _keep_stock_attention_local(model: nn.Module) -> None:
    """Under a ``"layers"`` plan only the planned MHLA layers see shards: take diffusers' parallel config back from
    every other processor, which would otherwise run a ring / Ulysses exchange over tokens no rank split
    (SANA-Video's cross-attention processor passes its config to the attention dispatch unconditionally)."""
    for attn in attention_modules(model).values():
        processor = getattr(attn, "processor", None)
        if not isinstance(processor, GridReader) and getattr(processor, "_parallel_config", None) is not None:
            processor._parallel_config = None


# -- the output gather of uneven shards on gloo ------------------------------------------------------
class _PaddedAllGather(torch.autograd.Function):
    """All-gather of uneven shards along ``dim`` (padded, gathered, trimmed); backward: this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
        local = torch.tensor([tensor.shape[dim]], dtype=torch.int64)
        counts = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, local, group=group)
        sizes = [int(c) for c in counts]
        pad = list(tensor.shape)
        pad[dim] = max(sizes) - tensor.shape[dim]
        padded = torch.cat((tensor, tensor.new_zeros(pad)), dim=dim).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None


class _PaddedGatherHook(ContextParallelGatherHook):
    """diffusers' output gather hook (``ContextParallelGatherHook``) with :class:`_PaddedAllGather` for the
    gather of uneven shards."""

    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        group = self.parallel_config._flattened_mesh.get_group()
        for i, entry in enumerate(self.metadata):
            if entry is not None:
                outputs[i] = _PaddedAllGather.apply(outputs[i].contiguous(), entry.gather_dim, group)
        return outputs[0] if single else tuple(outputs)


def _pad_uneven_gathers(model: nn.Module, plan: dict) -> None:
    """Replace, on ``model`` only, each output gather hook diffusers' ``enable_parallelism`` registered for
    ``plan`` by a :class:`_PaddedGatherHook` (same registry name, so diffusers removes it as its own)."""

    for module_id, entry in plan.items():
        if isinstance(entry, dict):  # an input split: unchanged
            continue
        modules = _get_submodule_by_name(model, module_id)
        for module in modules if isinstance(modules, list) else [modules]:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
            hook = registry.get_hook(name)
            if hook is not None:
                registry.remove_hook(name)
                registry.register_hook(_PaddedGatherHook(hook.metadata, hook.parallel_config), name)


# -- communication ----------------------------------------------------------------------------------
def communication_bytes(
    tokens: int, heads: int, head_dim: int, num_blocks: int, world: int, *, batch: int = 1,
    activation_bytes: int = 2, normalize: bool = True, layout: BlockLayout | None = None,
) -> dict[str, float]:
    """Bytes one rank sends for ONE attention layer's forward under context parallelism over ``world`` ranks.

    From the shapes (diffusers 0.42's algorithms; ``world`` divides ``tokens`` and ``heads``); keys
    ``"ring"``, ``"ulysses"``, ``"mhla_heads"``, ``"rope_gather"``, ``"mhla_payload"``, ``"mhla"``,
    ``"mhla_alltoall_min"`` and, with ``layout``, ``"mhla_alltoall"``. Formulas: ``docs/processor.md``.

    Raises:
        ValueError: non-positive sizes, ``world < 2``, a layout of another token or block count.
    """
    if min(tokens, heads, head_dim, num_blocks, batch, activation_bytes) < 1 or world < 2:
        raise ValueError("sizes must be positive and world >= 2")
    shard = batch * tokens / world * heads * head_dim * activation_bytes
    payload = batch * heads * num_blocks * head_dim * (head_dim + (1 if normalize else 0)) * 4
    result = {
        "ring": (world - 1) * 2 * shard,
        "ulysses": 4 * (world - 1) / world * shard,
        "mhla_heads": 4 * (world - 1) / world * shard,
        "rope_gather": (world - 1) * tokens / world * head_dim * 4,
        "mhla_payload": float(payload),
        "mhla": 2 * (world - 1) / world * payload,
        "mhla_alltoall_min": (world - 1) / world * payload,
    }
    if layout is not None:
        if layout.num_tokens != tokens or layout.num_blocks != num_blocks:
            raise ValueError(f"{layout} does not have {tokens} tokens and {num_blocks} blocks")
        sizes = shard_sizes(tokens, world)
        touched = [len(shard_blocks(layout, sum(sizes[:r]), n).blocks) for r, n in enumerate(sizes)]
        result["mhla_alltoall"] = max(sum(touched) - t for t in touched) * payload / num_blocks
    return result
