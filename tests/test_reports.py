"""HTML reports from a planted journal: content, escaping, self-containment, and a real headless browser."""
from __future__ import annotations

import base64
import html
import os
import re
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attnverify as av  # noqa: E402
from attnverify.adapters import registry  # noqa: E402
from attnverify.evidence import record_evidence  # noqa: E402
from attnverify.isolation import InProcessRunner  # noqa: E402
from attnverify.journal import Journal, save_case  # noqa: E402
from attnverify.probes import probe_record  # noqa: E402
from attnverify.reports import attach_extras, build_model, render  # noqa: E402
from attnverify.reports.heatmap import encode_png, heatmap_data_uri  # noqa: E402

EVIL = "<script>alert('pwned')</script>"


def _zoo():
    import _wrong_for_diagnosis as W

    z = {w.name: w for w in W.zoo()}
    for w in z.values():
        registry.register_adapter(w.adapter)
    return z


def _result_event(j, adapter, prop, res_dict, test):
    j({"event": "result", "adapter": adapter, "property": prop, "test": test, "result": res_dict})


def plant(report_dir, *, finished=True):
    """A run of 3 adapters x 3 properties: passes, a wrong answer, an exception with <script>, a skip, a crash.
    What the run stores beside the journal (evidence of each failure, convention probes) is stored as the
    plugin does, through a runner (in-process here)."""
    z = _zoo()
    j = Journal(str(report_dir), fsync=False)
    props = ["forward_matches_reference", "fully_masked_rows", "window"]
    j({"event": "run_start", "env": {"python": "3.x", "torch": "2.13", "gpu": None}, "seed": 1234, "profile": "ci",
       "device": "cpu", "isolate": "none",
       "adapters": [{"name": "naive", "available": True, "reason": None, "claims": "c", "device": "cpu"},
                    {"name": "no_scale", "available": True, "reason": None, "claims": "c", "device": "cpu"},
                    {"name": EVIL, "available": True, "reason": None, "claims": EVIL, "device": "cpu"}],
       "properties": props, "argv": ["pytest", "--adapter=naive,no_scale"]})
    from attnverify.properties.base import ExampleResult

    case = z["no_scale"].case()
    naive = registry.get("naive")
    for name, ad in (("naive", naive), ("no_scale", z["no_scale"].adapter)):
        res = av.check(ad, case, backward=False)
        er = ExampleResult(res.passed, message=res.message(), records=[res.to_dict()], case=case.to_dict(),
                           severity=res.severity())
        test = f"test_forward_matches_reference[{name}]"
        j({"event": "case_start", "adapter": name, "property": props[0], "test": test, "drawn": case.recipe.to_dict()})
        _result_event(j, name, props[0], er.to_dict(), test)
        cf = None
        if not res.passed:
            cf = save_case(str(report_dir), prop_name=props[0], adapter_name=name, drawn=case.recipe.to_dict(),
                           result=er.to_dict(), run_id=j.run_id, seed=1234, env={})
            record_evidence(InProcessRunner(), ad, status="failed", case=er.case, case_file=cf)
        j({"event": "test_end", "adapter": name, "property": props[0], "test": test,
           "outcome": "passed" if res.passed else "failed", "seconds": 0.1, "examples": 1,
           "message": "" if res.passed else res.message(), "case_file": cf,
           "repro": None if cf is None else f"attnverify repro {os.path.relpath(cf, os.path.dirname(str(report_dir)))}",
           "status": None if res.passed else "failed"})
    # the evil adapter raised with <script> in the message
    er = ExampleResult(False, message=f"RuntimeError: kernel said {EVIL}", status="error", case=case.to_dict())
    _result_event(j, EVIL, props[0], er.to_dict(), f"test_forward_matches_reference[{EVIL}]")
    j({"event": "test_end", "adapter": EVIL, "property": props[0], "outcome": "failed", "status": "error",
       "message": f"RuntimeError: kernel said {EVIL}", "case_file": None, "repro": None})
    for a in ("naive", "no_scale", EVIL):
        j({"event": "test_end", "adapter": a, "property": "window", "outcome": "skipped",
           "message": f"{a} does not claim window" if a != "naive" else "", "status": None})
    j({"event": "test_end", "adapter": "naive", "property": "window", "outcome": "passed"})
    j({"event": "test_end", "adapter": "naive", "property": "fully_masked_rows", "outcome": "passed"})
    j({"event": "test_end", "adapter": "no_scale", "property": "fully_masked_rows", "outcome": "passed"})
    for ad in (naive, z["no_scale"].adapter):
        j(probe_record(InProcessRunner(), ad, "cpu"))
    j({"event": "conventions", "adapter": EVIL, "device": "cpu", "declared": {}, "observed": {},
       "note": f"probe failed (crashed): {EVIL}"})
    # a crash: case_start without result for the evil adapter
    j({"event": "case_start", "adapter": EVIL, "property": "fully_masked_rows", "test": "t-crash",
       "drawn": case.recipe.to_dict()})
    if finished:
        j({"event": "run_end", "exit_status": 1, "seconds": 12.5, "counts": {"passed": 4, "failed": 2}})
    j.close()
    return z


