"""The run (or the merged runs) as the index page shows it: plain data built from journal records only.

One report folder shows its last run. A merged folder (`attnverify report RUN1 RUN2 --out MERGED`,
see merge.py) holds every source's records, each marked with `source`; cells then combine the
sources (worst status first) and every failure says where it came from.
"""
from __future__ import annotations

import datetime
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..journal import dangling_cases, describe_recipe, last_run, read_journal
from .bugs import bug_section

# worst first; known = a documented finding (xfail); xpass = a declared finding that did not reproduce (strict)
ORDER = ("crashed", "timeout", "error", "failed", "xpass", "known", "passed", "skipped", "stopped", "not run")
MANIFEST = "merged.json"


def safe_id(x: Any) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]", "_", str(x))[:80].lstrip(".")
    return s or "case"


def worst(a: str, b: str) -> str:
    ia = ORDER.index(a) if a in ORDER else 4
    ib = ORDER.index(b) if b in ORDER else 4
    return a if ia <= ib else b


def read_manifest(report_dir: str) -> Optional[dict]:
    import json

    p = os.path.join(report_dir, MANIFEST)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except ValueError:
        return None


def records_of(report_dir: str) -> Tuple[List[dict], Optional[dict]]:
    """(records, manifest): every record of a merged folder, else the folder's last run."""
    manifest = read_manifest(report_dir)
    if manifest is not None:
        return read_journal(report_dir), manifest
    return last_run(report_dir), None


def _status_of(rec: dict) -> str:
    r = rec.get("result") if isinstance(rec.get("result"), dict) else rec
    return str(r.get("status") or ("passed" if r.get("passed") else "failed"))


def _hint(drawn: Any) -> Optional[dict]:
    """What a dangling case_start says about its case, without building anything."""
    if not isinstance(drawn, dict):
        return None
    recipe = drawn.get("recipe") if isinstance(drawn.get("recipe"), dict) else None
    if recipe is None:
        return None
    return {"recipe": recipe, "describe": describe_recipe(recipe), "dtype": recipe.get("dtype"),
            "device": recipe.get("device")}


def _one_source(recs: List[dict], adapters: List[str], props: List[str]):
    """cells and failures of one source's records (the logic of a single run)."""
    cells: Dict[tuple, Dict[str, Any]] = {}
    failures: Dict[tuple, Dict[str, Any]] = {}

    def cell(a, p):
        if a not in adapters:
            adapters.append(a)
        if p not in props:
            props.append(p)
        return cells.setdefault((a, p), {"status": "not run", "examples": 0, "failed": 0, "message": "", "link": None,
                                         "final": False})

    for r in recs:
        ev = r.get("event")
        a, p = str(r.get("adapter", "?")), str(r.get("property", "?"))
        if ev == "result":
            c = cell(a, p)
            res = r.get("result") if isinstance(r.get("result"), dict) else r  # the driver writes it flat
            st = _status_of(r)
            c["examples"] += 1
            if not c["final"]:
                c["status"] = st if c["status"] == "not run" else worst(c["status"], st)
            if st not in ("passed", "skipped"):
                c["failed"] += 1
                f = failures.setdefault((a, p), {"adapter": a, "property": p})
                f.update({"status": st, "result": res, "case": res.get("case") or f.get("case"),
                          "message": res.get("message", ""), "test": r.get("test")})
            elif st == "skipped" and not c["message"]:
                c["message"] = res.get("message", "")
        elif ev == "test_end":
            c = cell(a, p)
            outcome = str(r.get("outcome", ""))
            st = r.get("status") or {"passed": "passed", "failed": "failed", "skipped": "skipped",
                                     "error": "error"}.get(outcome, outcome or "not run")
            c["status"], c["final"] = str(st), True
            c["message"] = r.get("message") or c["message"]
            if outcome == "known":  # the reason only; the failure itself is in the journal
                c["message"] = c["message"].split("\n", 1)[0]
            c["seconds"] = r.get("seconds")
            if outcome in ("failed", "error") or st in ("failed", "error", "crashed", "timeout"):
                f = failures.setdefault((a, p), {"adapter": a, "property": p})
                f.update({"status": str(st), "message": r.get("message") or f.get("message", ""),
                          "case_file": r.get("case_file"), "repro": r.get("repro"), "test": r.get("test")})
    for r in dangling_cases(recs):  # the examples that were running when the process died
        a, p = str(r.get("adapter", "?")), str(r.get("property", "?"))
        c = cell(a, p)
        if not c["final"]:
            c["status"] = "crashed"
            f = failures.setdefault((a, p), {"adapter": a, "property": p})
            f.update({"status": "crashed", "message": f.get("message") or "the process died while judging this example "
                      "(a case_start record without its result)", "drawn": r.get("drawn"), "test": r.get("test")})
            f["case"] = f.get("case") or _hint(r.get("drawn"))
    return cells, failures


