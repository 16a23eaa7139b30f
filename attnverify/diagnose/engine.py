"""The diagnosis' float64 attention engine with knobs: the SPEC's semantics by default (== reference_forward,
which tests hold it to), or an alternative (a `Variant`): another causal alignment, the diagonal excluded,
a window bound moved, another scale or softcap order, GQA interleaved, K/V of another slice, padded tail
keys counted, the last key tile skipped, fully-masked rows as NaN/mean(V)/unmasked, LSE in base 2 or
without the max, dropout not rescaled, the online softmax without its rescale.

Visibility comes from attnverify.visibility (not from the reference, which keeps its own copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from ..reference import online_softmax
from ..reference.online import OnlineState
from ..visibility import segments, visible

F64 = torch.float64
_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Variant:
    scale: Optional[float] = None  # None: the spec's (resolved) scale
    softcap: Optional[float] = -1.0  # -1: the spec's
    causal: Optional[str] = None  # None: the spec's
    strict_diag: bool = False  # causal bound j < diag instead of j <= diag
    window: Optional[Tuple[int, int]] = (-2, -2)  # (-2, -2): the spec's
    kv_map: str = "grouped"  # grouped | interleaved
    kv_source: Optional[Tuple[int, int]] = None  # every (b, h) reads K/V of (b', hkv')
    pad_to: Optional[int] = None  # keys padded with zeros up to a multiple of this, and counted
    skip_last_tile: Optional[int] = None  # keys of the last tile of this size never seen
    fully_masked: str = "zeros"  # zeros | nan | mean_v | unmasked
    dropout_rescale: bool = True
    lse_mode: str = "e"  # e | base2 | no_max
    online: Optional[Tuple[int, str]] = None  # (tile, "no_rescale" | "no_rescale_acc" | "no_rescale_sum")
    descale_ignored: Optional[str] = None  # "q" | "k" | "v": that fp8 descale taken as 1
    sink: str = "spec"  # spec | ignored (no sink) | numerator (the sink's value row is 1, not 0)
    # chunked local attention (Spec.attention_chunk): spec | ignored | early / late (every chunk boundary one key
    # early / late) | next_position (the query's chunk taken at p + 1) | top_left (chunks of the query index i, not
    # of its position i + Lk - Lq) | packed (positions counted in the packed batch: the segment's or batch's key
    # offset not subtracted) | last_partial_free (no chunk limit in a segment's last, partial chunk)
    chunk: str = "spec"
    # MLA's absorbed form (V = K[..., :Dv], one latent): spec | v_last (V read from K's last Dv columns) |
    # rope_dropped (the scores from the first Dv columns of q and K only: the rope columns left out)
    latent: str = "spec"


def _segments(spec, lq: int, lk: int):
    if spec.cu_seqlens_q is None:
        return [(0, lq, 0, lk)]
    return segments(spec.cu_seqlens_q, spec.cu_seqlens_k)


def _positions(spec, lq: int, lk: int, lk_total: int):
    """Per-row and per-column segment geometry: local indices, the row's diagonal offset, same-segment."""
    qi = torch.zeros(lq, dtype=F64)
    diag_off = torch.zeros(lq, dtype=F64)
    qseg = torch.full((lq,), -1, dtype=torch.long)
    kj = torch.arange(lk_total, dtype=F64)
    kseg = torch.zeros(lk_total, dtype=torch.long)
    segs = _segments(spec, lq, lk)
    if len(segs) == 1 and spec.cu_seqlens_q is None:
        qi = torch.arange(lq, dtype=F64)
        diag_off[:] = lk - lq
        qseg[:] = 0
    else:
        kseg[:] = -2
        for n, (q0, q1, k0, k1) in enumerate(segs):
            qi[q0:q1] = torch.arange(q1 - q0, dtype=F64)
            diag_off[q0:q1] = (k1 - k0) - (q1 - q0)
            qseg[q0:q1] = n
            kj[k0:k1] = torch.arange(k1 - k0, dtype=F64)
            kseg[k0:k1] = n
    same = qseg[:, None] == kseg[None, :]
    return qi, diag_off, kj, same


