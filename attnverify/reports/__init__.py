"""HTML reports rendered from a report folder: the journal (`results.jsonl`) and what the run stored
beside it (cases/<id>.json, their evidence: diagnosis, heatmap arrays, worst rows; convention probes
and the adapters' origins in the journal).

    from attnverify.reports import render
    index = render("reports")          # reports/index.html and reports/cases/<id>.html per failure

Rendering only reads the folder: it imports no adapter, reference, check or kernel code and never
touches a GPU, so a report renders the same on a laptop without the kernel, the GPU or the repository,
and rendering the same folder twice writes the same bytes. Everything is escaped (Jinja2 autoescape);
pages are static and self-contained (images as data: URIs). Several runs (shards, machines, GPUs)
merge into one report with `merge` (attnverify report RUN1 RUN2 --out MERGED).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .artifact import failure_context, load_evidence
from .model import ORDER, build_model, safe_id

__all__ = ["render", "build_model", "attach_extras", "safe_id", "ORDER", "RESULT_KEY"]

RESULT_KEY = "attnverify_result"  # item.user_properties key / item attribute the plugin sets for pytest-html


def _env():
    import jinja2

    from ..attribution_text import NO_NEED, needed

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("attnverify.reports", "templates"),
        autoescape=True,  # everything: adapter names, messages and tracebacks come from adapters
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True, lstrip_blocks=True,
    )
    env.filters["needed"] = needed  # an attribution's words (attnverify.attribution_text)
    env.globals["no_need"] = NO_NEED
    return env


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def render(report_dir: str = "reports") -> str:
    """Write `<report_dir>/index.html` and `<report_dir>/cases/<id>.html` per failure; return the index
    path. Reads only the folder (see the module doc)."""
    from .heatmap import colorbar_data_uri

    report_dir = os.path.abspath(report_dir)
    os.makedirs(os.path.join(report_dir, "cases"), exist_ok=True)
    env = _env()
    model = build_model(report_dir)
    css = env.loader.get_source(env, "report.css")[0]
    for f in model["failures"]:
        failure_context(report_dir, f, model["adapter_info"])
        html = env.get_template("case.html").render(f=f, model=model, css=css, colorbar=colorbar_data_uri(),
                                                    recipe_json=json.dumps((f["case"] or {}).get("recipe"), indent=1, default=str))
        _write(os.path.join(report_dir, "cases", f"{f['id']}.html"), html)
    html = env.get_template("index.html").render(m=model, css=css, conventions=model["conventions"], order=ORDER)
    index = os.path.join(report_dir, "index.html")
    _write(index, html)
    return index


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
    attach the stored diagnosis and the first heatmaps (the evidence the judging child wrote beside the
    case file; nothing is run here) as extras. Needs the plugin to leave
    {"adapter", "property", "result": ExampleResult.to_dict(), "case_file"?} on the item as
    `item.attnverify_result` or `item.user_properties` entry "attnverify_result". Returns True when it attached
    something; does nothing (False) without pytest-html."""
    if getattr(report, "when", None) != "call" or not getattr(report, "failed", False):
        return False
    try:
        from pytest_html import extras as html_extras
    except ImportError:
        return False
    data = _item_result(item)
    if not data:
        return False
    from markupsafe import escape

    cf = data.get("case_file")
    info = load_evidence(str(cf) if cf and os.path.isfile(str(cf)) else None)
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
