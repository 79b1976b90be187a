"""MHLA in plain PyTorch: batched GEMMs over a padded block-major view of the tokens.

Any device; cost O(N d^2 + M^2 d^2) per head, memory O(N d + M d^2). Forward and backward are
hand-written (a first-order ``torch.autograd.Function``) and batch-invariant by construction: a
sample's output and q, k, v gradients are the same bits alone and at any place in a batch.
On the CPU the work goes chunk by chunk (cache-sized). Every other device (the GPU code path) runs the
forward one sample at a time through strided windows (``ops/windows.py``: no gather, the feature map and the
casts fused into the copies, one GEMM per step) and the backward in one chunk per sample.
Steps, backward formulas and performance design: ``docs/operator.md``, "The torch backend".
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.autograd.function import once_differentiable

from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.windows import WindowForward, WindowPlan, window_plan

__all__ = ["mhla_attention_torch", "compute_dtype"]

# Bytes of one gathered operand per chunk on CPU (a few are live at once). Measured on a 1 MiB-L2
# core: 1 MiB beats 2-4 MiB by up to 20% (cache) and 256 KiB (Python overhead, ~40 ops a chunk).
_CPU_CHUNK_BYTES = 1 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Tests only: run the GPU code path (every device but the CPU) on CPU tensors. Never set in the package.
_FORCE_DEVICE_PATH = False


def _device_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the GPU code path (all but the CPU; the CPU too under ``_FORCE_DEVICE_PATH``)."""
    return device.type != "cpu" or _FORCE_DEVICE_PATH


@dataclass(frozen=True)
class _Plan:

    num_blocks: int  # M
    length: int  # L, the padded block length
    gather: torch.Tensor  # [M * L] token read into each padded slot
    scatter: torch.Tensor  # [N] slot of each token
    valid: torch.Tensor | None  # [M, L, 1] 1.0 on real slots, 0.0 on padded ones; None if no block is padded
    identity: bool  # tokens are already block-major with equal blocks: slices suffice
    cuts: tuple[int, ...]  # block ids m where blocks [0, m) hold exactly tokens [0, first_token[m])
    first_token: tuple[int, ...]  # [M + 1] number of tokens in blocks [0, m)


@lru_cache(maxsize=64)
@torch.inference_mode(False)  # cached across calls: never inference tensors (see layout.py)
def _plan(layout: BlockLayout, device: torch.device) -> _Plan:
    gather, scatter, valid, identity = layout.gather_tensors(device)
    m = layout.num_blocks
    first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(layout.block_sizes, 0)])
    order = torch.argsort(layout.block_index, stable=True)  # tokens in block-major order
    seen_max = torch.cummax(order, 0).values
    cuts = tuple(i for i in range(m + 1) if i in (0, m) or int(seen_max[first[i] - 1]) == int(first[i]) - 1)
    return _Plan(
        num_blocks=m,
        length=layout.max_block_size,
        gather=gather,
        scatter=scatter,
        valid=None if valid is None else valid[:, :, None].float(),
        identity=identity,
        cuts=cuts,
        first_token=tuple(int(t) for t in first),
    )


@dataclass(frozen=True)
class _Chunk:

    h0: int
    h1: int
    m0: int
    m1: int
    t0: int
    t1: int
    gather: torch.Tensor | None  # [(m1 - m0) * L] token read into each padded slot (None: identity layout)
    scatter: torch.Tensor | None  # [t1 - t0] slot of each token, counted from the chunk's first slot
    valid: torch.Tensor | None  # [m1 - m0, L, 1] 1.0 on real slots, 0.0 on padded ones (None: no padding)

    @property
    def heads(self) -> slice:
        return slice(self.h0, self.h1)

    @property
    def blocks(self) -> slice:
        return slice(self.m0, self.m1)