def final_scores(q, k, spec, var: Variant, lq: int, lk: int, pad: int):
    """(B, Hq, Lq, Lk+pad) scores with -inf where hidden, and the visibility that ignores masks (for
    'unmasked' fully-masked rows)."""
    d = q.shape[-1]
    scale = spec.resolved_scale(d) if var.scale is None else var.scale
    cap = spec.softcap if var.softcap == -1.0 else var.softcap
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    lk_tot = lk + pad
    qi, off, kj, same = _positions(spec, lq, lk, lk_tot)
    diag = qi[:, None] + off[:, None]  # (Lq, 1)
    j = kj[None, :]
    if spec.alibi_slopes is not None:
        a = torch.as_tensor(spec.alibi_slopes).to("cpu", F64)
        b, hq = q.shape[0], q.shape[1]
        a = a.view(1, hq).expand(b, hq) if a.dim() == 1 else a.view(b, hq)
        s = s - a[:, :, None, None] * (diag - j).abs()
    causal = spec.causal if var.causal is None else var.causal
    window = spec.window if var.window == (-2, -2) else var.window
    chunk = spec.attention_chunk
    vis = same & visible(qi[:, None], j, diag, causal, window, strict_diag=var.strict_diag,
                         chunk=chunk if var.chunk == "spec" else None)
    if chunk and var.chunk not in ("spec", "ignored"):
        vis = same & vis & _chunk_variant(spec, var.chunk, chunk, qi[:, None], j, diag, q.shape[0], lq, lk)
    if var.skip_last_tile:
        start = ((lk - 1) // var.skip_last_tile) * var.skip_last_tile if lk else 0
        vis[:, start:lk] = False
    positional = vis.clone()
    vis4 = vis.expand(q.shape[0], q.shape[1], lq, lk_tot)
    if spec.attn_mask is not None:
        m = torch.as_tensor(spec.attn_mask).to("cpu")
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m.expand(q.shape[0], q.shape[1], lq, lk)
        if pad:
            fill = torch.ones if m.dtype == torch.bool else torch.zeros
            m = torch.cat([m, fill(*m.shape[:3], pad, dtype=m.dtype)], dim=-1)
        if m.dtype == torch.bool:
            vis4 = vis4 & m
        else:
            s = s + m.to(F64)
    s = torch.where(vis4, s, torch.full_like(s, -math.inf))
    return s, positional


def _chunk_variant(spec, mode, c, i, j, diag, b, lq, lk):
    """The chunk restriction of a wrong chunk variant: (Lq, Lk) or, for `packed`, (B, 1, Lq, Lk)."""
    fl = lambda x: torch.div(x, c, rounding_mode="floor")  # noqa: E731
    if mode in ("early", "late"):
        start = fl(diag) * c + (-1 if mode == "early" else 1)
        return (j >= start) & (j < start + c)
    if mode == "next_position":
        return fl(j) == fl(diag + 1)
    if mode == "top_left":
        return fl(j) == fl(i)
    seg_k0 = torch.zeros(lq, 1, dtype=F64)  # each row's segment: its first key in the pack, its number of keys
    seg_lk = torch.full((lq, 1), float(lk), dtype=F64)
    if spec.cu_seqlens_q is not None:
        for q0, q1, k0, k1 in segments(spec.cu_seqlens_q, spec.cu_seqlens_k):
            seg_k0[q0:q1], seg_lk[q0:q1] = float(k0), float(k1 - k0)
    if mode == "packed":
        if spec.cu_seqlens_q is None:  # a padded batch counted as one pack: batch b's keys start at b * Lk
            seg_k0 = (torch.arange(b, dtype=F64) * lk).view(b, 1, 1, 1)
        return fl(j + seg_k0) == fl(diag + seg_k0)
    if mode == "last_partial_free":
        tail = (seg_lk % c != 0) & (fl(diag) * c >= fl(seg_lk) * c)
        return (fl(j) == fl(diag)) | tail
    raise ValueError(f"Variant(chunk={mode!r})")


def expand_kv(k, v, hq: int, var: Variant):
    b, hkv = k.shape[0], k.shape[1]
    if var.kv_source is not None:
        sb, sh = var.kv_source
        k = k[sb:sb + 1, sh:sh + 1].expand(b, hkv, *k.shape[2:])
        v = v[sb:sb + 1, sh:sh + 1].expand(b, hkv, *v.shape[2:])
    g = hq // hkv
    if g == 1:
        return k, v
    if var.kv_map == "interleaved":
        idx = torch.arange(hq) % hkv
    else:
        idx = torch.arange(hq) // g
    return k[:, idx], v[:, idx]


def alternative_forward(q, k, v, spec, var: Variant = Variant(), keep=None):
    """(out, lse) in float64 under the variant semantics (default Variant: the SPEC's, == reference)."""
    q, k, v = (t.detach().to("cpu") for t in (q, k, v))
    if spec.has_descales:  # fp8: the upcast inputs times their descales (attnverify.fp8), one of them left out
        from ..fp8 import descaled

        drop = {f"{var.descale_ignored}_descale": None} if var.descale_ignored else {}
        q, k, v, spec = descaled(q, k, v, spec.replace(**drop))
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    if var.latent == "v_last":
        v = k[..., k.shape[-1] - v.shape[-1]:]
    elif var.latent == "rope_dropped":
        q, k = q[..., :v.shape[-1]], k[..., :v.shape[-1]]
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    k, v = expand_kv(k, v, hq, var)
    pad = 0
    if var.pad_to and lk % var.pad_to and spec.cu_seqlens_q is None:
        pad = var.pad_to - lk % var.pad_to
        k = torch.cat([k, torch.zeros(*k.shape[:2], pad, k.shape[3], dtype=F64)], dim=2)
        v = torch.cat([v, torch.zeros(*v.shape[:2], pad, v.shape[3], dtype=F64)], dim=2)
    s, positional = final_scores(q, k, spec, var, lq, lk, pad)
    sink = int(spec.sinks is not None and var.sink != "ignored")
    if sink:  # one more key of score sink_h whose value row is 0 (1 when the sink is added to the numerator)
        logits = torch.as_tensor(spec.sinks).to("cpu", F64).reshape(1, hq, 1, 1).expand(b, hq, lq, 1)
        s = torch.cat([s, logits], dim=-1)
        v = torch.cat([v, torch.full((b, hq, 1, v.shape[3]), float(var.sink == "numerator"), dtype=F64)], dim=2)
    if var.online is not None:
        tile, mode = var.online
        bounds = list(range(0, lk + pad, tile)) + [lk + pad] + ([lk + pad + 1] if sink else [])
        st = online_softmax(s, v, sorted(set(bounds)), update=ONLINE_UPDATES[mode])
        out, lse = st.output(), st.lse()
    else:
        m = s.amax(-1, keepdim=True)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m_safe)
        l = e.sum(-1, keepdim=True)
        lse = (m_safe + torch.log(l)).squeeze(-1)
        p = e / torch.where(l > 0, l, torch.ones_like(l))
        if keep is not None and spec.dropout_p > 0:
            kp = keep.to("cpu", F64)
            if pad + sink:  # padded keys and the sink are never dropped
                kp = torch.cat([kp, torch.ones(*kp.shape[:3], pad + sink, dtype=F64)], dim=-1)
            p = p * kp
            if var.dropout_rescale:
                p = p / (1.0 - spec.dropout_p)
        v_clean = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
        out = torch.matmul(p, v_clean)
        if not bool(torch.isfinite(v).all()):  # what the mathematics says for inf/NaN values
            on = (s > -math.inf).to(F64)
            n_nan = torch.matmul(on, torch.isnan(v).to(F64))
            n_pos = torch.matmul(on, (v == math.inf).to(F64))
            n_neg = torch.matmul(on, (v == -math.inf).to(F64))
            out = torch.where(n_neg > 0, torch.full_like(out, -math.inf), out)
            out = torch.where(n_pos > 0, torch.full_like(out, math.inf), out)
            out = torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), torch.full_like(out, math.nan), out)
        if var.lse_mode == "no_max":
            lse = torch.where(torch.isfinite(lse), lse - m_safe.squeeze(-1), lse)
    fm = torch.isneginf(lse) if var.online is None else (st.l.squeeze(-1) == 0)
    if bool(fm.any()) and var.fully_masked != "zeros":
        out, lse = _fully_masked_variant(q, k[:, :, :lk], v[:, :, :lk], s, positional, spec, var, fm, out, lse, lq, lk)
    if var.lse_mode == "base2":
        lse = lse * _LOG2E
    return out[:, :, :, :], lse


