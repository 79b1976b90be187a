"""Attention-cost models of hybrid selection: per-layer FLOPs at the native token grid, or the measured time of
each layer's attention operator on the device at hand; and cost fractions (``docs/selection.md``, "The
attention-cost model")."""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.families import family_of, self_attention_modules
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.ops import mhla_attention
from mhla_diffusers.ops.layout import BlockLayout, normalize_grid
from mhla_diffusers.ops.mixing import mixing_init
from mhla_diffusers.ops.naive import plain_linear_attention
from mhla_diffusers.selection.hybrid import attention_flops, select_layers

__all__ = ["MeasuredCost", "COST_MODELS", "layer_attention_flops", "layer_attention_costs", "attention_cost",
           "cost_fraction", "time_attention"]

#: the ``cost=`` names: ``"flops"`` (:func:`attention_flops`) or ``"measured"`` (:class:`MeasuredCost` defaults)
COST_MODELS = ("flops", "measured")


@dataclass(frozen=True)
class MeasuredCost:
    """Price each layer by timing its attention operator (``cost="measured"`` with settings).

    Per distinct layer shape (heads, head_dim) it times, on the device and in the dtype of the layer's
    weights, one forward of the stock attention (softmax: ``F.scaled_dot_product_attention``; linear:
    :func:`~mhla_diffusers.ops.naive.plain_linear_attention`) and of :func:`~mhla_diffusers.mhla_attention`
    (the layer's block grid and backend) on ``[1, heads, N, head_dim]`` random inputs: the minimum over
    ``reps`` calls after a warm-up on a small problem. Projections are excluded, as in the FLOP model.

    Attributes:
        grid: token grid ``(T, H, W)`` (or ``(H, W)``) to price at; ``None``: the model's native grid. Softmax at
            the native video size is slow on a CPU (Wan-1.3B at 21 x 30 x 52: about a minute per call on one
            core): a smaller grid keeps the ratios' trend (``docs/performance.md``).
        cache: a JSON file of earlier measurements (read if present, updated atomically); ``None``: none kept.
            Entries are keyed by operator, shape, grid, block grid, backend, dtype, device name, threads and torch.
        reps: timed calls per operator (>= 1).

    Raises:
        ValueError: a grid that is not 1-3 positive integers, ``reps < 1``.
    """

    grid: Sequence[int] | None = None
    cache: str | os.PathLike | None = None
    reps: int = 2

    def __post_init__(self):
        if self.grid is not None:
            object.__setattr__(self, "grid", normalize_grid(tuple(self.grid)))
        if not isinstance(self.reps, int) or isinstance(self.reps, bool) or self.reps < 1:
            raise ValueError(f"MeasuredCost(reps=) must be an integer >= 1; got {self.reps!r}")


def cost_fraction(stock: Sequence[float], mhla: Sequence[float], chosen: Sequence[int]) -> float:
    """``sum_l (mhla[l] if l in chosen else stock[l]) / sum_l stock[l]``."""
    cost = sum(mhla[i] if i in chosen else stock[i] for i in range(len(stock)))
    return cost / sum(stock)


