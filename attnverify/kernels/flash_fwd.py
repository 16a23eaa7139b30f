"""FlashAttention-2 style forward kernel (Triton), with every SPEC feature.

One program computes a (BLOCK_M x Dv) tile of the output for one (batch or segment, query head).
Scores are kept in base-2 units (`s * log2(e)`) so the online softmax can use `exp2`; the LSE
stored is natural-log. Features are compile-time constants, so a plain call compiles to a plain
kernel:

- IS_CAUSAL with CAUSAL_OFFSET_BR (bottom-right: diagonal at i + Lk - Lq, else top-left: at i),
- HAS_WINDOW (bounds bottom-right aligned, inclusive; -1 = unbounded, passed as a huge number),
- HAS_SOFTCAP (s = c * tanh(s / c) after scaling), HAS_ALIBI (s -= slope * |i + Lk - Lq - j|),
- IS_VARLEN (cu_seqlens: segment z of the queries sees only segment z of the keys),
- HAS_SINKS (per-query-head sink logits: one more term exp(sink) in every row's denominator, with no
  value row; applied once, after the key loop, so a row with no visible key gives 0 and LSE = sink),
- HAS_DESCALE (fp8 inputs with FA3's descales, per (batch, kv head), in DESC (3, B, Hkv) float32: q's, k's, v's):
  q_descale * k_descale is folded into the softmax scale (and softcap's) in the prologue and v_descale
  multiplies the normalised output in the epilogue; the key loop is the plain one, fp8 dots with P cast to
  V's fp8 dtype after the running max is subtracted (`_lowp`), out in O's dtype (bfloat16),
- head dims padded to powers of two (BLOCK_D, BLOCK_DV) with masked loads/stores,
- UPCAST: convert dot operands to fp32 (the Triton interpreter's bf16 dot is wrong) and round to
  bf16 by hand (the interpreter truncates where a GPU rounds to nearest even).

A row that sees no key keeps m = -inf and l = 0: exponentials use a safe max of 0 so no
`-inf - -inf` is ever formed; the row's output is 0 and its LSE -inf.

Nothing here touches a GPU at import; TRITON_INTERPRET must be set before this module is imported
for the interpreter to be used.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    _aligned,
    _base,
    _dot,
    _key_range,
    _load_kv,
    _lowp,
    _rescale,
    _rt,
    _scores,
    _segment,
    _slope,
    nospec_twins,
    RT_SINKS,
)
from .flash_fwd_variants import _fwd_inner_v


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
               lo, hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left, win_right, slope,
               scale, qk_scale, softcap_scale, softcap_c2,
               BLOCK_N: tl.constexpr, HEAD_DIM, HEAD_DIM_V,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASK: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt, v = _load_kv(k_base, v_base, offs_n, offs_d, offs_dv, stride_kn, stride_kk, stride_vn, stride_vk, seq_k,
                         HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, MASK)
        qk = _dot(q, kt, UPCAST, IEEE)
        s, _t = _scores(qk, offs_m[:, None], offs_n[None, :], seq_k, diag_off, causal_off, win_left, win_right, slope,
                        scale, qk_scale, softcap_scale, softcap_c2,
                        MASK, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use, alpha = _rescale(m_i, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = acc + _dot(_lowp(p, v.dtype, UPCAST), v, UPCAST, IEEE)
        m_i = m_new
    return acc, l_i, m_i


# head dims only bound masks: not specialised, so D = 72 and 80 share one compiled kernel
@triton.jit(do_not_specialize=["HEAD_DIM", "HEAD_DIM_V"])
def _attn_fwd(
    Q, K, V, O, LSE, SLOPES, CU_Q, CU_K, SINKS,
    stride_qz, stride_qh, stride_qm, stride_qk,
    stride_kz, stride_kh, stride_kn, stride_kk,
    stride_vz, stride_vh, stride_vn, stride_vk,
    stride_oz, stride_oh, stride_om, stride_ok,
    stride_lz, stride_lh, stride_lm,
    stride_az, stride_ah,
    H, GROUP, seq_q_arg, seq_k_arg,
    scale, qk_scale, softcap_scale, softcap_c2, win_left, win_right,
    HEAD_DIM, HEAD_DIM_V, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_BR: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr = False,
    DESC_K=None, DESC_V=None, FMA: tl.constexpr = False, LAZY: tl.constexpr = False, TMA: tl.constexpr = False,
    WS: tl.constexpr = False, LPT: tl.constexpr = False,
    DESC=None, desc_n=0, HAS_DESCALE: tl.constexpr = False,
    ALIGNED: tl.constexpr = 0, RTF=None,
):
    if ALIGNED:  # `aligned` twins (variants.tile_args): the tile strides came divided by ALIGNED
        stride_qz, stride_qh, stride_qm, stride_qk = _aligned(stride_qz, stride_qh, stride_qm, ALIGNED)
        stride_kz, stride_kh, stride_kn, stride_kk = _aligned(stride_kz, stride_kh, stride_kn, ALIGNED)
        stride_vz, stride_vh, stride_vn, stride_vk = _aligned(stride_vz, stride_vh, stride_vn, ALIGNED)
        stride_oz, stride_oh, stride_om, stride_ok = _aligned(stride_oz, stride_oh, stride_om, ALIGNED)
    # speed candidates (flash_fwd_variants; all off by default): LPT runs the query blocks in reverse, so a
    # causal launch starts its longest programs first and ends on short ones (no long tail)
    if LPT:
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
    q_base = _base(Q, b_idx, off_h, q_start, stride_qz, stride_qh, stride_qm)
    k_base = _base(K, b_idx, off_hk, k_start, stride_kz, stride_kh, stride_kn)
    v_base = _base(V, b_idx, off_hk, k_start, stride_vz, stride_vh, stride_vn)
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk
    q_mask = offs_m[:, None] < seq_q
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    slope = _slope(SLOPES, b_idx, off_h, stride_az, stride_ah, HAS_ALIBI)
    if HAS_DESCALE:  # S = (q qd)(k kd)^T scale: qd * kd joins the scale, the loop is unchanged
        qkd = tl.load(DESC + b_idx * (H // GROUP) + off_hk) * tl.load(DESC + desc_n + b_idx * (H // GROUP) + off_hk)
        qk_scale = qk_scale * qkd
        softcap_scale = softcap_scale * qkd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_hi, mask_lo, hi = _key_range(start_m * BLOCK_M, seq_q, seq_k, diag_off, causal_off, win_left, win_right,
                                          BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, RTF)
    if FMA or LAZY or TMA or WS:
        acc, l_i, m_i = _fwd_inner_v(acc, l_i, m_i, q, k_base, v_base, DESC_K, DESC_V, b_idx, off_hk, k_start,
                                     stride_kn, stride_kk, stride_vn, stride_vk,
                                     lo, full_hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left,
                                     win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                                     BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, False,
                                     IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE, FMA, LAZY, TMA, WS)
        acc, l_i, m_i = _fwd_inner_v(acc, l_i, m_i, q, k_base, v_base, DESC_K, DESC_V, b_idx, off_hk, k_start,
                                     stride_kn, stride_kk, stride_vn, stride_vk,
                                     mask_lo, hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left,
                                     win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                                     BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, True,
                                     IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE, FMA, LAZY, TMA,
                                     False)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                                   lo, full_hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left,
                                   win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                                   BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, False,
                                   IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                                   mask_lo, hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off,
                                   win_left, win_right, slope, scale, qk_scale, softcap_scale, softcap_c2,
                                   BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, True,
                                   IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, UPCAST, IEEE)

    # the sink joins the denominator: rescale to max(m, sink) and add exp(sink) (`rtmask`: if its run-time bit is on)
    if HAS_SINKS and (RTF is None or _rt(RTF, RT_SINKS)):
        sink2 = tl.load(SINKS + off_h).to(tl.float32) * LOG2E
        m_f = tl.maximum(m_i, sink2)
        m_fs, alpha = _rescale(m_i, m_f)  # no key and a -inf sink: l stays 0
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_fs)
        acc = acc * alpha[:, None]
        m_i = m_f
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    if HAS_DESCALE:  # out = softmax(S) (v vd): v's descale once, on the normalised output
        out = out * tl.load(DESC + 2 * desc_n + b_idx * (H // GROUP) + off_hk)
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))

    o_ptrs = _base(O, b_idx, off_h, q_start, stride_oz, stride_oh, stride_om) \
        + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_ok
    o_mask = offs_m[:, None] < seq_q
    if not EVEN_DV:
        o_mask = o_mask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, _lowp(out, O.dtype.element_ty, UPCAST), mask=o_mask)
    l_ptrs = LSE + b_idx.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + (q_start + offs_m) * stride_lm
    tl.store(l_ptrs, lse, mask=offs_m < seq_q)


# Fewer compiles (issue 25): Triton compiles once per value class of every int argument (== 1, divisible by 16,
# other). These arguments only bound masks and loop ranges or address the per-row LSE and ALiBi slope, never a
# tile load, so their value class buys no vectorisation; the tile strides stay specialised (16-byte loads).
# A twin of the kernel, selected by Config.nospec, so that a GPU run can time it against the default.
NOSPEC = ("H", "GROUP", "seq_q_arg", "seq_k_arg", "win_left", "win_right", "stride_lz", "stride_lh", "stride_lm",
          "stride_az", "stride_ah")
# Its variants (variants.py): `aligned`, the tile strides unspecialised too (ALIGNED: the host's word that they are
# multiples of 16 bytes, for the vector loads); `rtmask`, causal, bottom-right, window and sinks at run time (RTF).
# TWINS[(aligned, rtmask)].
TILES = tuple(f"stride_{t}{d}" for t, dims in (("q", "zhmk"), ("k", "zhnk"), ("v", "zhnk"), ("o", "zhmk")) for d in dims)
TWINS = nospec_twins(_attn_fwd.fn, NOSPEC, TILES)
_attn_fwd_nospec = TWINS[(False, False)]
