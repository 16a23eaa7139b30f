"""Exact float64 attention: forward (out, LSE) and an explicit backward (dQ, dK, dV).

Everything is computed one block of queries at a time, so memory is O(block x Lk), never
O(Lq x Lk). The backward recomputes the probabilities of each block from the saved LSE,
exactly like a flash kernel, but in float64.

Semantics are those of SPEC.md; this module knows nothing of adapters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

_F64 = torch.float64
# Bytes of float64 scratch one query block may use (several (block x Lk) temporaries live at once).
_BLOCK_BUDGET_BYTES = 48 * 2**20


@dataclass
class _Params:
    scale: float
    causal: str
    window: Optional[Tuple[int, int]]
    softcap: Optional[float]
    alibi: Optional[torch.Tensor]  # (B, H) float64 or None
    mask: Optional[torch.Tensor]  # broadcastable (B, H, Lq, Lk), bool or float
    dropout_p: float
    keep: Optional[torch.Tensor]  # bool (B, H, Lq, Lk) or None
    sinks: Optional[torch.Tensor] = None  # (H,) float64 sink logits joining each row's denominator
    chunk: Optional[int] = None  # chunked local attention: diag // chunk == j // chunk


@dataclass
class ReferenceResult:
    out: torch.Tensor  # (B, Hq, Lq, Dv) float64
    lse: torch.Tensor  # (B, Hq, Lq) float64; -inf on fully-masked rows


@dataclass
class ReferenceGrads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsinks: Optional[torch.Tensor] = None  # (Hq,) float64 when the spec has sinks


def _block_rows(b: int, h: int, lk: int, block_q: Optional[int]) -> int:
    if block_q is not None:
        return max(1, int(block_q))
    per_row = max(1, b * h * max(lk, 1) * 8 * 6)
    return int(max(1, min(1024, _BLOCK_BUDGET_BYTES // per_row)))


def _visible(i0: int, i1: int, lq: int, lk: int, p: _Params, device) -> Optional[torch.Tensor]:
    """Positional visibility (causal, window) of queries [i0, i1) as a (rows, Lk) bool, or None."""
    if p.causal == "none" and p.window is None and p.chunk is None:
        return None
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(lk, device=device).unsqueeze(0)
    vis = torch.ones(i1 - i0, lk, dtype=torch.bool, device=device)
    if p.causal == "top_left":
        vis &= j <= i
    elif p.causal == "bottom_right":
        vis &= j <= i + (lk - lq)
    if p.window is not None:
        left, right = p.window
        diag = i + (lk - lq)
        if left >= 0:
            vis &= j >= diag - left
        if right >= 0:
            vis &= j <= diag + right
    if p.chunk is not None:  # a query at position diag sees only keys of its own chunk
        vis &= torch.div(j, p.chunk, rounding_mode="floor") == torch.div(i + (lk - lq), p.chunk, rounding_mode="floor")
    return vis


def _scores(qb, k, i0, i1, lq, lk, p: _Params):
    """Final scores of a query block (B, H, rows, Lk), the pre-cap scores, and the 'counts' mask.

    Masked positions hold -inf. Returns (s, s_pre, visible) where visible is the positional and
    boolean-mask visibility (bool, broadcastable) or None when everything is visible.
    """
    s_pre = torch.matmul(qb, k.transpose(-1, -2)) * p.scale
    s = s_pre
    if p.softcap is not None:
        s = p.softcap * torch.tanh(s_pre / p.softcap)
    if p.alibi is not None:
        i = torch.arange(i0, i1, device=qb.device, dtype=_F64).unsqueeze(1)
        j = torch.arange(lk, device=qb.device, dtype=_F64).unsqueeze(0)
        dist = (i + (lk - lq) - j).abs()
        s = s - p.alibi[:, :, None, None] * dist
    vis = _visible(i0, i1, lq, lk, p, qb.device)
    if p.mask is not None:
        m = p.mask[..., i0:i1, :] if p.mask.shape[-2] != 1 else p.mask
        if m.dtype == torch.bool:
            vis = m if vis is None else (vis & m)
        else:
            s = s + m.to(_F64)
    if vis is not None:
        s = torch.where(vis, s, torch.tensor(-math.inf, dtype=_F64, device=s.device))
    return s, s_pre, vis


def _row_stats(s: torch.Tensor, sink: Optional[torch.Tensor] = None):
    """Row max (for stability) and LSE; rows without a finite max keep their NaN/inf nature.

    With `sink` (broadcastable (B, H, 1, 1)): m = max(max_j s_j, sink), l = exp(sink - m) + sum_j exp(s_j - m),
    LSE = m + log(l); a row without visible keys gets l = 1 and LSE = sink. Returns (e, l, lse, e_sink)."""
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.expand_as(m))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m_safe)
    l = e.sum(dim=-1, keepdim=True)
    e_sink = None
    if sink is not None:
        e_sink = torch.exp(sink - m_safe)
        l = l + e_sink
    lse = m_safe + torch.log(l)  # l == 0 -> -inf (fully masked); NaN/inf propagate
    return e, l, lse, e_sink


def _sink(p: _Params):
    return None if p.sinks is None else p.sinks[None, :, None, None]


def _nonfinite_pv(weights_on: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Apply what the mathematics says when visible values are inf/NaN: w * inf with w > 0 is inf,
    inf + (-inf) and anything with NaN is NaN. Masked (weight exactly 0) values never contribute."""
    on = weights_on.to(_F64)
    n_nan = torch.matmul(on, torch.isnan(v).to(_F64))
    n_pos = torch.matmul(on, (v == math.inf).to(_F64))
    n_neg = torch.matmul(on, (v == -math.inf).to(_F64))
    out = torch.where(n_neg > 0, torch.full_like(out, -math.inf), out)
    out = torch.where(n_pos > 0, torch.full_like(out, math.inf), out)
    return torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), torch.full_like(out, math.nan), out)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _prep(q, k, v, p: _Params):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"reference: q, k, v must be 4-D BHSD tensors; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    b, hq, lq, d = q.shape
    bk, hkv, lk, dk = k.shape
    if (bk, hkv, lk) != tuple(v.shape[:3]) or bk != b or dk != d:
        raise ValueError(
            f"reference: shapes do not fit BHSD: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"reference: Hq={hq} must be a multiple of Hkv={hkv}")
    return b, hq, hkv, lq, lk


def _dense_forward(q, k, v, p: _Params, block_q=None) -> ReferenceResult:
    b, hq, hkv, lq, lk = _prep(q, k, v, p)
    q, k, v = q.to(_F64), _expand_kv(k.to(_F64), hq // hkv), _expand_kv(v.to(_F64), hq // hkv)
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=_F64, device=q.device)
    lse = torch.full((b, hq, lq), -math.inf, dtype=_F64, device=q.device)
    if lq == 0 or lk == 0:
        if p.sinks is not None and lq > 0:  # no key at all: out 0, LSE = the sink
            lse = p.sinks[None, :, None].expand(b, hq, lq).clone()
        return ReferenceResult(out, lse)
    v_finite = bool(torch.isfinite(v).all())
    v_clean = v if v_finite else torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    rows = _block_rows(b, hq, lk, block_q)
    for i0 in range(0, lq, rows):
        i1 = min(lq, i0 + rows)
        s, _, _ = _scores(q[:, :, i0:i1], k, i0, i1, lq, lk, p)
        e, l, lse_b, _ = _row_stats(s, _sink(p))
        prob = e / torch.where(l > 0, l, torch.ones_like(l))
        if p.keep is not None:
            prob = prob * p.keep[:, :, i0:i1].to(_F64) / (1.0 - p.dropout_p)
        o = torch.matmul(prob, v_clean)
        if not v_finite:
            on = s > -math.inf
            if p.keep is not None:
                on = on & p.keep[:, :, i0:i1]
            o = _nonfinite_pv(on, v, o)
        out[:, :, i0:i1] = o
        lse[:, :, i0:i1] = lse_b.squeeze(-1)
    return ReferenceResult(out, lse)


def _dense_backward(q, k, v, p: _Params, d_out, d_lse=None, block_q=None) -> ReferenceGrads:
    b, hq, hkv, lq, lk = _prep(q, k, v, p)
    g = hq // hkv
    q, k, v = q.to(_F64), _expand_kv(k.to(_F64), g), _expand_kv(v.to(_F64), g)
    d_out = d_out.to(_F64)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dsinks = None if p.sinks is None else torch.zeros(hq, dtype=_F64, device=q.device)
    if dsinks is not None and lk == 0 and d_lse is not None:  # no key: LSE = sink
        dsinks += d_lse.to(_F64).sum(dim=(0, 2)) * torch.isfinite(p.sinks)  # (a -inf sink: none)
    if lq > 0 and lk > 0:
        rows = _block_rows(b, hq, lk, block_q)
        for i0 in range(0, lq, rows):
            i1 = min(lq, i0 + rows)
            qb = q[:, :, i0:i1]
            s, s_pre, _ = _scores(qb, k, i0, i1, lq, lk, p)
            e, l, _, e_sink = _row_stats(s, _sink(p))
            prob = e / torch.where(l > 0, l, torch.ones_like(l))
            on = s > -math.inf
            do = d_out[:, :, i0:i1]
            dprob_dropped = torch.matmul(do, v.transpose(-1, -2))
            if p.keep is not None:
                kf = p.keep[:, :, i0:i1].to(_F64) / (1.0 - p.dropout_p)
                dv += torch.matmul((prob * kf).transpose(-1, -2), do)
                dprob = dprob_dropped * kf
            else:
                dv += torch.matmul(prob.transpose(-1, -2), do)
                dprob = dprob_dropped
            dprob = torch.where(on, dprob, torch.zeros_like(dprob))
            delta = (prob * dprob).sum(-1, keepdim=True)
            if dsinks is not None:  # d out_i / d sink = -P_sink,i out_i; d lse_i / d sink = P_sink,i
                p_sink = e_sink / torch.where(l > 0, l, torch.ones_like(l))
                g_sink = -delta if d_lse is None else d_lse.to(_F64)[:, :, i0:i1].unsqueeze(-1) - delta
                dsinks += (p_sink * g_sink).sum(dim=(0, 2, 3))
            ds = prob * (dprob - delta)
            if d_lse is not None:
                ds = ds + prob * d_lse.to(_F64)[:, :, i0:i1].unsqueeze(-1)
            if p.softcap is not None:
                t = torch.tanh(s_pre / p.softcap)
                ds = ds * (1.0 - t * t)
            ds = torch.where(on, ds, torch.zeros_like(ds)) * p.scale
            dq[:, :, i0:i1] = torch.matmul(ds, k)
            dk += torch.matmul(ds.transpose(-1, -2), qb)
    if g > 1:
        dk = dk.reshape(b, hkv, g, lk, dk.shape[-1]).sum(2)  # explicit sizes: lk may be 0
        dv = dv.reshape(b, hkv, g, lk, dv.shape[-1]).sum(2)
    return ReferenceGrads(dq, dk, dv, dsinks)
