"""What MHLA's two backends cost on a GPU, worked out without one: compile reports, a bytes model, ATen op counts.

Used by ``benchmarks/kernel_report.py`` (the command line) and importable by other scripts
(``from kernel_costs import bytes_model``, with ``benchmarks/`` on ``sys.path``).

- **Launches.** The Triton backend's own host code (``mhla_diffusers.ops.triton_ops``) is run on ``meta``
  tensors with its launch recorder (``triton_ops._RECORD``, private) switched on: kernels are not run,
  their grids, arguments and meta-parameters are recorded with the CUDA launch configuration (tiles,
  warps, stages, splits), so nothing here copies the launchers' tile choices.
- **Compile report.** Each recorded launch is specialised by Triton's own binder (as a CUDA launch
  would be: divisibility and alignment of every integer and pointer) and compiled for an sm_80 / sm_90
  target by ``triton.compile`` with the Triton wheel's ptxas, whose log gives registers, spills and
  shared memory. Occupancy (CTAs per SM) follows from those and the architecture's limits.
- **Bytes model.** Per launch, from the kernel's loads and stores (per program: which tensors, how
  many bytes; how many programs), under three assumptions on what stays in L2 (:data:`SCENARIOS`), plus
  the torch operations the launcher runs between kernels (counted as below).
- **Torch backend.** ``mhla_attention(..., backend="torch")`` on ``meta`` tensors under a
  ``TorchDispatchMode`` that counts every ATen op and the bytes of its tensor inputs plus outputs.
  ``torch_ops.py`` branches on ``device.type != "cpu"`` only, so ``meta`` takes every branch that CUDA
  takes (one chunk holding all heads, no kept workspace, no huge pages).

Nothing here needs a GPU; importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import re
import tempfile
import time
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Shapes, architectures, constants

#: Tensors smaller than this (bytes) are assumed to stay in L2 in every scenario: mixing matrix, block
#: starts / sizes, eps (an H100 / H200 has 50 MB of L2).
SMALL_BYTES = 1 << 20
#: H200 nominal HBM3e bandwidth, bytes / s (estimates only: not yet measured on a GPU).
H200_BYTES_PER_S = 4.8e12

#: What the bytes model assumes stays in L2, by scenario name.
SCENARIOS = {
    "no_l2": "every program's loads and stores reach HBM (tensors under 1 MiB count once per launch): the RoPE tables "
             "once per head, a block's summary once per token tile, the mixing GEMM's operand once per row tile",
    "shared_in_l2": "what the programs of one launch share is read from HBM once (RoPE tables once per launch, each "
                    "fp32 summary once per launch); everything passed between kernels or torch ops crosses HBM",
    "summaries_on_chip": "as shared_in_l2, and the fp32 summaries (S, z, their splits, mixes and gradients) never "
                         "reach HBM: the bound for kernels that keep them on chip",
}
#: The scenario reported as ``forward_bytes`` / ``backward_bytes``.
DEFAULT_SCENARIO = "shared_in_l2"


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


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one NVIDIA architecture (CUDA occupancy calculator values)."""

    name: str
    capability: int
    gpu: str
    sms: int
    regs_per_sm: int = 65536
    sub_partitions: int = 4  # register file split into 4 x 16 K, one per warp scheduler
    reg_alloc_unit: int = 256  # registers per warp are allocated in units of 256
    max_warps: int = 64
    max_ctas: int = 32
    smem_per_sm: int = 233472  # bytes
    smem_per_cta: int = 232448  # bytes a CTA may opt in to
    smem_reserved_per_cta: int = 1024  # bytes the driver reserves per CTA


ARCHS = {
    "sm_80": Arch("sm_80", 80, "A100", 108, smem_per_sm=167936, smem_per_cta=166912),
    "sm_90": Arch("sm_90", 90, "H100 / H200", 132),
}


