"""Plain-torch stand-ins of flash_attn_with_kvcache: FA2's (`flash_attn`) and FA3's (`flash_attn_interface`).

Written from the libraries' docstrings and argument checks (flash_attn/flash_attn_interface.py and
csrc/flash_attn/flash_api.cpp `mha_fwd_kvcache`; hopper/flash_attn_interface.py and hopper/flash_api.cpp
`mha_fwd`), with plain torch only -- nothing of attnverify (its naive, reference or paged rules) is used, so
running attnverify's properties through the adapters with these stand-ins checks the adapters' wiring end to
end. Each stand-in asserts the checks the real function makes on what the adapter controls (int32 and
contiguous metadata, BSHD layouts, page sizes, refused combinations, num_splits range, descale shapes) with the
library's own message, records every call in `.calls`, appends k / v into the caches in place, and returns an
LSE with +inf on rows that see no key (as the kernels store it). float32 is accepted as a CPU stand-in dtype.
"""
from __future__ import annotations

import math
import types

import torch

F8 = getattr(torch, "float8_e4m3fn", None)


def _need(cond, msg):
    if not cond:
        raise RuntimeError(msg)


def _attend(q, k, v, scale, causal, window, softcap, alibi, chunk):
    """q (Lq, H, D), k (L, Hkv, D), v (L, Hkv, Dv) float32 -> out (Lq, H, Dv), lse (H, Lq) (+inf: no key)."""
    lq, h = q.shape[:2]
    lk, hkv = k.shape[:2]
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = (torch.arange(lq) + lk - lq)[:, None]  # the query's position among the keys (bottom-right)
    j = torch.arange(lk)[None, :]
    if alibi is not None:  # "(-alibi_slope * |i + seqlen_k - seqlen_q - j|)"
        s = s - alibi.view(h, 1, 1) * (p - j).abs()
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= p - left
    if right >= 0:
        keep &= j <= p + right
    if chunk:  # hopper mask.h: keys from round_down(p, chunk) for chunk keys
        start = torch.div(p, chunk, rounding_mode="floor") * chunk
        keep &= (j >= start) & (j < start + chunk)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    w = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None]).masked_fill(empty[..., None], 0.0)
    out = torch.einsum("hqk,khd->qhd", w, vv)
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse)


def _int32_vec(name, t, b):
    _need(t.dtype == torch.int32, f"{name} must have dtype int32")
    _need(t.is_contiguous(), f"{name} must be contiguous")
    _need(tuple(t.shape) == (b,), f"{name} must have shape ({b},), got {tuple(t.shape)}")
    return [int(x) for x in t.tolist()]


