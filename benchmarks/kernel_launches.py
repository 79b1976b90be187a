"""What MHLA's backends run, recorded on ``meta`` tensors: the Triton backend's launches and the ATen ops around them.

Part of ``kernel_costs`` (``benchmarks/kernel_costs.py``: the method); the bytes model (``kernel_bytes.py``)
and the compile report (``kernel_compile.py``) start from :func:`record`'s :class:`Recording`.

- **Shapes** of the report (:data:`SHAPES`) and the helpers that turn them into a ``BlockLayout``.
- **ATen ops.** :func:`op_counter`: a ``TorchDispatchMode`` that counts every ATen op and the bytes of its
  tensor inputs plus outputs (views and allocations apart).
- **Launches.** :func:`record` runs the Triton backend's own host code (``mhla_diffusers.ops.triton_ops``) on
  ``meta`` tensors with its launch recorder (``triton_ops._RECORD``, private) switched on: kernels are not
  run, their grids, arguments and meta-parameters are recorded with the CUDA launch configuration (tiles,
  warps, stages, splits), so nothing here copies the launchers' tile choices.

Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Tensors smaller than this (bytes) are assumed to stay in L2 in every scenario: mixing matrix, block
#: starts / sizes, eps (an H100 / H200 has 50 MB of L2).
SMALL_BYTES = 1 << 20


@dataclass(frozen=True)
class Shape:
    """One model's self-attention at one resolution: ``heads`` x ``head_dim``, a token ``grid`` (T, H, W)."""

    name: str
    heads: int
    head_dim: int
    grid: tuple[int, int, int]
    #: block grid (bt, bh, bw), or None: ``choose_block_grid(grid, num_blocks)``
    block_grid: tuple[int, int, int] | None = None
    #: target M for ``choose_block_grid`` when ``block_grid`` is None (None: the library default)
    num_blocks: int | None = None
    #: the family applies RoPE (Wan): reported with and without the fused rotation
    rope: bool = False
    note: str = ""


#: Shapes of the report (batch 1 unless asked otherwise: the kernels' tiles and splits do not depend on the batch).
SHAPES = {s.name: s for s in (
    Shape("wan2.1-1.3b-480p", 12, 128, (21, 30, 52), (3, 5, 7), rope=True, note="Wan family default M = 105 (the paper's)"),
    Shape("wan2.1-1.3b-480p-M84", 12, 128, (21, 30, 52), (3, 4, 7), rope=True, note="choose_block_grid's generic default"),
    Shape("wan2.1-1.3b-480p-M64", 12, 128, (21, 30, 52), (4, 4, 4), rope=True, note="M = 64"),
    Shape("wan2.1-14b-720p", 40, 128, (21, 45, 80), None, 105, rope=True, note="Wan family default target M = 105"),
    Shape("sana-1600m-4k", 70, 32, (1, 128, 128), note="library default M"),
    Shape("dit-xl-2-256", 16, 72, (1, 16, 16), note="library default M"),
    Shape("dit-xl-2-512", 16, 72, (1, 32, 32), note="library default M"),
)}


# ---------------------------------------------------------------------------------------------
# Small helpers


def _torch_dtype(dtype):
    """``torch.bfloat16`` from ``"bfloat16"`` / ``"bf16"`` / a torch dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    return getattr(torch, names.get(str(dtype), str(dtype).replace("torch.", "")))


def _grid3(grid) -> tuple[int, int, int]:
    """A token grid as (T, H, W): ``(H, W)`` -> ``(1, H, W)``."""
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    return tuple([1] * (3 - len(grid)) + list(grid))


def _layout(grid, block_grid, num_blocks=None):
    from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid

    grid = _grid3(grid)
    if block_grid is None:
        block_grid = choose_block_grid(grid, num_blocks)
    return BlockLayout(grid, _grid3(block_grid))


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Counting ATen ops and their bytes (torch backend; the Triton launcher's torch ops between kernels)


def _allocation(func) -> bool:
    return func.__name__.split(".")[0] in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")


def _op_tensors(func, args, kwargs):
    """``(read, written)`` tensors of one op by its schema: ``out=`` and ``copy_`` destinations are written
    only, other in-place arguments read and written, fresh results written."""
    import torch
    from torch.utils._pytree import tree_flatten

    def tensors(x):
        return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]

    read, written = [], []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        ts = tensors(value)
        write = arg.alias_info is not None and arg.alias_info.is_write
        if write:
            written += ts
        if not write or not (arg.kwarg_only or func.__name__.startswith("copy_")):
            read += ts
    return read, written


@dataclass
class OpRecord:
    """One ATen op: name, bytes read and written (every tensor input plus output, views excluded)."""

    name: str
    read: int
    written: int
    small: int  # of read + written, bytes in tensors under SMALL_BYTES


def op_counter():
    """A ``TorchDispatchMode`` recording every ATen op as an :class:`OpRecord` (``.ops``), views and allocations
    apart (``.views``, ``.allocations``: counts only; they move no data)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[OpRecord] = []
            self.views = self.allocations = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view:
                self.views += 1
            elif _allocation(func):
                self.allocations += 1
            else:
                self.ops.append(_record(func, args, kwargs, out))
            return out

    return _Counter()


def _record(func, args, kwargs, out) -> OpRecord:
    import torch
    from torch.utils._pytree import tree_flatten

    read, written = _op_tensors(func, args, kwargs)
    outs, rets = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)], func._schema.returns
    if len(outs) == len(rets):  # results that alias an argument (in place, out=) are counted with it
        fresh = [t for t, ret in zip(outs, rets) if ret.alias_info is None]
    else:
        fresh = [t for t in outs if not any(t is w for w in written)]
    rb, wb = sum(map(_nbytes, read)), sum(map(_nbytes, written + fresh))
    small = sum(_nbytes(t) for t in read + written + fresh if _nbytes(t) < SMALL_BYTES)
    return OpRecord(func.__name__, rb, wb, small)


