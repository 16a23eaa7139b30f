"""Split-KV attention over a paged or contiguous KV cache (Triton): the partial kernel of flash decoding.

One program computes, for one (batch b, KV head) and one block of packed query rows, the attention over one
split of batch b's keys. The rows of a block are the GROUP query heads sharing the KV head times the Lq
query positions (row m is head `hkv * GROUP + m // Lq`, position `m % Lq`): with GQA a decode step reads
each key once for the whole group, and Lq = 1 still fills a 16-row dot.

Keys: batch b attends to seq_k = cache_seqlens[b] + new_len keys (an append is written into the cache
before the launch). Key t lives in page TABLE[b, t // page_size] at slot t % page_size of the pool
(N, page_size, Hkv, D) -- any strides, so a BHSD pool (N, Hkv, S, D) is the same kernel with other strides.
A contiguous cache is the same thing with one "page" per batch: TABLE = cache_batch_idx[:, None] and
page_size = S (ROW_IS_BATCH: row b, no table at all). With HAS_LEFTPAD (flash_attn_with_kvcache's
cache_leftpad) batch b's keys start at slot LEFTPAD[b]: seq_k = cache_seqlens[b] - LEFTPAD[b] + new_len, key t
in slot t + LEFTPAD[b]; positions (causal, window, ALiBi) count keys, not slots. Loads past seq_k (and table
entries past the last page) are masked: garbage in unused slots never enters a score or a product.

Splits: `splits` > 0 cuts every batch's keys into that many chunks of its own length (a multiple of
SPLIT_ALIGN keys each, so short sequences are split too); `splits` = 0 lets each batch choose min(max_splits, cdiv(seq_k, split_target)) --
from its own length only, so a request's result never depends on what it is batched with. A split that
gets no key (or sees none through causal / window) stores LSE -inf and a zero output.

Outputs: with DIRECT (one split) the final output (input dtype) and natural-log LSE; otherwise float32
partials (out normalised by its own sum, LSE in base 2: scores are in log2 units here and in the
combine kernel, kernels/combine.py, which is the only reader). Partials are never rounded to the input
dtype before the merge. Sinks (HAS_SINKS, one logit per query head, a score over a zero value) join the
denominator once: here with DIRECT, else in the combine.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, LOG2E, _dot, _lowp, _rescale, _scores


@triton.jit(do_not_specialize=["HEAD_DIM", "HEAD_DIM_V", "page_size", "new_len", "splits", "split_target"])
def _decode_partial(
    Q, K, V, O, LSE, OP, LP, SEQLENS, TABLE, SLOPES, SINKS, LEFTPAD,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_pb, stride_ph, stride_pm, stride_ps, stride_pd,
    stride_xb, stride_xh, stride_xm, stride_xs,
    stride_tb, stride_tj, stride_az, stride_ah,
    HKV, GROUP, seq_q, page_size, new_len, splits, max_splits, split_target,
    scale, qk_scale, softcap_scale, softcap_c2, win_left, win_right,
    HEAD_DIM, HEAD_DIM_V, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_BR: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, DIRECT: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, ROW_IS_BATCH: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * seq_q
    qi = offs_m % seq_q  # query position of each packed row
    head = hkv * GROUP + offs_m // seq_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)

    q_ptrs = Q + b64 * stride_qb + head64[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q_mask = row_ok[:, None]
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b * stride_az + head * stride_ah, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    else:
        slope = 0.0

    seq_k = tl.load(SEQLENS + b).to(tl.int32) + new_len
    if HAS_LEFTPAD:
        pad = tl.load(LEFTPAD + b).to(tl.int32)
        seq_k -= pad
    else:
        pad = 0
    diag_off = seq_k - seq_q
    if CAUSAL_BR:
        causal_off = diag_off
    else:
        causal_off = diag_off * 0
    # the keys any row of the call sees (rows of a block may be any positions 0 .. Lq - 1)
    lo = seq_k * 0
    hi = seq_k
    if IS_CAUSAL:
        hi = tl.minimum(hi, seq_q + causal_off)
    if HAS_WINDOW:
        hi = tl.minimum(hi, seq_q + diag_off + win_right)
        lo = tl.maximum(lo, diag_off - win_left)
    # this program's split of batch b's keys
    if splits > 0:
        n_split = splits + seq_k * 0
    else:
        n_split = tl.minimum(max_splits, tl.maximum(1, tl.cdiv(seq_k, split_target)))
    chunk = tl.cdiv(tl.cdiv(seq_k, n_split), SPLIT_ALIGN) * SPLIT_ALIGN
    k_lo = tl.maximum(lo, split * chunk)
    k_hi = tl.minimum(hi, split * chunk + chunk)
    if split >= n_split:
        k_hi = k_lo

    k_head = K + hkv.to(tl.int64) * stride_kh
    v_head = V + hkv.to(tl.int64) * stride_vh
    t_row = TABLE + b64 * stride_tb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(k_lo, k_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        live = offs_n < k_hi
        slot_n = offs_n + pad  # the cache slot of key t (left padding skipped)
        if ROW_IS_BATCH:  # a contiguous cache read at row b: no table to load
            page = (offs_n * 0 + b).to(tl.int64)
        else:
            page = tl.load(t_row + (slot_n // page_size) * stride_tj, mask=live, other=0).to(tl.int64)
        slot = (slot_n % page_size).to(tl.int64)
        kmask = live[None, :]
        vmask = live[:, None]
        if not EVEN_D:
            kmask = kmask & (offs_d[:, None] < HEAD_DIM)
        if not EVEN_DV:
            vmask = vmask & (offs_dv[None, :] < HEAD_DIM_V)
        kt = tl.load(k_head + page[None, :] * stride_kp + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                     mask=kmask, other=0.0)  # (D, N): K^T
        v = tl.load(v_head + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                    mask=vmask, other=0.0)
        qk = _dot(q, kt, UPCAST, IEEE)
        s, _t = _scores(qk, qi[:, None], offs_n[None, :], k_hi, diag_off, causal_off, win_left, win_right, slope,
                        scale, qk_scale, softcap_scale, softcap_c2,
                        True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use, alpha = _rescale(m_i, m_new)  # never -inf - -inf
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(_lowp(p, v.dtype, UPCAST), v, UPCAST, IEEE)
        m_i = m_new

    if HAS_SINKS and DIRECT:  # the sink: one more score (its raw logit) over a zero value, in the denominator
        sink2 = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink2)
        m_fin_use, alpha = _rescale(m_i, m_fin)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_fin_use)
        m_i = m_fin
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(has, m_i + tl.math.log2(l_safe), float("-inf"))
    o_mask = row_ok[:, None]
    if not EVEN_DV:
        o_mask = o_mask & (offs_dv[None, :] < HEAD_DIM_V)
    if DIRECT:
        o_ptrs = O + b64 * stride_ob + head64[:, None] * stride_oh + qi[:, None] * stride_om + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, _lowp(out, O.dtype.element_ty, UPCAST), mask=o_mask)
        tl.store(LSE + b64 * stride_lb + head64 * stride_lh + qi * stride_lm, lse2 * LN2, mask=row_ok)
    else:
        sp = split.to(tl.int64)
        p_ptrs = OP + b64 * stride_pb + head64[:, None] * stride_ph + qi[:, None] * stride_pm + sp * stride_ps \
            + offs_dv[None, :] * stride_pd
        tl.store(p_ptrs, out, mask=o_mask)
        tl.store(LP + b64 * stride_xb + head64 * stride_xh + qi * stride_xm + sp * stride_xs, lse2, mask=row_ok)
