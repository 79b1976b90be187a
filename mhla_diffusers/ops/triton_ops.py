"""MHLA in Triton: fused forward and backward kernels behind a ``torch.autograd.Function``.

Imported lazily (``mhla_attention(..., backend="triton")`` imports it); importing
``mhla_diffusers`` never imports this module. Runs on CUDA tensors, or on CPU tensors under the
Triton interpreter (``TRITON_INTERPRET=1`` set before this module is first imported; tests only).

The math is the MHLA paper's (Sec. 3.2), the same as ``torch_ops`` (see its module docstring for
the backward formulas). Per batch element and head, with ``phi = ReLU`` when ``feature_map`` (else
the identity: q and k are already features), for blocks ``b`` of the layout:

    S_b = phi(K_b)^T V_b   [d, d_v],     z_b = sum_{t in b} phi(k_t)   [d]
    S~  = Mc S,   z~ = Mc z                          (one GEMM over the block axis, all heads at once)
    out = phi(q) S~_{b(q)} / (phi(q) . z~_{b(q)} + eps)    (or the numerator when not normalize)

Kernels (a program never reads a token of another block; no atomics, so results are
deterministic and do not depend on the launch order):

    _fwd_summaries   grid (M * P, B * H): a program walks the tokens of one split of one block
                     (``P`` splits per block, usually 1; ``P`` depends on one sample's shape only),
                     gathering rows of k and v through the
                     layout's block-major token order (tokens of a block are not contiguous in
                     token order), applying phi at load, accumulating S and z in fp32 (fp64 for
                     fp64 inputs). Writes ``[P, M, B*H, d, d_v]`` partial summaries.
    _mix_gemm        grid (strips, B): ``S~ = Mc S``, ``z~ = Mc z`` as a ``[M, P*M] x [P*M, H*d*d_v]``
                     GEMM per sample over all its heads (``Mc`` repeated over the splits, so it also
                     sums them), in column strips counted from the sample's first column; fp32 (fp64).
    _fwd_output      grid (M * tiles, B * H): a tile of a block's queries; phi at load; numerator
                     ``phi(q) S~`` and denominator ``phi(q) . z~ + eps`` in fp32; the output is
                     written once, in the input dtype, in place in token order.
    _bwd_query       grid (M * P, B * H): recomputes numerator and denominator of a tile (no saved
                     output needed); ``gn = g / den``, ``gd = -(gn . num) / den``; writes dq and
                     accumulates ``dS~ = sum phi(q)^T gn``, ``dz~ = sum phi(q) gd`` per block.
    mixing backward  ``dS = Mc^T dS~``, ``dz = Mc^T dz~`` by ``_mix_gemm``; ``dMc = dS~ S^T + dz~ z^T`` by
                     torch GEMMs over ``[M, B*H*d*d_v]`` (the sum over heads and batch is free).
    _bwd_key         grid (M * tiles, B * H): ``dv = phi(K) dS``, ``dk = (V dS^T + dz) [k > 0]``.

With an :class:`~mhla_diffusers.ops.InterleavedRotary` ``R`` (Wan's RoPE; the ``ROTARY`` variant of
every kernel) the numerator uses rotated features and the denominator un-rotated ones::

    S_b = (R phi(K_b))^T V_b,   out = (R phi(q)) S~_{b(q)} / (phi(q) . z~_{b(q)} + eps)

q and k tiles are rotated at load (``_rotate``: pairs ``(2i, 2i+1)`` by the token's ``cos`` / ``sin``
table rows, fp32); the backward multiplies the numerator's gradients by ``R^T`` (``-sin``):
``dq = (R^T (gn S~^T) + gd z~) [q > 0]``, ``dv = (R phi(K)) dS``, ``dk = (R^T (V dS^T) + dz) [k > 0]``,
``dS~ = sum (R phi(q))^T gn``. The rotated keys of ``S`` stay in fp32 (TF32 products), not 16 bits.

Nothing of size ``N x N`` or ``N x d x d`` exists; the forward reads q, k, v once and writes the
output once (plus the fp32 summaries ``[M, B*H, d, d_v]``, saved for the backward).

Precision: summaries, mixing, numerator and denominator in fp32 (fp64 for fp64 inputs). The
``phi(K)^T V`` product runs on the inputs' own dtype when k and v are both fp16 or both bf16
(tensor cores, fp32 accumulation); every product with an fp32 operand (``phi(q) S~``, the mixing
and the backward's) uses TF32 for fp16/bf16 inputs (a relative rounding of 2^-11 of one operand,
below the output's own rounding to the input dtype) and full fp32 ("ieee") for fp32 inputs;
``dMc`` is a torch fp32 GEMM.

Head dims: ``d`` and ``d_v`` up to 128, any value (72 is padded to a 128-wide tile with masks);
larger head dims, and float64 inputs on a GPU, run through the torch backend instead (same
numbers; see ``torch_fallback_reason``). Under the interpreter fp64 runs through the kernels.
Layouts: any :class:`~mhla_diffusers.BlockLayout` (uneven blocks, partial tiles, single tokens).
Inputs: any strides (diffusers' ``[B, N, H, d]`` viewed as ``[B, H, N, d]`` is read in place; the
output and the input gradients take that memory layout too), dtypes may differ between q, k, v.
Configs are fixed per head dim (no autotuning).

Batch invariance by construction (CASES C03: CFG runs cond + uncond in one batch): every choice
that sets an order of summation -- tile sizes, the token splits ``P`` of a block, the mixing
GEMM's tiles and strips -- is made from one sample's shape (block lengths, heads x blocks, head
dims, dtype, device), never from the batch size, and every program works on one sample only, on
tiles whose shape and content do not depend on where the sample sits in the batch. A sample's
output, dq, dk and dv are therefore the same bits alone and at any position of any batch (only
``dMc``, a sum over the batch, depends on the other samples). Under the interpreter this matters
too: ``tl.dot`` runs numpy's BLAS, whose result for a column can depend on the column's place in
the matrix (OpenBLAS Haswell/Zen kernels), so a sample's tiles must sit at the same places.
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

__all__ = ["mhla_attention_triton", "interpreter_enabled", "check_supported", "torch_fallback_reason", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128
# Triton's switch for its CPU interpreter (the backend module, which must not import this one, reads it too)
_INTERPRET_VARIABLE = "TRITON_INTERPRET"

# Programs per sample (heads x blocks x splits) the summary kernels aim for on a GPU before they
# split blocks (P > 1): ~2 waves on an H100/H200 (132 SMs) for ONE sample, so batch-1 inference
# fills the GPU; larger batches only have more programs. Counted per sample, never per batch: the
# splits set the order in which a block's tokens are summed, so they must not depend on the batch
# (module docstring). A split holds >= _MIN_SPLIT_TOKENS tokens, which bounds the extra traffic of
# the partial summaries (written and read back once: 2 * 4 d d_v bytes per split) to
# <= 256 / split of the summary pass's reads at d = d_v = 128 in bf16 (<= 1x at 256 tokens).
# Under the interpreter every program costs ~1 ms per op, so no splitting unless a test asks for
# it through _INTERPRET_SPLIT_TOKENS.
_TARGET_PROGRAMS = 264
_MIN_SPLIT_TOKENS = 256
_INTERPRET_SPLIT_TOKENS: int | None = None  # tests: force splits of this many tokens under the interpreter
_INTERPRET_BLOCK_T = 256  # token-tile cap under the interpreter (large tiles: few programs)
_INTERPRET_MIX_BLOCKS: tuple[int, int, int] | None = None  # tests: (BLOCK_R, BLOCK_K, BLOCK_N) of _mix_gemm

# When a list, kernel launches are appended to it as (kernel, grid, args, meta) instead of run, and
# the GPU launch configuration is used whatever the device: lets a test compile the exact launches
# of a CUDA run for an sm_90 target on a machine without a GPU (see tests/ops/triton_compile_check.py).
_RECORD: list | None = None


def interpreter_enabled() -> bool:
    """True when the Triton interpreter is on (``TRITON_INTERPRET=1``): kernels then run on CPU tensors."""
    return env.flag(_INTERPRET_VARIABLE)


# Whether the kernels below are defined for the interpreter: Triton decides when they are defined.
_INTERPRETED = interpreter_enabled()

# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _rotate(x, cos, sin, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the interleaved channel pairs of a ``[BLOCK_T, BLOCK_D]`` tile by per-row angles:
    ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`` with ``cos``, ``sin`` of ``[BLOCK_T, BLOCK_D / 2]``
    (pass ``-sin`` for the transposed rotation ``R^T``, the backward's)."""
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_D // 2, 2)))
    return tl.reshape(tl.join(x0 * cos - x1 * sin, x0 * sin + x1 * cos), (BLOCK_T, BLOCK_D))