def _when(t) -> Optional[str]:
    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _run_summary(recs: List[dict]) -> Dict[str, Any]:
    start = next((r for r in recs if r.get("event") == "run_start"), {})
    end = next((r for r in reversed(recs) if r.get("event") == "run_end"), None)
    t0 = start.get("t") or (recs[0].get("t") if recs else None)
    t1 = (end or {}).get("t") or (recs[-1].get("t") if recs else None)
    seconds = (end or {}).get("seconds")
    if seconds is None and t0 and t1:
        seconds = float(t1) - float(t0)
    settings = {k: start.get(k) for k in ("seed", "profile", "device", "isolate", "timeout") if k in start}
    unisolated = sum(int(r.get("judged_in_process") or 0) for r in recs if r.get("event") == "test_end")
    if unisolated:
        settings["without crash isolation"] = (f"{unisolated} example(s): CUDA had been initialised in the process "
                                               f"that drives the run, so they were judged there")
    return {"run_id": start.get("run_id") or (recs[0].get("run_id") if recs else None), "finished": end is not None,
            "exit_status": (end or {}).get("exit_status"), "started": _when(t0), "seconds": seconds,
            "env": start.get("env") or {}, "settings": settings, "argv": " ".join(map(str, start.get("argv") or [])),
            "run_counts": (end or {}).get("counts"), "start": start, "n_records": len(recs)}


def build_model(report_dir: str) -> Dict[str, Any]:
    """The run as the index page shows it (plain data; tolerant of missing fields and killed runs)."""
    recs, manifest = records_of(report_dir)
    by_source: Dict[str, List[dict]] = {}
    for r in recs:
        by_source.setdefault(str(r.get("source") or ""), []).append(r)
    if not by_source:
        by_source[""] = []
    adapters: List[str] = []
    props: List[str] = []
    adapter_info: Dict[str, dict] = {}
    sources = []
    for src, srecs in by_source.items():
        s = _run_summary(srecs)
        s["label"] = src
        sources.append(s)
        for a in s["start"].get("adapters", []) or []:
            if isinstance(a, dict) and a.get("name"):
                if a["name"] not in adapters:
                    adapters.append(a["name"])
                adapter_info.setdefault(a["name"], a)
        props += [str(p) for p in s["start"].get("properties", []) or [] if str(p) not in props]
    cells: Dict[tuple, Dict[str, Any]] = {}
    fail_list: List[Dict[str, Any]] = []
    for s in sources:
        scells, sfails = _one_source(by_source[s["label"]], adapters, props)
        for key, c in scells.items():
            c["source"] = s["label"]
            agg = cells.get(key)
            if agg is None:
                cells[key] = dict(c, sources=[(s["label"], c["status"])])
            else:
                agg["sources"].append((s["label"], c["status"]))
                if worst(c["status"], agg["status"]) == c["status"] and c["status"] != agg["status"]:
                    agg["status"], agg["message"] = c["status"], c["message"] or agg["message"]
                agg["examples"] += c["examples"]
                agg["failed"] += c["failed"]
        for f in sfails.values():
            f["source"] = s["label"]
            fail_list.append(f)
    used = set()
    for f in fail_list:
        case = f.get("case") or {}
        cid = os.path.splitext(os.path.basename(str(f["case_file"])))[0] if f.get("case_file") else None
        cid = safe_id(cid or case.get("id") or f"{f['adapter']}-{f['property']}")
        if cid in used:  # the same case failed for another adapter, property or source: one page each
            cid = safe_id(f"{cid}-{f['adapter']}-{f['property']}" + (f"-{f['source']}" if f["source"] else ""))
            n = 2
            while cid in used:
                cid, n = safe_id(f"{cid}-{n}"), n + 1
        used.add(cid)
        f["id"] = cid
        f["link"] = f"cases/{cid}.html"
        c = cells[(f["adapter"], f["property"])]
        c["link"] = c.get("link") or f["link"]
    counts: Dict[str, int] = {}
    for c in cells.values():
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    conventions: Dict[tuple, dict] = {}
    for r in recs:
        if r.get("event") == "conventions":
            conventions[(str(r.get("source") or ""), r.get("adapter"), r.get("device"))] = dict(r, source=r.get("source") or "")
    first = sources[0]
    merged = manifest is not None
    return {
        "merged": merged, "sources": sources if merged else [],
        "run_id": first["run_id"] if not merged else ", ".join(str(s["run_id"]) for s in sources),
        "finished": all(s["finished"] for s in sources), "exit_status": first["exit_status"] if not merged else None,
        "started": first["started"], "seconds": first["seconds"] if not merged else None,
        "env": first["env"] if not merged else {}, "settings": first["settings"] if not merged else {},
        "argv": first["argv"] if not merged else "",
        "adapters": adapters, "adapter_info": adapter_info, "properties": props, "cells": cells,
        "counts": [(k, counts[k]) for k in ORDER if k in counts], "run_counts": first["run_counts"],
        "failures": fail_list, "n_records": len(recs), "conventions": list(conventions.values()),
        "distinct": bug_section(report_dir, recs, fail_list),
    }
