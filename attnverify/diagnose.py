"""Diagnosis of a failed check: which alternative semantics explain what the adapter returned.

    from attnverify.diagnose import diagnose, diagnose_result
    d = diagnose_result(check_result)          # a CheckResult from av.check (kept tensors)
    d = diagnose(case, {"out": out, "lse": lse}, declared_fully_masked="zeros", tiles=(64, 64))
    print(d.summary)                           # "scale missing (1.0 used instead of 0.125)" / "no simple explanation"

Method: the case is recomputed in float64 under each alternative semantics (the other causal
alignment, diagonal excluded, window bound off by one, scale missing/doubled/default, softcap before
scale, GQA interleaved, fully-masked rows as NaN/mean(V)/unmasked, LSE base 2, dropout not rescaled,
a batch or head reading another's K/V, padded tail keys counted, last key tile skipped, the online
softmax without its rescale). An alternative *explains* the output when the adapter's output is within
a few tolerances of it, much closer than to the reference, and NaN/Inf sit in the same places.
When none does, error signatures are measured (concentrated in the last key tile, only where the
running max jumps, growing with the number of keys summed, confined to some heads or to fully-masked
rows). When nothing fits the summary says "no simple explanation".

Pure functions of tensors and records: no pytest, no adapter calls, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .reference import online_softmax, reference_forward
from .tolerances import tolerance_for

NO_EXPLANATION = "no simple explanation"
TILE_CANDIDATES = (16, 32, 64, 128)
MAX_ELEMENTS = 2**23  # B*Hq*Lq*Lk of the float64 score tensor a diagnosis may build
_F64 = torch.float64
_LOG2E = 1.0 / math.log(2.0)


# ----------------------------------------------------------------------------------------------
# records


@dataclass
class Explanation:
    key: str  # stable id, e.g. "scale_missing"
    title: str  # what the adapter most likely does, in words
    residual: float  # rel L2 of the adapter's output against this alternative (worst over the outputs)
    ref_residual: float  # the same against the reference
    fits: bool
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Signature:
    key: str
    title: str
    strength: float  # 0..1, how strongly the error shows this pattern
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Diagnosis:
    summary: str  # the named explanation, a signature, or NO_EXPLANATION
    explanations: List[Explanation] = field(default_factory=list)  # every alternative tried, best first
    signatures: List[Signature] = field(default_factory=list)  # the ones that were observed
    notes: List[str] = field(default_factory=list)

    @property
    def explained(self) -> bool:
        return any(e.fits for e in self.explanations)

    @property
    def best(self) -> Optional[Explanation]:
        fit = [e for e in self.explanations if e.fits]
        return fit[0] if fit else None

    def to_dict(self) -> dict:
        return {
            "summary": self.summary,
            "explained": self.explained,
            "explanations": [e.to_dict() for e in self.explanations],
            "signatures": [s.to_dict() for s in self.signatures],
            "notes": list(self.notes),
        }

    def text(self) -> str:
        lines = [f"diagnosis: {self.summary}"]
        for e in self.explanations:
            if e.fits:
                lines.append(f"  fits: {e.title} (residual {e.residual:.2e} vs {e.ref_residual:.2e} against the reference)")
        for s in self.signatures:
            lines.append(f"  signature: {s.title}" + (f" ({s.detail})" if s.detail else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the float64 engine with knobs (default knobs == reference_forward; tests hold it to that)


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


def _segments(spec, lq: int, lk: int):
    if spec.cu_seqlens_q is None:
        return [(0, lq, 0, lk)]
    cq = [int(x) for x in torch.as_tensor(spec.cu_seqlens_q).tolist()]
    ck = [int(x) for x in torch.as_tensor(spec.cu_seqlens_k).tolist()]
    return list(zip(cq, cq[1:], ck, ck[1:]))


def _positions(spec, lq: int, lk: int, lk_total: int):
    """Per-row and per-column segment geometry: local indices, the row's diagonal offset, same-segment."""
    qi = torch.zeros(lq, dtype=_F64)
    diag_off = torch.zeros(lq, dtype=_F64)
    qseg = torch.full((lq,), -1, dtype=torch.long)
    kj = torch.arange(lk_total, dtype=_F64)
    kseg = torch.zeros(lk_total, dtype=torch.long)
    segs = _segments(spec, lq, lk)
    if len(segs) == 1 and spec.cu_seqlens_q is None:
        qi = torch.arange(lq, dtype=_F64)
        diag_off[:] = lk - lq
        qseg[:] = 0
    else:
        kseg[:] = -2
        for n, (q0, q1, k0, k1) in enumerate(segs):
            qi[q0:q1] = torch.arange(q1 - q0, dtype=_F64)
            diag_off[q0:q1] = (k1 - k0) - (q1 - q0)
            qseg[q0:q1] = n
            kj[k0:k1] = torch.arange(k1 - k0, dtype=_F64)
            kseg[k0:k1] = n
    same = qseg[:, None] == kseg[None, :]
    return qi, diag_off, kj, same


