"""Plain-torch stand-ins for the library calls the cookbook's recipes wrap (docs/adapters.md).

flash-attn and FlashInfer need a CUDA GPU and are not installed where these docs are tested, so
each recipe imports the real function when it can and falls back to the stand-in here, which has
the same signature, the same tensor layout and the same semantics as the library documents:

- `flash_attn_func(q, k, v, ...)`: flash-attn 2's padded-batch call. BSHD: q (B, Lq, Hq, D),
  k and v (B, Lk, Hkv, D); causal and window_size bottom-right aligned; softcap; alibi_slopes
  (Hq,) or (B, Hq); GQA grouped; a row with no visible key gives 0. With return_attn_probs=True
  it returns (out, softmax_lse (B, Hq, Lq) float32 natural log, None).
- `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`:
  flash-attn 2's packed call. q (total_q, Hq, D), k and v (total_k, Hkv, D); document i is rows
  cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and cu_seqlens_k[i]:cu_seqlens_k[i+1] of k and v.
- `single_prefill_with_kv_cache(q, k, v, ...)`: FlashInfer's single-request prefill. NHD: q
  (Lq, Hq, D), k and v (Lk, Hkv, D); causal bottom-right; window_left; logits_soft_cap; with
  return_lse=True it returns (out, lse (Lq, Hq) float32 in BASE 2), as FlashInfer does.

They compute in float32 and round the output to the input dtype; gradients flow through autograd.
They are stand-ins for testing the adapters' glue (layouts, argument mapping, LSE conversion),
not kernels: nothing here is tiled or fast.
"""
from __future__ import annotations

import math

import torch


def _core(q, k, v, *, scale, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> out (input dtype), lse (float32, natural log)."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype among float16, bfloat16 (and float32, which the stand-in "
                        f"adds for fast CPU tests); got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"number of query heads {hq} must be a multiple of key/value heads {hkv}")
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=1)  # query head h reads kv head h // g
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    diag = i + (lk - lq)  # bottom-right: the last query sees the last key
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(1 if alibi_slopes.dim() == 1 else b, hq, 1, 1)
        s = s - slopes * (diag - j).abs().float()
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:  # flash-attn: "if causal=True, window_size[1] is set to 0"
        right = 0
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    s = s.masked_fill(~visible, float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead.squeeze(-1), float("-inf"))
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(p, vf).to(q.dtype), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p:
        raise NotImplementedError("the stand-in has no dropout")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=causal,
                     window=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes)
    out = out.transpose(1, 2)  # back to BSHD
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    if dropout_p:
        raise NotImplementedError("the stand-in has no dropout")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise TypeError("cu_seqlens_q and cu_seqlens_k must be int32")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[-1] != q.shape[0] or ck[-1] != k.shape[0]:
        raise ValueError("cu_seqlens do not match the packed lengths")
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].transpose(0, 1)[None]  # (1, Hq, Lq_i, D)
        ki = k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vi = v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = _core(qi, ki, vi, scale=scale, causal=causal, window=tuple(window_size), softcap=softcap,
                       alibi_slopes=slopes)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])
    lse = torch.cat(lses, 1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32)  # (Hq, total_q)
    return (out, lse, None) if return_attn_probs else out


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 return_lse=False):
    if kv_layout != "NHD" or custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode != "NONE":
        raise NotImplementedError("the stand-in covers kv_layout='NHD' without masks or positional encodings")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _core(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale,
                     causal=causal, window=(window_left, -1), softcap=logits_soft_cap or 0.0)
    out = out[0].transpose(0, 1)  # (Lq, Hq, Dv)
    if not return_lse:
        return out
    return out, (lse[0].transpose(0, 1) / math.log(2.0)).contiguous()  # (Lq, Hq), base 2 like FlashInfer


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's decode call. q (B, Lq, Hq, D); k_cache/v_cache (B_cache, S, Hkv, D), or with block_table
    (B, max_blocks) int32 a paged pool (num_blocks, page_block_size, Hkv, D); k/v (B, Lnew, Hkv, D) are written
    in place at cache_seqlens[b] and attended to; causal and window bottom-right over all cache_seqlens[b] + Lnew
    keys; cache_leftpad (B,) int32 (contiguous caches only): batch b's cached keys start at slot cache_leftpad[b].
    num_splits is a performance knob (the stand-in never splits)."""
    if rotary_cos is not None:
        raise NotImplementedError("the stand-in has no rotary embedding")
    if cache_leftpad is not None and block_table is not None:
        raise RuntimeError("We don't support Paged KV and leftpad_k running at the same time yet")
    b, lq, hq, d = q.shape
    lens = [int(x) for x in torch.as_tensor(cache_seqlens).reshape(-1).expand(b).tolist()]
    pads = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for i in range(b):
        t = torch.arange(pads[i], lens[i] + new, device=q.device)
        if block_table is not None:
            pages, offs = block_table[i].long()[t // k_cache.shape[1]], t % k_cache.shape[1]
        else:
            row = i if cache_batch_idx is None else int(cache_batch_idx[i])
            pages, offs = torch.full_like(t, row), t
        if new:  # the in-place append
            k_cache[pages[lens[i] - pads[i]:], offs[lens[i] - pads[i]:]] = k[i]
            v_cache[pages[lens[i] - pads[i]:], offs[lens[i] - pads[i]:]] = v[i]
        kb, vb = k_cache[pages, offs].transpose(0, 1)[None], v_cache[pages, offs].transpose(0, 1)[None]
        slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = _core(q[i:i + 1].transpose(1, 2), kb, vb, scale=softmax_scale or 1.0 / math.sqrt(d), causal=causal,
                       window=window_size, softcap=softcap, alibi_slopes=slopes)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_softmax_lse else out
