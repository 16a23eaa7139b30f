"""What a case page shows beyond the journaled metrics: re-run the saved case (when the adapter can be
resolved by name and the failure was a plain wrong answer), then heatmaps, worst rows and a diagnosis.

Never raises: anything that cannot be done becomes a note on the page.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from .heatmap import heatmap_data_uri
from ..devices import cuda_present

RERUN_STATUSES = ("failed",)  # crashed/timeout would take the renderer down with them; error has no tensors
MAX_TILES = 64


def _adapter(name: str):
    from ..adapters import registry

    try:
        a = registry.get(name)
    except Exception as e:
        return None, f"adapter {name!r} cannot be resolved here ({type(e).__name__}: {e})"
    why = a.unavailable_reason()
    if why:
        return None, f"adapter {name!r} is unavailable here: {why}"
    return a, None


def _case(case_dict: Optional[dict], case_file: Optional[str]):
    from ..case import CaseRecipe, build_case, load_case

    dev = "cuda" if cuda_present() else "cpu"
    try:
        if case_dict and case_dict.get("recipe"):
            r = CaseRecipe.from_dict(dict(case_dict["recipe"]))
            if r.device == "cuda" and dev != "cuda":
                return None, "the case was made on cuda and this machine has none"
            return build_case(r, label=case_dict.get("label", "")), None
        if case_file:
            return load_case(case_file), None
    except Exception as e:
        return None, f"the case cannot be rebuilt ({type(e).__name__}: {e})"
    return None, "no recipe or saved tensors for this case"


def analyse(adapter_name: str, status: str, case_dict: Optional[dict], case_file: Optional[str] = None,
            *, rerun: bool = True) -> Dict[str, Any]:
    """-> {"notes": [...], "rerun": bool, "diagnosis": dict | None, "heatmaps": [...], "worst_rows": [...],
    "check": CheckResult.to_dict() | None}"""
    info: Dict[str, Any] = {"notes": [], "rerun": False, "diagnosis": None, "heatmaps": [], "worst_rows": [], "check": None}
    if not rerun:
        info["notes"].append("re-running disabled: metrics only")
        return info
    if status not in RERUN_STATUSES:
        info["notes"].append(f"status {status!r}: the case is not re-run while rendering (metrics and message only)")
        return info
    adapter, why = _adapter(adapter_name)
    if adapter is None:
        info["notes"].append(why + ": metrics only")
        return info
    case, why = _case(case_dict, case_file)
    if case is None:
        info["notes"].append(why + ": metrics only")
        return info
    try:
        _analyse(adapter, case, info)
    except Exception as e:  # a report must come out whatever the adapter does
        info["notes"].append(f"re-running the case failed ({type(e).__name__}: {e}); metrics only")
    return info


def _analyse(adapter, case, info) -> None:
    from ..check import check, unclaimed
    from ..diagnose import diagnose
    from ..reference import reference_backward, visible_counts
    from ..spec import Output

    why = unclaimed(adapter, case)
    if why:
        info["notes"].append(f"not re-run: {why}")
        return
    res = check(adapter, case)
    info["rerun"] = True
    info["check"] = res.to_dict()
    if res.status == "error":
        last = (res.error or "").strip().splitlines()[-1:] or ["(no message)"]
        info["notes"].append("re-running the case raised in the adapter: " + last[0])
        return
    if res.passed:
        info["notes"].append("re-running av.check on this case passes: this property's failure is not a plain "
                             "comparison with the reference (see the message above)")
    out = res.outputs.get("out")
    ref = res.reference
    if not isinstance(out, torch.Tensor) or out.shape != ref["out"].shape:
        info["notes"].append("the adapter's output has the wrong shape: no heatmaps")
        return
    keep = None
    if case.spec.dropout_p > 0:
        with torch.no_grad():
            o = adapter(case.q, case.k, case.v, case.spec)
        keep = o.dropout_mask if isinstance(o, Output) else None
    ref_grads = {}
    if any(n in res.outputs for n in ("dk", "dv")):
        gen = torch.Generator().manual_seed(int(case.seed) + 1)  # the upstream gradient check() used
        d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
        try:
            g = reference_backward(case.q, case.k, case.v, case.spec, d_out, dropout_mask=keep)
            ref_grads = {"dq": g.dq, "dk": g.dk, "dv": g.dv}
        except Exception as e:
            info["notes"].append(f"reference gradients unavailable ({e})")
    failing = [c.name for c in res.comparisons if not c.passed]
    if failing:
        d = diagnose(case, res.outputs, failing=failing, declared_fully_masked=adapter.claims.fully_masked,
                     tiles=adapter.claims.tiles, tol_norm={c.name: c.tol_norm for c in res.comparisons},
                     dropout_mask=keep, reference_grads=ref_grads)
        info["diagnosis"] = d.to_dict()
    o = out.detach().to("cpu", torch.float64)
    r = ref["out"].to("cpu", torch.float64)
    b, hq, lq, _ = r.shape
    lk = case.k.shape[2]
    err = (o - r).abs()
    row_err = torch.where(torch.isnan(err).any(-1), torch.full(err.shape[:-1], math.nan, dtype=torch.float64),
                          torch.nan_to_num(err, posinf=math.inf).amax(-1))  # (B, H, Lq)
    hm = info["heatmaps"]
    # 1. error over (query, key tile): exact per-tile attention mass from a one-hot probe of V
    tile_map, how, tile = _tile_mass_error(adapter, case, keep)
    if tile_map is None:
        tile_map, how, tile = _tile_projection(case, o, r)
    n_tiles = tile_map.shape[1]
    hm.append({"id": "query-keytile", "title": f"Error over (query row, key tile of {tile})",
               "x": f"key tile (0..{n_tiles - 1}, {tile} keys each, Lk={lk})", "y": f"query row (0..{lq - 1})",
               "how": how, "max": _fmt(tile_map), "uri": heatmap_data_uri(tile_map.numpy())})
    # 2. over heads: max |error| per output row, one line per (batch, head)
    heads = row_err.reshape(b * hq, lq)
    hm.append({"id": "heads-out", "title": "Output error over (batch, head) and query row",
               "x": f"query row (0..{lq - 1})", "y": f"(batch, head), {b} x {hq} lines, batch-major",
               "how": "max over the value dim of |out - reference| (NaN/Inf in magenta)", "max": _fmt(heads),
               "uri": heatmap_data_uri(heads.numpy())})
    for name in ("dk", "dv", "dq"):
        g = res.outputs.get(name)
        if name not in ref_grads or not isinstance(g, torch.Tensor) or g.shape != ref_grads[name].shape:
            continue
        e = (g.detach().to("cpu", torch.float64) - ref_grads[name].to("cpu", torch.float64)).abs()
        e = torch.where(torch.isnan(e).any(-1), torch.full(e.shape[:-1], math.nan, dtype=torch.float64), e.amax(-1))
        bb, hh, ll = e.shape
        what = "key" if name != "dq" else "query row"
        hm.append({"id": f"heads-{name}", "title": f"{name} error per {what}, over (batch, head)",
                   "x": f"{what} (0..{ll - 1})", "y": f"(batch, {'kv ' if name != 'dq' else ''}head), {bb} x {hh} lines",
                   "how": f"max over the head dim of |{name} - reference|", "max": _fmt(e),
                   "uri": heatmap_data_uri(e.reshape(bb * hh, ll).numpy())})
    # worst rows, with their count of visible keys
    counts = visible_counts(lq, lk, case.spec, batch=b, heads=hq)
    rel = row_err / r.abs().amax(-1).clamp_min(1e-30)
    flat = torch.nan_to_num(row_err, nan=math.inf).reshape(-1)
    for idx in torch.argsort(flat, descending=True)[:10].tolist():
        bi, hi, i = idx // (hq * lq), (idx // lq) % hq, idx % lq
        if float(flat[idx]) == 0:
            break
        info["worst_rows"].append({"batch": bi, "head": hi, "row": i, "max_abs": float(row_err[bi, hi, i]),
                                   "rel": float(rel[bi, hi, i]), "visible": int(counts[bi, hi, i]),
                                   "got": _vec(o[bi, hi, i]), "expected": _vec(r[bi, hi, i])})


def _fmt(t: torch.Tensor) -> str:
    fin = t[torch.isfinite(t)]
    return f"{float(fin.max()):.3g}" if fin.numel() else "n/a"


def _vec(t: torch.Tensor, n: int = 4) -> str:
    vals = ", ".join(f"{float(x):.4g}" for x in t[:n])
    return "[" + vals + (", ...]" if t.numel() > n else "]")


def _tile_width(lk: int, dv: int, claims_tiles) -> int:
    cols = max(1, min(dv, MAX_TILES))
    t = max(1, math.ceil(lk / cols))
    if claims_tiles and claims_tiles[1] >= t:
        t = int(claims_tiles[1])
    return t


def _tile_mass_error(adapter, case, keep):
    """Run the adapter once more with V = one-hot of each key's tile: output column t of row i is then the
    attention mass row i puts on tile t. Compare with the reference's mass. (None, ...) when impossible."""
    from ..reference import reference_forward
    from ..check import unpack_output as _unpack

    lk, dv = case.k.shape[2], case.v.shape[-1]
    if lk == 0:
        return None, "", 0
    tile = _tile_width(lk, dv, adapter.claims.tiles)
    n_tiles = math.ceil(lk / tile)
    if n_tiles > dv:
        return None, "", 0
    probe = torch.zeros(case.v.shape, dtype=torch.float64)
    for t in range(n_tiles):
        probe[:, :, t * tile:(t + 1) * tile, t] = 1.0
    probe = probe.to(case.v.device, case.v.dtype)
    try:
        with torch.no_grad():
            got, _, _ = _unpack(adapter(case.q, case.k, probe, case.spec))
        exp = reference_forward(case.q, case.k, probe, case.spec, dropout_mask=keep).out
    except Exception:
        return None, "", 0
    if not isinstance(got, torch.Tensor) or got.shape != exp.shape:
        return None, "", 0
    d = (got.detach().to("cpu", torch.float64) - exp.to("cpu", torch.float64))[..., :n_tiles].abs()
    m = torch.where(torch.isnan(d), torch.full_like(d, math.nan), d).amax(dim=(0, 1))  # (Lq, n_tiles)
    return m, ("exact: the adapter re-run with V = one-hot of each key's tile, so each output column is the "
               "attention mass on one tile; the cell is max over (batch, head) of |mass - reference mass|"), tile


def _tile_projection(case, o, r):
    from ..diagnose import key_error_profile

    lk = case.k.shape[2]
    tile = _tile_width(lk, MAX_TILES, None)
    est = key_error_profile(o, r, case.v).abs()  # (B, H, Lq, Lk)
    n_tiles = math.ceil(lk / tile) if lk else 1
    pad = n_tiles * tile - lk
    est = torch.nn.functional.pad(est, (0, pad))
    m = est.reshape(*est.shape[:3], n_tiles, tile).sum(-1).amax(dim=(0, 1))
    return m, ("estimated: the output error projected on each key's value direction (the one-hot probe "
               "could not be run)"), tile