def _final_scores(q, k, spec, var: Variant, lq: int, lk: int, pad: int):
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
        a = torch.as_tensor(spec.alibi_slopes).to("cpu", _F64)
        b, hq = q.shape[0], q.shape[1]
        a = a.view(1, hq).expand(b, hq) if a.dim() == 1 else a.view(b, hq)
        s = s - a[:, :, None, None] * (diag - j).abs()
    vis = same.clone()
    causal = spec.causal if var.causal is None else var.causal
    if causal == "top_left":
        vis &= (j < qi[:, None]) if var.strict_diag else (j <= qi[:, None])
    elif causal == "bottom_right":
        vis &= (j < diag) if var.strict_diag else (j <= diag)
    window = spec.window if var.window == (-2, -2) else var.window
    if window is not None:
        left, right = window
        if left >= 0:
            vis &= j >= diag - left
        if right >= 0:
            vis &= j <= diag + right
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
            s = s + m.to(_F64)
    s = torch.where(vis4, s, torch.full_like(s, -math.inf))
    return s, positional


def _expand_kv(k, v, hq: int, var: Variant):
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
    q = q.detach().to("cpu", _F64)
    k = k.detach().to("cpu", _F64)
    v = v.detach().to("cpu", _F64)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    k, v = _expand_kv(k, v, hq, var)
    pad = 0
    if var.pad_to and lk % var.pad_to and spec.cu_seqlens_q is None:
        pad = var.pad_to - lk % var.pad_to
        k = torch.cat([k, torch.zeros(*k.shape[:2], pad, k.shape[3], dtype=_F64)], dim=2)
        v = torch.cat([v, torch.zeros(*v.shape[:2], pad, v.shape[3], dtype=_F64)], dim=2)
    s, positional = _final_scores(q, k, spec, var, lq, lk, pad)
    if var.online is not None:
        tile, mode = var.online
        st = online_softmax(s, v, list(range(0, lk + pad, tile)) + [lk + pad], update=_UPDATES[mode])
        out, lse = st.output(), st.lse()
    else:
        m = s.amax(-1, keepdim=True)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m_safe)
        l = e.sum(-1, keepdim=True)
        lse = (m_safe + torch.log(l)).squeeze(-1)
        p = e / torch.where(l > 0, l, torch.ones_like(l))
        if keep is not None and spec.dropout_p > 0:
            kp = keep.to("cpu", _F64)
            if pad:
                kp = torch.cat([kp, torch.ones(*kp.shape[:3], pad, dtype=_F64)], dim=-1)
            p = p * kp
            if var.dropout_rescale:
                p = p / (1.0 - spec.dropout_p)
        v_clean = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
        out = torch.matmul(p, v_clean)
        if not bool(torch.isfinite(v).all()):  # what the mathematics says for inf/NaN values
            on = (s > -math.inf).to(_F64)
            n_nan = torch.matmul(on, torch.isnan(v).to(_F64))
            n_pos = torch.matmul(on, (v == math.inf).to(_F64))
            n_neg = torch.matmul(on, (v == -math.inf).to(_F64))
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
        w = same.to(_F64).expand(q.shape[0], q.shape[1], lq, lk)
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


def _upd(rescale_acc: bool, rescale_sum: bool):
    def step(st, s, v):
        from .reference.online import OnlineState

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