@triton.jit
def _load_tables(cos_ptr, sin_ptr, tok, mask_t, HALF, BLOCK_D: tl.constexpr):
    """Rows ``tok`` of the ``[N, HALF]`` rotary tables as ``[BLOCK_T, BLOCK_D / 2]`` tiles (0 where masked)."""
    offs_h = tl.arange(0, BLOCK_D // 2)
    mask = mask_t[:, None] & (offs_h < HALF)[None, :]
    offs = tok[:, None] * HALF + offs_h[None, :]
    return tl.load(cos_ptr + offs, mask=mask, other=0.0), tl.load(sin_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _fwd_summaries(
    k_ptr, v_ptr, order_ptr, start_ptr, size_ptr, s_ptr, z_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, M, P, split_tokens,
    skb, skh, skn, skd, svb, svh, svn, svd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """S_b = phi(K_b)^T V_b (or (R phi(K_b))^T V_b) and z_b = sum phi(K_b) over one split of one block, for one (batch, head)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // P
    p = pid % P
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start = tl.load(start_ptr + m)
    size = tl.load(size_ptr + m)
    lo = p * split_tokens
    hi = tl.minimum(lo + split_tokens, size)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh

    acc = tl.zeros([BLOCK_D, BLOCK_DV], dtype=ACC)
    zacc = tl.zeros([BLOCK_D], dtype=ACC)
    for t0 in range(lo, hi, BLOCK_T):
        slot = t0 + offs_t
        mask_t = slot < hi
        tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)
        kk = tl.load(k_base + tok[:, None] * skn + offs_d[None, :] * skd, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        vv = tl.load(v_base + tok[:, None] * svn + offs_e[None, :] * svd, mask=mask_t[:, None] & mask_e[None, :], other=0.0)
        kk = kk.to(DOT)
        if FEATURE_MAP:
            kk = tl.maximum(kk, 0.0).to(DOT)  # Triton 3.6 promotes bf16 vs a float literal to fp32
        if ROTARY:  # DOT is ACC here: the rotated keys are not rounded to 16 bits
            cos, sin = _load_tables(cos_ptr, sin_ptr, tok, mask_t, D // 2, BLOCK_D)
            rk = _rotate(kk, cos, sin, BLOCK_T, BLOCK_D)
        else:
            rk = kk
        acc = tl.dot(tl.trans(rk), vv.to(DOT), acc, input_precision=PREC, out_dtype=ACC)
        if NORMALIZE:
            zacc += tl.sum(kk.to(ACC), axis=0)

    row = ((p * M + m) * BH + bh).to(tl.int64)
    s_out = s_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :]
    tl.store(s_out, acc, mask=mask_d[:, None] & mask_e[None, :])
    if NORMALIZE:
        tl.store(z_ptr + row * D + offs_d, zacc, mask=mask_d)


@triton.jit
def _fwd_output(
    q_ptr, st_ptr, zt_ptr, eps_ptr, o_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, TILES,
    sqb, sqh, sqn, sqd, sob, soh, son, sod,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """out = phi(q) S~_b / (phi(q) . z~_b + eps) (numerator R phi(q) S~_b with ROTARY) for one tile of block b's
    queries, one (batch, head)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // TILES
    tile = pid % TILES
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start = tl.load(start_ptr + m)
    size = tl.load(size_ptr + m)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    slot = tile * BLOCK_T + offs_t
    mask_t = slot < size
    tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)

    qq = tl.load(q_ptr + b * sqb + h * sqh + tok[:, None] * sqn + offs_d[None, :] * sqd,
                 mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(ACC)
    if FEATURE_MAP:
        qq = tl.maximum(qq, 0.0)
    if ROTARY:
        cos, sin = _load_tables(cos_ptr, sin_ptr, tok, mask_t, D // 2, BLOCK_D)
        rq = _rotate(qq, cos, sin, BLOCK_T, BLOCK_D)
    else:
        rq = qq
    row = (m * BH + bh).to(tl.int64)
    st = tl.load(st_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    num = tl.dot(rq, st, input_precision=PREC, out_dtype=ACC)
    if NORMALIZE:
        zt = tl.load(zt_ptr + row * D + offs_d, mask=mask_d, other=0.0)
        den = tl.sum(qq * zt[None, :], axis=1) + tl.load(eps_ptr)
        den = tl.where(mask_t, den, 1.0)  # padded rows are not stored; keep them finite even with eps = 0
        num = num / den[:, None]
    o_out = o_ptr + b * sob + h * soh + tok[:, None] * son + offs_e[None, :] * sod
    tl.store(o_out, num.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :])


@triton.jit
def _bwd_query(
    q_ptr, g_ptr, st_ptr, zt_ptr, eps_ptr, dq_ptr, dst_ptr, dzt_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, M, P, split_tokens,
    sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd, sdb, sdh, sdn, sdd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, STORE_DQ: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Query side of the backward for one split of one block: dq, and partial dS~, dz~ of the block."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // P
    p = pid % P
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start = tl.load(start_ptr + m)
    size = tl.load(size_ptr + m)
    lo = p * split_tokens
    hi = tl.minimum(lo + split_tokens, size)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    mask_de = mask_d[:, None] & mask_e[None, :]
    row = (m * BH + bh).to(tl.int64)
    st = tl.load(st_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :], mask=mask_de, other=0.0)
    if NORMALIZE:
        zt = tl.load(zt_ptr + row * D + offs_d, mask=mask_d, other=0.0)
        eps = tl.load(eps_ptr)
    q_base = q_ptr + b * sqb + h * sqh
    g_base = g_ptr + b * sgb + h * sgh
    dq_base = dq_ptr + b * sdb + h * sdh

    dst = tl.zeros([BLOCK_D, BLOCK_DV], dtype=ACC)
    dzt = tl.zeros([BLOCK_D], dtype=ACC)
    for t0 in range(lo, hi, BLOCK_T):
        slot = t0 + offs_t
        mask_t = slot < hi
        tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)
        mask_td = mask_t[:, None] & mask_d[None, :]
        qraw = tl.load(q_base + tok[:, None] * sqn + offs_d[None, :] * sqd, mask=mask_td, other=0.0).to(ACC)
        if FEATURE_MAP:
            qq = tl.maximum(qraw, 0.0)
        else:
            qq = qraw
        if ROTARY:
            cos, sin = _load_tables(cos_ptr, sin_ptr, tok, mask_t, D // 2, BLOCK_D)
            rq = _rotate(qq, cos, sin, BLOCK_T, BLOCK_D)
        else:
            rq = qq
        gn = tl.load(g_base + tok[:, None] * sgn + offs_e[None, :] * sgd, mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(ACC)
        if NORMALIZE:
            num = tl.dot(rq, st, input_precision=PREC, out_dtype=ACC)
            den = tl.sum(qq * zt[None, :], axis=1) + eps
            den = tl.where(mask_t, den, 1.0)  # padded rows: g = 0, keep 0 / den finite even with eps = 0
            gn = gn / den[:, None]
            gd = -tl.sum(gn * num, axis=1) / den
            dzt += tl.sum(qq * gd[:, None], axis=0)
        dst = tl.dot(tl.trans(rq), gn, dst, input_precision=PREC, out_dtype=ACC)
        if STORE_DQ:
            da = tl.dot(gn, tl.trans(st), input_precision=PREC, out_dtype=ACC)
            if ROTARY:  # d/d phi(q) of (R phi(q)) S~ is R^T (gn S~^T)
                da = _rotate(da, cos, -sin, BLOCK_T, BLOCK_D)
            if NORMALIZE:
                da += gd[:, None] * zt[None, :]
            if FEATURE_MAP:
                da = tl.where(qraw > 0.0, da, 0.0)
            tl.store(dq_base + tok[:, None] * sdn + offs_d[None, :] * sdd, da.to(dq_ptr.dtype.element_ty), mask=mask_td)

    out_row = ((p * M + m) * BH + bh).to(tl.int64)
    tl.store(dst_ptr + out_row * D * DV + offs_d[:, None] * DV + offs_e[None, :], dst, mask=mask_de)
    if NORMALIZE:
        tl.store(dzt_ptr + out_row * D + offs_d, dzt, mask=mask_d)


@triton.jit
def _bwd_key(
    k_ptr, v_ptr, ds_ptr, dz_ptr, dk_ptr, dv_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, TILES,
    skb, skh, skn, skd, svb, svh, svn, svd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, NEED_DK: tl.constexpr, NEED_DV: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Key side of the backward for one tile of block b's tokens: dv = phi(K) dS_b, dk = (V dS_b^T + dz_b) [k > 0]
    (with ROTARY: dv = (R phi(K)) dS_b, dk = (R^T (V dS_b^T) + dz_b) [k > 0])."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // TILES
    tile = pid % TILES
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start = tl.load(start_ptr + m)
    size = tl.load(size_ptr + m)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    slot = tile * BLOCK_T + offs_t
    mask_t = slot < size
    tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)
    mask_td = mask_t[:, None] & mask_d[None, :]
    mask_te = mask_t[:, None] & mask_e[None, :]
    row = (m * BH + bh).to(tl.int64)
    ds = tl.load(ds_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0)

    kraw = tl.load(k_ptr + b * skb + h * skh + tok[:, None] * skn + offs_d[None, :] * skd, mask=mask_td, other=0.0).to(ACC)
    if ROTARY:
        cos, sin = _load_tables(cos_ptr, sin_ptr, tok, mask_t, D // 2, BLOCK_D)
    if NEED_DV:
        if FEATURE_MAP:
            kk = tl.maximum(kraw, 0.0)
        else:
            kk = kraw
        if ROTARY:
            kk = _rotate(kk, cos, sin, BLOCK_T, BLOCK_D)
        dvv = tl.dot(kk, ds, input_precision=PREC, out_dtype=ACC)
        tl.store(dv_ptr + b * sdvb + h * sdvh + tok[:, None] * sdvn + offs_e[None, :] * sdvd,
                 dvv.to(dv_ptr.dtype.element_ty), mask=mask_te)
    if NEED_DK:
        vv = tl.load(v_ptr + b * svb + h * svh + tok[:, None] * svn + offs_e[None, :] * svd, mask=mask_te, other=0.0).to(ACC)
        dphi = tl.dot(vv, tl.trans(ds), input_precision=PREC, out_dtype=ACC)
        if ROTARY:
            dphi = _rotate(dphi, cos, -sin, BLOCK_T, BLOCK_D)
        if NORMALIZE:
            dz = tl.load(dz_ptr + row * D + offs_d, mask=mask_d, other=0.0)
            dphi += dz[None, :]
        if FEATURE_MAP:
            dphi = tl.where(kraw > 0.0, dphi, 0.0)
        tl.store(dk_ptr + b * sdkb + h * sdkh + tok[:, None] * sdkn + offs_d[None, :] * sdkd,
                 dphi.to(dk_ptr.dtype.element_ty), mask=mask_td)


@triton.jit
def _mix_gemm(
    a_ptr, b_ptr, c_ptr, R, K, NCOL, COLS, sar, sak,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """C[R, NCOL] = A[R, K] @ B[K, NCOL] (A strided, B and C contiguous): the block mixing S~ = Mc S over all heads.

    The ``NCOL`` columns are ``B`` samples of ``COLS`` each. One program per column strip of one
    sample (grid axis 0: strips, axis 1: sample), strips counted from the sample's first column
    and masked at its last: a sample's tiles are the same whatever its place in the batch (batch
    invariance, module docstring). A program loops over the row tiles: the strip of B it reads
    again for the next row tile is still in cache. Grid axis 1 (the batch, at most 65535 on CUDA)
    is never longer than the other kernels' (batch x heads).
    """
    pid_n = tl.program_id(0)
    sample = tl.program_id(1)
    col = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = sample.to(tl.int64) * COLS + col
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = col < COLS
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            a = tl.load(a_ptr + offs_r[:, None] * sar + kk[None, :] * sak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr + kk[:, None].to(tl.int64) * NCOL + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a.to(ACC), b.to(ACC), acc, input_precision=PREC, out_dtype=ACC)
        c_out = c_ptr + offs_r[:, None].to(tl.int64) * NCOL + offs_n[None, :]
        tl.store(c_out, acc, mask=mask_r[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------------------------
# Host side

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


@lru_cache(maxsize=64)
def _index(layout: BlockLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [N], start [M], size [M])`` int32 on ``device``: tokens sorted by block (row-major
    inside a block), where each block's run starts, and its length."""
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
    """Fixed launch configuration (no autotuning): tile sizes, warps and stages by head dim and precision.

    Chosen by compiling every kernel for sm_90 (``tests/ops/triton_compile_check.py``): no register
    spills (a few bytes in ``_bwd_query`` at d > 64) and shared memory within an H100/H200's 227 KiB.
    ``BLOCK_T``: tokens per tile of the forward kernels and ``_bwd_key``; ``BLOCK_T_BWD``: of ``_bwd_query``.
    Not yet timed on a GPU.
    """
    block_d, block_dv = _next_pow2(d), _next_pow2(dv)
    widest = max(block_d, block_dv)
    if not _on_gpu(device):  # interpreter: one large tile per block, few programs
        block_t = min(_next_pow2(length), _INTERPRET_BLOCK_T)
        tiles = (block_t, block_t, 4, 4)
    elif prec == "ieee":  # fp32 inputs: FMA products, small tiles keep operands in registers
        tiles = (32, 32, 4, 4) if widest <= 32 else (32, 16, 8, 8) if widest <= 64 else (16, 16, 8, 8)
    else:  # fp16 / bf16 inputs: tensor cores
        tiles = (128, 32, 4, 4) if widest <= 64 else (64, 16, 8, 8)
    block_t, block_t_bwd, warps, warps_bwd = tiles
    return dict(BLOCK_T=block_t, BLOCK_T_BWD=block_t_bwd, BLOCK_D=block_d, BLOCK_DV=block_dv,
                num_warps=warps, num_warps_bwd=warps_bwd, num_stages=2)


def _split_tokens(length: int, programs: int, block_t: int, device: torch.device) -> int:
    """Tokens per split of a block (a multiple of ``block_t``) for the kernels that reduce over a block.

    ``programs``: programs of ONE sample without splits (heads x blocks), never of the batch: the
    split sets the summation order of a block, so a sample alone and in a batch must get the same
    (see ``_TARGET_PROGRAMS``).
    """
    if not _on_gpu(device):
        target = _INTERPRET_SPLIT_TOKENS or length
    else:
        want = -(-_TARGET_PROGRAMS // max(programs, 1))  # splits per block wanted
        target = max(_MIN_SPLIT_TOKENS, -(-length // want))
    return max(block_t, -(-max(1, target) // block_t) * block_t)


def _precision(*tensors: torch.Tensor) -> str:
    """``tl.dot`` precision of products with an fp32 operand: TF32 when any input is fp16/bf16
    (the result is at best that precise anyway), full fp32 ("ieee") for fp32/fp64 inputs."""
    return "tf32" if any(t.dtype in _LOW_PRECISION for t in tensors) else "ieee"


def _mix(mix: torch.Tensor, parts: torch.Tensor, prec: str, batch: int) -> torch.Tensor:
    """``Mc @ sum_p parts[p]`` over the block axis, all heads at once: ``[P, M, B*H, ...] -> [M, B*H, ...]``.

    Per sample, one GEMM ``[M, P*M] x [P*M, H*d*d_v]`` with ``Mc`` repeated ``P`` times along its
    columns, so the partial summaries of split blocks are summed by the same product; the
    ``batch`` samples are the second grid axis of one launch, and tiles are counted per sample
    (batch invariance: module docstring). By the ``_mix_gemm`` kernel: TF32 tensor cores for
    fp16/bf16 inputs (``prec``; torch's fp32 matmul would run full-fp32 SIMT, the slowest step of
    the forward at the Wan shape), full fp32 / fp64 otherwise. Tile sizes depend on ``M``, ``P``
    and the device only.
    """
    p, m = parts.shape[0], parts.shape[1]
    a = mix if p == 1 else mix.repeat(1, p)
    b = parts.reshape(p * m, -1)
    ncol = b.shape[1]
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    if ncol == 0:
        return out
    cols = ncol // batch  # columns of one sample: H * d * d_v (or H * d)
    if _on_gpu(parts.device):
        block_r, block_k, block_n, warps = 64, 32, 128, 4
    elif _INTERPRET_MIX_BLOCKS is not None:  # tests: several row tiles, K steps and column strips
        (block_r, block_k, block_n), warps = _INTERPRET_MIX_BLOCKS, 4
    else:  # interpreter: few, large programs (one strip per sample up to 4096 columns)
        block_r, block_k, block_n, warps = _next_pow2(min(m, 256)), _next_pow2(min(p * m, 256)), _next_pow2(min(cols, 4096)), 4
    _launch(
        _mix_gemm, (triton.cdiv(cols, block_n), batch),
        a, b, out, m, p * m, ncol, cols, a.stride(0), a.stride(1),
        ACC=_TL_DTYPE[parts.dtype], PREC=prec, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=warps, num_stages=3,
    )
    return out


def _sum_parts(parts: torch.Tensor) -> torch.Tensor:
    """``sum_p parts[p]`` of ``[P, ...]`` partial sums, added in the order ``p = 0, 1, ...`` element by
    element (a reduction kernel over ``P`` may pick its order by the total size, which grows with the batch)."""
    total = parts[0]
    if parts.shape[0] > 1:
        total = total.clone()
        for part in parts[1:]:
            total += part
    return total


def _device_of(x: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``x``'s (tensors on cuda:1 and others)."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


class _MHLATriton(torch.autograd.Function):
    """Forward and backward by the Triton kernels above (first order)."""

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
            _fwd_summaries, (m * parts, bh),
            k, v, order, starts, sizes, s_parts, z_parts, cos, sin,
            heads, d, dv, bh, m, parts, split,
            *k.stride(), *v.stride(),
            FEATURE_MAP=feature_map, NORMALIZE=normalize, ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], DOT=_TL_DTYPE[dot], PREC=prec,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        s_mix = _mix(mix, s_parts, prec, batch)
        z_mix = _mix(mix, z_parts, prec, batch) if normalize else s_mix

        tiles = -(-length // cfg["BLOCK_T"])
        _launch(
            _fwd_output, (m * tiles, bh),
            q, s_mix, z_mix, eps_t, out, order, starts, sizes, cos, sin,
            heads, d, dv, bh, tiles,
            *q.stride(), *out.stride(),
            FEATURE_MAP=feature_map, NORMALIZE=normalize, ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
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
            _bwd_query, (m * parts, bh),
            q, grad_out, s_mix, z_mix, eps_t, dq, ds_parts, dz_parts, order, starts, sizes, cos, sin,
            heads, d, dv, bh, m, parts, split,
            *q.stride(), *grad_out.stride(), *dq_strides,
            FEATURE_MAP=feature_map, NORMALIZE=normalize, STORE_DQ=bool(need_q), ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
            BLOCK_T=cfg["BLOCK_T_BWD"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
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
            tiles = -(-length // cfg["BLOCK_T"])
            _launch(
                _bwd_key, (m * tiles, bh),
                k, v, ds, dz, dk, dvv, order, starts, sizes, cos, sin,
                heads, d, dv, bh, tiles,
                *k.stride(), *v.stride(),
                *(dk.stride() if need_k else (0, 0, 0, 0)), *(dvv.stride() if need_v else (0, 0, 0, 0)),
                FEATURE_MAP=feature_map, NORMALIZE=normalize, NEED_DK=bool(need_k), NEED_DV=bool(need_v),
                ROTARY=rotary is not None, ACC=_TL_DTYPE[acc], PREC=prec,
                BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            )
            dk = dk if need_k else None
            dvv = dvv if need_v else None
        return (dq if need_q else None), dk, dvv, dmix, None, None, None, None, None, None


def check_supported(q: torch.Tensor, *others: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the kernels can run on ``q``'s device: CUDA tensors, or CPU
    tensors with the interpreter on (``TRITON_INTERPRET=1``, set before ``mhla_diffusers`` /
    diffusers / triton were imported) and no bfloat16 input (the interpreter's bf16 arithmetic
    is wrong)."""
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

    On a GPU: float64 ``q`` (an fp64 ``S~`` tile of 128 x 128 needs more shared memory than an
    H100/H200 has; fp64 is for oracles, not speed), and head dims above :data:`MAX_HEAD_DIM`.
    Under the interpreter only the head-dim limit applies.
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
    """MHLA by the Triton kernels (module docstring). Inputs are validated by :func:`mhla_attention`.

    Implements, per batch element and head (MHLA paper, Sec. 3.2), for a query in block ``i``::

        out = phi(q) S~_i / (phi(q) . z~_i + eps),  S~ = Mc S,  z~ = Mc z,
        S_b = phi(K_b)^T V_b,  z_b = sum_{t in b} phi(k_t),  phi = ReLU (identity if not feature_map)

    Args:
        q, k: ``[B, heads, N, d]``; v: ``[B, heads, N, d_v]``; float16, bfloat16, float32 or
            float64 (fp32/fp64 only under the interpreter: its bf16 arithmetic is wrong); any strides.
            CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
        mixing: ``[M, M]``, used as given (no clamping).
        layout: the :class:`BlockLayout` of the ``N`` tokens.
        normalize: divide by ``phi(q) . z~ + eps`` (True) or return the numerator (False).
        eps: added to the denominator, in fp32 (fp64 for fp64 ``q``).
        feature_map: apply ``phi = ReLU`` to q and k inside the kernels (True), or treat q and k as
            features already (False: no ReLU, no ReLU derivative in the backward).
        rotary: an :class:`~mhla_diffusers.ops.InterleavedRotary` applied inside the kernels (the
            RoPE variant: ``R phi`` in the numerator, ``phi`` in the denominator; its tables are
            read in the accumulation dtype and get no gradient), or ``None``. Even ``d`` only.

    Returns:
        ``[B, heads, N, d_v]`` in ``q.dtype`` and ``q``'s memory layout. Differentiable (first
        order) in q, k, v and ``mixing``; gradients in each input's dtype.

    Falls back to the torch backend (same numbers, see :func:`torch_fallback_reason`) for float64
    inputs on a GPU and for head dims above :data:`MAX_HEAD_DIM` (128).

    Raises:
        ValueError: for CPU tensors without the interpreter, or tensors on other devices.
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
