"""Reading what a run stored beside its journal: case files, their evidence, the adapter's origin.

Only files of the report folder are read here: no adapter, reference, check or kernel code runs, and
nothing touches a GPU (see attnverify/evidence.py for what writes the evidence during the run).
"""
from __future__ import annotations

import json
import os
import pprint
import shlex
from typing import Any, Dict, List, Optional, Tuple

from .heatmap import heatmap_data_uri

NO_EVIDENCE = ("no evidence was stored for this failure (the run was killed before it could be computed, or it "
               "was made by an attnverify that did not store it): metrics and message only")


def case_path(report_dir: str, f: dict) -> Optional[str]:
    """The failure's case file inside this report folder (wherever the run wrote it)."""
    cands = []
    cf = f.get("case_file")
    if cf:
        cf = str(cf)
        if not os.path.isabs(cf):
            cands.append(os.path.join(report_dir, cf))
        cands.append(os.path.join(report_dir, "cases", os.path.basename(cf)))
    cands.append(os.path.join(report_dir, "cases", f"{f['id']}.json"))
    return next((c for c in cands if os.path.isfile(c)), None)


def load_case_file(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _numbers(x: Any) -> Any:
    """Strict JSON keeps inf and nan as strings (attnverify.journal): make them numbers again."""
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    return x


def load_evidence(path: Optional[str]) -> Dict[str, Any]:
    """The evidence stored beside a case file, with heatmaps as PNG data URIs; a note when missing."""
    empty = {"notes": [NO_EVIDENCE], "rerun": False, "diagnosis": None, "heatmaps": [], "worst_rows": [],
             "check": None, "stored": False}
    if not path:
        return empty
    stem = path[:-5] if path.endswith(".json") else path
    ev = load_case_file(stem + ".evidence.json")
    if ev is None:
        return empty
    ev = _numbers(ev)
    arrays = {}
    npz = stem + ".evidence.npz"
    if os.path.exists(npz):
        import numpy as np

        try:
            with np.load(npz, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError):
            arrays = {}
    maps = []
    for h in ev.get("heatmaps") or []:
        if h.get("id") in arrays:
            maps.append(dict(h, uri=heatmap_data_uri(arrays[h["id"]])))
    out = dict(empty, **{k: ev.get(k) for k in ("notes", "rerun", "diagnosis", "worst_rows", "check")})
    out.update(heatmaps=maps, stored=True, notes=list(ev.get("notes") or []), worst_rows=list(ev.get("worst_rows") or []))
    return out


def comparisons(result: Optional[dict]) -> List[dict]:
    rows = []
    for rec in (result or {}).get("records") or []:
        for c in rec.get("comparisons") or []:
            rows.append(dict(c, adapter_status=rec.get("status")))
    return rows


def adapter_flag(origin: Optional[dict]) -> str:
    """What `attnverify repro` needs besides the case file to load the adapter that ran."""
    o = origin or {}
    if o.get("kind") in ("file", "module") and o.get("target"):
        return f"--adapter {shlex.quote(str(o['target']))}"
    if o.get("conftest"):
        return f"--conftest {shlex.quote(str(o['conftest']))}"
    return ""  # a built-in (or unknown origin): the recorded name is enough


def repro_command(case_rel: str, origin: Optional[dict]) -> str:
    flag = adapter_flag(origin)
    return f"attnverify repro {shlex.quote(case_rel)}" + (f" {flag}" if flag else "")


def snippet(adapter: str, origin: Optional[dict], case: Optional[dict], case_rel: str) -> str:
    """Standalone Python that rebuilds the case, loads the adapter by its origin, checks and diagnoses."""
    o = origin or {}
    lines = ["import attnverify as av", "from attnverify.case import CaseRecipe, build_case",
             "from attnverify.diagnose import diagnose_result"]
    if o.get("kind") not in ("file", "module") and o.get("conftest"):
        lines.append("from attnverify.adapters.registry import import_file")
    lines.append("")
    if case and case.get("recipe"):
        rec = pprint.pformat(case["recipe"], indent=1, width=96, sort_dicts=False)
        lines.append(f"case = build_case(CaseRecipe.from_dict({rec}))")
    else:
        lines.append(f"case = av.load_case({case_rel!r})")
    if o.get("kind") in ("file", "module") and o.get("target"):
        lines.append(f"adapter = av.resolve({str(o['target'])!r})[0]  # {o['kind']} {adapter!r} as the run loaded it")
    else:
        if o.get("conftest"):
            lines.append(f"import_file({str(o['conftest'])!r})  # registers {adapter!r}")
        lines.append(f"adapter = av.resolve({adapter!r})[0]")
    lines += ["result = av.check(adapter, case)", "print(result.message())",
              "print(diagnose_result(result, adapter=adapter).text())"]
    return "\n".join(lines)


def origin_note(origin: Optional[dict], here: Optional[str]) -> str:
    """Whether the adapter's file on this machine is the one that ran (by its hash)."""
    o = origin or {}
    if not o.get("sha256") or not o.get("file"):
        return ""
    cand = o["file"] if os.path.isabs(str(o["file"])) else os.path.join(here or ".", str(o["file"]))
    if not os.path.exists(cand):
        return ""
    try:
        import hashlib

        with open(cand, "rb") as fh:
            same = hashlib.sha256(fh.read()).hexdigest() == o["sha256"]
    except OSError:
        return ""
    return "" if same else f"note: {o['file']} has changed since the run (its sha256 differs)"


def failure_context(report_dir: str, f: dict, adapter_info: Dict[str, dict]) -> Tuple[Optional[dict], Optional[str]]:
    """Fill f with what its case page shows; returns (saved case dict, its path)."""
    path = case_path(report_dir, f)
    saved = load_case_file(path)
    # the saved case is what the failure's message and `attnverify repro` are about; the journal's last failing
    # result can be an earlier one (the attribution reduces the shrunk case to a simpler failing neighbour)
    case = saved if saved and (saved.get("shapes") or saved.get("recipe")) else f.get("case")
    f["case"] = case
    parent = os.path.dirname(report_dir)
    rel = (os.path.relpath(path, parent) if path else
           os.path.join(os.path.basename(report_dir), "cases", f"{f['id']}.json"))
    origin = (saved or {}).get("adapter_origin") or (adapter_info.get(f["adapter"]) or {}).get("origin")
    f["origin"] = origin if isinstance(origin, dict) else None
    f["repro"] = repro_command(rel, f["origin"])
    f["snippet"] = snippet(f["adapter"], f["origin"], case, rel)
    f["comparisons"] = comparisons(f.get("result")) or comparisons(saved)
    f["analysis"] = load_evidence(path)
    return saved, path