def _fully_masked_variant(q, k, v, s, positional, spec, var, fm, out, lse, lq, lk):
    fm4 = fm.unsqueeze(-1)
    if var.fully_masked == "nan":
        return torch.where(fm4, torch.full_like(out, math.nan), out), torch.where(fm, torch.full_like(lse, math.nan), lse)
    _, _, _, same = _positions(spec, lq, lk, lk)
    if var.fully_masked == "mean_v":  # uniform weights over the keys of the row's segment
        w = same.to(F64).expand(q.shape[0], q.shape[1], lq, lk)
        n = w.sum(-1, keepdim=True)
        alt = torch.matmul(w / torch.where(n > 0, n, torch.ones_like(n)), v)
        alt_lse = torch.where(n.squeeze(-1) > 0, torch.log(n.squeeze(-1)), torch.full_like(lse, -math.inf))
    else:  # unmasked: the row attends every key of its segment as if nothing hid them
        var2 = replace(var, causal="none", window=None, skip_last_tile=None, fully_masked="zeros", pad_to=None,
                       online=None, lse_mode="e", kv_source=None, kv_map="grouped")
        spec2 = spec.replace(causal="none", window=None, attn_mask=None, dropout_p=0.0)
        g = q.shape[1] // k.shape[1]
        alt, alt_lse = alternative_forward(q, k[:, ::g] if g > 1 else k, v[:, ::g] if g > 1 else v, spec2, var2)
    return torch.where(fm4, alt, out), torch.where(fm, alt_lse, lse)


def online_update(rescale_acc: bool, rescale_sum: bool):
    """An online-softmax step that rescales the accumulator and/or the sum (both: the correct update)."""
    def step(st, s, v):
        m_new = torch.maximum(st.m, s.amax(-1, keepdim=True))
        live = m_new > -math.inf
        m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(live, torch.exp(st.m - m_safe), torch.ones_like(m_new))
        one = torch.ones_like(alpha)
        p = torch.exp(s - m_safe)
        l = (alpha if rescale_sum else one) * st.l + p.sum(-1, keepdim=True)
        a = (alpha if rescale_acc else one) * st.a + torch.matmul(p, v)
        return OnlineState(m=m_new, l=l, a=a)

    return step


ONLINE_UPDATES = {"no_rescale": online_update(False, False), "no_rescale_acc": online_update(False, True), "no_rescale_sum": online_update(True, False)}
