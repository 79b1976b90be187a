"""MHLA in Triton: fused forward and backward kernels behind a ``torch.autograd.Function``.

Imported at the first ``backend="triton"`` call, never by ``import mhla_diffusers``. Runs on CUDA
tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before the first import; tests only).
Same math as ``torch_ops`` (MHLA paper, Sec. 3.2); fp32 accumulation (fp64 for fp64), no atomics,
batch-invariant by construction. The ``@triton.jit`` kernels are in :mod:`.triton_kernels`; this
module holds their launches (tile sizes, splits, grids) and the autograd function. Kernels,
precision, splits and launch configuration: ``docs/operator.md``, "The Triton backend".
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from mhla_diffusers import env
from mhla_diffusers.ops.layout import BlockLayout
from mhla_diffusers.ops.rotary import InterleavedRotary
from mhla_diffusers.ops.torch_ops import empty_like_layout, mhla_attention_torch
from mhla_diffusers.ops.triton_kernels import bwd_key, bwd_query, fwd_output, fwd_summaries, mix_gemm

__all__ = ["mhla_attention_triton", "interpreter_enabled", "check_supported", "torch_fallback_reason", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128
# Triton's switch for its CPU interpreter (the backend module, which must not import this one, reads it too)
_INTERPRET_VARIABLE = "TRITON_INTERPRET"

# Block splits (docs/operator.md, "Splits"): programs per ONE sample (~2 waves on 132 SMs) before
# blocks are split, and the fewest tokens per split. No splitting under the interpreter unless asked.
_TARGET_PROGRAMS = 264
_MIN_SPLIT_TOKENS = 256
_INTERPRET_SPLIT_TOKENS: int | None = None  # tests: force splits of this many tokens under the interpreter
_INTERPRET_BLOCK_T = 256  # token-tile cap under the interpreter (large tiles: few programs)
_INTERPRET_MIX_BLOCKS: tuple[int, int, int] | None = None  # tests: (BLOCK_R, BLOCK_K, BLOCK_N) of mix_gemm

# A list: launches are recorded as (kernel, grid, args, meta) with the GPU configuration, not run
# (tests/ops/triton_compile_check.py compiles them for sm_90 without a GPU).
_RECORD: list | None = None


def interpreter_enabled() -> bool:
    """Whether the Triton interpreter is on (``TRITON_INTERPRET=1``)."""
    return env.flag(_INTERPRET_VARIABLE)


# Whether the kernels (triton_kernels, imported above; this module is its only importer) are defined for
# the interpreter: Triton decides when they are defined.
_INTERPRETED = interpreter_enabled()

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


@lru_cache(maxsize=64)
def _index(layout: BlockLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [N], start [M], size [M])`` int32 on ``device``: tokens sorted by block, block runs."""
    with torch.inference_mode(False):  # cached: must not become an inference tensor
        order = torch.argsort(layout.block_index, stable=True)
        sizes = layout.block_sizes
        starts = torch.cumsum(sizes, 0) - sizes
        return tuple(t.to(device=device, dtype=torch.int32) for t in (order, starts, sizes))


def _next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(int(x)))


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda" or _RECORD is not None


def _launch(kernel, grid, *args, **meta) -> None:
    if _RECORD is not None:
        _RECORD.append((kernel, grid, args, meta))
    else:
        kernel[grid](*args, **meta)


