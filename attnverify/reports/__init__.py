"""HTML reports rendered from the results journal (`reports/results.jsonl`) and the saved cases.

    from attnverify.reports import render
    index = render("reports")          # reports/index.html and reports/cases/<id>.html per failure

Rendering reads only journaled records and saved cases; it may rebuild a failed case from its recipe
and re-run the check (when the adapter resolves by name here) to draw heatmaps and a diagnosis.
Everything is escaped (Jinja2 autoescape); pages are static, self-contained (images as data: URIs).
"""
from __future__ import annotations

import datetime
import json
import os
import pprint
import re
from typing import Any, Dict, List, Optional

# worst first; known = a documented finding (xfail); xpass = a declared finding that did not reproduce (strict)
ORDER = ("crashed", "timeout", "error", "failed", "xpass", "known", "passed", "skipped", "not run")
RESULT_KEY = "attnverify_result"  # item.user_properties key / item attribute the plugin sets for pytest-html


def _env():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("attnverify.reports", "templates"),
        autoescape=True,  # everything: adapter names, messages and tracebacks come from adapters
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True, lstrip_blocks=True,
    )


def safe_id(x: Any) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]", "_", str(x))[:80].lstrip(".")
    return s or "case"


def _read(report_dir: str) -> List[dict]:
    try:
        from ..journal import last_run

        return last_run(report_dir)
    except ImportError:  # pragma: no cover - the journal module is part of the package
        return []


def _status_of(rec: dict) -> str:
    r = rec.get("result") if isinstance(rec.get("result"), dict) else rec
    st = r.get("status") or ("passed" if r.get("passed") else "failed")
    return str(st)


def _worst(a: str, b: str) -> str:
    ia = ORDER.index(a) if a in ORDER else 3
    ib = ORDER.index(b) if b in ORDER else 3
    return a if ia <= ib else b


def build_model(report_dir: str) -> Dict[str, Any]:
    """The run as the index page shows it (plain data; tolerant of missing fields and killed runs)."""
    from ..journal import dangling_cases

    recs = _read(report_dir)
    start = next((r for r in recs if r.get("event") == "run_start"), {})
    end = next((r for r in reversed(recs) if r.get("event") == "run_end"), None)
    adapters: List[str] = [a.get("name") for a in start.get("adapters", []) if isinstance(a, dict) and a.get("name")]
    adapter_info = {a.get("name"): a for a in start.get("adapters", []) if isinstance(a, dict)}
    props: List[str] = [str(p) for p in start.get("properties", []) or []]
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
                c["status"] = st if c["status"] == "not run" else _worst(c["status"], st)
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
            st = r.get("status") or {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "error"}.get(outcome, outcome or "not run")
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
            if not f.get("case"):
                try:
                    from ..journal import case_hint

                    f["case"] = case_hint(r.get("drawn"))
                except Exception:
                    pass
    fail_list = []
    used = set()
    for (a, p), f in failures.items():
        case = f.get("case") or {}
        cid = None
        if f.get("case_file"):
            cid = os.path.splitext(os.path.basename(str(f["case_file"])))[0]
        cid = safe_id(cid or case.get("id") or f"{a}-{p}")
        if cid in used:  # the same case failed for another adapter or property: one page each
            cid = safe_id(f"{cid}-{a}-{p}")
            n = 2
            while cid in used:
                cid, n = safe_id(f"{cid}-{n}"), n + 1
        used.add(cid)
        f["id"] = cid
        f["link"] = f"cases/{cid}.html"
        cells[(a, p)]["link"] = f["link"]
        fail_list.append(f)
    counts: Dict[str, int] = {}
    for c in cells.values():
        counts[c["status"]] = counts.get(c["status"], 0) + 1
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
    return {
        "run_id": start.get("run_id") or (recs[0].get("run_id") if recs else None),
        "finished": end is not None, "exit_status": (end or {}).get("exit_status"),
        "started": _when(t0), "seconds": seconds, "env": start.get("env") or {},
        "settings": settings,
        "argv": " ".join(map(str, start.get("argv") or [])),
        "adapters": adapters, "adapter_info": adapter_info, "properties": props, "cells": cells,
        "counts": [(k, counts[k]) for k in ORDER if k in counts], "run_counts": (end or {}).get("counts"),
        "failures": fail_list, "n_records": len(recs),
    }