def test_png_encoder_roundtrip():
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    png = encode_png(img)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # decode the single IDAT by hand
    i = png.index(b"IDAT")
    n = int.from_bytes(png[i - 4:i], "big")
    raw = zlib.decompress(png[i + 4:i + 4 + n])
    assert raw == b"".join(b"\x00" + img[y].tobytes() for y in range(2))
    uri = heatmap_data_uri(np.array([[0.0, 1.0], [np.nan, 0.5]]))
    assert uri.startswith("data:image/png;base64,")
    base64.b64decode(uri.split(",", 1)[1])


def test_model_from_planted_journal(tmp_path):
    rep = tmp_path / "reports"
    plant(rep)
    m = build_model(str(rep))
    assert m["finished"] and m["settings"]["seed"] == 1234
    cells = m["cells"]
    assert cells[("naive", "forward_matches_reference")]["status"] == "passed"
    assert cells[("no_scale", "forward_matches_reference")]["status"] == "failed"
    assert cells[(EVIL, "forward_matches_reference")]["status"] == "error"
    assert cells[("no_scale", "window")]["status"] == "skipped"
    assert cells[("naive", "window")]["status"] == "passed"  # the later test_end wins
    assert cells[(EVIL, "fully_masked_rows")]["status"] == "crashed"
    assert {(f["adapter"], f["status"]) for f in m["failures"]} == {("no_scale", "failed"), (EVIL, "error"), (EVIL, "crashed")}
    for f in m["failures"]:
        assert re.fullmatch(r"cases/[A-Za-z0-9_.-]+\.html", f["link"])


def test_render_pages(tmp_path):
    rep = tmp_path / "reports"
    plant(rep)
    index = render(str(rep))
    text = open(index, encoding="utf-8").read()
    assert EVIL not in text and html.escape(EVIL, quote=False) in text.replace("&#39;", "'")
    assert 'id="matrix"' in text and "run time" in text and "12.5 s" in text
    assert "http://" not in text and "https://" not in text  # nothing to fetch
    m = build_model(str(rep))
    fail = next(f for f in m["failures"] if f["adapter"] == "no_scale")
    page = open(rep / fail["link"], encoding="utf-8").read()
    assert "softmax scale missing" in page  # the diagnosis
    assert page.count('class="heatmap" src="data:image/png;base64,') >= 2
    assert "attnverify repro reports/cases/" in page
    assert "av.resolve('no_scale')" in page or "av.resolve(&#39;no_scale&#39;)" in page
    assert 'id="worst-rows"' in page and "visible keys" in page
    assert "<script" not in page.lower()
    for f in m["failures"]:
        p = open(rep / f["link"], encoding="utf-8").read()
        assert "<script" not in p.lower(), f["adapter"]
    # the conventions table, from the journal's probe records (a failed probe says why)
    assert 'id="conventions"' in text and "probe failed (crashed)" in text
    assert "top_left/bottom_right / neither alignment" in text  # no_scale's causal probe, observed during the run
    # the index shows each failure's diagnosis
    assert "softmax scale missing" in text
    # rendering again writes the same bytes
    before = {p: p.read_bytes() for p in rep.rglob("*.html")}
    render(str(rep))
    assert {p: p.read_bytes() for p in rep.rglob("*.html")} == before


def test_snippet_replays(tmp_path):
    """The standalone snippet on a case page runs and reproduces the failure."""
    rep = tmp_path / "reports"
    plant(rep)
    render(str(rep))
    m = build_model(str(rep))
    fail = next(f for f in m["failures"] if f["adapter"] == "no_scale")
    page = open(rep / fail["link"], encoding="utf-8").read()
    snippet = html.unescape(re.search(r'<pre id="snippet">(.*?)</pre>', page, re.S).group(1))
    _zoo()
    ns = {}
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(snippet, "snippet", "exec"), ns)
    assert "FAILED" in buf.getvalue() and "scale missing" in buf.getvalue()


def test_killed_run_renders(tmp_path):
    rep = tmp_path / "reports"
    plant(rep, finished=False)
    with open(rep / "results.jsonl", "a") as f:
        f.write('{"v": 1, "event": "result", "adapter": "naive", "prop')  # cut short by the kill
    text = open(render(str(rep)), encoding="utf-8").read()
    assert 'id="unfinished"' in text and "crashed" in text


