"""Evidence of a failure, computed while the run judges it, in the process that judges it.

A case page and the pytest-html extras show more than the journaled error table: a diagnosis
(which alternative semantics explains the output), heatmaps of where the error sits, the worst rows.
Each needs the adapter's output again, so it is computed during the run, in the judging child
(crash isolation: `record_evidence` sends an `EvidenceJob` through the run's runner), and stored next
to the failure's case file, which the report then only reads:

    cases/<id>.evidence.json   {"v", "status", "notes", "rerun", "diagnosis", "check", "worst_rows",
                                "heatmaps": [{"id", "title", "x", "y", "how", "max"}], "computed": {...}}
    cases/<id>.evidence.npz    one float32 array per heatmap id (the error values; NaN/Inf kept)

Never raises into the run: anything that cannot be done becomes a note in the evidence.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Optional

import torch

from .devices import cuda_present
from .properties.base import ExampleResult

RERUN_STATUSES = ("failed",)  # crashed/timeout would only crash again; error has no tensors
MAX_TILES = 64
EVIDENCE_VERSION = 1


def evidence_paths(case_file: str):
    stem = case_file[:-5] if case_file.endswith(".json") else case_file
    return stem + ".evidence.json", stem + ".evidence.npz"


def _case(case_dict: Optional[dict], case_file: Optional[str]):
    from .case import CaseRecipe, build_case, load_case

    try:
        if case_dict and case_dict.get("rebuild"):  # a case no recipe describes (mla_latent_views: V a view of K)
            from .properties import get_property

            rb = case_dict["rebuild"]
            if rb.get("device") == "cuda" and not cuda_present():
                return None, "the case was made on cuda and this machine has none"
            return get_property(rb["property"]).rebuild_case(rb["drawn"], rb["device"]), None
        if case_dict and case_dict.get("recipe"):
            r = CaseRecipe.from_dict(dict(case_dict["recipe"]))
            if r.device == "cuda" and not cuda_present():
                return None, "the case was made on cuda and this machine has none"
            return build_case(r, label=case_dict.get("label", "")), None
        if case_file:
            return load_case(case_file), None
    except Exception as e:
        return None, f"the case cannot be rebuilt ({type(e).__name__}: {e})"
    return None, "no recipe or saved tensors for this case"


def analyse(adapter, status: str, case_dict: Optional[dict], case_file: Optional[str] = None) -> Dict[str, Any]:
    """-> {"notes": [...], "rerun": bool, "diagnosis": dict | None, "heatmaps": [{..., "values": ndarray}],
    "worst_rows": [...], "check": CheckResult.to_dict() | None}. Calls the adapter: run it where a crash
    costs nothing (the judging child)."""
    info: Dict[str, Any] = {"notes": [], "rerun": False, "diagnosis": None, "heatmaps": [], "worst_rows": [], "check": None}
    if status not in RERUN_STATUSES:
        info["notes"].append(f"status {status!r}: the case is not run again for a diagnosis (metrics and message only)")
        return info
    case, why = _case(case_dict, case_file)
    if case is None:
        info["notes"].append(why + ": metrics only")
        return info
    try:
        _analyse(adapter, case, info)
    except Exception as e:  # the evidence must come out whatever the adapter does
        info["notes"].append(f"running the case again failed ({type(e).__name__}: {e}); metrics only")
    return info


def _analyse(adapter, case, info) -> None:
    from .check import check, unclaimed
    from .diagnose import diagnose
    from .reference import reference_backward
    from .spec import Output

    why = unclaimed(adapter, case)
    if why:
        info["notes"].append(f"not re-run: {why}")
        return
    res = check(adapter, case)
    info["rerun"] = True
    info["check"] = res.to_dict()
    if res.status == "error":
        last = (res.error or "").strip().splitlines()[-1:] or ["(no message)"]
        info["notes"].append("running the case again raised in the adapter: " + last[0])
        return
    if res.passed:
        info["notes"].append("av.check on this case passes: this property's failure is not a plain "
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
    if case.spec.cache_seqlens is not None:  # k and v are the caches: their dim 2 is heads, not keys
        info["notes"].append("a KV-cache call: its keys are gathered per batch from the caches, so there is no "
                             "(query row, key tile) map; the per-head map and the worst rows are below")
    else:  # 1. error over (query, key tile): exact per-tile attention mass from a one-hot probe of V
        tile_map, how, tile = _tile_mass_error(adapter, case, keep)
        if tile_map is None:
            tile_map, how, tile = _tile_projection(case, o, r)
        n_tiles = tile_map.shape[1]
        hm.append({"id": "query-keytile", "title": f"Error over (query row, key tile of {tile})",
                   "x": f"key tile (0..{n_tiles - 1}, {tile} keys each, Lk={lk})", "y": f"query row (0..{lq - 1})",
                   "how": how, "max": _fmt(tile_map), "values": tile_map.numpy()})
    # 2. over heads: max |error| per output row, one line per (batch, head)
    heads = row_err.reshape(b * hq, lq)
    hm.append({"id": "heads-out", "title": "Output error over (batch, head) and query row",
               "x": f"query row (0..{lq - 1})", "y": f"(batch, head), {b} x {hq} lines, batch-major",
               "how": "max over the value dim of |out - reference| (NaN/Inf in magenta)", "max": _fmt(heads),
               "values": heads.numpy()})
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
                   "values": e.reshape(bb * hh, ll).numpy()})
    # worst rows, with their count of visible keys
    counts = _visible_rows(case, lq, b, hq)
    rel = row_err / r.abs().amax(-1).clamp_min(1e-30)
    flat = torch.nan_to_num(row_err, nan=math.inf).reshape(-1)
    for idx in torch.argsort(flat, descending=True)[:10].tolist():
        bi, hi, i = idx // (hq * lq), (idx // lq) % hq, idx % lq
        if float(flat[idx]) == 0:
            break
        info["worst_rows"].append({"batch": bi, "head": hi, "row": i, "max_abs": float(row_err[bi, hi, i]),
                                   "rel": float(rel[bi, hi, i]), "visible": int(counts[bi, hi, i]),
                                   "got": _vec(o[bi, hi, i]), "expected": _vec(r[bi, hi, i])})


def _visible_rows(case, lq: int, b: int, hq: int) -> torch.Tensor:
    """(B, Hq, Lq) visible keys per row; a KV-cache call's per batch, over the keys it gathers (reference.paged)."""
    from .reference import visible_counts
    from .reference.paged import leftpads, plain_spec

    s = case.spec
    if s.cache_seqlens is None:
        return visible_counts(lq, case.k.shape[2], s, batch=b, heads=hq)
    new = 0 if s.k_new is None else int(s.k_new.shape[2])
    lens = [int(c) - p + new for c, p in zip(torch.as_tensor(s.cache_seqlens).tolist(), leftpads(s))]
    return torch.cat([visible_counts(lq, n, plain_spec(s, i), batch=1, heads=hq) for i, n in enumerate(lens)])


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
    from .reference import reference_forward
    from .check import unpack_output

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
            got, _, _ = unpack_output(adapter(case.q, case.k, probe, case.spec))
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
    from .diagnose import key_error_profile

    lk = case.k.shape[2]
    tile = _tile_width(lk, MAX_TILES, None)
    est = key_error_profile(o, r, case.v).abs()  # (B, H, Lq, Lk)
    n_tiles = math.ceil(lk / tile) if lk else 1
    pad = n_tiles * tile - lk
    est = torch.nn.functional.pad(est, (0, pad))
    m = est.reshape(*est.shape[:3], n_tiles, tile).sum(-1).amax(dim=(0, 1))
    return m, ("estimated: the output error projected on each key's value direction (the one-hot probe "
               "could not be run)"), tile