def _layer_shapes(transformer: nn.Module, family) -> list[tuple[int, int]]:
    shapes = []
    for _, attn in self_attention_modules(transformer, family):
        heads = int(attn.heads)
        shapes.append((heads, (attn.to_q.out_features if hasattr(attn, "to_q") else attn.inner_dim) // heads))
    return shapes


def _block_grid(transformer, family, num_blocks, block_grid) -> tuple[int, int, int]:
    reference = family.reference_grid(transformer.config)
    return MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid).resolve_block_grid(reference, family)


def layer_attention_flops(
    transformer: nn.Module, *, num_blocks: int | None = None, block_grid: Sequence[int] | str | None = None
) -> tuple[list[int], list[int]]:
    """``(stock, mhla)`` attention FLOPs per self-attention layer at the native token grid."""
    family = family_of(transformer)
    reference = family.reference_grid(transformer.config)
    tokens, blocks = math.prod(reference), math.prod(_block_grid(transformer, family, num_blocks, block_grid))
    shapes = _layer_shapes(transformer, family)
    return ([attention_flops(family.stock_attention, tokens, d, h) for h, d in shapes],
            [attention_flops("mhla", tokens, d, h, blocks) for h, d in shapes])


def layer_attention_costs(
    transformer: nn.Module,
    cost: str | MeasuredCost = "flops",
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
    backend: str = "auto",
) -> tuple[list[float], list[float], dict]:
    """``(stock, mhla, record)``: each self-attention layer's attention cost under the cost model ``cost``.

    ``"flops"``: FLOPs at the native token grid (:func:`layer_attention_flops`). ``"measured"`` or a
    :class:`MeasuredCost`: seconds of one forward of the operator, timed here (see :class:`MeasuredCost`).
    ``record`` says how they were priced (kept in the selection record of ``mhla_config.json``).

    Raises:
        ValueError: an unknown ``cost``; a pricing grid the block grid does not fit.
    """
    if isinstance(cost, str) and cost == "flops":
        stock, mhla = layer_attention_flops(transformer, num_blocks=num_blocks, block_grid=block_grid)
        return stock, mhla, {"model": "flops"}
    if isinstance(cost, str) and cost == "measured":
        cost = MeasuredCost()
    if not isinstance(cost, MeasuredCost):
        raise ValueError(f"cost must be one of {COST_MODELS} or a MeasuredCost(...); got {cost!r}")
    family = family_of(transformer)
    grid = cost.grid or family.reference_grid(transformer.config)
    blocks = _block_grid(transformer, family, num_blocks, block_grid)
    _check_fits(blocks, grid)
    weight = next(self_attention_modules(transformer, family)[0][1].parameters())  # the layers' device and dtype
    cache = _read_cache(cost.cache)
    timed = {}
    for shape in dict.fromkeys(_layer_shapes(transformer, family)):
        for kind in (family.stock_attention, "mhla"):
            key = _cache_key(kind, shape, grid, blocks, backend, weight)
            if key not in cache:
                cache[key] = time_attention(kind, *shape, grid, blocks, device=weight.device, dtype=weight.dtype,
                                            backend=backend, reps=cost.reps)
            timed[kind, shape] = cache[key]
    _write_cache(cost.cache, cache)
    shapes = _layer_shapes(transformer, family)
    record = {"model": "measured", "grid": list(grid), "block_grid": list(blocks), "device": _device_name(weight.device),
              "dtype": str(weight.dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "reps": cost.reps}
    return ([timed[family.stock_attention, s] for s in shapes], [timed["mhla", s] for s in shapes], record)


def time_attention(
    kind: str,
    heads: int,
    head_dim: int,
    grid: Sequence[int],
    block_grid: Sequence[int] = (1, 1, 1),
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    reps: int = 2,
) -> float:
    """Seconds of one forward (``torch.no_grad``) of an attention operator on ``[1, heads, N, head_dim]`` inputs.

    ``kind``: ``"softmax"`` (``F.scaled_dot_product_attention``), ``"linear"``
    (:func:`~mhla_diffusers.ops.naive.plain_linear_attention`) or ``"mhla"`` (:func:`~mhla_diffusers.mhla_attention`
    over ``block_grid`` with the locality-initialised mixing matrix, ``backend``). ``N = prod(grid)``. The
    minimum of ``reps`` timed calls after one warm-up call on a 4-token problem; CUDA is synchronised.

    Raises:
        ValueError: an unknown ``kind``; a block grid that does not fit ``grid``.
    """
    if kind not in ("softmax", "linear", "mhla"):
        raise ValueError(f"kind must be 'softmax', 'linear' or 'mhla'; got {kind!r}")
    device = torch.device(device)

    def make(grid_, blocks_):
        layout = BlockLayout(normalize_grid(tuple(grid_)), tuple(blocks_) if kind == "mhla" else (1, 1, 1))
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, layout.num_tokens, head_dim, generator=gen).to(device, dtype) for _ in range(3))
        if kind == "softmax":
            return lambda: F.scaled_dot_product_attention(q, k, v)
        if kind == "linear":
            return lambda: plain_linear_attention(q, k, v)
        mixing = mixing_init(layout).to(device)
        return lambda: mhla_attention(q, k, v, mixing, layout, backend=backend)

    grid, block_grid = normalize_grid(tuple(grid)), normalize_grid(tuple(block_grid))
    if kind == "mhla":
        _check_fits(block_grid, grid)
    call = make(grid, block_grid)
    best = math.inf
    with torch.no_grad():
        make((2, 2), (1, 1))()
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            call()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    return best


def attention_cost(
    transformer: nn.Module,
    layers: str | Sequence[int] = "all",
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
    cost: str | MeasuredCost = "flops",
) -> float:
    """The attention cost with MHLA on ``layers`` (not ``"auto"``) as a fraction of the stock model's, under the
    cost model ``cost`` (:func:`layer_attention_costs`); ``ValueError`` if bad."""
    stock, mhla, _ = layer_attention_costs(transformer, cost, num_blocks=num_blocks, block_grid=block_grid)
    return cost_fraction(stock, mhla, select_layers(len(stock), layers))


def _check_fits(block_grid, grid) -> None:
    if any(b > n for b, n in zip(block_grid, grid)):
        raise ValueError(
            f"the block grid {tuple(block_grid)} does not fit the token grid {tuple(grid)} the cost is measured at: price "
            "at a grid at least as large on every axis (MeasuredCost(grid=...)), or give a smaller block grid")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _cache_key(kind, shape, grid, blocks, backend, weight) -> str:
    return "|".join(str(x) for x in (
        kind, f"{shape[0]}x{shape[1]}", "x".join(map(str, grid)), "x".join(map(str, blocks)) if kind == "mhla" else "-",
        backend if kind == "mhla" else "-", str(weight.dtype).replace("torch.", ""), _device_name(weight.device),
        f"{torch.get_num_threads()} threads", f"torch {torch.__version__}"))


def _read_cache(path) -> dict:
    """The cache file's ``{key: seconds}`` (``{}`` when there is none yet).

    Raises:
        ValueError: not readable JSON, not an object, or an entry that is not a time (a finite number of seconds
            > 0; booleans, NaN and infinities included): the message names the file and the entry.
    """
    if path is None or not Path(path).exists():
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"the cost cache {str(path)!r} is not a readable JSON file ({err}); delete it or give another path") from err
    if not isinstance(data, dict):
        raise ValueError(f"the cost cache {str(path)!r} is not a cost cache (a JSON object of seconds); give another path")
    for key, seconds in data.items():
        if not _is_time(seconds):
            raise ValueError(
                f"the cost cache {str(path)!r} is not a cost cache of seconds: entry {key!r} holds {seconds!r}, not a time "
                "(a finite number > 0); delete that entry (or the file) to measure it again"
            )
    return data


def _is_time(seconds) -> bool:
    """A measured time: a finite number of seconds > 0 (not a boolean, which JSON's true / false read as)."""
    return isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds > 0


def _write_cache(path, cache: dict) -> None:
    """Write ``cache`` to ``path`` atomically (a temporary file beside it, then ``os.replace``)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
