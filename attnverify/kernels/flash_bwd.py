"""FlashAttention-2 style backward kernels (Triton), recomputing probabilities from the saved LSE.

Three launches, no atomics, so the backward is bitwise deterministic:

1. `_bwd_preprocess`: delta_i = sum_d dO_i * O_i - dLSE_i (fp32). The dLSE term makes the LSE output
   differentiable: d lse_i / d s_ij = P_ij, so it folds into the usual dS = P * (dP - delta).
2. `_bwd_dkdv`: one program per (key block, batch or segment, kv head); it loops over the query
   heads of its GQA group and over the query blocks that can see its keys, accumulating dK and dV
   in registers (the group sum happens here, in a fixed order).
3. `_bwd_dq`: one program per (query block, batch or segment, query head), looping over key blocks.

Fully-masked rows have LSE -inf; they are given +inf here so P = exp2(s - inf) = 0 (never
`-inf - -inf`), which makes their gradients exactly zero.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    _aligned,
    _base,
    _dot,
    _key_range,
    _lowp,
    _query_range,
    _scores,
    _segment,
    _slope,
    nospec_twins,
)


# head dims only bound masks: not specialised, so D = 72 and 80 share one compiled kernel. Whether a
# head dim is padded (EVEN_D, EVEN_DV) is compile-time: an unpadded one has no mask along D, so its
# loads stay 16 bytes wide (a runtime mask on every load cost the backward 40%, issue 25).
@triton.jit(do_not_specialize=["HEAD_DIM_V"])
def _bwd_preprocess(
    O, DO, DLSE, DELTA,
    stride_oz, stride_oh, stride_om, stride_ok,
    stride_doz, stride_doh, stride_dom, stride_dok,
    stride_dlz, stride_dlh, stride_dlm,
    H, seq_q,
    HEAD_DIM_V, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    ALIGNED: tl.constexpr = 0,
):
    if ALIGNED:  # `aligned` twins (variants.tile_args): the tile strides came divided by ALIGNED
        stride_oz, stride_oh, stride_om, stride_ok = _aligned(stride_oz, stride_oh, stride_om, ALIGNED)
        stride_doz, stride_doh, stride_dom, stride_dok = _aligned(stride_doz, stride_doh, stride_dom, ALIGNED)
    start_m = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = off_zh // H
    off_h = off_zh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = offs_m[:, None] < seq_q
    if not EVEN_DV:
        mask = mask & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(O + off_z.to(tl.int64) * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_dv[None, :] * stride_ok, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_z.to(tl.int64) * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dok, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        dl = tl.load(DLSE + off_z.to(tl.int64) * stride_dlz + off_h * stride_dlh + offs_m * stride_dlm,
                     mask=offs_m < seq_q, other=0.0).to(tl.float32)
        delta = delta - dl
    # DELTA is contiguous (B, H, Lq)
    tl.store(DELTA + off_zh.to(tl.int64) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, lo, hi,
                stride_qm, stride_qk, stride_dom, stride_dok, offs_n, offs_d, offs_dv, seq_q, seq_k,
                diag_off, causal_off, win_left, win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                BLOCK_M: tl.constexpr, HEAD_DIM, HEAD_DIM_V, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qtmask = offs_m[None, :] < seq_q
        domask = offs_m[:, None] < seq_q
        if not EVEN_D:
            qtmask = qtmask & (offs_d[:, None] < HEAD_DIM)
        if not EVEN_DV:
            domask = domask & (offs_dv[None, :] < HEAD_DIM_V)
        qt = tl.load(q_base + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qk, mask=qtmask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dok, mask=domask, other=0.0)
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seq_q, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        qkt = _dot(k, qt, UPCAST, IEEE)  # (N, M)
        st, tt = _scores(qkt, offs_m[None, :], offs_n[:, None], seq_k, diag_off, causal_off, win_left, win_right,
                         slope, scale, qk_scale, softcap_scale, softcap_c2,
                         MASK, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, False)
        pt = tl.math.exp2(st - lse2[None, :])  # (N, M)
        dv += _dot(_lowp(pt, do.dtype, UPCAST), do, UPCAST, IEEE)
        dpt = _dot(v, tl.trans(do), UPCAST, IEEE)
        dst = pt * (dpt - delta[None, :])
        if HAS_SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk += _dot(_lowp(dst, qt.dtype, UPCAST), tl.trans(qt), UPCAST, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["HEAD_DIM", "HEAD_DIM_V"])
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES, CU_Q, CU_K,
    stride_qz, stride_qh, stride_qm, stride_qk,
    stride_kz, stride_kh, stride_kn, stride_kk,
    stride_vz, stride_vh, stride_vn, stride_vk,
    stride_doz, stride_doh, stride_dom, stride_dok,
    stride_dkz, stride_dkh, stride_dkn, stride_dkk,
    stride_dvz, stride_dvh, stride_dvn, stride_dvk,
    stride_az, stride_ah,
    H, HK, GROUP, seq_q_arg, seq_k_arg, total_q,
    scale, qk_scale, softcap_scale, softcap_c2, win_left, win_right,
    HEAD_DIM, HEAD_DIM_V, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_BR: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr = 0, RTF=None,
):
    if ALIGNED:  # `aligned` twins (variants.tile_args): the tile strides came divided by ALIGNED
        stride_qz, stride_qh, stride_qm, stride_qk = _aligned(stride_qz, stride_qh, stride_qm, ALIGNED)
        stride_kz, stride_kh, stride_kn, stride_kk = _aligned(stride_kz, stride_kh, stride_kn, ALIGNED)
        stride_vz, stride_vh, stride_vn, stride_vk = _aligned(stride_vz, stride_vh, stride_vn, ALIGNED)
        stride_doz, stride_doh, stride_dom, stride_dok = _aligned(stride_doz, stride_doh, stride_dom, ALIGNED)
        stride_dkz, stride_dkh, stride_dkn, stride_dkk = _aligned(stride_dkz, stride_dkh, stride_dkn, ALIGNED)
        stride_dvz, stride_dvh, stride_dvn, stride_dvk = _aligned(stride_dvz, stride_dvh, stride_dvn, ALIGNED)
    start_n = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = off_zh // HK
    off_hk = off_zh % HK
    b_idx, q_start, k_start, seq_q, seq_k, diag_off, causal_off = _segment(
        CU_Q, CU_K, off_z, seq_q_arg, seq_k_arg, CAUSAL_BR, IS_VARLEN, RTF)
    if start_n * BLOCK_N >= seq_k:
        return
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kmask = offs_n[:, None] < seq_k
    vmask = offs_n[:, None] < seq_k
    if not EVEN_D:
        kmask = kmask & (offs_d[None, :] < HEAD_DIM)
    if not EVEN_DV:
        vmask = vmask & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(_base(K, b_idx, off_hk, k_start, stride_kz, stride_kh, stride_kn)
                + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk, mask=kmask, other=0.0)
    v = tl.load(_base(V, b_idx, off_hk, k_start, stride_vz, stride_vh, stride_vn)
                + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vk, mask=vmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, hi = _query_range(start_n * BLOCK_N, seq_q, seq_k, diag_off, causal_off, win_left, win_right,
                                   BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, RTF)

    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        q_base = _base(Q, b_idx, off_h, q_start, stride_qz, stride_qh, stride_qm)
        do_base = _base(DO, b_idx, off_h, q_start, stride_doz, stride_doh, stride_dom)
        # LSE and DELTA are contiguous (B, H, total_q)
        row_base = (b_idx * H + off_h).to(tl.int64) * total_q + q_start
        slope = _slope(SLOPES, b_idx, off_h, stride_az, stride_ah, HAS_ALIBI)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, lo, full_lo,
                             stride_qm, stride_qk, stride_dom, stride_dok, offs_n, offs_d, offs_dv, seq_q, seq_k,
                             diag_off, causal_off, win_left, win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                             BLOCK_M, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, True,
                             IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, full_lo, hi,
                             stride_qm, stride_qk, stride_dom, stride_dok, offs_n, offs_d, offs_dv, seq_q, seq_k,
                             diag_off, causal_off, win_left, win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                             BLOCK_M, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, False,
                             IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)
    dk = dk * scale
    dk_ptrs = _base(DK, b_idx, off_hk, k_start, stride_dkz, stride_dkh, stride_dkn) \
        + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :] * stride_dkk
    dv_ptrs = _base(DV, b_idx, off_hk, k_start, stride_dvz, stride_dvh, stride_dvn) \
        + offs_n[:, None].to(tl.int64) * stride_dvn + offs_dv[None, :] * stride_dvk
    tl.store(dk_ptrs, _lowp(dk, DK.dtype.element_ty, UPCAST), mask=kmask)
    tl.store(dv_ptrs, _lowp(dv, DV.dtype.element_ty, UPCAST), mask=vmask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, lo, hi, stride_kn, stride_kk, stride_vn, stride_vk,
              offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left, win_right, slope,
              scale, qk_scale, softcap_scale, softcap_c2, BLOCK_N: tl.constexpr, HEAD_DIM, HEAD_DIM_V,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              UPCAST: tl.constexpr, IEEE: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ktmask = offs_n[None, :] < seq_k
        vtmask = offs_n[None, :] < seq_k
        if not EVEN_D:
            ktmask = ktmask & (offs_d[:, None] < HEAD_DIM)
        if not EVEN_DV:
            vtmask = vtmask & (offs_dv[:, None] < HEAD_DIM_V)
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kk, mask=ktmask, other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vk, mask=vtmask, other=0.0)
        qk = _dot(q, kt, UPCAST, IEEE)
        s, t = _scores(qk, offs_m[:, None], offs_n[None, :], seq_k, diag_off, causal_off, win_left, win_right, slope,
                       scale, qk_scale, softcap_scale, softcap_c2,
                       MASK, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, MASK)
        p = tl.math.exp2(s - lse2[:, None])
        dp = _dot(do, vt, UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += _dot(_lowp(ds, kt.dtype, UPCAST), tl.trans(kt), UPCAST, IEEE)
    return dq


@triton.jit(do_not_specialize=["HEAD_DIM", "HEAD_DIM_V"])
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, SLOPES, CU_Q, CU_K,
    stride_qz, stride_qh, stride_qm, stride_qk,
    stride_kz, stride_kh, stride_kn, stride_kk,
    stride_vz, stride_vh, stride_vn, stride_vk,
    stride_doz, stride_doh, stride_dom, stride_dok,
    stride_dqz, stride_dqh, stride_dqm, stride_dqk,
    stride_az, stride_ah,
    H, GROUP, seq_q_arg, seq_k_arg, total_q,
    scale, qk_scale, softcap_scale, softcap_c2, win_left, win_right,
    HEAD_DIM, HEAD_DIM_V, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_BR: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, LPT: tl.constexpr = False, ALIGNED: tl.constexpr = 0, RTF=None,
):
    if ALIGNED:  # `aligned` twins (variants.tile_args): the tile strides came divided by ALIGNED
        stride_qz, stride_qh, stride_qm, stride_qk = _aligned(stride_qz, stride_qh, stride_qm, ALIGNED)
        stride_kz, stride_kh, stride_kn, stride_kk = _aligned(stride_kz, stride_kh, stride_kn, ALIGNED)
        stride_vz, stride_vh, stride_vn, stride_vk = _aligned(stride_vz, stride_vh, stride_vn, ALIGNED)
        stride_doz, stride_doh, stride_dom, stride_dok = _aligned(stride_doz, stride_doh, stride_dom, ALIGNED)
        stride_dqz, stride_dqh, stride_dqm, stride_dqk = _aligned(stride_dqz, stride_dqh, stride_dqm, ALIGNED)
    if LPT:  # longest (causal) query blocks first: no tail of long programs at the end of the launch
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = off_zh // H
    off_h = off_zh % H
    off_hk = off_h // GROUP
    b_idx, q_start, k_start, seq_q, seq_k, diag_off, causal_off = _segment(
        CU_Q, CU_K, off_z, seq_q_arg, seq_k_arg, CAUSAL_BR, IS_VARLEN, RTF)
    if start_m * BLOCK_M >= seq_q:
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qmask = offs_m[:, None] < seq_q
    domask = offs_m[:, None] < seq_q
    if not EVEN_D:
        qmask = qmask & (offs_d[None, :] < HEAD_DIM)
    if not EVEN_DV:
        domask = domask & (offs_dv[None, :] < HEAD_DIM_V)
    q = tl.load(_base(Q, b_idx, off_h, q_start, stride_qz, stride_qh, stride_qm)
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk, mask=qmask, other=0.0)
    do = tl.load(_base(DO, b_idx, off_h, q_start, stride_doz, stride_doh, stride_dom)
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dok, mask=domask, other=0.0)
    k_base = _base(K, b_idx, off_hk, k_start, stride_kz, stride_kh, stride_kn)
    v_base = _base(V, b_idx, off_hk, k_start, stride_vz, stride_vh, stride_vn)
    row_base = (b_idx * H + off_h).to(tl.int64) * total_q + q_start
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seq_q, other=float("inf"))
    delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    slope = _slope(SLOPES, b_idx, off_h, stride_az, stride_ah, HAS_ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_hi, mask_lo, hi = _key_range(start_m * BLOCK_M, seq_q, seq_k, diag_off, causal_off, win_left, win_right,
                                          BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, RTF)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, lo, full_hi, stride_kn, stride_kk, stride_vn, stride_vk,
                   offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left, win_right, slope,
                   scale, qk_scale, softcap_scale, softcap_c2, BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, False,
                   IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, mask_lo, hi, stride_kn, stride_kk, stride_vn, stride_vk,
                   offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left, win_right, slope,
                   scale, qk_scale, softcap_scale, softcap_c2, BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, True,
                   IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)
    dq = dq * scale
    dq_ptrs = _base(DQ, b_idx, off_h, q_start, stride_dqz, stride_dqh, stride_dqm) \
        + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :] * stride_dqk
    tl.store(dq_ptrs, _lowp(dq, DQ.dtype.element_ty, UPCAST), mask=qmask)


# twins not specialised on lengths, head counts, windows and per-row strides (flash_fwd.NOSPEC says why)
PRE_NOSPEC = ("H", "seq_q", "stride_dlz", "stride_dlh", "stride_dlm")
DKDV_NOSPEC = ("H", "HK", "GROUP", "seq_q_arg", "seq_k_arg", "total_q", "win_left", "win_right", "stride_az",
               "stride_ah")
DQ_NOSPEC = ("H", "GROUP", "seq_q_arg", "seq_k_arg", "total_q", "win_left", "win_right", "stride_az", "stride_ah")
# their `aligned` and `rtmask` variants (flash_fwd.TWINS says what they are): *_TWINS[(aligned, rtmask)]; the
# preprocess has no mask flags (its rtmask twins are its plain ones)
def _tiles(spec: str) -> tuple:
    return tuple(f"stride_{t}{d}" for t, dims in (x.split(":") for x in spec.split()) for d in dims)


PRE_TWINS = nospec_twins(_bwd_preprocess.fn, PRE_NOSPEC, _tiles("o:zhmk do:zhmk"))
DKDV_TWINS = nospec_twins(_bwd_dkdv.fn, DKDV_NOSPEC, _tiles("q:zhmk k:zhnk v:zhnk do:zhmk dk:zhnk dv:zhnk"))
DQ_TWINS = nospec_twins(_bwd_dq.fn, DQ_NOSPEC, _tiles("q:zhmk k:zhnk v:zhnk do:zhmk dq:zhmk"))
_bwd_preprocess_nospec = PRE_TWINS[(False, False)]
_bwd_dkdv_nospec = DKDV_TWINS[(False, False)]
_bwd_dq_nospec = DQ_TWINS[(False, False)]