# --------------------------------------------------------------------------- stored with the case


def write_evidence(case_file: str, info: Dict[str, Any], *, status: str, computed: Optional[dict] = None) -> str:
    """Store `analyse`'s result next to the case file (json + npz); returns the json's path."""
    import numpy as np

    from .journal import _jsonable

    jpath, npath = evidence_paths(case_file)
    arrays, maps = {}, []
    for h in info.get("heatmaps") or []:
        h = dict(h)
        vals = h.pop("values", None)
        if vals is not None:
            arrays[h["id"]] = np.asarray(vals, dtype=np.float32)
        maps.append(h)
    rec = {"v": EVIDENCE_VERSION, "status": status, "notes": list(info.get("notes") or []),
           "rerun": bool(info.get("rerun")), "diagnosis": info.get("diagnosis"), "check": info.get("check"),
           "worst_rows": info.get("worst_rows") or [], "heatmaps": maps, "computed": computed or {}}
    if arrays:
        tmp = npath + ".tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, npath)
    elif os.path.exists(npath):
        os.unlink(npath)
    tmp = jpath + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(_jsonable(rec), indent=1, allow_nan=False))
    os.replace(tmp, jpath)
    return jpath


class EvidenceJob:
    """Property-shaped, so the run's runner (attnverify.isolation) judges it like an example: in the
    forked child that holds the adapter. drawn: {"status", "case" (Case.to_dict()), "case_file"}."""

    name = "evidence"
    cost = 4.0  # check again + the tile probe + the diagnosis's alternatives, in adapter calls
    needs = ()

    def run_example(self, adapter, drawn) -> ExampleResult:
        t0 = time.perf_counter()
        info = analyse(adapter, drawn.get("status") or "failed", drawn.get("case"), drawn.get("case_file"))
        computed = {"in": "judging process", "pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 3),
                    "device": (drawn.get("case") or {}).get("device")}
        path = write_evidence(drawn["case_file"], info, status=drawn.get("status") or "failed", computed=computed)
        d = info.get("diagnosis") or {}
        return ExampleResult(True, message=d.get("summary") or "; ".join(info["notes"]) or path)


EVIDENCE_JOB = EvidenceJob()  # one object: handed to the judging child before it forks (runner.prepare)


def record_evidence(runner, adapter, *, status: str, case: Optional[dict], case_file: str) -> str:
    """Compute and store the evidence of one failure through `runner` (the run's judge: a forked child
    under crash isolation), so the process that drives the run never calls the adapter or builds a
    case on its device. A crash or timeout of the job costs only the evidence (a note says why)."""
    if status not in RERUN_STATUSES:  # nothing to run: the journal's metrics and message are the evidence
        info = analyse(adapter, status, case, case_file)
        return write_evidence(case_file, info, status=status, computed={"in": "driving process (no adapter call)"})
    res = runner(EVIDENCE_JOB, adapter, {"status": status, "case": case, "case_file": case_file})
    jpath = evidence_paths(case_file)[0]
    if res.passed and os.path.exists(jpath):
        return jpath
    why = (res.message or res.status).strip().splitlines()
    note = f"computing the diagnosis failed ({res.status}): {why[0] if why else '?'}; metrics only"
    return write_evidence(case_file, {"notes": [note]}, status=status, computed={"in": "judging process", "failed": True})
