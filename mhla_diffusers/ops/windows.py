"""The padded block-major form of a token grid as strided windows: how the torch backend's GPU path reads and writes.

Along each axis of a ``(T, H, W)`` grid, ``n`` tokens fall into ``b`` runs (``layout.py``: token ``i`` in run
``i * b // n``) of ``ceil(n / b)`` or one token fewer, the first run a long one. Every run is padded to
``L = ceil(n / b)`` *slots*: a long run's slots are its tokens; a short run's window starts one token early,
so its slot 0 holds the last token of the run before (a *pad*: a real token of another block, masked out of
the keys, its outputs never written) and slots ``1..L-1`` its own. A block's slots are the product of its
three runs' slots, ``L_t L_h L_w`` of them.

Runs of one kind (long or short) whose indices and starts both step evenly form a *group*; a group of each
axis makes a *piece*. The windows of a piece are one strided view of a ``[heads, N, c]`` tensor (any
strides: diffusers' ``[B, N, H, d]`` memory too), and the piece's blocks one strided view of a block-major
buffer ``[b_t, b_h, b_w, heads, L_t, L_h, L_w, c]``: copying a tensor into its padded block-major form (with
the feature map and the pad mask fused in) is one elementwise op per piece, and writing a block-major result
back to token order one more per piece. No index tensor, no gather, no scatter.

Wan2.1 480p's grid (21, 30, 52) in (3, 5, 7) blocks: T and H split evenly (one group each); W's runs are
8, 7, 8, 7, 8, 7, 7 tokens: long runs at 0, 15, 30, short ones at 8, 23, 38 and 45, three groups: three pieces.

:class:`WindowForward` is the torch backend's forward on every device but the CPU (``torch_ops.py`` runs it one
sample at a time): per sample, one op per piece for each of q, k and v, one batched GEMM per step, one op per
piece for the output. See ``docs/operator.md``, "The torch backend".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from mhla_diffusers.ops.layout import BlockLayout

__all__ = [
    "AxisGroup", "WindowForward", "WindowPlan", "axis_groups", "chunked_slot_rows", "key_bounds", "token_slots", "window_plan",
]


@dataclass(frozen=True)
class AxisGroup:
    """Runs ``first, first + step, ...`` (``count`` of them) of one axis, one kind, starts stepping evenly."""

    first: int  # index of the first run
    step: int  # run-index step
    count: int
    start: int  # first token of run ``first``
    stride: int  # tokens from one run's start to the next one's in the group
    short: bool  # one token shorter than the slots: slot 0 is a pad

    def runs(self) -> slice:
        """The group's runs as a slice of the run axis."""
        return slice(self.first, self.first + self.step * (self.count - 1) + 1, self.step)