def _config(d: int, dv: int, length: int, device: torch.device, prec: str) -> dict:
    """Fixed launch configuration by head dim and precision (chosen by compiling for sm_90; not yet timed)."""
    block_d, block_dv = _next_pow2(d), _next_pow2(dv)
    widest = max(block_d, block_dv)
    if not _on_gpu(device):  # interpreter: one large tile per block, few programs
        block_t = min(_next_pow2(length), _INTERPRET_BLOCK_T)
        tiles = (block_t, block_t, 4, 4)
    elif prec == "ieee":  # fp32 inputs: FMA products, small tiles keep operands in registers
        tiles = (32, 32, 4, 4) if widest <= 32 else (32, 16, 8, 8) if widest <= 64 else (16, 16, 8, 8)
    else:  # fp16 / bf16 inputs: tensor cores; bwd_query above d = 64 in 16 warps (<= 128 registers, no spill)
        tiles = (128, 32, 4, 4) if widest <= 64 else (64, 16, 8, 16)
    block_t, block_t_bwd, warps, warps_bwd = tiles
    return dict(BLOCK_T=block_t, BLOCK_T_BWD=block_t_bwd, BLOCK_D=block_d, BLOCK_DV=block_dv,
                num_warps=warps, num_warps_bwd=warps_bwd, num_stages=2, **_key_config(block_t, widest, device))


def _key_config(block_t: int, widest: int, device: torch.device) -> dict:
    """``bwd_key``'s token tile and stages: it holds ``dS_b`` twice in shared memory (each of its products needs its
    own operand order; 64 KB fp32 each at d = 128) while it walks its split's tiles of k and v.

    On a GPU: tiles of at most 64 tokens (128-token tiles spill at d = 64 with RoPE); above d = 64 one stage (two: 160-192 KB
    of shared memory, over sm_80's 163 KB, and a spill with RoPE at sm_90).
    """
    if not _on_gpu(device):
        return dict(BLOCK_T_KEY=block_t, num_stages_key=2)
    return dict(BLOCK_T_KEY=min(block_t, 64), num_stages_key=2 if widest <= 64 else 1)


def _align(d: int, dv: int, *tensors: torch.Tensor) -> int:
    """The token kernels' ``ALIGN``: the largest of 16, 8, 4, 2, 1 dividing the head dims and every batch, head and
    token stride of ``tensors`` (their channel strides aside), so the kernels may tell the compiler so.

    Taken from one sample's memory layout (the strides of a sample do not change with the batch size).
    """
    values = [d, dv, *(stride for t in tensors for stride in t.stride()[:3])]
    return next(a for a in (16, 8, 4, 2, 1) if all(v % a == 0 for v in values))


