"""Distinct bugs: journaled as they are found, grouped across properties and adapters, summarised.

The driver (properties.driver) attributes each shrunk failure (attnverify.attribution) and calls
`on_bug` as each distinct bug of a property is found; the plugin hands it `record_bug`, which saves
the case (replayable with `attnverify repro`), stores its evidence through the run's runner (the
judging child) and journals

    {"event": "bug", "adapter", "properties": [..], "case": Case.to_dict(), "needs": [..], "holds": [..],
     "untested": [..], "signature", "case_file", "repro", "property", "attribution": {...}}

once per signature and process, at once (a killed run keeps it); a later sighting of the same
signature (another property or adapter) is a `bug_seen` record {"signature", "adapter", "property",
"case_file", "repro"}. Failures with the same needs are one bug (a failure that needs nothing: the same
needs and the same shrunk case). `group` merges bug dicts (from test_end infos, or the journal:
reports/bugs.py reads those) and `summary_lines` leads the terminal summary:

    3 distinct bugs (seen by 26 properties)
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

from .attribution_text import needs_text
from .origin import display_path as _rel


def record_bug(bug: dict, *, s, prop, adapter, journal_write, origin: Optional[dict] = None,
               evidence: bool = True) -> Optional[str]:
    """Save, journal and (for bugs after a property's first) store the evidence of one bug; returns its
    case file. `s` is the plugin's Settings (report folder, run id, seed, runner, seen signatures)."""
    from .journal import save_case

    result = dict(bug["result"])
    path = save_case(s.report, prop_name=prop.name, adapter_name=adapter.name, drawn=bug["drawn"], result=result,
                     run_id=s.run_id, seed=s.seed,
                     extra={"adapter_origin": origin, "records": result.get("records"),
                            "attribution": bug.get("attribution"), "signature": bug["signature"]})
    repro = f"attnverify repro {_rel(path)}"
    seen = s.__dict__.setdefault("bug_signatures", set())
    if bug["signature"] in seen:
        journal_write({"event": "bug_seen", "signature": bug["signature"], "adapter": adapter.name,
                       "property": prop.name, "case_file": path, "repro": repro})
    else:
        seen.add(bug["signature"])
        a = bug.get("attribution") or {}
        journal_write({"event": "bug", "adapter": adapter.name, "properties": [prop.name], "property": prop.name,
                       "case": bug.get("case"), "describe": bug.get("describe"), "needs": list(bug.get("needs") or []),
                       "holds": a.get("holds", []), "untested": a.get("untested", []), "signature": bug["signature"],
                       "case_file": path, "repro": repro, "attribution": a or None,
                       "attribution_error": bug.get("attribution_error") or None})
    if evidence and bug.get("index", 0) > 0:  # the first bug's evidence is stored by the plugin as before
        from .recording import store_evidence

        store_evidence(s.runner, adapter, result, path)
    return path


def brief(bug: dict, case_file: Optional[str] = None) -> dict:
    """What a test_end info keeps of a bug (JSON-able, small): enough to group and summarise."""
    return {"signature": bug["signature"], "needs": list(bug.get("needs") or []), "property": bug["property"],
            "adapter": bug["adapter"], "describe": bug.get("describe") or "",
            "case_file": case_file or bug.get("case_file"),
            "text": (bug.get("attribution") or {}).get("text") or bug.get("attribution_error") or ""}


def _size(describe: str) -> int:
    """Elements of q in a case description (the smallest case is shown)."""
    import re

    n = 1
    for key in ("B", "Hq", "Lq", "D"):
        m = re.search(rf"\b{key}=(\d+)", describe or "")
        n *= int(m.group(1)) if m else 1
    return n


def group(bugs: Iterable[dict]) -> List[dict]:
    """Bug dicts ({"signature", "needs", "property" | "properties", "adapter", "describe", "case_file",
    "repro", "text", ...}) merged by signature, most properties first: {"signature", "needs", "text",
    "properties", "adapters", "describe" (the smallest case), "case_file", "repro", "sightings", "cases" (every
    sighting's (property, case_file), for `diagnosis_for`)}."""
    out: Dict[str, dict] = {}
    for b in bugs:
        sig = b.get("signature")
        if not sig:
            continue
        g = out.setdefault(sig, {"signature": sig, "needs": list(b.get("needs") or []), "text": b.get("text") or "",
                                 "properties": [], "adapters": [], "describe": None, "case_file": None,
                                 "repro": None, "sightings": 0, "cases": []})
        g["sightings"] += 1
        if b.get("case_file"):
            g["cases"].append((b.get("property") or (list(b.get("properties") or []) + [""])[0], b["case_file"]))
        for p in list(b.get("properties") or []) + ([b["property"]] if b.get("property") else []):
            if p not in g["properties"]:
                g["properties"].append(p)
        if b.get("adapter") and b["adapter"] not in g["adapters"]:
            g["adapters"].append(b["adapter"])
        if not g["text"] and b.get("text"):
            g["text"] = b["text"]
        d = b.get("describe") or ""
        if d and (g["describe"] is None or _size(d) < _size(g["describe"])):
            g["describe"], g["case_file"] = d, b.get("case_file")
            g["repro"] = b.get("repro") or (f"attnverify repro {_rel(b['case_file'])}" if b.get("case_file") else None)
    return sorted(out.values(), key=lambda g: -len(g["properties"]))  # stable: the first found first among equals


def headline(groups: List[dict]) -> str:
    props = {(a, p) for g in groups for a in g["adapters"] for p in g["properties"]}
    n = len(groups)
    return f"{n} distinct bug{'s' if n != 1 else ''} (seen by {len(props)} propert{'ies' if len(props) != 1 else 'y'})"


def summary_lines(infos: Iterable[dict]) -> List[str]:
    """The terminal summary's lead: the headline, then per bug its needs, smallest case, repro, diagnosis."""
    groups = group(b for i in infos for b in (i.get("bugs") or []))
    if not groups:
        return []
    lines = [headline(groups)]
    for k, g in enumerate(groups, 1):
        lines.append(f"bug {k} [{g['signature']}]: {needs_text(g['needs'])}")
        lines.append(f"    seen by {len(g['properties'])}: {', '.join(g['properties'])} ({', '.join(g['adapters'])})")
        lines.append(f"    smallest case: {g['describe']}")
        if g["repro"]:
            lines.append(f"    repro: {g['repro']}")
        diag = diagnosis_for(g, _stored_diagnosis)
        if diag:
            lines.append(f"    diagnosis: {diag}")
    return lines


def diagnosis_for(g: dict, load: Callable[[str], Optional[dict]]) -> str:
    """A bug group's diagnosis: its smallest case's when that one is explained; else the first of its other
    sightings' cases that is, saying which property's case it comes from (the smallest case of a bug seen by
    several properties may be one the engine cannot explain, e.g. a causal case of a padded-keys bug); else the
    smallest case's summary ('no simple explanation', a signature), or ''. `load(case_file)` gives the stored
    diagnosis dict ({"summary", "explained", ...}) or None."""
    first = load(g["case_file"]) if g.get("case_file") else None
    if first and first.get("explained"):
        return str(first.get("summary") or "")
    for prop, case_file in g.get("cases") or []:
        if case_file == g.get("case_file"):
            continue
        d = load(case_file)
        if d and d.get("explained"):
            own = (first or {}).get("summary")
            return f"{d.get('summary')} (from the {prop} case" + (f"; the smallest case's: {own})" if own else ")")
    return str((first or {}).get("summary") or "")


def _stored_diagnosis(case_file: str) -> Optional[dict]:
    """The diagnosis dict stored beside a case file (written by the judging child), or None."""
    import json

    from .evidence import evidence_paths

    try:
        with open(evidence_paths(case_file)[0]) as f:
            return json.load(f).get("diagnosis") or None
    except (OSError, ValueError, AttributeError):
        return None