def _op_summary(ops: list[OpRecord], views: int = 0, allocations: int = 0) -> dict:
    """Op count and bytes (read + written) of a list of ops."""
    by_name: dict[str, dict] = {}
    for op in ops:
        row = by_name.setdefault(op.name, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += op.read + op.written
    return {
        "ops": len(ops),
        "views": views,
        "allocations": allocations,
        "read_bytes": sum(o.read for o in ops),
        "written_bytes": sum(o.written for o in ops),
        "bytes": sum(o.read + o.written for o in ops),
        "by_op": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["bytes"])),
    }


# ---------------------------------------------------------------------------------------------
# Recording the Triton backend's launches


@dataclass
class Launch:
    """One recorded kernel launch with the CUDA configuration; ``phase`` is ``"forward"`` or ``"backward"``."""

    kernel: object
    grid: tuple
    args: tuple
    meta: dict
    phase: str
    role: str = ""

    @property
    def name(self) -> str:
        return _kernel_name(self.kernel)

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@dataclass
class Recording:
    """The launches and the launcher's torch ops of one inference forward, and of a training forward + backward."""

    layout: object
    batch: int
    forward: list[Launch]
    forward_ops: list[OpRecord]
    train_forward: list[Launch]
    train_forward_ops: list[OpRecord]
    backward: list[Launch]
    backward_ops: list[OpRecord]


def _inputs(batch, heads, layout, head_dim, dtype, memory="bnhd", requires_grad=False):
    """q, k, v on ``meta`` in diffusers' ``[B, N, H, d]`` memory viewed as ``[B, H, N, d]`` (``memory="bnhd"``) or contiguous."""
    import torch

    n = layout.num_tokens

    def one():
        if memory == "bnhd":
            t = torch.empty(batch, n, heads, head_dim, dtype=dtype, device="meta").transpose(1, 2)
        else:
            t = torch.empty(batch, heads, n, head_dim, dtype=dtype, device="meta")
        return t.requires_grad_(requires_grad)

    q, k, v = one(), one(), one()
    mixing = torch.empty(layout.num_blocks, layout.num_blocks, device="meta").requires_grad_(requires_grad)
    return q, k, v, mixing


def _rotary(layout, head_dim):
    """Wan's RoPE as the kernels take it: an ``InterleavedRotary`` with fp32 ``[N, d/2]`` tables on ``meta``."""
    import torch

    from mhla_diffusers.ops.rotary import InterleavedRotary

    table = (layout.num_tokens, head_dim // 2)
    return InterleavedRotary(torch.empty(table, device="meta"), torch.empty(table, device="meta"))


def _roles(launches: list[Launch]) -> list[Launch]:
    """Name what each launch computes (the mixing GEMM runs four times)."""
    mixes = {"forward": iter(["S~ = Mc S", "z~ = Mc z"]), "train": iter(["S~ = Mc S", "z~ = Mc z"]),
             "backward": iter(["S~ = Mc S (recomputed)", "z~ = Mc z (recomputed)", "dS = Mc^T dS~", "dz = Mc^T dz~"])}
    for launch in launches:
        launch.role = next(mixes[launch.phase], "") if launch.name == "mix_gemm" else launch.name
    return launches


def record(batch, heads, grid, head_dim, block_grid, dtype, rope, num_blocks=None) -> Recording:
    """Run the Triton backend's host code on ``meta`` tensors with launches recorded (nothing runs on a device).

    Records an inference forward (no grad) and a training forward + backward of every input and the mixing
    matrix; the torch ops the launcher runs between kernels are counted by :func:`op_counter`. Uses the
    private ``triton_ops._RECORD`` and ``_MHLATriton`` (there is no public hook for this).
    """
    import torch

    from mhla_diffusers.ops import triton_ops

    layout = _layout(grid, block_grid, num_blocks)
    dtype = _torch_dtype(dtype)
    rot = _rotary(layout, head_dim) if rope else None

    def run(train: bool):
        q, k, v, mixing = _inputs(batch, heads, layout, head_dim, dtype, requires_grad=train)
        grad = torch.empty(batch, heads, layout.num_tokens, head_dim, dtype=dtype, device="meta") if train else None
        triton_ops._RECORD = []
        counter = op_counter()
        try:
            with torch.set_grad_enabled(train), counter:
                out = triton_ops._MHLATriton.apply(q, k, v, mixing, layout, True, 1e-6, True, rot, train)
                split = (len(triton_ops._RECORD), len(counter.ops))
                if train:  # gradients returned, not accumulated into .grad (a model's q, k, v are not leaves)
                    torch.autograd.grad(out, (q, k, v, mixing), grad)
            return list(triton_ops._RECORD), counter.ops, split
        finally:
            triton_ops._RECORD = None

    run(False)  # warm the launcher's caches (block index, RoPE tables on the device)
    fwd, fwd_ops, _ = run(False)
    train, train_ops, (n_launch, n_ops) = run(True)

    def launches(rows, phase):
        return [Launch(k, tuple(g), a, m, phase) for k, g, a, m in rows]

    return Recording(
        layout=layout, batch=batch,
        forward=_roles(launches(fwd, "forward")), forward_ops=fwd_ops,
        train_forward=_roles(launches(train[:n_launch], "train")), train_forward_ops=train_ops[:n_ops],
        backward=_roles(launches(train[n_launch:], "backward")), backward_ops=train_ops[n_ops:],
    )
