"""A report is a function of its folder: it renders elsewhere, without the adapter, the GPU or the repo.

- a run of a file adapter, its report folder moved to an empty folder and the adapter file deleted,
  renders in a fresh interpreter with CUDA hidden: every page holds the diagnosis and the heatmaps
  (checked in headless Chromium), the repro names the adapter by its origin, and rendering twice gives
  the same bytes;
- several runs merge into one report that says where each result came from;
- nothing under attnverify/reports imports adapters, check, reference, kernels (nor torch).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WRONG_FILE = '''
import torch, attnverify as av

@av.adapter("filemine", backward=True)
def impl(q, k, v, spec):   # forgets the softmax scale
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
'''
PROPS = "forward_matches_reference or gradients_match_reference"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ATTNVERIFY_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(args, cwd, timeout=600, **env):
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _html_files(folder: Path):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.html"))}


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """One run of a wrong adapter defined in a file (kernels/mine_impl.py:impl)."""
    run = tmp_path_factory.mktemp("run")
    (run / "kernels").mkdir()
    (run / "kernels" / "mine_impl.py").write_text(WRONG_FILE)
    code, out = _run(["-m", "attnverify.cli", "run", "--adapter", "kernels/mine_impl.py:impl", "--profile", "ci",
                      "--max-examples", "3", "-k", PROPS, "-q"], cwd=run)
    assert code == 1, out[-4000:]  # the properties failed, the run completed
    pristine = tmp_path_factory.mktemp("pristine") / "reports"
    shutil.copytree(run / "reports", pristine)  # for the merge test: the other test moves the run's folder
    return run, pristine


def test_a_moved_report_renders_without_the_adapter_with_every_diagnosis_and_heatmap(file_run, tmp_path):
    from test_reports import _chromium, _dump

    file_run, _ = file_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(str(file_run / "reports"), str(elsewhere / "reports"))
    adapter_file = file_run / "kernels" / "mine_impl.py"
    run_hash = __import__("hashlib").sha256(adapter_file.read_bytes()).hexdigest()
    shutil.rmtree(file_run / "kernels")  # the adapter is gone
    rep = elsewhere / "reports"
    for p in rep.rglob("*.html"):
        p.unlink()  # whatever the run rendered: the pages below come from the folder alone
    # a fresh interpreter, CUDA hidden; rendering must not load the analysis, probes or any kernel
    check_imports = (
        "import sys\n"
        "from attnverify import cli\n"
        "rc = cli.main(['report', 'reports'])\n"
        "bad = sorted(m for m in sys.modules if m in ('attnverify.evidence', 'attnverify.probes', "
        "'attnverify.diagnose', 'attnverify.adapters.naive') or m.startswith(('attnverify.kernels', 'attnverify_user_')))\n"
        "assert not bad, bad\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "sys.exit(rc)\n"
    )
    code, out = _run(["-c", check_imports], cwd=elsewhere, CUDA_VISIBLE_DEVICES="")
    assert code == 0, out[-3000:]
    first = _html_files(rep)
    code, out = _run(["-m", "attnverify.cli", "report", "reports"], cwd=elsewhere, CUDA_VISIBLE_DEVICES="")
    assert code == 0, out[-3000:]
    assert _html_files(rep) == first  # idempotent: the same bytes
    index = (rep / "index.html").read_text()
    links = sorted(set(re.findall(r'href="(cases/[^"]+\.html)"', index)))
    assert len(links) == 2, links  # forward and gradients both failed
    for link in links:
        page = (rep / link).read_text()
        assert "softmax scale missing" in page, link  # the diagnosis, from the stored evidence
        assert page.count('class="heatmap" src="data:image/png;base64,') >= 2, link
        assert "No comparison records" not in page and 'id="metrics"' in page
        repro = re.search(r'<pre id="repro">(.*?)</pre>', page, re.S).group(1)
        assert "--adapter kernels/mine_impl.py:impl" in repro, repro
        assert "av.resolve(&#39;kernels/mine_impl.py:impl&#39;)" in page
        assert run_hash in page  # the origin's file hash
    assert index.count("softmax scale missing") >= 2  # the index shows each failure's diagnosis
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it): pages checked as "
                    "files only, not in a browser")
    r = _dump(browser, "file://" + str(rep / "index.html"), tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'id="matrix"' in r.stdout and r.stdout.count("softmax scale missing") >= 2
    for link in links:
        r = _dump(browser, "file://" + str(rep / link), tmp_path, "--dump-dom")
        assert r.returncode == 0, r.stderr[-2000:]
        dom = r.stdout
        assert "softmax scale missing" in dom and 'href="../index.html"' in dom
        uris = re.findall(r'class="heatmap" src="data:image/png;base64,([^"]+)"', dom)
        assert len(uris) >= 2
        import base64

        assert all(base64.b64decode(u)[:8] == b"\x89PNG\r\n\x1a\n" for u in uris)
    # on a machine that has the adapter (same layout), the page's repro command replays the failure
    (elsewhere / "kernels").mkdir()
    (elsewhere / "kernels" / "mine_impl.py").write_text(WRONG_FILE)
    page = (rep / links[0]).read_text()
    import html as html_mod

    cmd = html_mod.unescape(re.search(r'<pre id="repro">(.*?)</pre>', page, re.S).group(1)).split()
    assert cmd[:2] == ["attnverify", "repro"]
    code, out = _run(["-m", "attnverify.cli", *cmd[1:], "--isolate", "none"], cwd=elsewhere)
    assert code == 1 and "STILL FAILS" in out, out[-3000:]


def test_runs_merge_into_one_report_with_their_sources(file_run, tmp_path):
    """Two runs (as two shards or two machines) merge into one report: a source column and per-source
    environments; the merged folder renders like any other and again to the same bytes."""
    from attnverify import cli
    from attnverify.reports import build_model
    from attnverify.journal import Journal

    src = file_run[1]
    a, b = tmp_path / "gpu0" / "reports", tmp_path / "gpu1" / "reports"
    shutil.copytree(src, a)
    b.mkdir(parents=True)
    j = Journal(str(b), run_id="second")
    j({"event": "run_start", "env": {"gpu": ["H200"], "torch": "2.11"}, "seed": 7, "profile": "ci",
       "adapters": [{"name": "filemine", "available": True, "origin": {"kind": "builtin", "target": "filemine"}}],
       "properties": ["forward_matches_reference"]})
    j({"event": "test_end", "property": "forward_matches_reference", "adapter": "filemine", "outcome": "passed",
       "examples": 4})
    j({"event": "run_end", "exit_status": 0})
    j.close()
    out = tmp_path / "merged"
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 0
    m = build_model(str(out))
    assert m["merged"] and [s["label"] for s in m["sources"]] == ["gpu0", "gpu1"]
    cell = m["cells"][("filemine", "forward_matches_reference")]
    assert cell["status"] == "failed" and dict(cell["sources"]) == {"gpu0": "failed", "gpu1": "passed"}
    assert {f["source"] for f in m["failures"]} == {"gpu0"}
    index = (out / "index.html").read_text()
    assert 'id="sources"' in index and "H200" in index and '<td class="source">gpu0</td>' in index
    page = (out / m["failures"][0]["link"]).read_text()
    assert "softmax scale missing" in page and "from: <b>gpu0</b>" in page
    before = _html_files(out)
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 0  # merging again rebuilds the same
    assert _html_files(out) == before
    # bad input names the argument and the fix
    assert cli.main(["report", str(a), str(b)]) == 2
    assert cli.main(["report", str(a), str(tmp_path), "--out", str(tmp_path / "m2")]) == 2
    assert cli.main(["report", str(a), "--out", str(a)]) == 2


# ----------------------------------------------------------------------------------- architecture

FORBIDDEN = ("attnverify.adapters", "attnverify.check", "attnverify.reference", "attnverify.kernels",
             "attnverify.diagnose", "attnverify.evidence", "attnverify.probes", "attnverify.case", "torch")


def _absolute(module: str, level: int, name: str) -> str:
    if level == 0:
        return name
    parts = module.split(".")[: len(module.split(".")) - level]
    return ".".join(parts + ([name] if name else []))


def test_reports_import_nothing_that_runs_an_adapter_ast():
    pkg = ROOT / "attnverify" / "reports"
    found = []
    for path in sorted(pkg.rglob("*.py")):
        mod = "attnverify.reports" + ("" if path.name == "__init__.py" else "." + path.stem)
        if path.name == "__init__.py":
            mod = "attnverify.reports.__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node.level, node.module or "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                if any(n == f or n.startswith(f + ".") for f in FORBIDDEN):
                    found.append(f"{path.name}:{node.lineno} imports {n}")
    assert not found, found


def test_reports_render_with_those_modules_unimportable(tmp_path):
    """A fresh interpreter where importing attnverify's adapters, check, reference, kernels, diagnosis or
    torch raises: attnverify.reports still renders a report folder (the package's own __init__, which
    imports the façade, is bypassed so only what reports import is loaded)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_reports import plant

    rep = tmp_path / "reports"
    plant(rep)
    code = (
        "import importlib.abc, sys, types\n"
        f"FORBIDDEN = {FORBIDDEN!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == f or name.startswith(f + '.') for f in FORBIDDEN):\n"
        "            raise ImportError('reports must not import ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "pkg = types.ModuleType('attnverify')\n"
        f"pkg.__path__ = [{str(ROOT / 'attnverify')!r}]\n"
        "sys.modules['attnverify'] = pkg\n"
        "from attnverify.reports import render\n"
        f"print(render({str(rep)!r}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "softmax scale missing" in (rep / "index.html").read_text()


def test_the_import_blocker_would_catch_a_forbidden_import(tmp_path):
    """The check above can fail: the same blocker stops a module that imports check."""
    code = (
        "import importlib.abc, sys, types\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'attnverify.check':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "pkg = types.ModuleType('attnverify')\n"
        f"pkg.__path__ = [{str(ROOT / 'attnverify')!r}]\n"
        "sys.modules['attnverify'] = pkg\n"
        "import attnverify.evidence, attnverify.check\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "blocked attnverify.check" in p.stderr


def test_origin_of_builtin_file_module_and_conftest_adapters(tmp_path, monkeypatch):
    import attnverify as av
    from attnverify.adapters import registry
    from attnverify.origin import adapter_origin
    from attnverify.reports.artifact import adapter_flag

    naive = registry.get("naive")
    o = adapter_origin(naive, "naive")
    assert o["kind"] == "builtin" and o["target"] == "naive" and adapter_flag(o) == ""
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "impl_file.py").write_text(WRONG_FILE)
    monkeypatch.chdir(tmp_path)
    a = registry.get("k/impl_file.py:impl")
    o = adapter_origin(a, "k/impl_file.py:impl", cwd=str(tmp_path))
    assert o["kind"] == "file" and o["target"] == "k/impl_file.py:impl" and len(o["sha256"]) == 64
    assert adapter_flag(o) == "--adapter k/impl_file.py:impl"
    # a module-level adapter registered by name (as from a conftest): found by its attribute
    (tmp_path / "conftest.py").write_text(WRONG_FILE.replace('"filemine"', '"byname"').replace("def impl", "def mine"))
    mod = registry.import_file(str(tmp_path / "conftest.py"))
    o = adapter_origin(mod.mine, "byname", cwd=str(tmp_path))
    assert o["kind"] == "file" and o["target"] == "conftest.py:mine"
    # one made in a hook, bound to no module name: repro imports its conftest
    made = av.adapter("hooked", register=False)(mod.mine.fn)
    o = adapter_origin(made, "hooked", cwd=str(tmp_path))
    assert o["kind"] == "registered" and o["target"] is None and o["conftest"] == "conftest.py"
    assert adapter_flag(o) == "--conftest conftest.py"
    json.dumps(o)  # journal-able