def _run_starts(n: int, b: int) -> list[int]:
    """First token of each run and ``n``: ``ceil(j n / b)`` for ``j = 0..b`` (the smallest ``i`` with ``i b // n >= j``)."""
    return [-(-j * n // b) for j in range(b + 1)]


def _longest_progression(j0: int, candidates: list[int], starts: list[int], free: set[int], short: list[bool]) -> list[int]:
    """The longest run list ``j0, j1, ...`` of ``j0``'s kind among ``free`` whose indices and starts step evenly."""
    best = [j0]
    for j1 in candidates:
        dj, ds, chain = j1 - j0, starts[j1] - starts[j0], [j0, j1]
        while (nxt := chain[-1] + dj) in free and short[nxt] == short[j0] and starts[nxt] - starts[chain[-1]] == ds:
            chain.append(nxt)
        if len(chain) > len(best):
            best = chain
    return best


@lru_cache(maxsize=256)
def axis_groups(n: int, b: int) -> tuple[AxisGroup, ...]:
    """The groups of an axis of ``n`` tokens in ``b`` runs (greedy: from the first free run, the longest progression)."""
    starts = _run_starts(n, b)
    slots = starts[1]
    short = [starts[j + 1] - starts[j] < slots for j in range(b)]
    free, groups = set(range(b)), []
    while free:
        j0 = min(free)
        candidates = [j for j in sorted(free) if j > j0 and short[j] == short[j0]]
        chain = _longest_progression(j0, candidates, starts, free, short)
        step = chain[1] - chain[0] if len(chain) > 1 else 1
        stride = starts[chain[1]] - starts[chain[0]] if len(chain) > 1 else 0
        groups.append(AxisGroup(j0, step, len(chain), starts[j0], stride, short[j0]))
        free -= set(chain)
    return tuple(groups)


@dataclass(frozen=True)
class WindowPlan:
    """The windows of one layout: per axis its size, runs, slots and groups; the pieces (one group per axis)."""

    layout: BlockLayout
    sizes: tuple[int, int, int]  # tokens per axis (T, H, W)
    runs: tuple[int, int, int]  # blocks per axis (b_t, b_h, b_w)
    slots: tuple[int, int, int]  # slots per run (L_t, L_h, L_w)
    pieces: tuple[tuple[AxisGroup, AxisGroup, AxisGroup], ...]

    @property
    def num_blocks(self) -> int:
        return math.prod(self.runs)

    @property
    def length(self) -> int:
        """Slots per block, ``L_t L_h L_w``."""
        return math.prod(self.slots)

    @property
    def padded(self) -> bool:
        """Whether some run is short (then some slots are pads)."""
        return any(g.short for piece in self.pieces for g in piece)

    def buffer_shape(self, heads: int, width: int) -> tuple[int, ...]:
        """``[b_t, b_h, b_w, heads, L_t, L_h, L_w, width]``: block-major, blocks outermost (the order of the block ids)."""
        return (*self.runs, heads, *self.slots, width)

    def window(self, x: torch.Tensor, piece, *, real: bool = False) -> torch.Tensor:
        """The piece's tokens of ``x`` (``[heads, N, c]``, any strides) as ``[c_t, c_h, c_w, heads, l_t, l_h, l_w, c]``.

        ``real=False``: every slot of the piece's runs (pads included: the windows); ``real=True``: the runs' own
        tokens only (``l = L - 1`` for short runs).
        """
        heads, n, width = x.shape
        s_head, s_tok, s_chan = x.stride()
        tok = (self.sizes[1] * self.sizes[2] * s_tok, self.sizes[2] * s_tok, s_tok)  # token strides of t, h, w
        counts, lengths, run_strides, offset = [], [], [], x.storage_offset()
        for g, slots, step in zip(piece, self.slots, tok):
            skip = int(g.short) if real else 0
            counts.append(g.count)
            lengths.append(slots - skip)
            run_strides.append(g.stride * step)
            offset += (g.start - int(g.short) + skip) * step
        size = (*counts, heads, *lengths, width)
        return x.as_strided(size, (*run_strides, s_head, *tok, s_chan), offset)

    def blocks(self, buf: torch.Tensor, piece, *, real: bool = False) -> torch.Tensor:
        """The piece's blocks of a block-major ``buf`` (:meth:`buffer_shape`, last dims may be broadcast ones),
        shaped like :meth:`window`'s result."""
        index = [g.runs() for g in piece] + [slice(None)]
        for g, slots in zip(piece, self.slots):
            skip = int(g.short) if real else 0
            index.append(slice(skip, slots))
        return buf[tuple(index)]


@lru_cache(maxsize=64)
def window_plan(layout: BlockLayout) -> WindowPlan:
    """The :class:`WindowPlan` of ``layout`` (cached)."""
    sizes, runs = layout.grid, layout.block_grid
    slots = tuple(-(-n // b) for n, b in zip(sizes, runs))
    groups = [axis_groups(n, b) for n, b in zip(sizes, runs)]
    pieces = tuple((gt, gh, gw) for gt in groups[0] for gh in groups[1] for gw in groups[2])
    return WindowPlan(layout, sizes, runs, slots, pieces)


@lru_cache(maxsize=16)
@torch.inference_mode(False)  # cached across calls: never inference tensors
def key_bounds(plan: WindowPlan, device: torch.device, dtype: torch.dtype, relu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` ``[b_t, b_h, b_w, 1, L_t, L_h, L_w, 1]``: ``clamp(k, lo, hi)`` is ``phi(k)`` on a block's own
    tokens (``lo = 0`` with ReLU, ``-inf`` without; ``hi = inf``) and 0 on its pads (``lo = hi = 0``)."""
    valid = torch.ones((), dtype=torch.bool)
    for axis, (b, slots) in enumerate(zip(plan.runs, plan.slots)):
        starts = _run_starts(plan.sizes[axis], b)
        own = torch.ones(b, slots, dtype=torch.bool)
        own[:, 0] = torch.tensor([starts[j + 1] - starts[j] == slots for j in range(b)])
        shape = [1] * 6
        shape[axis], shape[3 + axis] = b, slots
        valid = valid & own.view(shape)
    valid = valid.view(*plan.runs, 1, *plan.slots, 1)
    zero = torch.zeros((), dtype=dtype)
    lo = torch.where(valid, torch.tensor(0.0 if relu else -math.inf, dtype=dtype), zero)
    hi = torch.where(valid, torch.tensor(math.inf, dtype=dtype), zero)
    return lo.to(device), hi.to(device)


@lru_cache(maxsize=16)
@torch.inference_mode(False)  # cached across calls: never inference tensors
def token_slots(plan: WindowPlan, device: torch.device) -> torch.Tensor:
    """``[N]`` int64: the flat slot ``m L + l`` of each token (``m`` its block, ``l`` its slot in the block)."""
    coords = torch.meshgrid(*(torch.arange(n) for n in plan.sizes), indexing="ij")
    block, slot = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    for axis, (n, b, slots) in enumerate(zip(plan.sizes, plan.runs, plan.slots)):
        starts = torch.tensor(_run_starts(n, b))
        run = coords[axis] * b // n
        first_slot = starts[run] - (starts[run + 1] - starts[run] < slots).long()  # window start of the run
        block, slot = block * b + run, slot * slots + coords[axis] - first_slot
    return (block * plan.length + slot).reshape(-1).to(device)


# ---------------------------------------------------------------------------------------------
# The windowed forward: the torch backend's forward on every device but the CPU (``torch_ops.py`` runs it
# sample by sample). A sample's q, k, v are copied into padded block-major buffers through the windows (the
# feature map, the pad mask and the casts fused into the copies), each step is one batched GEMM, and the
# quotient goes back to token order through the same windows.
#
# Batch invariance: the batch is a Python loop in torch_ops.py, so no GEMM or reduction has the batch size in
# its shape. Each sample's GEMMs read and write the same buffers (allocated once per call, so at the same
# addresses and alignment for every sample), with shapes and strides fixed by the layout, heads, head dims and
# dtypes: the summaries reduce over the slots of a block, the mixing over the blocks, the output over d.
# Everything else is elementwise (copy, clamp, add, divide), where a result does not depend on where it sits.

# GEMMs of bf16 / fp16 operands with fp32 results (``torch.bmm(..., out_dtype=)``, torch >= 2.8; CUDA and meta).
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()
# Columns of the block-major value and result buffers are a multiple of this: rows of 16 bytes or more for cuBLAS.
_COLUMNS = 8


def _key_value_dtype(k: torch.Tensor, v: torch.Tensor, acc: torch.dtype) -> torch.dtype:
    """dtype of the buffers of phi(K) and V: theirs when both have the same 16-bit dtype, the accumulation is fp32
    and the device multiplies 16-bit operands into fp32 (cuBLAS; not on ROCm here: unverified); else ``acc``. The
    products of 16-bit numbers are exact in fp32, so the sums are those of fp32 copies, without the copies."""
    same16 = k.dtype == v.dtype and k.dtype in (torch.float16, torch.bfloat16) and acc == torch.float32
    if not same16:
        return acc
    if k.device.type in ("meta", "cpu"):  # meta: counted as CUDA; cpu: the tests of this path (upcast)
        return k.dtype
    cublas = k.device.type == "cuda" and torch.version.hip is None
    return k.dtype if cublas and _fp32_products_work(k.device, k.dtype) else acc


@lru_cache(maxsize=8)
@torch.inference_mode(False)
def _fp32_products_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(a, b, out_dtype=torch.float32, out=...)`` runs on ``device`` for ``dtype`` operands and
    gives the fp32 products of their values (checked once per device and dtype on a small case against the same
    GEMM of fp32 copies; the 16-bit buffers are used only then, else fp32 ones: the same sums either way)."""
    if not _BMM_OUT_DTYPE:
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for shape in ((2, 24, 40), (2, 40, 16)))
    out = torch.empty(2, 24, 32, device=device)[..., :16]  # a strided destination, as the buffers' slices are
    try:
        torch.bmm(a, b, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    want = torch.bmm(a.float(), b.float())
    return bool(torch.allclose(out, want, rtol=1e-5, atol=1e-5))


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` (batched), accumulated and written in ``out``'s dtype; ``a``, ``b`` may be 16-bit (fp32 ``out``)."""
    if a.dtype == out.dtype:
        torch.bmm(a, b, out=out)
    elif out.device.type == "cpu":  # the GPU code path under test on CPU: the same products, upcast
        torch.bmm(a.to(out.dtype), b.to(out.dtype), out=out)
    else:
        torch.bmm(a, b, out_dtype=out.dtype, out=out)


@lru_cache(maxsize=16)
@torch.inference_mode(False)  # cached across calls: never an inference tensor
def _zero(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d zero: ``clamp(x, min=_zero(..., acc), out=acc_buffer)`` is ReLU and the cast in one op."""
    return torch.zeros((), dtype=dtype, device=device)


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def chunked_slot_rows(layout: BlockLayout, heads: int, device: torch.device) -> torch.Tensor:
    """``[heads * M * L']``: for each (head, block, slot) of the chunked code's padded layout (``L'`` slots a block),
    the row of the windowed result ``[M, heads, L]`` holding that slot's token (the block's first token for a pad)."""
    windows, gather = window_plan(layout), layout.gather_tensors()[0]
    slot = token_slots(windows, torch.device("cpu"))[gather]  # m * L + l of each chunked slot's token
    block, within = slot // windows.length, slot % windows.length
    head = torch.arange(heads)[:, None]
    return ((block[None] * heads + head) * windows.length + within[None]).reshape(-1).to(device)


class WindowForward:
    """The windowed forward of one call: buffers shared by its samples, and the steps for one sample."""

    def __init__(self, plan: WindowPlan, q, k, v, acc: torch.dtype, normalize: bool, feature_map: bool):
        self.plan, self.normalize, self.feature_map = plan, normalize, feature_map
        self.heads, self.d, self.dv = q.shape[1], q.shape[-1], v.shape[-1]
        self.width = self.dv + int(normalize)  # [S | z] and [numerator | denominator]: the ones column of [V | 1]
        self.acc = acc  # the accumulation dtype: fp32, fp64 for fp64 inputs
        kv = _key_value_dtype(k, v, self.acc)
        columns = -(-self.width // _COLUMNS) * _COLUMNS
        self.keys = self._buffer(self.d, kv, q.device)  # phi(K), pads zeroed
        self.values = self._buffer(columns, kv, q.device)  # [V | 1]
        self.queries = self._buffer(self.d, self.acc, q.device)  # phi(Q) (pads unwritten: their rows are never read back)
        self.result = self._buffer(columns, self.acc, q.device)  # [numerator | denominator]
        if normalize:
            self.values[..., self.dv].fill_(1)
        shape = (plan.num_blocks, self.heads, self.d, self.width)
        self.summary = torch.empty(shape, dtype=self.acc, device=q.device)  # [S | z] per block and head
        self.mixed = torch.empty(shape, dtype=self.acc, device=q.device)  # [S~ | z~]

    def _buffer(self, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(self.plan.buffer_shape(self.heads, columns), dtype=dtype, device=device)

    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        """A block-major buffer as ``[M heads, L, columns]`` (a GEMM batch)."""
        return buf.view(self.plan.num_blocks * self.heads, self.plan.length, buf.shape[-1])

    def summaries(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Steps 1-2 for one sample's ``[heads, N, *]`` k, v: ``[S | z] = phi(K_b)^T [V_b | 1]`` per block and head."""
        plan = self.plan
        for piece in plan.pieces:
            self._key_features(plan.window(k, piece), piece)
            plan.blocks(self.values, piece)[..., : self.dv].copy_(plan.window(v, piece))
        summary = self.summary.view(-1, self.d, self.width)
        _bmm_into(summary, self._rows(self.keys).transpose(1, 2), self._rows(self.values)[..., : self.width])

    def _key_features(self, src: torch.Tensor, piece) -> None:
        """phi(k) of a piece's windows into its blocks of the key buffer; pads (tokens of other blocks) zeroed."""
        dst = self.plan.blocks(self.keys, piece)
        if self.plan.padded:
            lo, hi = key_bounds(self.plan, dst.device, dst.dtype, self.feature_map)
            torch.clamp(src, min=self.plan.blocks(lo, piece), max=self.plan.blocks(hi, piece), out=dst)
        elif self.feature_map:
            torch.clamp(src, min=_zero(dst.device, dst.dtype), out=dst)
        else:
            dst.copy_(src)

    def mix(self, mixing: torch.Tensor) -> None:
        """Step 3: ``[S~ | z~] = Mc [S | z]``, one GEMM for all heads (blocks are the outer dim)."""
        m = self.plan.num_blocks
        torch.mm(mixing, self.summary.view(m, -1), out=self.mixed.view(m, -1))

    def outputs(self, q: torch.Tensor, out: torch.Tensor, eps: float) -> None:
        """Step 4 for one sample's ``[heads, N, d]`` q: ``phi(Q_b) [S~ | z~]``, divided, into ``out`` ``[heads, N, d_v]``."""
        plan, dv = self.plan, self.dv
        for piece in plan.pieces:
            dst = plan.blocks(self.queries, piece, real=True)
            src = plan.window(q, piece, real=True)
            if self.feature_map:
                torch.clamp(src, min=_zero(dst.device, dst.dtype), out=dst)
            else:
                dst.copy_(src)
        mixed = self.mixed.view(-1, self.d, self.width)
        torch.bmm(self._rows(self.queries), mixed, out=self._rows(self.result)[..., : self.width])
        num, den = self.result[..., :dv], self.result[..., dv : self.width]
        if self.normalize and eps:
            den.add_(eps)
        for piece in plan.pieces:
            dst, res = plan.window(out, piece, real=True), plan.blocks(num, piece, real=True)
            if self.normalize:
                torch.div(res, plan.blocks(den, piece, real=True), out=dst)
            else:
                dst.copy_(res)

    def save(self, b: int, s_all: torch.Tensor, z_all, den_all) -> None:
        """What the backward reads, in the chunked code's layouts: S ``[heads, M, d, d_v]``, z ``[heads, M, d]`` and
        the denominator (with eps) ``[heads, M, L']`` of sample ``b``."""
        s_all[b].copy_(self.summary[..., : self.dv].transpose(0, 1))
        if self.normalize:
            z_all[b].copy_(self.summary[..., self.dv].transpose(0, 1))
            den = self.result.view(-1, self.result.shape[-1])[:, self.dv]
            index = chunked_slot_rows(self.plan.layout, self.heads, den.device)
            torch.index_select(den, 0, index, out=den_all[b].view(-1))