def _split_tokens(length: int, programs: int, block_t: int, device: torch.device) -> int:
    """Tokens per split of a block, from one sample's programs (never the batch's)."""
    if not _on_gpu(device):
        target = _INTERPRET_SPLIT_TOKENS or length
    else:
        want = -(-_TARGET_PROGRAMS // max(programs, 1))  # splits per block wanted
        target = max(_MIN_SPLIT_TOKENS, -(-length // want))
    return max(block_t, -(-max(1, target) // block_t) * block_t)


def _precision(*tensors: torch.Tensor) -> str:
    """``tl.dot`` precision with an fp32 operand: TF32 for fp16/bf16 inputs, else ``"ieee"``."""
    return "tf32" if any(t.dtype in _LOW_PRECISION for t in tensors) else "ieee"


def _mix(mix: torch.Tensor, parts: torch.Tensor, prec: str, batch: int) -> torch.Tensor:
    """``Mc @ sum_p parts[p]`` over the block axis by ``mix_gemm``: ``[P, M, B*H, ...] -> [M, B*H, ...]``."""
    p, m = parts.shape[0], parts.shape[1]
    a = mix if p == 1 else mix.repeat(1, p)
    b = parts.reshape(p * m, -1)
    ncol = b.shape[1]
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    if ncol == 0:
        return out
    cols = ncol // batch  # columns of one sample: H * d * d_v (or H * d)
    if _on_gpu(parts.device):  # 8 warps: no spill with A = Mc^T (unit row stride) either (4: 64 + 64 B at sm_90)
        block_r, block_k, block_n, warps = 64, 32, 128, 8
    elif _INTERPRET_MIX_BLOCKS is not None:  # tests: several row tiles, K steps and column strips
        (block_r, block_k, block_n), warps = _INTERPRET_MIX_BLOCKS, 4
    else:  # interpreter: few, large programs (one strip per sample up to 4096 columns)
        block_r, block_k, block_n, warps = _next_pow2(min(m, 256)), _next_pow2(min(p * m, 256)), _next_pow2(min(cols, 4096)), 4
    _launch(
        mix_gemm, (triton.cdiv(cols, block_n), batch),
        a, b, out, m, p * m, ncol, cols, a.stride(0), a.stride(1),
        ACC=_TL_DTYPE[parts.dtype], PREC=prec, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=warps, num_stages=3,
    )
    return out


def _sum_parts(parts: torch.Tensor) -> torch.Tensor:
    """``sum_p parts[p]`` in the order ``p = 0, 1, ...`` (independent of the batch size)."""
    total = parts[0]
    if parts.shape[0] > 1:
        total = total.clone()
        for part in parts[1:]:
            total += part
    return total


def _device_of(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


class _MHLATriton(torch.autograd.Function):
    """Forward and backward by the kernels of :mod:`.triton_kernels` (first order)."""

    @staticmethod
    def forward(ctx, q, k, v, mixing, layout, normalize, eps, feature_map, rotary, need_grad):
        with _device_of(q):
            return _MHLATriton._forward(ctx, q, k, v, mixing, layout, normalize, eps, feature_map, rotary, need_grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        with _device_of(grad_out):
            return _MHLATriton._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, q, k, v, mixing, layout, normalize, eps, feature_map, rotary, need_grad):
        batch, heads, n, d = q.shape
        dv = v.shape[-1]
        bh, m, length = batch * heads, layout.num_blocks, layout.max_block_size
        device = q.device
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        # phi(K)^T V on 16-bit tensor cores when k and v are both 16-bit; rotated keys stay in acc.
        dot = k.dtype if (k.dtype == v.dtype and k.dtype in _LOW_PRECISION and rotary is None) else acc
        prec = _precision(q, k, v)
        order, starts, sizes = _index(layout, device)
        cfg = _config(d, dv, length, device, prec)
        mix = mixing.to(device=device, dtype=acc)
        eps_t = torch.full((1,), eps, dtype=acc, device=device)
        out = empty_like_layout(q, dv, q.dtype)
        cos, sin = rotary.tables(device, acc) if rotary is not None else (order, order)  # placeholders when unused

        split = _split_tokens(length, heads * m, cfg["BLOCK_T"], device)
        parts = -(-length // split)
        s_parts = torch.empty(parts, m, bh, d, dv, dtype=acc, device=device)
        z_parts = torch.empty(parts, m, bh, d, dtype=acc, device=device) if normalize else s_parts
        _launch(
            fwd_summaries, (m * parts, bh),
            k, v, order, starts, sizes, s_parts, z_parts, cos, sin,
            heads, d, dv, bh, m, parts, split,
            *k.stride(), *v.stride(),
            FEATURE_MAP=feature_map, NORMALIZE=normalize, ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], DOT=_TL_DTYPE[dot], PREC=prec,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"], ALIGN=_align(d, dv, k, v),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        s_mix = _mix(mix, s_parts, prec, batch)
        z_mix = _mix(mix, z_parts, prec, batch) if normalize else s_mix

        _launch(  # the summaries' splits: S~_b read once per split, not once per token tile
            fwd_output, (m * parts, bh),
            q, s_mix, z_mix, eps_t, out, order, starts, sizes, cos, sin,
            heads, d, dv, bh, parts, split,
            *q.stride(), *out.stride(),
            FEATURE_MAP=feature_map, NORMALIZE=normalize, ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"], ALIGN=_align(d, dv, q, out),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        if need_grad:  # the un-mixed summaries (for dMc and the recomputed S~)
            s = _sum_parts(s_parts)
            z = _sum_parts(z_parts) if normalize else None
            ctx.save_for_backward(q, k, v, mixing, s, z)
            ctx.layout, ctx.normalize, ctx.eps, ctx.feature_map, ctx.rotary = layout, normalize, eps, feature_map, rotary
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, mixing, s, z = ctx.saved_tensors
        layout, normalize, eps, feature_map, rotary = ctx.layout, ctx.normalize, ctx.eps, ctx.feature_map, ctx.rotary
        need_q, need_k, need_v, need_mix = ctx.needs_input_grad[:4]
        batch, heads, n, d = q.shape
        dv = v.shape[-1]
        bh, m, length = batch * heads, layout.num_blocks, layout.max_block_size
        device = q.device
        acc = s.dtype
        prec = _precision(q, k, v)
        order, starts, sizes = _index(layout, device)
        cfg = _config(d, dv, length, device, prec)
        mix = mixing.to(device=device, dtype=acc)
        eps_t = torch.full((1,), eps, dtype=acc, device=device)
        s_mix = _mix(mix, s[None], prec, batch)
        z_mix = _mix(mix, z[None], prec, batch) if normalize else s_mix
        cos, sin = rotary.tables(device, acc) if rotary is not None else (order, order)

        dq = empty_like_layout(q, d, q.dtype) if need_q else s_mix  # placeholder pointer when unused
        split = _split_tokens(length, heads * m, cfg["BLOCK_T_BWD"], device)
        parts = -(-length // split)
        ds_parts = torch.empty(parts, m, bh, d, dv, dtype=acc, device=device)
        dz_parts = torch.empty(parts, m, bh, d, dtype=acc, device=device) if normalize else ds_parts
        dq_strides = dq.stride() if need_q else (0, 0, 0, 0)
        _launch(
            bwd_query, (m * parts, bh),
            q, grad_out, s_mix, z_mix, eps_t, dq, ds_parts, dz_parts, order, starts, sizes, cos, sin,
            heads, d, dv, bh, m, parts, split,
            *q.stride(), *grad_out.stride(), *dq_strides,
            FEATURE_MAP=feature_map, NORMALIZE=normalize, STORE_DQ=bool(need_q), ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
            BLOCK_T=cfg["BLOCK_T_BWD"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
            ALIGN=_align(d, dv, q, grad_out, *((dq,) if need_q else ())),
            num_warps=cfg["num_warps_bwd"], num_stages=cfg["num_stages"],
        )
        dmix = None
        if need_mix:  # dMc[i, j] = sum over batch and heads of <dS~_i, S_j> (+ <dz~_i, z_j>): torch GEMMs
            ds_mix = _sum_parts(ds_parts)
            dz_mix = _sum_parts(dz_parts) if normalize else None
            dmix = torch.mm(ds_mix.reshape(m, -1), s.reshape(m, -1).t())
            if normalize:
                dmix += torch.mm(dz_mix.reshape(m, -1), z.reshape(m, -1).t())
            dmix = dmix.to(mixing.dtype)

        dk = dvv = None
        if need_k or need_v:
            mix_t = mix.t()
            ds = _mix(mix_t, ds_parts, prec, batch)
            dz = _mix(mix_t, dz_parts, prec, batch) if normalize else ds
            dk = empty_like_layout(k, d, k.dtype) if need_k else ds
            dvv = empty_like_layout(v, dv, v.dtype) if need_v else ds
            split = _split_tokens(length, heads * m, cfg["BLOCK_T_KEY"], device)
            parts = -(-length // split)
            _launch(  # dS_b read once per split, not once per token tile
                bwd_key, (m * parts, bh),
                k, v, ds, dz, dk, dvv, order, starts, sizes, cos, sin,
                heads, d, dv, bh, parts, split,
                *k.stride(), *v.stride(),
                *(dk.stride() if need_k else (0, 0, 0, 0)), *(dvv.stride() if need_v else (0, 0, 0, 0)),
                FEATURE_MAP=feature_map, NORMALIZE=normalize, NEED_DK=bool(need_k), NEED_DV=bool(need_v),
                ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
                BLOCK_T=cfg["BLOCK_T_KEY"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
                ALIGN=_align(d, dv, k, v, *((dk,) if need_k else ()), *((dvv,) if need_v else ())),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages_key"],
            )
            dk = dk if need_k else None
            dvv = dvv if need_v else None
        return (dq if need_q else None), dk, dvv, dmix, None, None, None, None, None, None


def check_supported(q: torch.Tensor, *others: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the kernels can run on ``q``'s device.

    CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before the first import and no
    bfloat16 input (the interpreter's bf16 arithmetic is wrong).
    """
    if q.device.type == "cpu":
        late = interpreter_enabled() and not (_INTERPRETED and env.flag(_INTERPRET_VARIABLE, at_import=True))
        if late:
            raise ValueError(
                "TRITON_INTERPRET=1 was set after mhla_diffusers (which imports diffusers and triton) was imported: "
                "Triton's functions are set up for a GPU. Set it in the environment before the first import"
            )
        if _INTERPRETED and any(t.dtype == torch.bfloat16 for t in (q, *others)):
            raise ValueError(
                "bfloat16 inputs cannot run in Triton's CPU interpreter (its bf16 arithmetic is wrong); "
                "use float32 / float64 / float16 there, or backend='torch'"
            )
        if not _INTERPRETED:
            raise ValueError(
                "the Triton MHLA backend runs on CUDA tensors; these are on the CPU (set TRITON_INTERPRET=1 "
                "before importing mhla_diffusers.ops.triton_ops to run the kernels in Triton's CPU interpreter, "
                "for tests only), or use backend='torch'"
            )
    elif q.device.type != "cuda":
        raise ValueError(f"the Triton MHLA backend runs on CUDA tensors; got {q.device.type} tensors. Use backend='torch'")


def torch_fallback_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why these inputs go to the torch backend instead of the kernels, or ``None``.

    Head dims above :data:`MAX_HEAD_DIM`; on a GPU also float64 (too much shared memory).
    """
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims d={q.shape[-1]}, d_v={v.shape[-1]} above {MAX_HEAD_DIM}"
    if q.device.type == "cuda" and q.dtype == torch.float64:
        return "float64 on a GPU"
    return None


@torch.compiler.disable
def mhla_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    layout: BlockLayout,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_map: bool = True,
    rotary: InterleavedRotary | None = None,
) -> torch.Tensor:
    """MHLA by the Triton kernels; inputs validated by :func:`~mhla_diffusers.ops.mhla_attention`.

    q, k ``[B, heads, N, d]``, v ``[B, heads, N, d_v]`` (no bf16 under the interpreter), any strides;
    ``rotary``: an :class:`~mhla_diffusers.ops.InterleavedRotary` applied in the kernels (no table
    gradient, even ``d``). Returns ``[B, heads, N, d_v]`` in ``q``'s dtype and memory layout. Head dims
    above 128 and fp64 on a GPU run the torch backend (:func:`torch_fallback_reason`).

    Raises:
        ValueError: CPU tensors without the interpreter, other devices, or a fallback case with ``rotary``.
        TypeError: ``rotary`` is not an ``InterleavedRotary``.
    """
    check_supported(q, k, v, mixing)
    if rotary is not None:
        if not isinstance(rotary, InterleavedRotary):
            raise TypeError(f"the Triton kernels take an InterleavedRotary as rotary; got {type(rotary).__name__}")
        rotary.check(q.shape)
    if torch_fallback_reason(q, v) is not None:
        if rotary is not None:
            raise ValueError(
                f"rotary inputs the kernels do not take ({torch_fallback_reason(q, v)}): call mhla_attention, "
                "which composes the rotation with the torch backend"
            )
        return mhla_attention_torch(q, k, v, mixing, layout, normalize=normalize, eps=eps, feature_map=feature_map)
    if q.numel() == 0 or v.numel() == 0:
        return empty_like_layout(q, v.shape[-1], q.dtype) * mixing.sum().to(q.dtype)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing))
    return _MHLATriton.apply(q, k, v, mixing, layout, bool(normalize), float(eps), bool(feature_map), rotary, need_grad)
