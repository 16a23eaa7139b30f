"""Triton helpers shared by the forward and backward kernels: one home for each rule.

- `_segment`: the prologue of every kernel: where batch or varlen segment `off_z` lives (its start
  rows and lengths, from cu_seqlens or the dense shape) and the diagonal offsets (`diag_off` for
  windows and ALiBi, always bottom-right; `causal_off` for the causal mask, by its alignment).
- `_base`: a (batch, head, start row) base pointer in 64-bit arithmetic.
- `_key_range`: which key blocks a query block sees, and which of them need no element mask
  (the forward and dQ kernels loop over keys; dK/dV loops over queries, `_query_range`).
- `_scores`: raw q.k -> scores in log2 units with softcap, ALiBi and the visibility masks (`_visible`).
- `_load_kv`: the forward key loop's K^T and V tiles (masked past Lk, padded head dims), for the plain
  loop (`flash_fwd._fwd_inner`) and the speed variants' (`flash_fwd_variants._fwd_inner_v`).
- `_safe_max`: a running max to subtract, -inf read as 0 (so `-inf - -inf` is never formed), and `_rescale`,
  the online softmax's factor for a new running max built on it: the forward's loops and sink, the decode
  kernel's loop and sink (`decode._decode_partial`) and the split-KV combine (`combine._combine`).
- `_lowp`, `_dot`, `_tanh`: dtype conversion, dots, tanh that also run under the interpreter.
- The `nospec` twins' variants (issue 25, fewer compiles; kernels/variants.py has the host side): `_aligned`, tile
  strides that came unspecialised and divided by ALIGNED (the host's word that each is a multiple of 16 bytes), and
  `RTF`, the causal, bottom-right, window and sinks flags at run time (bits RT_*): a kernel given RTF has their code
  compiled in and `_rt` reads them. Not causal then reads as a diagonal past every key (`_segment`: causal_off =
  NO_DIAG), no window as unbounded sides (the host's BIG): the masks' arithmetic is unchanged, no branch in a key
  loop; only which blocks are masked (`_key_range`, `_query_range`) and the sink (the forward's epilogue) are chosen
  at run time. Every helper's RTF defaults to None (constexpr): the default kernels compile as before.

Nothing here touches a GPU at import.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E_F = 1.4426950408889634  # host-side floats
LN2_F = 0.6931471805599453
LOG2E = tl.constexpr(LOG2E_F)  # globals read inside @triton.jit must be constexpr
LN2 = tl.constexpr(LN2_F)
BIG = 1 << 30  # "unbounded" window side
NO_DIAG = tl.constexpr(BIG)  # `rtmask`, not causal: the causal diagonal past every key
# bits of RTF (the `rtmask` twins' run-time mask flags); host side: variants.rtmask_args
RT_CAUSAL = tl.constexpr(0)
RT_BR = tl.constexpr(1)
RT_WINDOW = tl.constexpr(2)
RT_SINKS = tl.constexpr(3)


@triton.jit
def _rt(RTF, BIT: tl.constexpr):
    """Whether run-time mask flag BIT (RT_*) is on in RTF."""
    return ((RTF >> BIT) & 1) != 0


@triton.jit
def _aligned(stride_z, stride_h, stride_l, ALIGNED: tl.constexpr):
    """A tile tensor's strides, given divided by ALIGNED elements (16 bytes; its last dim's stride is 1): multiplied
    back by the constexpr, so Triton sees them as multiples of 16 bytes and the last dim as contiguous (the vector
    loads that the specialisation on divisibility by 16 gave the nospec twins)."""
    return stride_z * ALIGNED, stride_h * ALIGNED, stride_l * ALIGNED, 1


@triton.jit
def _segment(CU_Q, CU_K, off_z, seq_q_arg, seq_k_arg, CAUSAL_BR: tl.constexpr, IS_VARLEN: tl.constexpr, RTF=None):
    """-> (b_idx, q_start, k_start, seq_q, seq_k, diag_off, causal_off) of batch or segment `off_z`."""
    zero = off_z * 0
    if IS_VARLEN:  # one packed batch: segment z is rows [cu[z], cu[z + 1])
        q_start = tl.load(CU_Q + off_z)
        seq_q = tl.load(CU_Q + off_z + 1) - q_start
        k_start = tl.load(CU_K + off_z)
        seq_k = tl.load(CU_K + off_z + 1) - k_start
        b_idx = zero
    else:
        q_start = zero
        k_start = zero
        seq_q = zero + seq_q_arg
        seq_k = zero + seq_k_arg
        b_idx = off_z
    diag_off = seq_k - seq_q
    if CAUSAL_BR:
        causal_off = diag_off
    else:
        causal_off = zero
    if RTF is not None:  # `rtmask`: bottom-right or top-left at run time; not causal, a diagonal past every key
        causal_off = tl.where(_rt(RTF, RT_BR), diag_off, zero)
        causal_off = tl.where(_rt(RTF, RT_CAUSAL), causal_off, zero + NO_DIAG)
    return b_idx, q_start, k_start, seq_q, seq_k, diag_off, causal_off


@triton.jit
def _base(P, b_idx, head, start, stride_z, stride_h, stride_l):
    return P + b_idx.to(tl.int64) * stride_z + head.to(tl.int64) * stride_h + start.to(tl.int64) * stride_l


@triton.jit
def _key_range(m_lo, seq_q, seq_k, diag_off, causal_off, win_left, win_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               RTF=None):
    """Key blocks that query rows [m_lo, m_lo + BLOCK_M) see: -> (lo, full_hi, mask_lo, hi).

    Blocks [lo, full_hi) need no element mask (inside Lk and, causal, wholly under the diagonal);
    blocks [mask_lo, hi) are masked. With a window every block is masked. Keys past Lk are always in
    the masked part: zero-loaded they would give p = exp2(0 - lse), which can overflow in dQ.
    """
    m_hi = tl.minimum(m_lo + BLOCK_M, seq_q)  # exclusive
    hi = seq_k
    lo = m_lo * 0
    if IS_CAUSAL:
        hi = tl.minimum(hi, m_hi + causal_off)
    if HAS_WINDOW:
        hi = tl.minimum(hi, m_hi + diag_off + win_right)
        lo = tl.maximum(lo, m_lo + diag_off - win_left)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, 0)
    if HAS_WINDOW and RTF is None:
        full_hi = lo
    else:
        full_hi = tl.minimum((seq_k // BLOCK_N) * BLOCK_N, hi)
        if IS_CAUSAL:
            full_hi = tl.minimum(full_hi, (tl.maximum(m_lo + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
        if HAS_WINDOW:  # `rtmask`: every block masked while a window is on
            full_hi = tl.where(_rt(RTF, RT_WINDOW), lo, full_hi)
    return lo, full_hi, tl.maximum(full_hi, lo), hi


@triton.jit
def _query_range(n_lo, seq_q, seq_k, diag_off, causal_off, win_left, win_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 RTF=None):
    """Query blocks that see keys [n_lo, n_lo + BLOCK_N): -> (lo, full_lo, hi).

    Blocks [lo, full_lo) are masked (they cross the causal diagonal, or a window is on); blocks
    [full_lo, hi) are wholly below the diagonal and need no element mask (keys past Lk are
    zero-loaded there and reach only rows that are never stored).
    """
    n_hi = tl.minimum(n_lo + BLOCK_N, seq_k)
    lo = n_lo * 0
    hi = seq_q
    if IS_CAUSAL:
        lo = tl.maximum(lo, n_lo - causal_off)
    if HAS_WINDOW:
        lo = tl.maximum(lo, n_lo - diag_off - win_right)
        hi = tl.minimum(hi, n_hi - 1 - diag_off + win_left + 1)
    lo = tl.minimum(lo, seq_q)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    if HAS_WINDOW and RTF is None:
        full_lo = hi
    else:
        if IS_CAUSAL:
            full_lo = tl.minimum(tl.maximum(((n_lo + BLOCK_N - 1 - causal_off + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo),
                                 hi)
        else:
            full_lo = lo
        if HAS_WINDOW:  # `rtmask`: every block masked while a window is on
            full_lo = tl.where(_rt(RTF, RT_WINDOW), hi, full_lo)
    return lo, full_lo, hi


@triton.jit
def _tanh(x):
    """tanh in fp32 without libdevice (the interpreter has none): series near 0, exp form elsewhere."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397))))
    t = tl.where(ax < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _lowp(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 -> DT. Under the interpreter (UPCAST) bf16 is rounded to nearest even by hand first: its
    own conversion truncates, which biases P and the outputs low and fails a correct kernel."""
    if UPCAST and DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
    if UPCAST and (DT == tl.float8e4nv or DT == tl.float8e5):
        x = _round_fp8(x, DT)
    return x.to(DT)


@triton.jit
def _round_fp8(x, DT: tl.constexpr):
    """fp32 -> the nearest-even value of fp8 DT (e4m3fn or e5m2), still fp32; for the interpreter, whose own
    conversion does not carry a rounded-up mantissa into the exponent (0.499 became 0.25, not 0.5). Finite
    values within DT's range (P in [0, 1]): normals drop mantissa bits, subnormals round to the fixed quantum
    by adding and subtracting a float32 whose ulp is that quantum."""
    if DT == tl.float8e4nv:
        DROP: tl.constexpr = 20  # 3 mantissa bits; normals from 2^-6, subnormal quantum 2^-9
        MIN_NORMAL: tl.constexpr = 0.015625
        MAGIC: tl.constexpr = 24576.0  # 1.5 * 2^14: ulp 2^-9
    else:
        DROP: tl.constexpr = 21  # 2 mantissa bits; normals from 2^-14, subnormal quantum 2^-16
        MIN_NORMAL: tl.constexpr = 0.00006103515625
        MAGIC: tl.constexpr = 192.0  # 1.5 * 2^7: ulp 2^-16
    b = x.to(tl.uint32, bitcast=True)
    b = b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)
    normal = ((b >> DROP) << DROP).to(tl.float32, bitcast=True)
    sub = (x + MAGIC) - MAGIC
    return tl.where(tl.abs(x) < MIN_NORMAL, sub, normal)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _scores(qk, ii, jj, seq_k, diag_off, causal_off, win_left, win_right, slope,
            scale, qk_scale, softcap_scale, softcap_c2,
            MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BOUNDS: tl.constexpr = True):
    """Raw q.k (fp32) -> final scores in log2 units, and tanh (for softcap grads).

    `ii` (query index) and `jj` (key index) are 2-D broadcastable index tensors, so the same code
    serves the (M, N) orientation of the forward and dQ and the (N, M) one of dK/dV.
    """
    if HAS_SOFTCAP:
        t = _tanh(qk * softcap_scale)  # softcap_scale = scale / c
        s = t * softcap_c2  # softcap_c2 = c * log2(e)
    else:
        t = qk
        s = qk * qk_scale  # qk_scale = scale * log2(e)
    if HAS_ALIBI:
        dist = tl.abs(ii + diag_off - jj).to(tl.float32)
        s = s - (slope * LOG2E) * dist
    if MASK:
        vis = _visible(ii, jj, seq_k, diag_off, causal_off, win_left, win_right, IS_CAUSAL, HAS_WINDOW, BOUNDS)
        s = tl.where(vis, s, float("-inf"))
    return s, t


@triton.jit
def _visible(ii, jj, seq_k, diag_off, causal_off, win_left, win_right,
             IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDS: tl.constexpr):
    """Which (query ii, key jj) pairs are visible: inside Lk (BOUNDS), causal, window."""
    if BOUNDS:
        vis = jj < seq_k
    else:  # keys past Lk are zero-loaded; in the backward they only reach unstored rows
        vis = jj >= 0
    if IS_CAUSAL:
        vis = vis & (jj <= ii + causal_off)
    if HAS_WINDOW:
        vis = vis & (jj >= ii + diag_off - win_left)
        vis = vis & (jj <= ii + diag_off + win_right)
    return vis


@triton.jit
def _slope(SLOPES, b_idx, head, stride_az, stride_ah, HAS_ALIBI: tl.constexpr):
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b_idx * stride_az + head * stride_ah).to(tl.float32)
    else:
        slope = (b_idx * 0).to(tl.float32)
    return slope


@triton.jit
def _load_kv(k_base, v_base, offs_n, offs_d, offs_dv, stride_kn, stride_kk, stride_vn, stride_vk, seq_k,
             HEAD_DIM, HEAD_DIM_V, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASK: tl.constexpr):
    """-> (K^T (BLOCK_D, N), V (N, BLOCK_DV)) of keys `offs_n`, zero past Lk (MASK) and past the head dims.

    An unmasked block with an unpadded head dim loads with no mask at all (16-byte loads, issue 25).
    """
    k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kk  # (D, N): K^T
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vk
    if MASK:
        kmask = offs_n[None, :] < seq_k
        vmask = offs_n[:, None] < seq_k
        if not EVEN_D:
            kmask = kmask & (offs_d[:, None] < HEAD_DIM)
        if not EVEN_DV:
            vmask = vmask & (offs_dv[None, :] < HEAD_DIM_V)
        kt = tl.load(k_ptrs, mask=kmask, other=0.0)
        v = tl.load(v_ptrs, mask=vmask, other=0.0)
    else:
        if EVEN_D:
            kt = tl.load(k_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
    return kt, v



@triton.jit
def _safe_max(m):
    """A row's running max as the value to subtract from its scores: -inf (no visible key yet, or an inf in q or k)
    read as 0, so that -inf - -inf, a NaN, is never formed (the row's exponentials are then exp2(-inf) = 0)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _rescale(m_i, m_new):
    """Online softmax, a row's running max going from m_i to m_new (log2 units) -> (m_use, alpha): P is computed
    against m_use (`_safe_max(m_new)`) and what was summed against m_i is multiplied by alpha."""
    m_use = _safe_max(m_new)
    return m_use, tl.math.exp2(m_i - m_use)


def nospec_twins(fn, nospec: tuple, tiles: tuple) -> dict:
    """{(aligned, rtmask): kernel}: the `nospec` twin of @triton.jit function `fn` (not specialised on the arguments
    `nospec` names, nor on the head dims) and its variants: `aligned` leaves the tile strides `tiles` unspecialised too
    (the kernel's ALIGNED says what the host knows of them), `rtmask` the run-time mask flags RTF. Host side only."""
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    base = [d for d in ("HEAD_DIM", "HEAD_DIM_V") if d in params] + list(nospec)
    rtf = ["RTF"] if "RTF" in params else []  # the preprocess has no mask flags
    return {(aligned, rtmask): triton.jit(do_not_specialize=base + (list(tiles) if aligned else [])
                                          + (rtf if rtmask else []))(fn)
            for aligned in (False, True) for rtmask in (False, True)}
