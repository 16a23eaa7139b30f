"""The float64 reference: exact attention with every semantic of SPEC.md.

    from attnverify.reference import reference_forward, reference_backward
    res = reference_forward(q, k, v, spec)                 # .out (B,Hq,Lq,Dv) and .lse (B,Hq,Lq), float64
    grads = reference_backward(q, k, v, spec, d_out, d_lse)  # .dq .dk .dv, float64

Also `online_softmax`, the algorithm's running-max model over arbitrary key-tile partitions.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec import Spec
from ..timesplit import timed
from ._exact import ReferenceGrads, ReferenceResult, _dense_backward, _dense_forward, _Params
from .online import OnlineState, online_softmax

__all__ = [
    "reference_forward",
    "reference_backward",
    "ReferenceResult",
    "ReferenceGrads",
    "online_softmax",
    "OnlineState",
    "visible_counts",
]


def _params(spec: Spec, q: torch.Tensor, attn_mask, keep, b: int, hq: int) -> _Params:
    alibi = None
    if spec.alibi_slopes is not None:
        a = torch.as_tensor(spec.alibi_slopes).to(device=q.device, dtype=torch.float64)
        if a.dim() == 1:
            if a.shape[0] != hq:
                raise ValueError(f"spec.alibi_slopes has shape {tuple(a.shape)}; expected ({hq},) or ({b}, {hq})")
            a = a.unsqueeze(0).expand(b, hq)
        elif tuple(a.shape) != (b, hq):
            raise ValueError(f"spec.alibi_slopes has shape {tuple(a.shape)}; expected ({hq},) or ({b}, {hq})")
        alibi = a
    mask = None
    if attn_mask is not None:
        mask = torch.as_tensor(attn_mask).to(q.device)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    if keep is not None and spec.dropout_p == 0:
        keep = None
    sinks = None
    if spec.sinks is not None:
        sinks = torch.as_tensor(spec.sinks).to(device=q.device, dtype=torch.float64).reshape(-1)
        if sinks.shape[0] != hq:
            raise ValueError(f"spec.sinks has shape {tuple(spec.sinks.shape)}; expected ({hq},), one logit per query head")
    return _Params(
        scale=spec.resolved_scale(q.shape[-1]),
        causal=spec.causal,
        window=spec.window,
        softcap=spec.softcap,
        alibi=alibi,
        mask=mask,
        dropout_p=float(spec.dropout_p),
        keep=keep,
        sinks=sinks,
        chunk=spec.attention_chunk,
    )


def _check_keep(spec: Spec, keep, shape):
    if spec.dropout_p > 0 and keep is None:
        raise ValueError(
            "reference: spec.dropout_p > 0 needs the keep-mask (dropout_mask=...) to be exact; "
            "check dropout statistically when the adapter does not return it"
        )
    if keep is not None and spec.dropout_p > 0 and tuple(keep.shape) != tuple(shape):
        raise ValueError(f"reference: dropout_mask has shape {tuple(keep.shape)}; expected {tuple(shape)}")


def _segments(spec: Spec):
    cq = [int(x) for x in torch.as_tensor(spec.cu_seqlens_q).tolist()]
    ck = [int(x) for x in torch.as_tensor(spec.cu_seqlens_k).tolist()]
    if len(cq) != len(ck) or len(cq) < 1:
        raise ValueError("spec.cu_seqlens_q and spec.cu_seqlens_k must have the same length n+1 >= 1")
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(f"spec.{name}={c} must start at 0 and never decrease")
    return list(zip(cq, cq[1:], ck, ck[1:]))


def _seg_params(base: _Params, keep, q0, q1, k0, k1) -> _Params:
    return _Params(
        base.scale, base.causal, base.window, base.softcap, base.alibi, None, base.dropout_p,
        None if keep is None else keep[:, :, q0:q1, k0:k1], base.sinks, base.chunk,
    )


@timed("reference")
def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: Spec = Spec(),
    *,
    dropout_mask: Optional[torch.Tensor] = None,
    block_q: Optional[int] = None,
) -> ReferenceResult:
    """Exact attention in float64. Inputs of any dtype are upcast exactly. A KV-cache call (spec.cache_seqlens;
    k and v are caches) attends each batch to its gathered keys (reference.paged). fp8 descales (attnverify/fp8.py)
    multiply the upcast inputs exactly: q * q_descale[b, h // g], k * k_descale[b, h], v * v_descale[b, h]."""
    if spec.has_descales:
        from ..fp8 import descaled

        q, k, v, spec = descaled(q, k, v, spec)
    if spec.cache_seqlens is not None:
        from .paged import cache_forward

        return cache_forward(q, k, v, spec, lambda *a: reference_forward(*a, block_q=block_q))
    b, hq, lq = q.shape[0], q.shape[1], q.shape[2]
    _check_keep(spec, dropout_mask, (b, hq, lq, k.shape[2]))
    p = _params(spec, q, spec.attn_mask, dropout_mask, b, hq)
    if not spec.is_varlen:
        return _dense_forward(q, k, v, p, block_q)
    if b != 1:
        raise ValueError(f"reference: varlen packs need B == 1, got B={b}")
    if spec.attn_mask is not None:
        raise ValueError("reference: attn_mask together with varlen is not part of the semantics")
    out = torch.zeros(1, hq, lq, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((1, hq, lq), float("-inf"), dtype=torch.float64, device=q.device)
    for q0, q1, k0, k1 in _segments(spec):
        if q1 == q0:
            continue
        r = _dense_forward(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], _seg_params(p, p.keep, q0, q1, k0, k1), block_q
        )
        out[:, :, q0:q1], lse[:, :, q0:q1] = r.out, r.lse
    return ReferenceResult(out, lse)


@timed("reference")
def reference_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: Spec,
    d_out: torch.Tensor,
    d_lse: Optional[torch.Tensor] = None,
    *,
    dropout_mask: Optional[torch.Tensor] = None,
    block_q: Optional[int] = None,
) -> ReferenceGrads:
    """Gradients of <out, d_out> + <lse, d_lse> with respect to q, k, v, in float64."""
    if spec.has_descales:
        raise ValueError("reference_backward: calls with q_descale/k_descale/v_descale (fp8) are forward only "
                         "(docs/adapters.md); drop the descales or check the forward")
    b, hq, lq = q.shape[0], q.shape[1], q.shape[2]
    _check_keep(spec, dropout_mask, (b, hq, lq, k.shape[2]))
    p = _params(spec, q, spec.attn_mask, dropout_mask, b, hq)
    if not spec.is_varlen:
        return _dense_backward(q, k, v, p, d_out, d_lse, block_q)
    if spec.attn_mask is not None:
        raise ValueError("reference: attn_mask together with varlen is not part of the semantics")
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=q.device)
    dsinks = None if p.sinks is None else torch.zeros(hq, dtype=torch.float64, device=q.device)
    for q0, q1, k0, k1 in _segments(spec):
        if q1 == q0 or (k1 == k0 and dsinks is None):  # rows without keys: LSE = sink still has a gradient
            continue
        g = _dense_backward(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], _seg_params(p, p.keep, q0, q1, k0, k1),
            d_out[:, :, q0:q1], None if d_lse is None else d_lse[:, :, q0:q1], block_q,
        )
        dq[:, :, q0:q1] = g.dq
        if k1 > k0:
            dk[:, :, k0:k1], dv[:, :, k0:k1] = g.dk, g.dv
        if dsinks is not None:
            dsinks += g.dsinks
    return ReferenceGrads(dq, dk, dv, dsinks)


def visible_counts(lq: int, lk: int, spec: Spec, batch: int = 1, heads: int = 1) -> torch.Tensor:
    """Number of visible keys per query row (B, H, Lq), from the positional, boolean and -inf masks.

    Used by reports ("worst rows with their count of visible keys") and by strategies.
    """
    q = torch.zeros(batch, heads, lq, 1, dtype=torch.float64)
    k = torch.zeros(batch, 1, lk, 1, dtype=torch.float64)
    v = torch.ones(batch, 1, lk, 1, dtype=torch.float64)
    mask = spec.attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > float("-inf")  # an additive mask hides a key only with -inf
    no_cap = spec.replace(softcap=None, alibi_slopes=None, dropout_p=0.0, scale=1.0, attn_mask=mask)
    r = reference_forward(q, k.expand(batch, heads, lk, 1), v.expand(batch, heads, lk, 1), no_cap)
    return torch.where(torch.isfinite(r.lse), torch.exp(r.lse), torch.zeros_like(r.lse)).round().to(torch.int64)
