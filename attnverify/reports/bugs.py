"""The distinct bugs of a run, as the index page leads with them: read from the journal's `bug` and
`bug_seen` records (attnverify.bugs writes them as each bug is found) and the evidence stored beside
their case files. Reads only the report folder."""
from __future__ import annotations

import os
from typing import Dict, List

from ..bugs import diagnosis_for, group, headline
from .artifact import load_case_file


def bug_section(report_dir: str, recs: List[dict], failures: List[dict]) -> Dict[str, object]:
    """{"headline": "3 distinct bugs (seen by 26 properties)" | "", "bugs": [group dict + "diagnosis",
    "case_rel", "link"]}."""
    rows = []
    for r in recs:
        ev = r.get("event")
        if ev == "bug":
            rows.append({**r, "text": (r.get("attribution") or {}).get("text") or r.get("attribution_error") or ""})
        elif ev == "bug_seen":
            rows.append({"signature": r.get("signature"), "property": r.get("property"), "adapter": r.get("adapter"),
                         "case_file": r.get("case_file"), "repro": r.get("repro")})
    groups = group(rows)
    pages = {os.path.basename(str(f.get("case_file") or "")): f.get("link") for f in failures if f.get("case_file")}
    for g in groups:
        base = os.path.basename(str(g.get("case_file") or ""))
        g["case_rel"] = f"cases/{base}" if base else None
        g["link"] = pages.get(base)
        g["diagnosis"] = diagnosis_for(g, lambda case_file: _stored(report_dir, case_file))
        if not g.get("repro") and g["case_rel"]:
            g["repro"] = f"attnverify repro {g['case_rel']}"
    return {"headline": headline(groups) if groups else "", "bugs": groups}


def _stored(report_dir: str, case_file: str):
    """The diagnosis stored beside a case file of this report folder (by its basename), or None."""
    base = os.path.basename(str(case_file or ""))
    if not base.endswith(".json"):
        return None
    ev = load_case_file(os.path.join(report_dir, "cases", base[:-5] + ".evidence.json"))
    return (ev or {}).get("diagnosis") or None
