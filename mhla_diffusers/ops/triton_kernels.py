"""The Triton kernels of MHLA (``@triton.jit`` only): forward summaries and output, backward query and
key sides, the block-mixing GEMM.

Launched by :mod:`mhla_diffusers.ops.triton_ops` (launch configuration, the autograd function), its
only importer: Triton decides when a kernel is defined whether it runs in the CPU interpreter
(``TRITON_INTERPRET=1``). Same math as ``torch_ops`` (MHLA paper, Sec. 3.2); fp32 accumulation (fp64
for fp64), no atomics, batch-invariant by construction. What each kernel does, precision, splits:
``docs/operator.md``, "The Triton backend".
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fwd_summaries", "fwd_output", "bwd_query", "bwd_key", "mix_gemm"]


@triton.jit
def _multiple(x, ALIGN: tl.constexpr):
    """``x`` rewritten so that the compiler knows it is a multiple of ``ALIGN`` (the launcher checked that it is).

    Head dims and strides that are multiples of 8 but not of 16 (DiT's d = 72 in diffusers' ``[B, N, H, d]``
    memory: a head starts 144 bytes after the previous one) are not specialised by Triton, so without this its
    loads of such rows run one element per instruction, with a 64-bit address per element held in registers.
    ``ALIGN`` 16 (Triton's own specialisation covers it) and 1 leave ``x`` as it is.
    """
    if ALIGN > 1 and ALIGN < 16:
        x = (x // ALIGN) * ALIGN
    return x


@triton.jit
def _rotate(x, cos, sin, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the interleaved pairs of a ``[BLOCK_T, BLOCK_D]`` tile by per-row angles (``-sin``: ``R^T``)."""
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
def fwd_summaries(
    k_ptr, v_ptr, order_ptr, start_ptr, size_ptr, s_ptr, z_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, M, P, split_tokens,
    skb, skh, skn, skd, svb, svh, svn, svd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ALIGN: tl.constexpr = 1,
):
    """``S_b = (R) phi(K_b)^T V_b`` and ``z_b = sum phi(K_b)`` over one split of one block, one (batch, head)."""
    D, DV = _multiple(D, ALIGN), _multiple(DV, ALIGN)
    skb, skh, skn = _multiple(skb, ALIGN), _multiple(skh, ALIGN), _multiple(skn, ALIGN)
    svb, svh, svn = _multiple(svb, ALIGN), _multiple(svh, ALIGN), _multiple(svn, ALIGN)
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
def fwd_output(
    q_ptr, st_ptr, zt_ptr, eps_ptr, o_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, P, split_tokens,
    sqb, sqh, sqn, sqd, sob, soh, son, sod,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ALIGN: tl.constexpr = 1,
):
    """``out = (R) phi(q) S~_b / (phi(q) . z~_b + eps)`` over one split of block b's queries, one (batch, head).

    ``S~_b`` and ``z~_b`` are loaded once and kept on chip while the program walks its split's token tiles.
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // P
    p = pid % P
    size = tl.load(size_ptr + m)
    lo = p * split_tokens
    if lo >= size:  # a split past a shorter block's end: nothing to load, compute or store
        return
    hi = tl.minimum(lo + split_tokens, size)
    start = tl.load(start_ptr + m)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    D, DV = _multiple(D, ALIGN), _multiple(DV, ALIGN)
    sqb, sqh, sqn = _multiple(sqb, ALIGN), _multiple(sqh, ALIGN), _multiple(sqn, ALIGN)
    sob, soh, son = _multiple(sob, ALIGN), _multiple(soh, ALIGN), _multiple(son, ALIGN)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    row = (m * BH + bh).to(tl.int64)
    st = tl.load(st_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    if NORMALIZE:
        zt = tl.load(zt_ptr + row * D + offs_d, mask=mask_d, other=0.0)
        eps = tl.load(eps_ptr)
    q_base = q_ptr + b * sqb + h * sqh
    o_base = o_ptr + b * sob + h * soh

    for t0 in range(lo, hi, BLOCK_T):
        slot = t0 + offs_t
        mask_t = slot < hi
        tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)
        qq = tl.load(q_base + tok[:, None] * sqn + offs_d[None, :] * sqd, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(ACC)
        if FEATURE_MAP:
            qq = tl.maximum(qq, 0.0)
        if ROTARY:
            cos, sin = _load_tables(cos_ptr, sin_ptr, tok, mask_t, D // 2, BLOCK_D)
            rq = _rotate(qq, cos, sin, BLOCK_T, BLOCK_D)
        else:
            rq = qq
        num = tl.dot(rq, st, input_precision=PREC, out_dtype=ACC)
        if NORMALIZE:
            den = tl.sum(qq * zt[None, :], axis=1) + eps
            den = tl.where(mask_t, den, 1.0)  # padded rows are not stored; keep them finite even with eps = 0
            num = num / den[:, None]
        o_out = o_base + tok[:, None] * son + offs_e[None, :] * sod
        tl.store(o_out, num.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :])


@triton.jit
def bwd_query(
    q_ptr, g_ptr, st_ptr, zt_ptr, eps_ptr, dq_ptr, dst_ptr, dzt_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, M, P, split_tokens,
    sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd, sdb, sdh, sdn, sdd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, STORE_DQ: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ALIGN: tl.constexpr = 1,
):
    """Query side of the backward for one split of one block: dq, and partial dS~, dz~.

    One product with ``S~`` per tile, ``a = g S~^T`` (as ``(S~ g^T)^T``: ``S~`` is the left operand, read from
    shared memory by the tensor cores, not copied into registers for a 16-row product); the numerator
    ``num = (R) phi(q) S~`` is not formed: ``gn . num = (R) phi(q) . (gn S~^T)``.
    """
    D, DV = _multiple(D, ALIGN), _multiple(DV, ALIGN)
    sqb, sqh, sqn = _multiple(sqb, ALIGN), _multiple(sqh, ALIGN), _multiple(sqn, ALIGN)
    sgb, sgh, sgn = _multiple(sgb, ALIGN), _multiple(sgh, ALIGN), _multiple(sgn, ALIGN)
    sdb, sdh, sdn = _multiple(sdb, ALIGN), _multiple(sdh, ALIGN), _multiple(sdn, ALIGN)
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
        if NORMALIZE or STORE_DQ:
            da = tl.trans(tl.dot(st, tl.trans(gn), input_precision=PREC, out_dtype=ACC))  # g S~^T
        if NORMALIZE:
            den = tl.sum(qq * zt[None, :], axis=1) + eps
            den = tl.where(mask_t, den, 1.0)  # padded rows: g = 0, keep 0 / den finite even with eps = 0
            gn = gn / den[:, None]
            da = da / den[:, None]  # gn S~^T
            gd = -tl.sum(rq * da, axis=1) / den  # -(gn . num) / den
            dzt += tl.sum(qq * gd[:, None], axis=0)
        dst = tl.dot(tl.trans(rq), gn, dst, input_precision=PREC, out_dtype=ACC)
        if STORE_DQ:
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
def bwd_key(
    k_ptr, v_ptr, ds_ptr, dz_ptr, dk_ptr, dv_ptr, order_ptr, start_ptr, size_ptr, cos_ptr, sin_ptr,
    H, D, DV, BH, P, split_tokens,
    skb, skh, skn, skd, svb, svh, svn, svd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    FEATURE_MAP: tl.constexpr, NORMALIZE: tl.constexpr, NEED_DK: tl.constexpr, NEED_DV: tl.constexpr, ROTARY: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ALIGN: tl.constexpr = 1,
):
    """Key side of the backward over one split of block b: ``dv = (R) phi(K) dS_b``, ``dk = ((R^T) V dS_b^T + dz_b) [k > 0]``.

    ``dS_b`` and ``dz_b`` are loaded once and kept on chip while the program walks its split's token tiles.
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m = pid // P
    p = pid % P
    size = tl.load(size_ptr + m)
    lo = p * split_tokens
    if lo >= size:  # a split past a shorter block's end: nothing to load, compute or store
        return
    hi = tl.minimum(lo + split_tokens, size)
    start = tl.load(start_ptr + m)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    D, DV = _multiple(D, ALIGN), _multiple(DV, ALIGN)
    skb, skh, skn = _multiple(skb, ALIGN), _multiple(skh, ALIGN), _multiple(skn, ALIGN)
    svb, svh, svn = _multiple(svb, ALIGN), _multiple(svh, ALIGN), _multiple(svn, ALIGN)
    sdkb, sdkh, sdkn = _multiple(sdkb, ALIGN), _multiple(sdkh, ALIGN), _multiple(sdkn, ALIGN)
    sdvb, sdvh, sdvn = _multiple(sdvb, ALIGN), _multiple(sdvh, ALIGN), _multiple(sdvn, ALIGN)

    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D
    mask_e = offs_e < DV
    row = (m * BH + bh).to(tl.int64)
    ds = tl.load(ds_ptr + row * D * DV + offs_d[:, None] * DV + offs_e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    if NEED_DK and NORMALIZE:
        dz = tl.load(dz_ptr + row * D + offs_d, mask=mask_d, other=0.0)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    dk_base = dk_ptr + b * sdkb + h * sdkh
    dv_base = dv_ptr + b * sdvb + h * sdvh

    for t0 in range(lo, hi, BLOCK_T):
        slot = t0 + offs_t
        mask_t = slot < hi
        tok = tl.load(order_ptr + start + slot, mask=mask_t, other=0).to(tl.int64)
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_te = mask_t[:, None] & mask_e[None, :]
        kraw = tl.load(k_base + tok[:, None] * skn + offs_d[None, :] * skd, mask=mask_td, other=0.0).to(ACC)
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
            tl.store(dv_base + tok[:, None] * sdvn + offs_e[None, :] * sdvd, dvv.to(dv_ptr.dtype.element_ty), mask=mask_te)
        if NEED_DK:
            vv = tl.load(v_base + tok[:, None] * svn + offs_e[None, :] * svd, mask=mask_te, other=0.0).to(ACC)
            dphi = tl.dot(vv, tl.trans(ds), input_precision=PREC, out_dtype=ACC)
            if ROTARY:
                dphi = _rotate(dphi, cos, -sin, BLOCK_T, BLOCK_D)
            if NORMALIZE:
                dphi += dz[None, :]
            if FEATURE_MAP:
                dphi = tl.where(kraw > 0.0, dphi, 0.0)
            tl.store(dk_base + tok[:, None] * sdkn + offs_d[None, :] * sdkd, dphi.to(dk_ptr.dtype.element_ty), mask=mask_td)


@triton.jit
def mix_gemm(
    a_ptr, b_ptr, c_ptr, R, K, NCOL, COLS, sar, sak,
    ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``C = A @ B`` per sample column strip: the block mixing ``S~ = Mc S`` over all heads."""
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
