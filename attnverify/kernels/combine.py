"""The LSE combine of split-KV attention (Triton): merges the float32 partials of kernels/decode.py.

Each program merges BLOCK_R query rows (flattened (b, head, position), decomposed with the real strides of
every tensor, never assumed contiguous). For row r with split partials (o_s, lse_s), lse_s in base 2:

    m = max_s lse_s,  w_s = 2^(lse_s - m),  out = sum_s w_s o_s / sum_s w_s,  LSE = (m + log2 sum_s w_s) ln 2

A split with lse_s = -inf (no key, or none visible) has weight 0 and its partial output is not even
loaded; a row whose splits are all -inf gets output 0 and LSE -inf. Sinks (HAS_SINKS: one logit per query
head) are one more partial with that LSE and a zero output. The output is rounded to its dtype
once, after the merge; the LSE is natural-log.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, LOG2E, _lowp, _safe_max


@triton.jit(do_not_specialize=["HEAD_DIM_V"])
def _combine(
    OP, LP, O, LSE, SINKS,
    stride_pb, stride_ph, stride_pm, stride_ps, stride_pd,
    stride_xb, stride_xh, stride_xm, stride_xs,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    n_rows, H, seq_q, n_splits, HEAD_DIM_V,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < n_rows
    qi = (offs_r % seq_q).to(tl.int64)
    head = ((offs_r // seq_q) % H).to(tl.int64)
    b = (offs_r // (seq_q * H)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)

    lp = LP + b * stride_xb + head * stride_xh + qi * stride_xm
    lse = tl.load(lp[:, None] + offs_s[None, :].to(tl.int64) * stride_xs,
                  mask=row_ok[:, None] & (offs_s[None, :] < n_splits), other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:  # the sink: a partial of LSE = its logit and output 0
        sink2 = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink2)
    m_use = _safe_max(m)
    w = tl.math.exp2(lse - m_use[:, None])  # 0 for -inf partials
    l_sum = tl.sum(w, 1)
    if HAS_SINKS:
        l_sum += tl.math.exp2(sink2 - m_use)

    dv_ok = offs_dv[None, :] < BLOCK_DV
    if not EVEN_DV:
        dv_ok = offs_dv[None, :] < HEAD_DIM_V
    op = OP + b[:, None] * stride_pb + head[:, None] * stride_ph + qi[:, None] * stride_pm + offs_dv[None, :] * stride_pd
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(0, n_splits):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        live = row_ok & (w_s > 0.0)
        o_s = tl.load(op + s * stride_ps, mask=live[:, None] & dv_ok, other=0.0)
        acc += w_s[:, None] * o_s

    has = l_sum > 0.0
    l_safe = tl.where(has, l_sum, 1.0)
    out = acc / l_safe[:, None]
    lse_out = tl.where(has, (m_use + tl.math.log2(l_safe)) * LN2, float("-inf"))
    o_ptrs = O + b[:, None] * stride_ob + head[:, None] * stride_oh + qi[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, _lowp(out, O.dtype.element_ty, UPCAST), mask=row_ok[:, None] & dv_ok)
    tl.store(LSE + b * stride_lb + head * stride_lh + qi * stride_lm, lse_out, mask=row_ok)
