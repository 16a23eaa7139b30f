"""Building masks and biases for eager adapters from a Spec (shared by naive, sdpa and the zoo).

These are adapter-side helpers: the float64 reference has its own, independent implementation.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import visibility
from ..spec import Spec


def positional_visibility(lq: int, lk: int, spec: Spec, device) -> Optional[torch.Tensor]:
    """(Lq, Lk) bool: causal and window visibility, or None when everything is visible."""
    return visibility.positional_visibility(lq, lk, spec.causal, spec.window, device, chunk=spec.attention_chunk)


def alibi_bias(lq: int, lk: int, slopes, b: int, hq: int, device, dtype=torch.float32) -> torch.Tensor:
    """(B, Hq, Lq, Lk): -slope * |i + Lk - Lq - j|."""
    s = torch.as_tensor(slopes, device=device).to(dtype)
    s = s.view(1, hq) if s.dim() == 1 else s.view(b, hq)
    i = torch.arange(lq, device=device, dtype=dtype)[:, None]
    j = torch.arange(lk, device=device, dtype=dtype)[None, :]
    return -s[:, :, None, None] * (i + (lk - lq) - j).abs()


def varlen_visibility(spec: Spec, lq: int, lk: int, device) -> torch.Tensor:
    """(Lq, Lk) bool for a packed batch: segment i of queries sees segment i of keys (causal/window inside)."""
    return visibility.varlen_visibility(spec.cu_seqlens_q, spec.cu_seqlens_k, lq, lk, spec.causal, spec.window, device,
                                        chunk=spec.attention_chunk)


def varlen_alibi_distance(spec: Spec, lq: int, lk: int, device, dtype=torch.float32) -> torch.Tensor:
    """(Lq, Lk) |i + Lk_seg - Lq_seg - j| in segment-local coordinates (0 across segments)."""
    cq = torch.as_tensor(spec.cu_seqlens_q).tolist()
    ck = torch.as_tensor(spec.cu_seqlens_k).tolist()
    dist = torch.zeros(lq, lk, dtype=dtype, device=device)
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        i = torch.arange(q1 - q0, device=device, dtype=dtype)[:, None]
        j = torch.arange(k1 - k0, device=device, dtype=dtype)[None, :]
        dist[q0:q1, k0:k1] = (i + (k1 - k0) - (q1 - q0) - j).abs()
    return dist


def score_bias_and_visibility(spec: Spec, b: int, hq: int, lq: int, lk: int, device, dtype=torch.float32):
    """Everything added to / hiding scores: returns (bias (B,Hq,Lq,Lk) in `dtype` or None, visible bool or None)."""
    bias = None
    if spec.is_varlen:
        vis = varlen_visibility(spec, lq, lk, device)
        if spec.alibi_slopes is not None:
            s = torch.as_tensor(spec.alibi_slopes, device=device).to(dtype)
            s = s.view(1, hq) if s.dim() == 1 else s.view(b, hq)
            bias = -s[:, :, None, None] * varlen_alibi_distance(spec, lq, lk, device, dtype)
    else:
        vis = positional_visibility(lq, lk, spec, device)
        if spec.alibi_slopes is not None:
            bias = alibi_bias(lq, lk, spec.alibi_slopes, b, hq, device, dtype)
    if spec.attn_mask is not None:
        m = spec.attn_mask.to(device)
        if m.dtype == torch.bool:
            vis = m if vis is None else (vis & m)
        else:
            bias = m.to(dtype) if bias is None else bias + m.to(dtype)
    return bias, vis


def keep_mask(spec: Spec, shape, device) -> Optional[torch.Tensor]:
    """A reproducible dropout keep-mask from spec.seed (for adapters that return theirs)."""
    if spec.dropout_p <= 0:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(spec.seed or 0))
    return (torch.rand(shape, generator=gen) >= spec.dropout_p).to(device)


NEG_INF = -math.inf