def _run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, table, scale, causal, window,
         softcap, alibi, chunk, descales, out_dtype):
    """The shared semantics: in-place append, then attention over slots leftpad[b] .. seqlens[b] + Lnew - 1."""
    b, lq, h, d = q.shape
    paged = table is not None
    seqlen_k = table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    lens = _int32_vec("seqlens_k", cache_seqlens, b)
    pads = [0] * b if cache_leftpad is None else _int32_vec("leftpad_k", cache_leftpad, b)
    rows = list(range(b)) if cache_batch_idx is None else _int32_vec("cache_batch_idx", cache_batch_idx, b)
    new = 0
    if k is not None:
        _need(v is not None, "If key is supplied, value must also be passed in")
        _need(lq <= seqlen_k, "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        _need(k.dtype == q.dtype and v.dtype == q.dtype, "Key must have the same dtype as query")
        _need(k.stride(-1) == 1 and v.stride(-1) == 1, "Key tensor must have contiguous last dimension")
        _need(tuple(k.shape) == (b, k.shape[1], k_cache.shape[2], d), f"k must be (batch, seqlen_new, nheads_k, headdim), got {tuple(k.shape)}")
        _need(tuple(v.shape) == (b, k.shape[1], k_cache.shape[2], v_cache.shape[3]), f"v has shape {tuple(v.shape)}")
        new = k.shape[1]
    qd, kd, vd = descales
    outs, lses = [], []
    for i in range(b):
        t = torch.arange(lens[i], lens[i] + new)  # the append's slots
        if paged:
            _need(lens[i] + new <= seqlen_k, "exceeds the capacity addressable by block_table")
            pg, off = table[i].long()[t // k_cache.shape[1]], t % k_cache.shape[1]
        else:
            pg, off = torch.full_like(t, rows[i]), t
        if new:
            k_cache[pg, off] = k[i]
            v_cache[pg, off] = v[i]
        t = torch.arange(pads[i], lens[i] + new)  # the keys
        if paged:
            pg, off = table[i].long()[t // k_cache.shape[1]], t % k_cache.shape[1]
        else:
            pg, off = torch.full_like(t, rows[i]), t
        qi, ki, vi = q[i].float(), k_cache[pg, off].float(), v_cache[pg, off].float()
        if qd is not None:  # (b, h_k): query head h reads kv head h // (H / Hkv)
            qi = qi * qd[i].repeat_interleave(h // k_cache.shape[2]).view(1, h, 1)
        if kd is not None:
            ki = ki * kd[i].view(1, -1, 1)
        if vd is not None:
            vi = vi * vd[i].view(1, -1, 1)
        al = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[i])
        o, lse = _attend(qi, ki, vi, scale, causal, window, softcap, al, chunk)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs).to(out_dtype), torch.stack(lses)


def _common_checks(q, k_cache, v_cache, table, table_name, dtypes):
    _need(k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension")
    _need(v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension")
    _need(q.dtype in dtypes, f"FlashAttention does not support {q.dtype}")
    _need(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "query and key must have the same dtype")
    _need(q.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _need(q.dim() == 4 and k_cache.dim() == 4, "q (batch, seqlen, nheads, headdim) and caches 4-D")
    _need(q.shape[2] % k_cache.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
    if table is not None:
        _need(table.dtype == torch.int32, f"{table_name} must have dtype torch.int32")
        _need(table.stride(-1) == 1, f"{table_name} must have contiguous last dimension")
        _need(table.dim() == 2 and table.shape[0] == q.shape[0], f"{table_name} must be (batch_size, max_num_blocks_per_seq)")


def fake_fa2():
    """`flash_attn` with FA2's flash_attn_with_kvcache (flash-attn 2.8 signature)."""
    m = types.ModuleType("flash_attn")
    m.__version__ = "2.8.3+standin"
    m.calls = []

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                                cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                                alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        m.calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, num_splits=num_splits, return_softmax_lse=return_softmax_lse))
        _need(rotary_cos is None and rotary_sin is None, "the stand-in has no rotary embedding")
        _common_checks(q, k_cache, v_cache, block_table, "block_table", (torch.float16, torch.bfloat16, torch.float32))
        _need(v_cache.shape[-1] == q.shape[-1], "v_cache must have the head dim of q (CHECK_SHAPE)")
        _need(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
        if block_table is not None:
            _need(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
            _need(k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
            _need(cache_leftpad is None, "We don't support Paged KV and leftpad_k running at the same time yet")
        _need(isinstance(num_splits, int) and 0 <= num_splits <= 128, "num_splits > 128 not supported")
        if alibi_slopes is not None:
            _need(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse = _run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, scale,
                        causal, tuple(window_size), softcap, alibi_slopes, 0, (None, None, None), q.dtype)
        return (out, lse) if return_softmax_lse else out

    m.flash_attn_with_kvcache = flash_attn_with_kvcache
    return m


def fake_fa3():
    """`flash_attn_interface` (hopper/) with FA3's flash_attn_with_kvcache."""
    m = types.ModuleType("flash_attn_interface")
    m.calls = []

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        m.calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=page_table,
                            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal,
                            window_size=window_size, attention_chunk=attention_chunk, num_splits=num_splits,
                            softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse))
        _need(qv is None and rotary_cos is None and cu_seqlens_q is None, "the stand-in has no qv, rotary or varlen q")
        _common_checks(q, k_cache, v_cache, page_table, "page_table",
                       (torch.float16, torch.bfloat16, torch.float32, F8))
        d, dv = q.shape[-1], v_cache.shape[-1]
        _need(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        if dv != d:
            _need((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512),
                  "If V headdim is different from Q/K dim, we only support ...")
        align = 16 if q.dtype == F8 else 8
        _need(d % align == 0 and dv % align == 0, f"head_size should be a multiple of {align}")
        _need(isinstance(num_splits, int) and 0 <= num_splits <= 256, "num_splits > 256 not supported")
        _need(isinstance(attention_chunk, int) and attention_chunk >= 0, "attention_chunk is an int >= 0")
        b, hkv = q.shape[0], k_cache.shape[2]
        descales = (None, None, None)
        if q.dtype == F8:  # descales are read on the fp8 path only
            for t in (q_descale, k_descale, v_descale):
                _need(t is None or (tuple(t.shape) == (b, hkv) and t.dtype == torch.float32),
                      f"descales are float32 (b, h_k) = ({b}, {hkv}), got {None if t is None else (tuple(t.shape), t.dtype)}")
            descales = (q_descale, k_descale, v_descale)
        if softmax_scale is None:
            softmax_scale = (d + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
        out_dtype = torch.bfloat16 if q.dtype == F8 else q.dtype  # "For FP8 input, output must have dtype BF16"
        out, lse = _run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                        softmax_scale, causal, tuple(window_size), softcap, None, attention_chunk, descales, out_dtype)
        empty = torch.empty(0)
        return (out, lse, empty, empty) if return_softmax_lse else out

    m.flash_attn_with_kvcache = flash_attn_with_kvcache
    return m