_UPDATES = {"no_rescale": _upd(False, False), "no_rescale_acc": _upd(False, True), "no_rescale_sum": _upd(True, False)}


# ----------------------------------------------------------------------------------------------
# measuring fit


def _f64(t) -> Optional[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return None
    return t.detach().to("cpu", _F64)


def _residual(obs: torch.Tensor, alt: torch.Tensor) -> Tuple[float, int]:
    """(relative L2 over elements finite in both, number of elements whose NaN/Inf pattern differs)."""
    if obs.shape != alt.shape:
        if obs.numel() != alt.numel():
            return math.inf, max(obs.numel(), alt.numel())
        obs = obs.reshape(alt.shape)
    fo, fa = torch.isfinite(obs), torch.isfinite(alt)
    same_nf = (torch.isnan(obs) & torch.isnan(alt)) | (torch.isinf(obs) & torch.isinf(alt) & (torch.sign(obs) == torch.sign(alt)))
    bad_nf = int(((~fo | ~fa) & ~same_nf).sum())
    both = fo & fa
    d = torch.where(both, obs - alt, torch.zeros_like(alt))
    n = torch.where(both, alt, torch.zeros_like(alt)).norm()
    dn = float(d.norm())
    if float(n) == 0:
        return (0.0 if dn == 0 else math.inf), bad_nf
    return dn / float(n), bad_nf


def _score(obs: Dict[str, torch.Tensor], alt: Dict[str, torch.Tensor], names) -> Tuple[float, int]:
    worst, nf = 0.0, 0
    for n in names:
        r, b = _residual(obs[n], alt[n])
        worst = max(worst, r)
        nf += b
    return worst, nf


# ----------------------------------------------------------------------------------------------
# the alternatives


def _alternatives(case, spec, tiles: Sequence[int], declared_fm: str, has_keep: bool, has_fm: bool):
    """(key, title, Variant) for every alternative that differs from the SPEC for this case."""
    q, k, v = case.q, case.k, case.v
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    alts = []
    base_fm = declared_fm if declared_fm in ("zeros", "nan") else "zeros"
    V = lambda **kw: Variant(fully_masked=base_fm, **kw)  # noqa: E731
    if spec.causal == "top_left" and lq != lk:
        alts.append(("causal_bottom_right", "causal mask aligned bottom-right (flash-attn) instead of top-left", V(causal="bottom_right")))
    if spec.causal == "bottom_right" and lq != lk:
        alts.append(("causal_top_left", "causal mask aligned top-left (SDPA is_causal) instead of bottom-right", V(causal="top_left")))
    if spec.causal != "none":
        alts.append(("diagonal_excluded", "causal mask excludes the diagonal (j < i instead of j <= i)", V(strict_diag=True)))
        alts.append(("causal_ignored", "causal mask ignored", V(causal="none")))
    else:
        alts.append(("causal_applied", "a causal mask applied though none was asked (top-left)", V(causal="top_left")))
        if lq != lk:
            alts.append(("causal_applied_br", "a causal mask applied though none was asked (bottom-right)", V(causal="bottom_right")))
    if spec.window is not None:
        left, right = spec.window
        for dl, dr, what in ((1, 0, "left bound one too wide"), (-1, 0, "left bound one too narrow"),
                             (0, 1, "right bound one too wide"), (0, -1, "right bound one too narrow")):
            nl, nr = (left + dl if left >= 0 else -1), (right + dr if right >= 0 else -1)
            if (nl, nr) != (left, right) and nl >= -1 and nr >= -1 and not (left >= 0 and nl < 0) and not (right >= 0 and nr < 0):
                alts.append((f"window_off_by_one_{'left' if dl else 'right'}{'+' if (dl or dr) > 0 else '-'}",
                             f"window {what}: ({nl}, {nr}) instead of ({left}, {right})", V(window=(nl, nr))))
        alts.append(("window_ignored", "window ignored", V(window=None)))
    sc = spec.resolved_scale(d)
    default = 1.0 / math.sqrt(d)
    alts.append(("scale_missing", f"softmax scale missing (1 used instead of {sc:.4g})", V(scale=1.0)))
    alts.append(("scale_doubled", f"softmax scale doubled ({2 * sc:.4g} instead of {sc:.4g})", V(scale=2 * sc)))
    alts.append(("scale_squared", f"softmax scale applied twice ({sc * sc:.4g} instead of {sc:.4g})", V(scale=sc * sc)))
    if spec.scale is not None and abs(sc - default) > 1e-12 * default:
        alts.append(("scale_default", f"the default scale 1/sqrt(D) = {default:.4g} used instead of the given {sc:.4g}", V(scale=default)))
    if spec.softcap is not None:
        alts.append(("softcap_before_scale", f"softcap applied before the scale: c*tanh(q.k/c)*scale (c={spec.softcap:g})",
                     V(softcap=spec.softcap * sc)))
        alts.append(("softcap_ignored", "softcap ignored", V(softcap=None)))
    if hkv != hq and hkv > 1:
        alts.append(("gqa_interleaved", f"GQA heads mapped interleaved (h % {hkv}) instead of grouped (h // {hq // hkv})",
                     V(kv_map="interleaved")))
    if has_fm:
        for mode, title in (("zeros", "fully-masked rows give 0 (and LSE -inf)"), ("nan", "fully-masked rows give NaN"),
                            ("mean_v", "fully-masked rows give mean(V) (uniform weights over all keys)"),
                            ("unmasked", "fully-masked rows attend every key as if unmasked")):
            if mode != declared_fm and not (declared_fm == "unsupported" and mode == "zeros"):
                alts.append((f"fully_masked_{mode}", title, Variant(fully_masked=mode)))
    alts.append(("lse_base2", "LSE in base 2 (log2 instead of natural log)", V(lse_mode="base2")))
    alts.append(("lse_no_max", "LSE without the row max added back (log of the rescaled sum)", V(lse_mode="no_max")))
    if has_keep and spec.dropout_p > 0:
        alts.append(("dropout_not_rescaled", f"dropout keeps not rescaled by 1/(1-p) (p={spec.dropout_p:g})", V(dropout_rescale=False)))
    if spec.cu_seqlens_q is None:
        for t in tiles:
            if 0 < t and lk % t:
                alts.append((f"padded_keys_{t}", f"padded tail keys counted: keys {lk}..{lk + t - lk % t - 1} of the last "
                             f"{t}-wide tile enter the softmax with score 0", V(pad_to=t)))
    for t in tiles:
        if 0 < t < lk:
            alts.append((f"last_tile_skipped_{t}", f"last key tile skipped (keys {((lk - 1) // t) * t}..{lk - 1}, tile {t})",
                         V(skip_last_tile=t)))
    for t in tiles:
        if 0 < t < lk:
            alts.append((f"missing_rescale_{t}", f"online softmax without rescale: accumulator and sum not multiplied by "
                         f"exp(m_old - m_new) when the running max rises (key tile {t})", V(online=(t, "no_rescale"))))
            alts.append((f"missing_rescale_acc_{t}", "online softmax rescales the sum but not the output accumulator "
                         f"when the running max rises (key tile {t})", V(online=(t, "no_rescale_acc"))))
            alts.append((f"missing_rescale_sum_{t}", "online softmax rescales the output accumulator but not the sum "
                         f"when the running max rises (key tile {t})", V(online=(t, "no_rescale_sum"))))
    return alts


def _tile_candidates(tiles) -> List[int]:
    out: List[int] = []
    if tiles:
        t = tiles[1] if isinstance(tiles, (tuple, list)) and len(tiles) == 2 else tiles
        if isinstance(t, int) and t > 0:
            out.append(int(t))
    for t in TILE_CANDIDATES:
        if t not in out:
            out.append(t)
    return out


def diagnose(
    case,
    observed: Dict[str, torch.Tensor],
    *,
    failing: Optional[Sequence[str]] = None,
    declared_fully_masked: str = "zeros",
    tiles=None,
    tol_norm: Optional[Dict[str, float]] = None,
    dropout_mask=None,
    reference_grads: Optional[Dict[str, torch.Tensor]] = None,
) -> Diagnosis:
    """Name the alternative semantics that explain `observed` ({"out", "lse", "dq", "dk", "dv"} tensors).

    `failing`: the outputs that failed the check (default: every forward output given). `tiles`: the
    adapter's claimed (BLOCK_M, BLOCK_N) if any (other widths are tried too). `tol_norm`: the norm-wise
    tolerance per output used by the check (default: the dtype's floor).
    """
    spec = case.spec
    b, hq, lq, d = case.q.shape
    lk = case.k.shape[2]
    notes: List[str] = []
    obs = {n: _f64(t) for n, t in observed.items() if _f64(t) is not None}
    failing = list(failing) if failing is not None else [n for n in ("out", "lse") if n in obs]
    fwd = [n for n in failing if n in ("out", "lse") and n in obs]
    if b * hq * lq * max(lk, 1) > MAX_ELEMENTS:
        return Diagnosis(NO_EXPLANATION, notes=[f"case too large to diagnose ({b}x{hq}x{lq}x{lk} scores > {MAX_ELEMENTS}); shrink it first"])
    keep = dropout_mask
    if spec.dropout_p > 0 and keep is None:
        notes.append("dropout without the adapter's keep-mask: alternatives cannot be recomputed exactly")
        return Diagnosis(NO_EXPLANATION, notes=notes)
    ref = reference_forward(case.q, case.k, case.v, spec, dropout_mask=keep)
    refd = {"out": ref.out, "lse": ref.lse}
    if declared_fully_masked == "nan":
        fmr = torch.isneginf(ref.lse)
        refd = {"out": torch.where(fmr.unsqueeze(-1), torch.full_like(ref.out, math.nan), ref.out),
                "lse": torch.where(fmr, torch.full_like(ref.lse, math.nan), ref.lse)}
    has_fm = bool(torch.isneginf(ref.lse).any())
    dtype = case.dtype
    tol = {}
    for n in ("out", "lse"):
        t = (tol_norm or {}).get(n)
        tol[n] = float(t) if t else tolerance_for(n, dtype).norm
    explanations: List[Explanation] = []
    if fwd:
        ref_res, ref_nf = _score(obs, refd, fwd)
        tiles_c = _tile_candidates(tiles)
        for key, title, var in _alternatives(case, spec, tiles_c, declared_fully_masked, keep is not None, has_fm):
            try:
                ao, al = alternative_forward(case.q, case.k, case.v, spec, var, keep=keep)
            except Exception as e:  # an alternative that cannot be formed here is simply not a candidate
                notes.append(f"{key}: not evaluated ({type(e).__name__}: {e})")
                continue
            alt = {"out": ao, "lse": al.to(_F64)}
            same_as_ref, same_nf = _score(alt, refd, fwd)
            if same_as_ref == 0.0 and same_nf == 0:
                continue  # identical to the SPEC for this case: it cannot explain anything
            res, nf = _score(obs, alt, fwd)
            thr = max(3.0 * max(tol[n] for n in fwd), 1e-9)
            fits = nf == 0 and res <= thr and (res <= 0.25 * ref_res or (ref_nf > 0 and nf == 0))
            explanations.append(Explanation(key, title, res, ref_res, fits))
        cross = _cross_slice(case, spec, obs, refd, fwd, tol, keep, declared_fully_masked)
        if cross is not None:
            explanations.append(cross)
        # fitting first; among the fitting, whole-tensor semantics before the per-slice K/V search
        explanations.sort(key=lambda e: (not e.fits, e.key == "kv_cross", e.residual))
        fitting = [e for e in explanations if e.fits]
        if len(fitting) > 1:  # ties (e.g. scale 1 == doubled 0.5): prefer the listed order among equals
            best = fitting[0].residual
            equal = [e for e in fitting if e.residual <= 2 * best + 1e-12]
            for e in equal[1:]:
                notes.append(f"equally consistent: {e.title}")
    else:
        notes.append("the forward outputs match the reference: the error is in the backward pass only")
    sigs = _signatures(case, spec, obs, refd, ref, failing, tiles, reference_grads)
    best = next((e for e in explanations if e.fits), None)
    if best is not None:
        summary = best.title
    elif sigs:
        summary = sigs[0].title
    else:
        summary = NO_EXPLANATION
    return Diagnosis(summary, explanations, sigs, notes)


def _cross_slice(case, spec, obs, refd, fwd, tol, keep, declared_fm) -> Optional[Explanation]:
    """Some (batch, head) slices wrong, each explained by reading another slice's K/V."""
    if "out" not in fwd:
        return None
    o, r = obs["out"], refd["out"]
    b, hq = o.shape[0], o.shape[1]
    hkv = case.k.shape[1]
    if b * hkv < 2 or b * hkv > 32:
        return None
    g = hq // hkv
    thr = 3.0 * tol["out"]
    bad = []
    for bi in range(b):
        for hi in range(hq):
            res, nf = _residual(o[bi, hi], r[bi, hi])
            if res > thr or nf:
                bad.append((bi, hi, res))
    if not bad:
        return None
    base_fm = declared_fm if declared_fm in ("zeros", "nan") else "zeros"
    srcs = {}
    for sb in range(b):
        for sh in range(hkv):
            srcs[(sb, sh)] = alternative_forward(case.q, case.k, case.v, spec, Variant(kv_source=(sb, sh), fully_masked=base_fm), keep=keep)[0]
    found = []
    worst = 0.0
    for bi, hi, res in bad:
        own = (bi, hi // g)
        best = min(((_residual(o[bi, hi], out[bi, hi])[0], s) for s, out in srcs.items() if s != own), default=None)
        if best is None or best[0] > thr or best[0] > 0.25 * res:
            return Explanation("kv_cross", "a batch or head reads another's K/V", math.inf, max(x[2] for x in bad), False)
        found.append((bi, hi, best[1]))
        worst = max(worst, best[0])
    desc = "; ".join(f"batch {bi} head {hi} reads K/V of batch {s[0]} kv-head {s[1]}" for bi, hi, s in found[:4])
    if len(found) > 4:
        desc += f"; and {len(found) - 4} more"
    ref_res = max(x[2] for x in bad)
    return Explanation("kv_cross", f"one batch or head reads another's K/V: {desc}", worst, ref_res, True,
                       detail=f"{len(found)} of {b * hq} (batch, head) slices wrong, each matches another slice's K/V")


# ----------------------------------------------------------------------------------------------
# error signatures


def key_error_profile(obs_out: torch.Tensor, ref_out: torch.Tensor, v: torch.Tensor, scores_visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Estimated change of attention weight per (B, Hq, Lq, Lk): the output error projected on each
    key's value direction, <dO_i, v_j - O_i> / |v_j - O_i|^2 (exact when values are orthogonal)."""
    o = obs_out.detach().to("cpu", _F64)
    r = ref_out.detach().to("cpu", _F64)
    hq, hkv = r.shape[1], v.shape[1]
    vv = v.detach().to("cpu", _F64)
    if hq != hkv:
        vv = vv.repeat_interleave(hq // hkv, dim=1)
    dO = torch.nan_to_num(o - r, nan=0.0, posinf=0.0, neginf=0.0)
    diff = vv.unsqueeze(2) - r.unsqueeze(3)  # (B, H, Lq, Lk, Dv)
    num = (dO.unsqueeze(3) * diff).sum(-1)
    den = (diff * diff).sum(-1).clamp_min(1e-30)
    est = num / den
    if scores_visible is not None:
        est = torch.where(scores_visible, est, torch.zeros_like(est))
    return est


def _last_tile_signature(per_key: torch.Tensor, lk: int, tiles, source: str) -> Optional[Signature]:
    tot = float(per_key.sum())
    if not (tot > 0) or lk < 2:
        return None
    best = None
    for t in _tile_candidates(tiles):
        if t >= lk:
            continue
        s0 = ((lk - 1) // t) * t
        frac = float(per_key[s0:].sum()) / tot
        share = (lk - s0) / lk
        if frac >= 0.8 and share <= 0.5 and (best is None or frac - share > best[1] - best[2]):
            best = (t, frac, share, s0)
    if best is None:
        return None
    t, frac, share, s0 = best
    return Signature("last_key_tile", f"error concentrated in the last key tile (keys {s0}..{lk - 1}, tile {t})",
                     frac, f"{100 * frac:.0f}% of the {source} error on {100 * share:.0f}% of the keys")


def _signatures(case, spec, obs, refd, ref, failing, tiles, ref_grads) -> List[Signature]:
    sigs: List[Signature] = []
    lk = case.k.shape[2]
    # 1. last key tile: a change of the scores of keys T moves O_i only within span{v_j - O_i : j in T}
    #    (renormalisation included), so the share of the output error inside that span says whether the
    #    error comes from the last tile; for a backward-only error, the per-key dK/dV error says it.
    per_key, source = None, ""
    if "out" in failing and "out" in obs and obs["out"].shape == refd["out"].shape:
        s_tile = _tile_span_signature(case, spec, obs["out"], refd["out"], tiles)
        if s_tile is not None:
            sigs.append(s_tile)
    elif ref_grads:
        errs = [_per_key(obs[n], ref_grads[n]) for n in ("dk", "dv") if n in failing and n in obs and n in ref_grads]
        errs = [e for e in errs if e is not None and e.numel() == lk]
        if errs:
            per_key = sum(errs)
            source = "/".join(n for n in ("dk", "dv") if n in failing) + " (per key)"
    if per_key is not None:
        s = _last_tile_signature(per_key, lk, tiles, source)
        if s:
            sigs.append(s)
    if "out" not in failing or "out" not in obs or obs["out"].shape != refd["out"].shape:
        return sigs
    o, r = obs["out"], refd["out"]
    row_err = torch.nan_to_num((o - r).abs(), nan=1e30, posinf=1e30, neginf=1e30).pow(2).sum(-1).sqrt()  # (B, H, Lq)
    row_ref = r.pow(2).sum(-1).sqrt().clamp_min(1e-30)
    rel = row_err / row_ref
    total = float(row_err.pow(2).sum())
    if total <= 0:
        return sigs
    # 2. running max jumps: rows where a later key tile raises the running max carry the error
    s_final, _ = _final_scores(*_f64_qk(case, spec), spec, Variant(), case.q.shape[2], lk, 0)
    for t in _tile_candidates(tiles):
        if t >= lk:
            continue
        first = s_final[..., :t].amax(-1)
        later = s_final[..., t:].amax(-1)
        jump = later > first  # the running max rises after the first tile
        if bool(jump.all()) or not bool(jump.any()):
            continue
        frac = float(row_err[jump].pow(2).sum()) / total
        share = float(jump.double().mean())
        if frac >= 0.99 and share <= 0.75:
            sigs.append(Signature("running_max_jump", f"error only in rows where the running max rises after the first key tile (tile {t}): missing rescale",
                                  frac, f"{100 * frac:.1f}% of the error on {100 * share:.0f}% of the rows"))
            break
    # 3. growing with the number of keys summed (low-precision accumulation)
    counts = torch.isfinite(s_final).sum(-1).to(_F64)  # visible keys per row
    ok = (counts > 0) & torch.isfinite(rel)
    if int(ok.sum()) >= 16 and float(counts[ok].max()) >= 4 * max(1.0, float(counts[ok].min())):
        rho = _spearman(counts[ok], rel[ok])
        c = counts[ok]
        lo, hi = c <= torch.quantile(c, 0.25), c >= torch.quantile(c, 0.75)
        ratio = float(rel[ok][hi].mean()) / max(float(rel[ok][lo].mean()), 1e-300)
        if rho >= 0.6 and ratio >= 2.0:
            sigs.append(Signature("grows_with_lk", "error grows with the number of keys summed: low-precision accumulation",
                                  min(1.0, rho), f"Spearman {rho:.2f} between visible keys and row error; "
                                  f"rows with many keys {ratio:.1f}x worse than rows with few"))
    # 4. confined to some (batch, head) slices
    per_slice = row_err.pow(2).sum(-1)
    frac_slices = per_slice / per_slice.sum()
    hot = frac_slices > 0.01
    n_s = per_slice.numel()
    if n_s > 1 and int(hot.sum()) <= n_s // 2:
        idx = [tuple(int(x) for x in i) for i in hot.nonzero()[:6]]
        sigs.append(Signature("some_heads", f"error confined to {int(hot.sum())} of {n_s} (batch, head) slices",
                              float(frac_slices[hot].sum()), "slices " + ", ".join(map(str, idx))))
    # 5. confined to fully-masked rows
    fm = torch.isneginf(ref.lse)
    if bool(fm.any()) and not bool(fm.all()):
        frac = float(row_err[fm].pow(2).sum()) / total if math.isfinite(total) else 0.0
        if frac >= 0.99:
            sigs.append(Signature("fully_masked_rows", "error confined to fully-masked rows (no visible key)", frac,
                                  f"{int(fm.sum())} fully-masked row(s)"))
    return sigs


def _tile_span_signature(case, spec, obs_out, ref_out, tiles) -> Optional[Signature]:
    lk, dv = case.k.shape[2], case.v.shape[-1]
    hq = case.q.shape[1]
    dO = torch.nan_to_num(obs_out - ref_out, nan=0.0, posinf=0.0, neginf=0.0)
    tot = float(dO.pow(2).sum())
    if not tot > 0:
        return None
    s_final, _ = _final_scores(*_f64_qk(case, spec), spec, Variant(), case.q.shape[2], lk, 0)
    v = _expand_kv(case.k.detach().to("cpu", _F64), case.v.detach().to("cpu", _F64), hq, Variant())[1]
    for t in _tile_candidates(tiles):
        if t >= lk:
            continue
        s0 = ((lk - 1) // t) * t
        n_t = lk - s0
        if n_t > dv // 2:
            continue  # the span would hold a large part of any error: no evidence either way
        vis = torch.isfinite(s_final[..., s0:]).to(_F64)  # (B, H, Lq, n_t)
        A = (v[:, :, None, s0:, :] - ref_out[:, :, :, None, :]) * vis.unsqueeze(-1)  # (B, H, Lq, n_t, Dv)
        At = A.transpose(-1, -2)
        x = torch.linalg.lstsq(At, dO.unsqueeze(-1)).solution
        proj = (At @ x).squeeze(-1)
        frac = float(proj.pow(2).sum()) / tot
        chance = n_t / dv
        if frac >= 0.95:
            return Signature("last_key_tile", f"error concentrated in the last key tile (keys {s0}..{lk - 1}, tile {t})", frac,
                             f"{100 * frac:.1f}% of the output error lies in the span of those {n_t} keys' values "
                             f"(chance: {100 * chance:.0f}%)")
    return None


def _per_key(obs: torch.Tensor, ref: torch.Tensor) -> Optional[torch.Tensor]:
    """Error per key position (Lk,) of a dK/dV tensor (B, Hkv, Lk, D), summed over the rest."""
    ref = ref.detach().to("cpu", _F64)
    if obs.shape != ref.shape or obs.dim() != 4:
        return None
    return torch.nan_to_num((obs - ref).abs(), nan=1e30, posinf=1e30, neginf=1e30).sum(dim=(0, 1, 3))


def _f64_qk(case, spec):
    q = case.q.detach().to("cpu", _F64)
    k, _ = _expand_kv(case.k.detach().to("cpu", _F64), case.v.detach().to("cpu", _F64), case.q.shape[1], Variant())
    return q, k


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx = torch.argsort(torch.argsort(x)).to(_F64)
    ry = torch.argsort(torch.argsort(y)).to(_F64)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


def diagnose_result(result, *, adapter=None, dropout_mask=None) -> Diagnosis:
    """Diagnose a failed `CheckResult` (made with keep_tensors=True, the default)."""
    if result.status == "error":
        return Diagnosis(NO_EXPLANATION, notes=["the adapter raised; nothing to diagnose numerically"])
    if not result.outputs:
        return Diagnosis(NO_EXPLANATION, notes=["the check kept no tensors (keep_tensors=False)"])
    failing = [c.name for c in result.comparisons if not c.passed]
    tol = {c.name: c.tol_norm for c in result.comparisons}
    claims = getattr(adapter, "claims", None)
    fm = claims.fully_masked if claims is not None else "zeros"
    tiles = claims.tiles if claims is not None else None
    keep = dropout_mask if dropout_mask is not None else result.outputs.get("dropout_mask")
    d = diagnose(result.case, result.outputs, failing=failing, declared_fully_masked=fm, tiles=tiles,
                 tol_norm=tol, dropout_mask=keep)
    from .precision_diagnosis import with_precision  # issue 20: name precision where semantics explain nothing

    return with_precision(d, result)