def _when(t) -> Optional[str]:
    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except Exception:
        return None


def _load_case_file(report_dir: str, f: dict) -> (Optional[dict], Optional[str]):
    path = f.get("case_file")
    cands = [path] if path else []
    cands.append(os.path.join(report_dir, "cases", f"{f['id']}.json"))
    for c in cands:
        if not c:
            continue
        p = c if os.path.isabs(c) else (c if os.path.exists(c) else os.path.join(report_dir, "cases", os.path.basename(c)))
        if os.path.exists(p):
            try:
                with open(p) as fh:
                    return json.load(fh), p
            except Exception:
                return None, p
    return None, None


def _snippet(adapter: str, case: Optional[dict], case_path_rel: str) -> str:
    lines = ["import attnverify as av", "from attnverify.case import CaseRecipe, build_case",
             "from attnverify.diagnose import diagnose_result", ""]
    if case and case.get("recipe"):
        rec = pprint.pformat(_non_default(case["recipe"]), indent=1, width=96, sort_dicts=False)
        lines.append(f"case = build_case(CaseRecipe.from_dict({rec}))")
    else:
        lines.append(f"case = av.load_case({case_path_rel!r})")
    lines += [f"adapter = av.resolve({adapter!r})[0]", "result = av.check(adapter, case)", "print(result.message())",
              "print(diagnose_result(result, adapter=adapter).text())"]
    return "\n".join(lines)


def _non_default(recipe: dict) -> dict:
    """Only the fields that differ from CaseRecipe's defaults (from_dict fills in the rest)."""
    try:
        from ..case import CaseRecipe

        default = CaseRecipe().to_dict()
    except Exception:
        return dict(recipe)

    def norm(x):
        return list(x) if isinstance(x, tuple) else x

    return {k: v for k, v in recipe.items() if k not in default or norm(default[k]) != norm(v)}


def _comparisons(result: dict) -> List[dict]:
    rows = []
    for rec in (result or {}).get("records") or []:
        for c in rec.get("comparisons") or []:
            rows.append(dict(c, adapter_status=rec.get("status")))
    return rows


def render(report_dir: str = "reports", *, rerun: bool = True, probe_conventions: bool = True,
           timeout: Optional[float] = 60.0, isolate: bool = True) -> str:
    """Write `<report_dir>/index.html` and `<report_dir>/cases/<id>.html` per failure; return the index path.

    Diagnosis re-runs a failing case and the conventions table probes each adapter: both call the
    adapter again, so each runs in a forked child with `timeout` seconds (a hanging or crashing
    adapter costs that piece of the report, never the report); isolate=False runs them here."""
    from .heatmap import colorbar_data_uri

    report_dir = os.path.abspath(report_dir)
    os.makedirs(os.path.join(report_dir, "cases"), exist_ok=True)
    env = _env()
    model = build_model(report_dir)
    css = env.loader.get_source(env, "report.css")[0]
    parent = os.path.dirname(report_dir)
    for f in model["failures"]:
        saved, path = _load_case_file(report_dir, f)
        case = f.get("case") or (saved if saved and saved.get("shapes") else None)
        if saved and not case:
            case = saved
        f["case"] = case
        json_path = path or os.path.join(report_dir, "cases", f"{f['id']}.json")
        rel = os.path.relpath(json_path, parent) if os.path.exists(json_path) else os.path.join(os.path.basename(report_dir), "cases", f"{f['id']}.json")
        f["repro"] = f.get("repro") or (saved or {}).get("repro") or f"attnverify repro {rel}"
        f["snippet"] = _snippet(f["adapter"], case, rel)
        f["comparisons"] = _comparisons(f.get("result"))
        f["analysis"] = _isolated_analysis(f, case, path, rerun, timeout, isolate)
        html = env.get_template("case.html").render(f=f, model=model, css=css, colorbar=colorbar_data_uri(),
                                                    recipe_json=json.dumps((case or {}).get("recipe"), indent=1, default=str))
        with open(os.path.join(report_dir, "cases", f"{f['id']}.html"), "w", encoding="utf-8") as fh:
            fh.write(html)
    conv = []
    if probe_conventions and len(model["adapters"]) > 1:
        conv = conventions_table(model["adapters"], timeout=timeout, isolate=isolate)
    html = env.get_template("index.html").render(m=model, css=css, conventions=conv, order=ORDER)
    index = os.path.join(report_dir, "index.html")
    with open(index, "w", encoding="utf-8") as fh:
        fh.write(html)
    return index


