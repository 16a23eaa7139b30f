"""Candidate speed variants of the forward's key loop (issue 25), each a compile-time switch.

`_fwd_inner_v` computes what `flash_fwd._fwd_inner` computes (same scores, same masks, the same
output and LSE up to rounding); the switches change only how:

- FMA: the row max is taken on the raw q.k (so the scale is applied once per row, not per element) and
  P = exp2(q.k * qk_scale - m) is one fused multiply-add per element. Exact for qk_scale > 0 without
  softcap and ALiBi (max(x * c) = max(x) * c for c > 0); the launcher sets it only then.
- LAZY: conditional rescaling (FlashAttention-4): the accumulator and the denominator are rescaled only
  when some row's max grows by more than RESCALE_TAU (log2 units) past the reference max that P is
  computed against; otherwise P uses the stale reference, so P <= 2**RESCALE_TAU (256: no overflow in
  fp16, fp32 sums). Exact in the end: out = acc / l and LSE = m + log2(l) use the same reference.
  The decision is one block-wide max, so the branch is uniform over the program.
- TMA: K and V tiles come through host tensor descriptors (Hopper TMA; zero-filled past Lk and past D).
  The launcher sets it only for dense (non-varlen) inputs whose strides TMA accepts.
- WS: `tl.range(..., warp_specialize=True)` on the key loop (Triton's automatic warp specialisation;
  documented for Blackwell: kept as a candidate to time, not a default).

Rows that see no key keep m = -inf and l = 0, as in the plain loop: no `-inf - -inf` is formed.
Nothing here touches a GPU at import.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _load_kv, _lowp, _rescale, _safe_max, _scores, _visible

RESCALE_TAU = tl.constexpr(8.0)  # log2 units: P <= 256 between rescales


@triton.jit
def _fwd_inner_v(acc, l_i, m_i, q, k_base, v_base, DESC_K, DESC_V, b_idx, off_hk, k_start,
                 stride_kn, stride_kk, stride_vn, stride_vk,
                 lo, hi, offs_m, offs_d, offs_dv, seq_k, diag_off, causal_off, win_left, win_right, slope,
                 scale, qk_scale, softcap_scale, softcap_c2,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM, HEAD_DIM_V,
                 EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASK: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 FMA: tl.constexpr, LAZY: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:  # OOB rows (past Lk) and columns (past D) arrive as zeros
            kt = tl.trans(DESC_K.load([b_idx, off_hk, k_start + start_n, 0]).reshape(BLOCK_N, BLOCK_D))
            v = DESC_V.load([b_idx, off_hk, k_start + start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            kt, v = _load_kv(k_base, v_base, offs_n, offs_d, offs_dv, stride_kn, stride_kk, stride_vn, stride_vk,
                             seq_k, HEAD_DIM, HEAD_DIM_V, EVEN_D, EVEN_DV, MASK)
        qk = _dot(q, kt, UPCAST, IEEE)
        if FMA:  # qk_scale > 0, no softcap, no ALiBi (the launcher's rule)
            if MASK:
                vis = _visible(offs_m[:, None], offs_n[None, :], seq_k, diag_off, causal_off, win_left, win_right,
                               IS_CAUSAL, HAS_WINDOW, True)
                qk = tl.where(vis, qk, float("-inf"))
            m_blk = tl.max(qk, 1) * qk_scale
        else:
            qk, _t = _scores(qk, offs_m[:, None], offs_n[None, :], seq_k, diag_off, causal_off, win_left, win_right,
                             slope, scale, qk_scale, softcap_scale, softcap_c2,
                             MASK, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            m_blk = tl.max(qk, 1)
        m_new = tl.maximum(m_i, m_blk)
        if LAZY:
            # m_i is the reference P is computed against; -inf -> finite is an infinite growth
            grow = tl.where(m_new > m_i, m_new - m_i, 0.0)
            if tl.max(grow, 0) > RESCALE_TAU:
                _m_fix, alpha = _rescale(m_i, m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            m_use = _safe_max(m_i)
        else:
            m_use, alpha = _rescale(m_i, m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        if FMA:
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            p = tl.math.exp2(qk - m_use[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = acc + _dot(_lowp(p, v.dtype, UPCAST), v, UPCAST, IEEE)
    return acc, l_i, m_i
