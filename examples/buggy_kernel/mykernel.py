"""mykernel: a small eager attention kernel with two classic bugs (attnverify's two-minute demo).

    out = attention(q, k, v, causal=True, softmax_scale=None, attn_mask=None)    # BHSD in, BHSD out

Bug 1: the kernel promises flash-attn's bottom-right causal alignment (query i sees keys
       j <= i + Lk - Lq), but clamps the offset Lk - Lq at 0: with fewer queries than keys (a chunk of
       new queries against a longer KV cache) the mask is top-left (j <= i), as SDPA's is_causal.
Bug 2: a query row that sees no key at all (all masked) gives NaN: softmax over a row of -inf.
       The kernel promises zeros there, as flash-attn does.

mykernel_fixed.py is the same kernel with both bugs fixed.
"""
import math

import torch


def attention(q, k, v, *, causal=False, softmax_scale=None, attn_mask=None):
    """q (B, H, Lq, D), k and v (B, H, Lk, D); attn_mask: bool, True = may attend, broadcastable to
    (B, H, Lq, Lk). Computes in float32, returns q's dtype."""
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"attention: q, k, v must share one of float32, float16, bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    lq, lk = q.shape[-2], k.shape[-2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        offset = min(lk - lq, 0)  # BUG 1: the offset must be lk - lq; clamped at 0 the mask is top-left when Lq < Lk
        s = s.masked_fill(j > i + offset, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    p = torch.softmax(s, dim=-1)  # BUG 2: a row of all -inf gives NaN
    return (p @ v.float()).to(q.dtype)