def _isolated_analysis(f: dict, case, path, rerun: bool, timeout: Optional[float], isolate: bool) -> dict:
    from ..isolation import call_isolated
    from .analysis import analyse

    if not rerun:  # nothing calls the adapter
        return analyse(f["adapter"], f["status"], case, path, rerun=False)
    ok, value = call_isolated(analyse, f["adapter"], f["status"], case, path, rerun=True, timeout=timeout,
                              inline=not isolate)
    if ok:
        return value
    return {"notes": [f"re-running the case for diagnosis failed: {value}; metrics only"], "rerun": False,
            "diagnosis": None, "heatmaps": [], "worst_rows": [], "check": None}


def conventions_table(names: List[str], timeout: Optional[float] = 60.0, isolate: bool = True) -> List[dict]:
    from ..isolation import call_isolated
    from . import conventions
    from .analysis import _adapter

    rows = []
    for n in names:
        a, why = _adapter(n)
        if a is None:
            rows.append({"adapter": n, "note": why, "declared": {}, "observed": {}})
            continue
        ok, observed = call_isolated(conventions.observe, a, timeout=timeout, inline=not isolate)
        if ok:
            rows.append({"adapter": n, "note": "", "declared": conventions.declared(a), "observed": observed})
        else:
            rows.append({"adapter": n, "note": f"probe failed: {observed}", "declared": conventions.declared(a), "observed": {}})
    return rows


# ------------------------------------------------------------------------------------ pytest-html


def _item_result(item) -> Optional[dict]:
    r = getattr(item, RESULT_KEY, None)
    if isinstance(r, dict):
        return r
    for k, v in getattr(item, "user_properties", []) or []:
        if k == RESULT_KEY and isinstance(v, dict):
            return v
    return None


def attach_extras(item, report, report_dir: Optional[str] = None) -> bool:
    """From a `pytest_runtest_makereport` hookwrapper: when pytest-html is active and the test failed,
    attach the diagnosis and the first heatmap as extras. Needs the plugin to leave
    {"adapter", "property", "result": ExampleResult.to_dict(), "case_file"?} on the item as
    `item.attnverify_result` or `item.user_properties` entry "attnverify_result". Returns True when it attached
    something; does nothing (False) without pytest-html."""
    if getattr(report, "when", None) != "call" or not getattr(report, "failed", False):
        return False
    try:
        from pytest_html import extras as html_extras
    except Exception:
        return False
    data = _item_result(item)
    if not data:
        return False
    from .analysis import analyse
    from markupsafe import escape

    res = data.get("result") or {}
    info = analyse(str(data.get("adapter", "")), res.get("status") or "failed", res.get("case"), data.get("case_file"))
    diag = (info.get("diagnosis") or {}).get("summary") or "; ".join(info.get("notes") or []) or "no diagnosis"
    extra = [html_extras.html(f"<div><b>attnverify diagnosis:</b> {escape(diag)}</div>")]
    if data.get("case_file") and report_dir:
        cid = safe_id(os.path.splitext(os.path.basename(str(data["case_file"])))[0])
        extra.append(html_extras.url(os.path.join(report_dir, "cases", f"{cid}.html"), name="attnverify case page"))
    for h in info.get("heatmaps", [])[:2]:
        extra.append(html_extras.png(h["uri"].split(",", 1)[1], name=h["title"]))
    attr = "extras" if hasattr(report, "extras") or not hasattr(report, "extra") else "extra"
    setattr(report, attr, list(getattr(report, attr, []) or []) + extra)
    return True
