"""`diagnose`: recompute the case under every alternative, rank those that explain the adapter's output
(fitting first, whole-tensor semantics before the per-slice K/V search), and fall back to error signatures."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from ..reference import reference_forward
from ..tolerances import tolerance_for
from .alternatives import alternatives_for, tile_candidates
from .engine import F64, Variant, alternative_forward
from .fit import as_f64, fit_score, residual
from .records import NO_EXPLANATION, Diagnosis, Explanation
from .signatures import observed_signatures

MAX_ELEMENTS = 2**23  # B*Hq*Lq*Lk of the float64 score tensor a diagnosis may build


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
    obs = {n: as_f64(t) for n, t in observed.items() if as_f64(t) is not None}
    failing = list(failing) if failing is not None else [n for n in ("out", "lse") if n in obs]
    fwd = [n for n in failing if n in ("out", "lse") and n in obs]
    if spec.cache_seqlens is not None:
        return Diagnosis(NO_EXPLANATION, notes=["a KV-cache call: the diagnosis recomputes plain calls only (its keys "
                                                "are gathered per batch from the caches); see the per-head map"])
    if b * hq * lq * max(lk, 1) > MAX_ELEMENTS:
        return Diagnosis(NO_EXPLANATION, notes=[f"case too large to diagnose ({b}x{hq}x{lq}x{lk} scores > {MAX_ELEMENTS}); shrink it first"])
    keep = dropout_mask
    if spec.dropout_p > 0 and keep is None:
        notes.append("dropout without the adapter's keep-mask: alternatives cannot be recomputed exactly")
        return Diagnosis(NO_EXPLANATION, notes=notes)
    ref = reference_forward(case.q, case.k, case.v, spec, dropout_mask=keep)
    # the reference runs on the case's device (cuda on a GPU); observed outputs and alternatives are float64 on
    # the CPU, so the reference joins them there (mixed, every fit raised "Expected all tensors to be on the same
    # device" and a GPU failure's evidence fell back to metrics only)
    ref = type(ref)(out=as_f64(ref.out), lse=as_f64(ref.lse))
    refd = {"out": ref.out, "lse": ref.lse}
    if declared_fully_masked == "nan":
        fmr = torch.isneginf(ref.lse)
        refd = {"out": torch.where(fmr.unsqueeze(-1), torch.full_like(ref.out, math.nan), ref.out),
                "lse": torch.where(fmr, torch.full_like(ref.lse, math.nan), ref.lse)}
    has_fm = bool(torch.isneginf(ref.lse).any())
    swallowed = _nonfinite_mismatch(case, obs.get("out"), refd["out"])
    if swallowed is not None:  # the error shapes below would be measured over NaN-zeroed differences: misleading
        return Diagnosis(swallowed.title, [swallowed], notes=notes)
    dtype = case.dtype
    tol = {}
    for n in ("out", "lse"):
        t = (tol_norm or {}).get(n)
        tol[n] = float(t) if t else tolerance_for(n, dtype).norm
    explanations: List[Explanation] = []
    if fwd:
        unmodelled = _unmodelled(case, spec, refd, fwd, keep, declared_fully_masked)
        if unmodelled:  # every alternative would be measured against another baseline: name none
            notes.append(unmodelled)
            return Diagnosis(NO_EXPLANATION, notes=notes)
        ref_res, ref_nf = fit_score(obs, refd, fwd)
        tiles_c = tile_candidates(tiles)
        for key, title, var in alternatives_for(case, spec, tiles_c, declared_fully_masked, keep is not None, has_fm):
            try:
                ao, al = alternative_forward(case.q, case.k, case.v, spec, var, keep=keep)
            except Exception as e:  # an alternative that cannot be formed here is simply not a candidate
                notes.append(f"{key}: not evaluated ({type(e).__name__}: {e})")
                continue
            alt = {"out": ao, "lse": al.to(F64)}
            same_as_ref, same_nf = fit_score(alt, refd, fwd)
            if same_as_ref == 0.0 and same_nf == 0:
                continue  # identical to the SPEC for this case: it cannot explain anything
            res, nf = fit_score(obs, alt, fwd)
            # residuals are relative to the alternative's norm: never tighter than the dtype's own floor (a check's
            # bound can be far below it where the reference is ~0, e.g. a dominant sink, and the alternative is not)
            thr = max(3.0 * max(max(tol[n], tolerance_for(n, dtype).norm) for n in fwd), 1e-9)
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
    sigs = observed_signatures(case, spec, obs, refd, ref, failing, tiles, reference_grads)
    best = next((e for e in explanations if e.fits), None)
    if best is not None:
        summary = best.title
    elif sigs:
        summary = sigs[0].title
    else:
        summary = NO_EXPLANATION
    return Diagnosis(summary, explanations, sigs, notes)


def _nonfinite_mismatch(case, out, ref_out) -> Optional[Explanation]:
    """With a NaN/Inf among the inputs, rows finite in the output where the reference's are not (swallowed), or the
    reverse (spread): that is the explanation; None otherwise. Before, a swallowed NaN read as 'missing rescale' (the
    running-max signature over the NaN-zeroed error)."""
    if out is None or out.shape != ref_out.shape:
        return None
    if all(bool(torch.isfinite(t.detach().float()).all()) for t in (case.q, case.k, case.v)):  # fp8: no isfinite
        return None
    got_nf = ~torch.isfinite(out).all(-1)  # (B, H, Lq): a row with a non-finite element
    ref_nf = ~torch.isfinite(ref_out).all(-1)
    lost, spread = int((ref_nf & ~got_nf).sum()), int((got_nf & ~ref_nf).sum())
    if lost:
        return Explanation("nonfinite_swallowed", f"a NaN/Inf input swallowed: {lost} row(s) finite where the reference "
                           "is NaN/Inf (a kernel that reads a NaN or +Inf row max as 'no visible key': isfinite(max), "
                           "max > -inf, nan_to_num)", 0.0, 1.0, True)
    if spread:
        return Explanation("nonfinite_spread", f"a NaN/Inf input spread: {spread} row(s) NaN/Inf where the reference is "
                           "finite (a masked or other row's NaN reaching them)", 0.0, 1.0, True)
    return None


def _unmodelled(case, spec, refd, fwd, keep, declared_fm) -> str:
    """'' when the engine's own semantics (no alternative) reproduce the reference on this case, else why not:
    a feature the engine does not model (a KV cache, chunked attention), so no alternative may be named."""
    base_fm = declared_fm if declared_fm in ("zeros", "nan") else "zeros"
    try:
        o, lse = alternative_forward(case.q, case.k, case.v, spec, Variant(fully_masked=base_fm), keep=keep)
    except Exception as e:  # noqa: BLE001 - a case the engine cannot form is one it does not model
        return f"the diagnosis engine cannot recompute this case ({type(e).__name__}: {e}); no alternative is tried"
    res, nf = fit_score({"out": o, "lse": lse.to(F64)}, refd, fwd)
    if res > 1e-9 or nf:
        feats = ", ".join(sorted(spec.features())) or "its features"
        return (f"the diagnosis engine does not reproduce the reference on this case ({feats}: residual {res:.2e}, "
                f"{nf} NaN/Inf differences); no alternative is tried")
    return ""


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
            res, nf = residual(o[bi, hi], r[bi, hi])
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
        best = min(((residual(o[bi, hi], out[bi, hi])[0], s) for s, out in srcs.items() if s != own), default=None)
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