def test_attach_extras_without_or_with_pytest_html(tmp_path):
    class Rep:
        when, failed = "call", True
        extras = []

    class Item:
        user_properties = []

    try:
        import pytest_html  # noqa: F401
        have = True
    except ImportError:
        have = False
    assert attach_extras(Item(), Rep()) is False  # nothing recorded on the item -> nothing attached
    if not have:
        pytest.skip("pytest-html is not installed: attach_extras is a no-op (checked above)")
    z = _zoo()
    w = z["no_scale"]
    import _wrong_for_diagnosis as W

    res, _ = W.run_one(w)
    cf = save_case(str(tmp_path), prop_name="forward_matches_reference", adapter_name="no_scale",
                   drawn={"recipe": res.case.recipe.to_dict()}, result={"status": "failed"})
    item = Item()
    item.user_properties = [("attnverify_result", {"adapter": "no_scale", "property": "forward_matches_reference",
                                                   "result": {"status": "failed"}, "case_file": cf})]
    rep = Rep()
    rep.extras = []
    assert attach_extras(item, rep) is True  # no evidence stored: a note, nothing run here
    assert "no evidence was stored" in rep.extras[0]["content"]
    record_evidence(InProcessRunner(), w.adapter, status="failed", case=res.case.to_dict(), case_file=cf)
    rep = Rep()
    rep.extras = []
    assert attach_extras(item, rep) is True
    kinds = [e.get("format_type") or e.get("format") for e in rep.extras]
    assert "html" in kinds and "image" in kinds, rep.extras
    assert "scale missing" in rep.extras[0]["content"]


# --------------------------------------------------------------------------- headless Chromium

def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _dump(browser, url, tmp_path, *extra):
    prof = tmp_path / f"profile{len(list(tmp_path.iterdir()))}"
    prof.mkdir()
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={prof}", *extra, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return r


def test_report_in_headless_chromium(tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it): browser test not run")
    rep = tmp_path / "reports"
    plant(rep)
    index = render(str(rep))
    # the DOM after the browser parsed it: a <script> from the adapter must be text, never an element
    r = _dump(browser, "file://" + index, tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert 'id="matrix"' in dom
    assert "<script" not in dom.lower()  # had it been parsed as markup, the DOM would hold a script element
    assert "&lt;script&gt;alert" in dom  # ... it is shown, escaped, as text
    # every link of the index resolves to a page the browser can open, which holds heatmap images
    links = re.findall(r'href="(cases/[^"]+\.html)"', dom)
    assert links, "no links to failures"
    m = build_model(str(rep))
    fail = next(f for f in m["failures"] if f["adapter"] == "no_scale")
    assert fail["link"] in links
    for link in sorted(set(links)):
        assert (rep / link).exists(), link
    r = _dump(browser, "file://" + str(rep / fail["link"]), tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    page = r.stdout
    assert page.count('class="heatmap"') >= 2 and "softmax scale missing" in page
    assert 'href="../index.html"' in page
    # the images decode: a screenshot with a script that would mark failures is not allowed (no JS), so
    # check the data URIs are valid PNGs and that a screenshot renders
    for uri in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        assert base64.b64decode(uri)[:8] == b"\x89PNG\r\n\x1a\n"
    shot = tmp_path / "shot.png"
    r = _dump(browser, "file://" + str(rep / fail["link"]), tmp_path, f"--screenshot={shot}", "--window-size=1200,2400")
    assert r.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, r.stderr[-2000:]


def _bwd_wrong_adapter():
    """Forward right; dV of the last 8 keys doubled (a backward-only, key-local bug)."""
    from attnverify.adapters.naive import naive_attention

    class Grad(__import__("torch").autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.clone()

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            g[:, :, -8:] *= 2.0
            return g

    @av.adapter("bwd_last_keys", register=False, backward=True, causal=("none", "top_left"))
    def bwd(q, k, v, spec):
        return naive_attention(q, k, Grad.apply(v), spec).out

    return bwd


def test_analysis_of_a_backward_failure_shows_per_key_maps():
    from attnverify.case import CaseRecipe
    from attnverify.evidence import analyse

    a = _bwd_wrong_adapter()
    recipe = CaseRecipe(len_q=40, len_k=40, causal="top_left", seed=4).to_dict()
    info = analyse(a, "failed", {"recipe": recipe})
    ids = [h["id"] for h in info["heatmaps"]]
    assert "heads-dk" in ids and "heads-dv" in ids and "query-keytile" in ids, info["notes"]
    failing = [c["name"] for c in info["check"]["comparisons"] if not c["passed"]]
    assert failing == ["dv"]
    d = info["diagnosis"]
    assert "backward pass only" in " ".join(d["notes"])
    assert any(s["key"] == "last_key_tile" for s in d["signatures"]), d
