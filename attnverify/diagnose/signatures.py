"""Error signatures: where the error sits when no alternative explains it (the last key tile, rows where
the running max jumps, growing with the number of keys summed, some (batch, head) slices, fully-masked rows)."""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from .alternatives import tile_candidates
from .engine import F64, Variant, expand_kv, final_scores
from .records import Signature


def key_error_profile(obs_out: torch.Tensor, ref_out: torch.Tensor, v: torch.Tensor, scores_visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Estimated change of attention weight per (B, Hq, Lq, Lk): the output error projected on each
    key's value direction, <dO_i, v_j - O_i> / |v_j - O_i|^2 (exact when values are orthogonal)."""
    o = obs_out.detach().to("cpu", F64)
    r = ref_out.detach().to("cpu", F64)
    hq, hkv = r.shape[1], v.shape[1]
    vv = v.detach().to("cpu", F64)
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
    for t in tile_candidates(tiles):
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


def observed_signatures(case, spec, obs, refd, ref, failing, tiles, ref_grads) -> List[Signature]:
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
    s_final, _ = final_scores(*_f64_qk(case, spec), spec, Variant(), case.q.shape[2], lk, 0)
    for t in tile_candidates(tiles):
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
    counts = torch.isfinite(s_final).sum(-1).to(F64)  # visible keys per row
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
    s_final, _ = final_scores(*_f64_qk(case, spec), spec, Variant(), case.q.shape[2], lk, 0)
    v = expand_kv(case.k.detach().to("cpu", F64), case.v.detach().to("cpu", F64), hq, Variant())[1]
    for t in tile_candidates(tiles):
        if t >= lk:
            continue
        s0 = ((lk - 1) // t) * t
        n_t = lk - s0
        if n_t > dv // 2:
            continue  # the span would hold a large part of any error: no evidence either way
        vis = torch.isfinite(s_final[..., s0:]).to(F64)  # (B, H, Lq, n_t)
        A = (v[:, :, None, s0:, :] - ref_out[:, :, :, None, :]) * vis.unsqueeze(-1)  # (B, H, Lq, n_t, Dv)
        if not bool(torch.isfinite(A).all()):  # NaN/Inf values or reference rows (a poisoned input): no fit; MKL's
            continue  # lstsq also printed "Intel oneMKL ERROR: Parameter 4 was incorrect on entry to DGELSY" per call
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
    ref = ref.detach().to("cpu", F64)
    if obs.shape != ref.shape or obs.dim() != 4:
        return None
    return torch.nan_to_num((obs - ref).abs(), nan=1e30, posinf=1e30, neginf=1e30).sum(dim=(0, 1, 3))


def _f64_qk(case, spec):
    q = case.q.detach().to("cpu", F64)
    k, _ = expand_kv(case.k.detach().to("cpu", F64), case.v.detach().to("cpu", F64), case.q.shape[1], Variant())
    return q, k


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx = torch.argsort(torch.argsort(x)).to(F64)
    ry = torch.argsort(torch.argsort(y)).to(F64)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0