def occupancy(registers: int, shared_bytes: int, num_warps: int, arch: Arch) -> dict:
    """Resident CTAs per SM from registers per thread, shared bytes per CTA and warps per CTA; what limits it."""
    per_warp = -(-registers * 32 // arch.reg_alloc_unit) * arch.reg_alloc_unit
    warps_by_regs = arch.sub_partitions * ((arch.regs_per_sm // arch.sub_partitions) // per_warp) if per_warp else arch.max_warps
    limits = {
        "registers": warps_by_regs // num_warps,
        "shared_memory": 0 if shared_bytes > arch.smem_per_cta else arch.smem_per_sm // (shared_bytes + arch.smem_reserved_per_cta),
        "warps": arch.max_warps // num_warps,
        "ctas": arch.max_ctas,
    }
    ctas = min(limits.values())
    return {
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * num_warps,
        "limited_by": sorted(k for k, v in limits.items() if v == ctas),
        "by": limits,
    }


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


# ---------------------------------------------------------------------------------------------
# The bytes model: per kernel, from its loads and stores


@dataclass
class Access:
    """Bytes one launch moves for one tensor: ``loaded`` summed over its programs, ``unique`` distinct bytes."""

    tensor: str
    kind: str  # "stream" (q, k, v, outputs, gradients), "summary" (fp32 S, z and their kin), "table" (RoPE), "small"
    write: bool
    loaded: float
    unique: float

    def bytes(self, scenario: str) -> float:
        """HBM bytes under ``scenario`` (a key of :data:`SCENARIOS`)."""
        if self.kind == "summary" and scenario == "summaries_on_chip":
            return 0.0
        if self.kind == "small" or self.unique < SMALL_BYTES:
            return self.unique
        if self.write or self.kind == "stream" or scenario == "no_l2":
            return self.loaded
        return self.unique


def _tokens_per_program(layout, programs_per_block: int, tokens_per_program: int) -> list[int]:
    """Tokens each program of a (block, split or tile) grid axis handles, block by block."""
    out = []
    for size in layout.block_sizes.tolist():
        for p in range(programs_per_block):
            out.append(max(0, min((p + 1) * tokens_per_program, size) - p * tokens_per_program))
    return out


def _elem(t) -> int:
    return t.element_size()


def _order(tokens, bh) -> Access:
    """The block-major token order (int32 ``[N]``), read by every (batch, head) program: under 1 MiB, once per launch."""
    return Access("order", "small", False, float(tokens * bh * 4), float(tokens * 4))


def _rows(name, kind, width_bytes, tokens, bh, write=False) -> Access:
    """A per-token tensor read or written once per (token, batch x head): ``tokens x bh`` rows of ``width_bytes``."""
    total = float(tokens * bh * width_bytes)
    return Access(name, kind, write, total, total)


def _tables(launch, tokens, bh, head_dim, cos) -> list[Access]:
    """The RoPE cos / sin tables ``[N, d/2]``, read per token by every (batch, head) program."""
    if not launch.meta.get("ROTARY"):
        return []
    row = head_dim // 2 * _elem(cos)
    return [Access(t, "table", False, float(tokens * bh * row), float(tokens * row)) for t in ("cos", "sin")]


def _per_block(name, kind, programs, unique_rows, row_bytes, write=False) -> Access:
    """A ``[M, B*H, ...]`` summary read (or written) whole by each of ``programs`` programs."""
    return Access(name, kind, write, float(programs * row_bytes), float(unique_rows * row_bytes))


def _split_grid(launch, layout) -> tuple[int, int, int]:
    """``(M, programs per block, B*H)`` of a ``(M x per_block, B*H)`` grid."""
    m = layout.num_blocks
    return m, launch.grid[0] // m, launch.grid[1]


def _traffic_fwd_summaries(launch, layout):
    k, v, order, _, _, s, z, cos = launch.args[:8]
    m, parts, bh = _split_grid(launch, layout)
    n, d, dv = layout.num_tokens, k.shape[-1], v.shape[-1]
    out = [_rows("k", "stream", d * _elem(k), n, bh), _rows("v", "stream", dv * _elem(v), n, bh),
           _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S parts", "summary", m * parts * bh, m * parts * bh, d * dv * _elem(s), write=True)]
    if launch.meta["NORMALIZE"]:
        out.append(_per_block("z parts", "summary", m * parts * bh, m * parts * bh, d * _elem(z), write=True))
    tokens = launch.args[15]
    return out, _tokens_per_program(layout, parts, tokens)


def _traffic_fwd_output(launch, layout):
    q, st, zt, _, o, _, _, _, cos = launch.args[:9]
    m, tiles, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, q.shape[-1], o.shape[-1], m * tiles * bh
    out = [_rows("q", "stream", d * _elem(q), n, bh), _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S~", "summary", programs, m * bh, d * dv * _elem(st)),
           _rows("out", "stream", dv * _elem(o), n, bh, write=True)]
    if launch.meta["NORMALIZE"]:
        out.append(_per_block("z~", "summary", programs, m * bh, d * _elem(zt)))
    return out, _tokens_per_program(layout, tiles, launch.meta["BLOCK_T"])


def _traffic_bwd_query(launch, layout):
    q, g, st, zt, _, dq, dst, dzt, _, _, _, cos = launch.args[:12]
    m, parts, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, q.shape[-1], g.shape[-1], m * parts * bh
    out = [_rows("q", "stream", d * _elem(q), n, bh), _rows("grad out", "stream", dv * _elem(g), n, bh),
           _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S~", "summary", programs, m * bh, d * dv * _elem(st)),
           _per_block("dS~ parts", "summary", programs, programs, d * dv * _elem(dst), write=True)]
    if launch.meta["STORE_DQ"]:
        out.append(_rows("dq", "stream", d * _elem(dq), n, bh, write=True))
    if launch.meta["NORMALIZE"]:
        out += [_per_block("z~", "summary", programs, m * bh, d * _elem(zt)),
                _per_block("dz~ parts", "summary", programs, programs, d * _elem(dzt), write=True)]
    return out, _tokens_per_program(layout, parts, launch.args[19])


def _traffic_bwd_key(launch, layout):
    k, v, ds, dz, dk, dvv, _, _, _, cos = launch.args[:10]
    m, tiles, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, k.shape[-1], v.shape[-1], m * tiles * bh
    out = [_rows("k", "stream", d * _elem(k), n, bh), _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("dS", "summary", programs, m * bh, d * dv * _elem(ds))]
    if launch.meta["NEED_DV"]:
        out.append(_rows("dv", "stream", dv * _elem(dvv), n, bh, write=True))
    if launch.meta["NEED_DK"]:
        out += [_rows("v", "stream", dv * _elem(v), n, bh), _rows("dk", "stream", d * _elem(dk), n, bh, write=True)]
        if launch.meta["NORMALIZE"]:
            out.append(_per_block("dz", "summary", programs, m * bh, d * _elem(dz)))
    return out, _tokens_per_program(layout, tiles, launch.meta["BLOCK_T"])


def _traffic_mix_gemm(launch, layout):
    """``C = A @ B`` per column strip: each program loops over row tiles, each re-reading its strip of B."""
    a, b, c, rows, depth, ncol = launch.args[:6]
    row_tiles = -(-rows // launch.meta["BLOCK_R"])
    strips, item = launch.grid[0] * launch.grid[1], _elem(b)
    a_bytes = rows * depth * _elem(a)
    out = [Access("Mc", "small" if a_bytes < SMALL_BYTES else "summary", False, float(strips * a_bytes), float(a_bytes)),
           Access("B", "summary", False, float(row_tiles * depth * ncol * item), float(depth * ncol * item)),
           Access("C", "summary", True, float(rows * ncol * item), float(rows * ncol * item))]
    return out, None


_TRAFFIC = {
    "fwd_summaries": _traffic_fwd_summaries,
    "fwd_output": _traffic_fwd_output,
    "bwd_query": _traffic_bwd_query,
    "bwd_key": _traffic_bwd_key,
    "mix_gemm": _traffic_mix_gemm,
}


def launch_traffic(launch: Launch, layout) -> dict:
    """One launch's HBM bytes under each scenario, its accesses, and its programs (and how many handle no token)."""
    accesses, tokens = _TRAFFIC[launch.name](launch, layout)
    bh = launch.grid[1] if launch.name != "mix_gemm" else 1
    return {
        "kernel": launch.name,
        "role": launch.role,
        "phase": launch.phase,
        "grid": list(launch.grid),
        "programs": launch.programs,
        "empty_programs": None if tokens is None else bh * sum(1 for t in tokens if t == 0),
        "bytes": {s: sum(a.bytes(s) for a in accesses) for s in SCENARIOS},
        "accesses": [{"tensor": a.tensor, "kind": a.kind, "write": a.write, **{s: a.bytes(s) for s in SCENARIOS}} for a in accesses],
    }


def _ops_bytes(ops: list[OpRecord], scenario: str) -> float:
    """HBM bytes of the launcher's torch ops: all fp32 summaries here; tensors under 1 MiB count once."""
    if scenario == "summaries_on_chip":
        return float(sum(o.small for o in ops))
    return float(sum(o.read + o.written for o in ops))


def _pass_bytes(launches: list[Launch], ops: list[OpRecord], layout) -> dict:
    kernels = [launch_traffic(launch, layout) for launch in launches]
    totals = {s: sum(k["bytes"][s] for k in kernels) + _ops_bytes(ops, s) for s in SCENARIOS}
    torch_ops = {"ops": len(ops), "bytes": float(sum(o.read + o.written for o in ops)), "names": sorted({o.name for o in ops})}
    return {"bytes": totals, "kernels": kernels, "torch_ops": torch_ops}


def floor_bytes(batch, heads, tokens, head_dim, dtype, head_dim_v=None) -> dict:
    """Compulsory HBM bytes: forward = read q, k, v + write the output; backward = read q, k, v and the output
    gradient + write dq, dk, dv (the output is not needed: the kernels recompute what they need). Input dtype."""
    dv = head_dim if head_dim_v is None else head_dim_v
    item = _torch_dtype(dtype).itemsize
    rows = batch * heads * tokens * item
    return {"forward": rows * (2 * head_dim + 2 * dv), "backward": rows * (4 * head_dim + 3 * dv)}


def _assumes(rope: bool) -> str:
    text = (f"bytes from each kernel's loads and stores (masked loads of padded rows and tails cost nothing) plus the "
            f"launcher's torch ops between kernels; '{DEFAULT_SCENARIO}' scenario: {SCENARIOS[DEFAULT_SCENARIO]}; "
            f"useful bytes, not 32-byte sectors; the floor excludes the RoPE tables")
    return text + ("; RoPE tables fp32 [N, d/2], computed once per forward outside the operator" if rope else "")


def bytes_model(batch, heads, grid, head_dim, block_grid, dtype, rope) -> dict:
    """Modelled HBM bytes of the Triton backend's forward and backward against the compulsory floor.

    Args:
        batch: samples. heads: attention heads. grid: token grid (T, H, W) or (H, W). head_dim: d (= d_v).
        block_grid: (bt, bh, bw) or (bh, bw); None: ``choose_block_grid(grid)``.
        dtype: q, k, v dtype (torch dtype or name: "bfloat16", "float16", "float32").
        rope: Wan's RoPE fused into the kernels (fp32 cos / sin tables).

    Returns:
        ``forward_bytes`` (an inference forward) and ``backward_bytes`` (the backward pass alone) under the
        ``"shared_in_l2"`` scenario, ``floor_bytes`` (forward: read q, k, v + write the output) and
        ``backward_floor_bytes``, their ratios, ``scenarios`` (all three: :data:`SCENARIOS`),
        ``estimated_us`` at the H200's nominal 4.8 TB/s, per-kernel ``kernels``, and ``assumes`` (text).
        Bytes are ints; nothing is measured.
    """
    rec = record(batch, heads, grid, head_dim, block_grid, dtype, rope)
    return _model_from_recording(rec, heads, head_dim, dtype, rope)


def _model_from_recording(rec: Recording, heads, head_dim, dtype, rope) -> dict:
    layout = rec.layout
    fwd = _pass_bytes(rec.forward, rec.forward_ops, layout)
    train = _pass_bytes(rec.train_forward, rec.train_forward_ops, layout)
    bwd = _pass_bytes(rec.backward, rec.backward_ops, layout)
    floor = floor_bytes(rec.batch, heads, layout.num_tokens, head_dim, dtype)
    scenarios = {s: {"forward_bytes": int(fwd["bytes"][s]), "train_forward_bytes": int(train["bytes"][s]),
                     "backward_bytes": int(bwd["bytes"][s]),
                     "forward_ratio": round(fwd["bytes"][s] / floor["forward"], 3),
                     "backward_ratio": round(bwd["bytes"][s] / floor["backward"], 3)} for s in SCENARIOS}
    main = scenarios[DEFAULT_SCENARIO]
    return {
        "batch": rec.batch, "heads": heads, "head_dim": head_dim, "tokens": layout.num_tokens,
        "grid": list(layout.grid), "block_grid": list(layout.block_grid), "num_blocks": layout.num_blocks,
        "max_block_size": layout.max_block_size, "dtype": str(_torch_dtype(dtype)).replace("torch.", ""), "rope": bool(rope),
        "forward_bytes": main["forward_bytes"], "backward_bytes": main["backward_bytes"],
        "floor_bytes": floor["forward"], "backward_floor_bytes": floor["backward"],
        "forward_ratio": main["forward_ratio"], "backward_ratio": main["backward_ratio"],
        "estimated_us": {"forward": round(main["forward_bytes"] / H200_BYTES_PER_S * 1e6, 1),
                         "backward": round(main["backward_bytes"] / H200_BYTES_PER_S * 1e6, 1),
                         "forward_floor": round(floor["forward"] / H200_BYTES_PER_S * 1e6, 1),
                         "backward_floor": round(floor["backward"] / H200_BYTES_PER_S * 1e6, 1),
                         "bandwidth": "H200 nominal 4.8 TB/s; not yet measured on a GPU"},
        "scenario": DEFAULT_SCENARIO,
        "scenarios": scenarios,
        "kernels": {"forward": fwd["kernels"], "train_forward": train["kernels"], "backward": bwd["kernels"]},
        "torch_ops": {"forward": fwd["torch_ops"], "train_forward": train["torch_ops"], "backward": bwd["torch_ops"]},
        "assumes": _assumes(rope),
    }


# ---------------------------------------------------------------------------------------------
# The torch backend's CUDA code path, counted


def torch_backend_traffic(batch, heads, grid, head_dim, block_grid, dtype, rope, memory="bnhd") -> dict:
    """ATen ops and bytes of ``mhla_attention(..., backend="torch")`` on its CUDA code path, on ``meta`` tensors.

    A warm call (caches filled by a first call) is counted: ``forward`` under ``torch.no_grad``;
    ``forward_backward``: a forward with gradients of q, k, v and the mixing matrix, then the backward.
    Bytes: every op's tensor inputs plus outputs (views and allocations move none; ``out=`` and ``copy_``
    destinations count as outputs only). ``memory``: ``"bnhd"`` (diffusers' ``[B, N, H, d]`` viewed as
    ``[B, H, N, d]``) or ``"bhnd"`` (contiguous). With ``rope`` the rotation is composed around the backend
    (two backend calls), as ``mhla_attention`` does for the torch backend.
    """
    import torch

    from mhla_diffusers.ops import mhla_attention

    layout = _layout(grid, block_grid)
    dtype = _torch_dtype(dtype)
    rot = _rotary(layout, head_dim) if rope else None
    floor = floor_bytes(batch, heads, layout.num_tokens, head_dim, dtype)

    def count(train: bool):
        q, k, v, mixing = _inputs(batch, heads, layout, head_dim, dtype, memory, requires_grad=train)
        grad = torch.empty(batch, heads, layout.num_tokens, head_dim, dtype=dtype, device="meta")
        with torch.set_grad_enabled(train):
            mhla_attention(q, k, v, mixing, layout, backend="torch", rotary=rot)  # warm: plan, chunks, tables
            counter = op_counter()
            with counter:
                out = mhla_attention(q, k, v, mixing, layout, backend="torch", rotary=rot)
                if train:  # gradients returned, not accumulated into .grad (a model's q, k, v are not leaves)
                    torch.autograd.grad(out, (q, k, v, mixing), grad)
        return _op_summary(counter.ops, counter.views, counter.allocations)

    fwd, both = count(False), count(True)
    fwd["floor_ratio"] = round(fwd["bytes"] / floor["forward"], 2)
    both["floor_ratio"] = round(both["bytes"] / (floor["forward"] + floor["backward"]), 2)
    fwd["estimated_us"] = round(fwd["bytes"] / H200_BYTES_PER_S * 1e6, 1)
    both["estimated_us"] = round(both["bytes"] / H200_BYTES_PER_S * 1e6, 1)
    return {"memory": memory, "rope": bool(rope), "floor_bytes": floor["forward"], "backward_floor_bytes": floor["backward"],
            "forward": fwd, "forward_backward": both}


# ---------------------------------------------------------------------------------------------
# Compiling the recorded launches for a GPU target


def parse_ptxas(log: str) -> dict:
    """Registers per thread, spill store / load bytes and stack frame bytes from a ``ptxas -v`` log (last kernel)."""
    def last(pattern):
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None

    return {
        "registers": last(r"Used (\d+) registers"),
        "spill_store_bytes": last(r"(\d+) bytes spill stores"),
        "spill_load_bytes": last(r"(\d+) bytes spill loads"),
        "stack_frame_bytes": last(r"(\d+) bytes stack frame"),
    }


def _bind(launch: Launch, backend):
    """Triton's binder, as a CUDA launch calls it: ``(specialization, options, signature, constexprs, attrs)``."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = dict(launch.meta, debug=bool(kernel.debug or knobs.runtime.debug),
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    packed = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return specialization, options, packed


def build_key(launch: Launch, arch: Arch) -> str:
    """What makes two launches the same build: kernel, target, specialisation (types, constexprs, divisibility), options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    specialization, options, _ = _bind(launch, make_backend(GPUTarget("cuda", arch.capability, 32)))
    return f"{launch.name}|{arch.name}|{specialization}|{options}"


def compile_launch(launch: Launch, arch: Arch) -> dict:
    """Compile one launch to a cubin for ``arch`` (fresh, no Triton cache) and read ptxas's report.

    Returns registers, spills (bytes), shared memory (bytes per CTA, Triton's metadata), compile seconds.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(GPUTarget("cuda", arch.capability, 32))
    _, _, (options, signature, constexprs, attrs) = _bind(launch, backend)
    log = io.StringIO()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mhla-kernel-report-") as cache, \
            knobs.cache.scope(), knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch.capability, 32), options=options.__dict__)
    row = parse_ptxas(log.getvalue())
    if None in (row["registers"], row["spill_store_bytes"], row["spill_load_bytes"]):
        raise RuntimeError(f"ptxas's report was not understood (no registers / spill lines): {log.getvalue()[-800:]!r}")
    row["shared_bytes"] = int(compiled.metadata.shared)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


class BuildCache:
    """Compile results by :func:`build_key` within one run: identical builds compile once."""

    def __init__(self):
        self.results: dict[str, dict] = {}
        self.compiles = 0

    def get(self, launch: Launch, arch: Arch) -> tuple[dict, str, bool]:
        """``(result, key, cached)``; a failed compile is a result with ``error``."""
        key = build_key(launch, arch)
        cached = key in self.results
        if not cached:
            self.compiles += 1
            try:
                self.results[key] = compile_launch(launch, arch)
            except Exception as exc:  # reported in the row: the caller decides
                self.results[key] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
        return self.results[key], key, cached


def build_rows(rec: Recording, arch: Arch, cache: BuildCache, *, shape: str, dtype, rope: bool) -> list[dict]:
    """One row per distinct build among the recorded launches (forward and backward) of one configuration."""
    rows: dict[str, dict] = {}
    for launch in rec.train_forward + rec.backward:
        result, key, cached = cache.get(launch, arch)
        use = f"{'backward' if launch.phase == 'backward' else 'forward'}: {launch.role}"
        if key in rows:
            rows[key]["uses"].append(use)
            continue
        warps = launch.meta.get("num_warps", 4)
        row = {"kernel": launch.name, "arch": arch.name, "dtype": str(_torch_dtype(dtype)).replace("torch.", ""),
               "shape": shape, "rope": bool(rope), "uses": [use],
               "num_warps": warps, "num_stages": launch.meta.get("num_stages"),
               "tiles": {k: v for k, v in launch.meta.items() if k.startswith("BLOCK_")},
               "grid": list(launch.grid), "programs": launch.programs, "cached": cached,
               "build_key": hashlib.sha1(key.encode()).hexdigest()[:16], **result}
        if "error" not in result:
            row["spill_bytes"] = result["spill_store_bytes"] + result["spill_load_bytes"]
            row["occupancy"] = occupancy(result["registers"], result["shared_bytes"], warps, arch)
            per_wave = max(1, row["occupancy"]["ctas_per_sm"]) * arch.sms
            row["waves"] = round(launch.programs / per_wave, 2)
            row["ok"] = result["shared_bytes"] <= arch.smem_per_cta
        else:
            row["ok"] = False
        rows[key] = row
    return list(rows.values())


def compile_available(environ=None) -> str | None:
    """Why kernels cannot be compiled (no Triton, no CUDA backend, no ptxas; ``TRITON_INTERPRET`` set in ``environ``,
    default ``os.environ``), or None."""
    import importlib.util
    import os

    environ = os.environ if environ is None else environ
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels are defined for the CPU interpreter"
    try:
        from triton import knobs
        from triton.backends import backends

        if "nvidia" not in backends:
            return "Triton's CUDA backend is not installed"
        ptxas = knobs.nvidia.ptxas.path
    except Exception as exc:  # an unusual installation: report, do not crash
        return f"cannot locate ptxas: {type(exc).__name__}: {exc}"
    if not ptxas or not os.path.exists(ptxas):
        return f"no ptxas at {ptxas!r}"
    return None