@lru_cache(maxsize=256)
@torch.inference_mode(False)
def _chunks(
    layout: BlockLayout, device: torch.device, heads: int, width: int, itemsize: int, device_path: bool
) -> tuple[tuple[_Chunk, ...], ...]:
    """Groups of heads, each a tuple of chunks over all blocks, of about ``_CPU_CHUNK_BYTES`` per operand (one chunk
    on the GPU code path, ``device_path``)."""
    plan = _plan(layout, device)
    m, length, first = plan.num_blocks, plan.length, plan.first_token
    rows = max(1, _CPU_CHUNK_BYTES // (width * itemsize))  # padded token slots per chunk
    if device_path or m * length <= rows:
        per = heads if device_path else rows // (m * length)
        head_ranges, runs = [(h, min(h + per, heads)) for h in range(0, heads, max(per, 1))], [(0, m)]
    else:
        head_ranges, runs, start, cuts = [(h, h + 1) for h in range(heads)], [], 0, plan.cuts
        count = -(-m * length // rows)  # runs of near-equal length, each ending at the cut nearest its target
        for i in range(1, count + 1):
            target, j = m * i // count, bisect_left(cuts, m * i // count)
            ends = [c for c in cuts[max(j - 1, 0) : j + 1] if c > start]
            if ends:
                runs.append((start, min(ends, key=lambda c: abs(c - target))))
                start = runs[-1][1]
        if start < m:
            runs.append((start, m))
    indexed = []
    for m0, m1 in runs:
        t0, t1 = first[m0], first[m1]
        valid = None if plan.valid is None else plan.valid[m0:m1]
        if plan.identity:
            indexed.append((m0, m1, t0, t1, None, None, valid))
        else:
            gather, scatter = plan.gather[m0 * length : m1 * length], plan.scatter[t0:t1] - m0 * length
            indexed.append((m0, m1, t0, t1, gather, scatter, valid))
    return tuple(tuple(_Chunk(h0, h1, *run) for run in indexed) for h0, h1 in head_ranges)


# CPU scratch buffers kept between calls, per thread (fresh large allocations cost more than the
# arithmetic in them); larger than _CPU_KEEP_BYTES: allocated per call.
_CPU_KEEP_BYTES = 1 << 25
_cpu_pool = threading.local()


def _release_workspace() -> None:
    """Free this thread's kept CPU scratch buffers."""
    _cpu_pool.__dict__.clear()


class _Workspace:
    """Scratch buffers reused across chunks (and, on CPU, calls); no view of one escapes a call."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        kept = not _device_path(device)
        self.kept = _cpu_pool.__dict__.setdefault("buffers", {}) if kept else {}
        self.keep_bytes = _CPU_KEEP_BYTES if kept else math.inf
        self.local, self.views = {}, {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (name, dtype or self.dtype, tuple(shape))
        view = self.views.get(key)
        if view is None:
            numel = math.prod(shape)
            buf = self.local.get(key[:2], self.kept.get(key[:2]))
            if buf is None or buf.numel() < numel:
                with torch.inference_mode(False):  # kept between calls, which may be in or out of inference mode
                    buf = _huge_pages(torch.empty(numel, dtype=key[1], device=self.device))
                (self.kept if numel * buf.element_size() <= self.keep_bytes else self.local)[key[:2]] = buf
            view = self.views[key] = buf[:numel].view(shape)
        return view


def _load(x, b, c: _Chunk, plan: _Plan, ws: _Workspace, name: str, *, relu=False, mask_pad=False, copy=True):
    """Step 1 for one chunk: ``x[b, h0:h1]`` into block-major ``[G, m, L, w]`` (``copy=False``: maybe a view)."""
    g, w = c.h1 - c.h0, x.shape[-1]
    shape = (g, c.m1 - c.m0, plan.length, w)
    src = x[b, c.h0 : c.h1]
    if c.gather is None:
        src = src[:, c.t0 : c.t1]
        if not copy and src.dtype == ws.dtype:
            return src.reshape(shape)
        dst = ws.get(name, (g, c.t1 - c.t0, w))
        dst.copy_(src)
    else:
        dst = ws.get(name, (g, c.gather.numel(), w))
        gathered = dst if src.dtype == dst.dtype else ws.get(name, dst.shape, src.dtype)
        if src.is_contiguous() or _device_path(src.device):  # a GPU's index_select reads any strides in place
            torch.index_select(src, 1, c.gather, out=gathered)
        else:  # e.g. diffusers' [B, N, H, d] layout: on CPU a strided 3-D index_select would copy all of x first
            for i in range(g):
                torch.index_select(src[i], 0, c.gather, out=gathered[i])
        if gathered is not dst:
            dst.copy_(gathered)  # to the accumulation dtype
    dst = dst.view(shape)
    if relu:
        dst.relu_()
    if mask_pad and c.valid is not None:
        dst.mul_(c.valid)  # a multiply: masked_fill_ with a broadcast mask is 10x slower
    return dst


def _store(res: torch.Tensor, dest: torch.Tensor, b, c: _Chunk, ws: _Workspace) -> None:
    """Write a block-major chunk result ``[G, m, L, w]`` to ``dest[b, h0:h1, t0:t1]`` in token order."""
    g, w = res.shape[0], res.shape[-1]
    src = res.view(g, res.shape[1] * res.shape[2], w)
    dst = dest[b, c.h0 : c.h1, c.t0 : c.t1]
    if c.scatter is None:
        dst.copy_(src)
    elif dst.dtype == src.dtype and dst.is_contiguous():
        torch.index_select(src, 1, c.scatter, out=dst)
    else:  # another dtype, or the [B, N, H, w] memory layout: reorder in cache, then cast / copy
        dst.copy_(torch.index_select(src, 1, c.scatter, out=ws.get("store", dst.shape)))


# CPU tensors this large that the operator allocates and fills get transparent huge pages where the kernel
# offers them on request (Linux, THP "madvise" mode): their first touch then costs one fault per 2 MiB instead of
# per 4 KiB page. At N = 16,384 (12 x 64) that first touch was a quarter of the forward (docs/performance.md).
_HUGE_PAGE_BYTES = 2 << 20
_HUGE_HINT_MIN_BYTES = 4 * _HUGE_PAGE_BYTES
_MADV_HUGEPAGE = 14


@lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (argument types set), or ``None`` off Linux / without it."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask the kernel for huge pages on the 2 MiB-aligned interior of ``t``'s fresh CPU storage; returns ``t``.
    A hint only: values never change, and where it is refused (THP off, another OS) nothing happens."""
    if t.device.type != "cpu":
        return t
    storage = t.untyped_storage()
    if storage.nbytes() < _HUGE_HINT_MIN_BYTES or _madvise() is None:
        return t
    start = -(-storage.data_ptr() // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (storage.data_ptr() + storage.nbytes()) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if end > start:
        _madvise()(start, end - start, _MADV_HUGEPAGE)
    return t


def empty_like_layout(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``[B, H, N, width]`` tensor in ``x``'s memory layout (``[B, N, H, d]`` transposed stays so)."""
    b, h, n, _ = x.shape
    if not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return torch.empty(b, n, h, width, dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty(b, h, n, width, dtype=dtype, device=x.device)


def _new_output(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty_like_layout` for a result this backend fills (huge pages asked for on CPU)."""
    out = empty_like_layout(x, width, dtype)
    _huge_pages(out)
    return out


# Per-sample backward tensors start at multiples of this (the CUDA allocator's alignment): batch invariance.
_SAMPLE_ALIGN_BYTES = 512


def _per_sample(batch: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty ``[batch, *shape]`` tensor whose samples start ``_SAMPLE_ALIGN_BYTES``-aligned."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    step = -(-numel * itemsize // _SAMPLE_ALIGN_BYTES) * _SAMPLE_ALIGN_BYTES // itemsize
    return _huge_pages(torch.empty(batch, max(step, 1), dtype=dtype, device=device))[:, :numel].view(batch, *shape)


def _mix(mixing: torch.Tensor, summaries: torch.Tensor, ws: _Workspace, name: str) -> torch.Tensor:
    """Step 3 for a group of heads: ``Mc @ summaries[g]`` for each head, ``[G, M, ...] -> [G, M, ...]``."""
    g, m, rest = summaries.shape[0], summaries.shape[1], summaries.shape[2:]
    flat = summaries.reshape(g, m, math.prod(rest))
    return torch.bmm(mixing.expand(g, m, m), flat, out=ws.get(name, flat.shape)).view(summaries.shape)


def _relu_grad_(grad: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``grad * [phi > 0]`` in place."""
    return torch.ops.aten.threshold_backward.grad_input(grad, phi, 0, grad_input=grad)


def _setup(q, v, mixing, layout):
    acc = compute_dtype(q.dtype)
    plan = _plan(layout, q.device)
    width = max(q.shape[-1], v.shape[-1])
    groups = _chunks(layout, q.device, q.shape[1], width, torch.finfo(acc).bits // 8, _device_path(q.device))
    return acc, plan, groups, _Workspace(acc, q.device), mixing.to(device=q.device, dtype=acc)


def _forward_chunks(q, k, v, mixing, layout, normalize, eps, feature_map, need_grad):
    """The forward chunk by chunk (the CPU code path): ``(S, z, output, denominator)``, S, z and the denominator
    ``None`` unless ``need_grad``."""
    acc, plan, groups, ws, mix = _setup(q, v, mixing, layout)
    batch, heads, n, d = q.shape
    dv, m, length = v.shape[-1], plan.num_blocks, plan.length
    new = lambda *shape: _per_sample(shape[0], shape[1:], acc, q.device)  # noqa: E731
    s_all = new(batch, heads, m, d, dv) if need_grad else None
    z_all = new(batch, heads, m, d) if need_grad and normalize else None
    den_all = new(batch, heads, m, length) if need_grad and normalize else None
    out = _new_output(q, dv, q.dtype)
    for b in range(batch):
        for group in groups:
            hs, g = group[0].heads, group[0].h1 - group[0].h0
            s = s_all[b, hs] if need_grad else ws.get("s", (g, m, d, dv))
            z = (z_all[b, hs] if need_grad else ws.get("z", (g, m, d))) if normalize else None
            # Steps 1-2: per-block summaries S, z.
            for c in group:
                phi_k = _load(k, b, c, plan, ws, "k", relu=feature_map, mask_pad=True)
                v_b = _load(v, b, c, plan, ws, "v")
                torch.matmul(phi_k.transpose(-1, -2), v_b, out=s[:, c.blocks])
                if normalize:
                    torch.sum(phi_k, dim=-2, out=z[:, c.blocks])
            # Step 3: mixing.
            s_mix = _mix(mix, s, ws, "s_mix")
            z_mix = _mix(mix, z, ws, "z_mix") if normalize else None
            # Step 4: output, written straight into token order.
            for c in group:
                phi_q = _load(q, b, c, plan, ws, "q", relu=feature_map)
                num = torch.matmul(phi_q, s_mix[:, c.blocks], out=ws.get("num", (*phi_q.shape[:3], dv)))
                if normalize:
                    prod = torch.mul(phi_q, z_mix[:, c.blocks, None, :], out=ws.get("prod", phi_q.shape))
                    den = den_all[b, c.heads, c.blocks] if need_grad else ws.get("den", phi_q.shape[:3])
                    torch.sum(prod, dim=-1, out=den).add_(eps)
                    num.div_(den[..., None])
                _store(num, out, b, c, ws)
    return s_all, z_all, out, den_all


# ---------------------------------------------------------------------------------------------
# The GPU code path's forward: the windowed forward of ops/windows.py, one sample at a time (the batch never
# enters a GEMM's shape: see there for how each step keeps a sample's bits whatever its batch).

# Pieces (one op per tensor each, ops/windows.py) above which the GPU code path runs the chunked forward instead.
_MAX_PIECES = 16


def _window_plan(layout: BlockLayout, device: torch.device) -> WindowPlan | None:
    """The windows of ``layout`` if tensors on ``device`` take the windowed forward, else ``None`` (chunked forward)."""
    if not _device_path(device):
        return None
    plan = window_plan(layout)
    return plan if len(plan.pieces) <= _MAX_PIECES else None


def _forward_windows(q, k, v, mixing, layout, plan, normalize, eps, feature_map, need_grad):
    """The forward of the GPU code path, sample by sample: ``(S, z, output, denominator)`` as :func:`_forward_chunks`."""
    run = WindowForward(plan, q, k, v, compute_dtype(q.dtype), normalize, feature_map)
    batch, heads, _, d = q.shape
    dv, m, acc = v.shape[-1], layout.num_blocks, run.acc
    mix = mixing.to(device=q.device, dtype=acc)
    new = lambda *shape: _per_sample(shape[0], shape[1:], acc, q.device)  # noqa: E731
    s_all = new(batch, heads, m, d, dv) if need_grad else None
    z_all = new(batch, heads, m, d) if need_grad and normalize else None
    den_all = new(batch, heads, m, layout.max_block_size) if need_grad and normalize else None
    out = _new_output(q, dv, q.dtype)
    for b in range(batch):
        run.summaries(k[b], v[b])
        run.mix(mix)
        run.outputs(q[b], out[b], eps)
        if need_grad:
            run.save(b, s_all, z_all, den_all)
    return s_all, z_all, out, den_all


class _MHLA(torch.autograd.Function):
    """The operator with a hand-written backward, group of heads by group of heads."""

    @staticmethod
    def forward(ctx, q, k, v, mixing, layout, normalize, eps, feature_map, need_grad):
        windows = _window_plan(layout, q.device)
        if windows is None:
            saved = _forward_chunks(q, k, v, mixing, layout, normalize, eps, feature_map, need_grad)
        else:
            saved = _forward_windows(q, k, v, mixing, layout, windows, normalize, eps, feature_map, need_grad)
        s_all, z_all, out, den_all = saved
        ctx.save_for_backward(q, k, v, mixing, s_all, z_all, out, den_all)
        ctx.layout, ctx.normalize, ctx.feature_map = layout, normalize, feature_map
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, mixing, s_all, z_all, out, den_all = ctx.saved_tensors
        layout, normalize, feature_map = ctx.layout, ctx.normalize, ctx.feature_map
        relu_grad_ = _relu_grad_ if feature_map else (lambda grad, phi: grad)  # noqa: E731
        need_q, need_k, need_v, need_mix = ctx.needs_input_grad[:4]
        acc, plan, groups, ws, mix = _setup(q, v, mixing, layout)
        batch, heads, _, d = q.shape
        dv, m = v.shape[-1], plan.num_blocks
        mix_t = mix.t().contiguous()
        dq = _new_output(q, d, q.dtype) if need_q else None
        dk = _new_output(k, d, k.dtype) if need_k else None
        dvv = _new_output(v, dv, v.dtype) if need_v else None
        dmix = torch.zeros(m, m, dtype=acc, device=q.device)
        for b in range(batch):
            for group in groups:
                hs, g = group[0].heads, group[0].h1 - group[0].h0
                s, z = s_all[b, hs], (z_all[b, hs] if normalize else None)
                s_mix = _mix(mix, s, ws, "s_mix")
                z_mix = _mix(mix, z, ws, "z_mix") if normalize else None
                # Query side: dq and the gradients of the mixed summaries dS~, dz~.
                ds_mix = ws.get("ds_mix", (g, m, d, dv))
                dz_mix = ws.get("dz_mix", (g, m, d)) if normalize else None
                for c in group:
                    phi_q = _load(q, b, c, plan, ws, "q", relu=feature_map)
                    gn = _load(grad_out, b, c, plan, ws, "g", mask_pad=True)  # padded slots: no gradient
                    if normalize:
                        gn.div_(den_all[b, c.heads, c.blocks, :, None])
                        o = _load(out, b, c, plan, ws, "o", copy=False)
                        gd = torch.mul(gn, o, out=ws.get("prod", gn.shape)).sum(-1, keepdim=True).neg_()
                        prod = torch.mul(phi_q, gd, out=ws.get("prod", phi_q.shape))
                        torch.sum(prod, dim=-2, out=dz_mix[:, c.blocks])
                    torch.matmul(phi_q.transpose(-1, -2), gn, out=ds_mix[:, c.blocks])
                    if need_q:
                        da = torch.matmul(gn, s_mix[:, c.blocks].transpose(-1, -2), out=ws.get("da", phi_q.shape))
                        if normalize:
                            da.addcmul_(gd, z_mix[:, c.blocks, None, :])
                        _store(relu_grad_(da, phi_q), dq, b, c, ws)
                # Mixing: dMc += sum over heads of dS~ S^T (+ dz~ z^T); dS = Mc^T dS~, dz = Mc^T dz~.
                if need_mix:
                    dmix += torch.bmm(ds_mix.view(g, m, d * dv), s.reshape(g, m, d * dv).transpose(1, 2)).sum(0)
                    if normalize:
                        dmix += torch.bmm(dz_mix, z.transpose(1, 2)).sum(0)
                if not (need_k or need_v):
                    continue
                ds = _mix(mix_t, ds_mix, ws, "ds")
                dz = _mix(mix_t, dz_mix, ws, "dz") if normalize else None
                # Key side: dv = phi(K) dS, dk = (V dS^T + dz) [k > 0].
                for c in group:
                    phi_k = _load(k, b, c, plan, ws, "k", relu=feature_map, mask_pad=True)
                    if need_v:
                        dv_b = torch.matmul(phi_k, ds[:, c.blocks], out=ws.get("num", (*phi_k.shape[:3], dv)))
                        _store(dv_b, dvv, b, c, ws)
                    if need_k:
                        v_b = _load(v, b, c, plan, ws, "v")
                        dphi = torch.matmul(v_b, ds[:, c.blocks].transpose(-1, -2), out=ws.get("da", phi_k.shape))
                        if normalize:
                            dphi += dz[:, c.blocks, None, :]
                        _store(relu_grad_(dphi, phi_k), dk, b, c, ws)
        return dq, dk, dvv, dmix.to(mixing.dtype) if need_mix else None, None, None, None, None, None


# Hidden from torch.compile: tracing would unroll the chunk loops (ops/compiled.py wraps it instead).
@torch.compiler.disable
def mhla_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_map: bool = True,
) -> torch.Tensor:
    """MHLA in PyTorch; inputs validated by :func:`~mhla_diffusers.ops.mhla_attention`.

    q, k ``[B, heads, N, d]``, v ``[B, heads, N, d_v]`` (fp16, bf16, fp32 or fp64); ``feature_map``: apply
    ``phi = ReLU``. Returns ``[B, heads, N, d_v]`` in ``q``'s dtype and memory layout, differentiable
    (first order) in q, k, v and ``mixing``.
    """
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing))
    return _MHLA.apply(q, k, v, mixing, layout, normalize, float(eps), bool(feature_map), need_grad)
