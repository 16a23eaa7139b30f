"""mykernel, fixed: bottom-right causal alignment, and rows that see no key give 0 (zero gradient)."""
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
    visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        visible = j <= i + (lk - lq)  # FIX 1: bottom-right alignment
    if attn_mask is not None:
        visible = visible & attn_mask
    s = s.masked_fill(~visible, float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # rows that see no key (masked, or scores of -inf)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1)  # FIX 2: no softmax over a row of -inf ...
    p = p.masked_fill(dead, 0.0)  # ... those rows give 0, and a zero gradient
    return (p @ v.float()).to(q.dtype)
