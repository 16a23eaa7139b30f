"""The docs cannot rot: every Python and shell block in docs/ runs, the cookbook's recipes are checked
with `av.check` and a short property run, the CI YAML is parsed and its commands run in a copy of the
example kernel repo, and that repo fails (buggy kernel, with a report) and passes (fixed kernel).

Markers, written as an HTML comment on the line(s) right before a fenced block:

    <!-- gpu -->              needs a CUDA GPU: skipped with that reason on a CPU-only machine
    <!-- exit N -->           a single shell command that must exit with status N (default 0)
    <!-- file: PATH -->       the block is PATH (less a leading module docstring): compared, not run here
                              (the cookbook's files run in the cookbook tests below)
    <!-- raises: NAME -->     a Python block that shows a bug: it must raise an exception of that class name
                              (or a subclass of one so named)
    <!-- needs: MODULE -->    a Python block that needs an optional package: skipped, naming it, where it is
                              not installed
    <!-- standalone -->       a Python block run as a script in a fresh interpreter (a compiler bug whose
                              reproduction depends on the process state), with `raises` checked on its stderr
    <!-- install -->          install commands: checked (paths exist, `bash -n`, extras exist, `pip wheel`
                              builds the wheel offline into a temporary folder, and pip resolves the local
                              attnverify or that wheel with --dry-run), not run: they would change the
                              environment the tests run in
    <!-- quickstart: PATH -->  README's quick start: the block is the file PATH of a user's kernel repo, or
                              (PATH `run`) the command run there; tests/test_quickstart.py writes them into
                              a fresh repository and runs them, nothing else runs them

Python blocks of one page run in order in one namespace; shell blocks of one page run in order in
one bash process (`cd` and variables carry over, `set -e`), in a workspace holding copies of docs/ and
examples/, with this interpreter's bin/ first on PATH and ATTNVERIFY_MAX_EXAMPLES=3 (the documented
commands, run with 3 generated examples per property plus the corpus, to stay fast). Pages whose shell
blocks run the suite, or whose Python blocks call torch.compile, are marked slow.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import attnverify as av
from attnverify.adapters.base import Adapter

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COOKBOOK = DOCS / "cookbook"
EXAMPLE = ROOT / "examples" / "buggy_kernel"
CI_DIR = DOCS / "ci"
BIN = str(Path(sys.executable).parent)
CUDA = torch.cuda.is_available()
GPU_REASON = "needs a CUDA GPU (marked <!-- gpu --> in the docs); this machine has none"

RUN_LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell", "console": "shell"}
OTHER_LANGS = {"yaml", "yml", "toml", "text", "ini", "json", "html"}

PAGES = sorted(DOCS.rglob("*.md")) + [EXAMPLE / "README.md", ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


# ------------------------------------------------------------------------------------------ parsing


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    markers: dict

    @property
    def kind(self) -> str:
        return RUN_LANGS.get(self.lang, "other")

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<name>[\w-]+)(?:(?::\s*|\s+)(?P<value>.*?))?\s*-->\s*$")
MARKERS = ("gpu", "exit", "file", "install", "raises", "needs", "standalone", "quickstart")


def parse_blocks(path: Path):
    lines = path.read_text(encoding="utf-8").splitlines()
    out, pending, i = [], {}, 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m and m["name"] in MARKERS:
            pending[m["name"]] = (m["value"] or "").strip()
            i += 1
            continue
        f = _FENCE.match(lines[i])
        if f:
            indent, start, body = len(f["indent"]), i + 2, []
            i += 1
            while i < len(lines) and not re.match(r"^ *```\s*$", lines[i]):
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{path}:{start - 1}: unclosed code fence")
            out.append(Block(path, start, f["lang"].lower(), "\n".join(body), pending))
            pending = {}
        elif lines[i].strip():
            pending = {}  # a marker belongs to the block right after it
        i += 1
    return out


def _strip_docstring(text: str) -> str:
    mod = ast.parse(text)
    if mod.body and isinstance(mod.body[0], ast.Expr) and isinstance(getattr(mod.body[0], "value", None), ast.Constant) \
            and isinstance(mod.body[0].value.value, str):
        text = "".join(text.splitlines(True)[mod.body[0].end_lineno:])
    return text


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _runnable(block: Block) -> bool:
    return block.kind in ("python", "shell") and not {"file", "install", "quickstart"} & set(block.markers)


def _runs_suite(code: str) -> bool:
    return bool(re.search(r"(^|\s)(attnverify run|pytest\s)", code, re.M))


def _workspace(tmp_path: Path) -> Path:
    """A folder laid out like a clone: copies of docs/ and examples/ (attnverify itself is installed)."""
    ws = tmp_path / "ws"
    ignore = shutil.ignore_patterns("reports", ".hypothesis", "__pycache__", "*.pyc")
    shutil.copytree(DOCS, ws / "docs", ignore=ignore)
    shutil.copytree(ROOT / "examples", ws / "examples", ignore=ignore)
    return ws


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.setdefault("ATTNVERIFY_MAX_EXAMPLES", "3")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for k in ("ATTNVERIFY_ADAPTER", "ATTNVERIFY_PROFILE", "ATTNVERIFY_REPORT", "ATTNVERIFY_SEED", "PYTEST_ADDOPTS"):
        env.pop(k, None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------------- every page, block


def test_the_documented_pages_exist():
    for name in ("guide.md", "reference.md", "adapters.md", "ci.md", "tolerances.md"):
        assert (DOCS / name).is_file(), name
    assert (EXAMPLE / "README.md").is_file()


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_block_has_a_known_language(page):
    for b in parse_blocks(page):
        assert b.lang in RUN_LANGS or b.lang in OTHER_LANGS, (
            f"{b.where}: give the code block a language ({sorted(RUN_LANGS)} run in tests; "
            f"{sorted(OTHER_LANGS)} do not)")
        if "exit" in b.markers:
            assert b.kind == "shell" and len(_commands(b.code)) == 1, f"{b.where}: <!-- exit N --> needs one shell command"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_comments_before_blocks_are_known_markers(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip().startswith("<!--") and _FENCE.match(lines[i + 1]):
            m = _MARKER.match(line)
            assert m and m["name"] in MARKERS, f"{page.relative_to(ROOT)}:{i + 1}: unknown marker {line.strip()!r}; known: {MARKERS}"
            if m["name"] == "exit":
                assert (m["value"] or "").isdigit(), f"{page.relative_to(ROOT)}:{i + 1}: <!-- exit N --> needs a number"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_file_blocks_are_their_files(page):
    for b in parse_blocks(page):
        if "file" not in b.markers:
            continue
        f = ROOT / b.markers["file"]
        assert f.is_file(), f"{b.where}: {f} does not exist"
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".py":
            text = _strip_docstring(text)
        assert b.code.strip("\n") == text.strip("\n"), (
            f"{b.where} differs from {b.markers['file']}: paste the file into the block (less its docstring)")


def test_every_cookbook_recipe_and_ci_file_is_shown():
    shown = {b.markers.get("file") for p in PAGES for b in parse_blocks(p)}
    for f in sorted(COOKBOOK.glob("*.py")) + sorted(CI_DIR.glob("*.yml")):
        if f.name.startswith("_"):
            continue
        assert str(f.relative_to(ROOT)) in shown, f"{f.relative_to(ROOT)} is not shown in any page"


def _python_pages():
    out = []
    for p in PAGES:
        bs = [b for b in parse_blocks(p) if _runnable(b) and b.kind == "python"]
        if bs:
            slow = any("torch.compile" in b.code for b in bs)  # minutes of inductor compiles on 2 cores
            out.append(pytest.param(p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks_run(page, tmp_path, monkeypatch):
    ws = _workspace(tmp_path)
    monkeypatch.chdir(ws)
    monkeypatch.setattr(sys, "path", list(sys.path))  # blocks may extend sys.path: undone afterwards
    module = types.ModuleType(f"docs_{page.stem}")  # a real module: torch.compile looks its globals up by name
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ns: dict = module.__dict__
    skipped = []
    for b in parse_blocks(page):
        if not (_runnable(b) and b.kind == "python"):
            continue
        if "gpu" in b.markers and not CUDA:
            skipped.append(f"{b.where}: {GPU_REASON}")
            continue
        need = b.markers.get("needs")
        if need and importlib.util.find_spec(need) is None:
            skipped.append(f"{b.where}: needs the optional package {need!r}, not installed here")
            continue
        if "standalone" in b.markers:
            _run_standalone(b, tmp_path)
            continue
        code = compile(b.code, b.where, "exec")
        if "raises" not in b.markers:
            exec(code, ns)  # noqa: S102 - the docs' own code
            continue
        want = b.markers["raises"]
        with pytest.raises(Exception) as info:  # a block that shows a bug: it must still raise what it says
            exec(code, ns)  # noqa: S102
        names = [c.__name__ for c in type(info.value).__mro__]
        assert want in names, f"{b.where}: expected {want}, raised {type(info.value).__name__}: {info.value}"
    if skipped:
        pytest.skip(f"ran every other block; skipped {'; '.join(skipped)}")


def _run_standalone(b, tmp_path) -> None:
    script = tmp_path / f"block_{b.where.replace('/', '_').replace(':', '_')}.py"
    script.write_text(b.code, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    want = b.markers.get("raises")
    if want:
        last = (r.stderr.strip().splitlines() or [""])[-1]
        assert r.returncode != 0 and want in r.stderr, f"{b.where}: expected {want}; exit {r.returncode}, last line {last!r}"
    else:
        assert r.returncode == 0, f"{b.where}: exit {r.returncode}\n{r.stderr[-3000:]}"


def _commands(code: str):
    """Shell commands of a block: lines joined at trailing backslashes, comments and blanks dropped."""
    out, cur = [], ""
    for line in code.splitlines():
        cur += line.rstrip("\\") + (" " if line.endswith("\\") else "")
        if line.endswith("\\"):
            continue
        s = cur.strip()
        cur = ""
        if s and not s.startswith("#"):
            out.append(s)
    return out


def _shell_pages():
    out = []
    for p in PAGES:
        bs = [b for b in parse_blocks(p) if _runnable(b) and b.kind == "shell"]
        if bs:
            slow = any(_runs_suite(b.code) for b in bs)
            out.append(pytest.param(p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("page", _shell_pages())
def test_shell_blocks_run(page, tmp_path):
    ws = _workspace(tmp_path)
    script = ["set -e", f"cd {shlex.quote(str(ws))}"]
    skipped = []
    for n, b in enumerate(parse_blocks(page)):
        if not (_runnable(b) and b.kind == "shell"):
            continue
        if "gpu" in b.markers and not CUDA:
            skipped.append(b.where)
            continue
        f = tmp_path / f"block{n}.sh"
        f.write_text(b.code + "\n")
        want = int(b.markers.get("exit", "0") or 0)
        script.append(f"echo '::: {b.where} (expect exit {want})'")
        if want == 0:
            script.append(f"source {shlex.quote(str(f))}")
        else:
            script.append(f"set +e; source {shlex.quote(str(f))}; rc=$?; set -e")
            script.append(f"if [ $rc != {want} ]; then echo '::: {b.where} exited '$rc', expected {want}'; exit 97; fi")
    script.append("echo '::: all blocks done'")
    res = subprocess.run(["bash", "-c", "\n".join(script)], env=_env(), capture_output=True, text=True, timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "::: all blocks done" in res.stdout, (
        f"{page.relative_to(ROOT)}: a block failed (exit {res.returncode}); last output:\n{out[-6000:]}")
    if skipped:
        pytest.skip(f"ran every other block; skipped {'; '.join(skipped)}")


def _install_blocks():
    return [pytest.param(b, id=b.where) for p in PAGES for b in parse_blocks(p) if "install" in b.markers]


def _extras():
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _check_requirement(req: str, where: str) -> None:
    m = re.match(r"^(?P<name>[^\[\s@]+)(\[(?P<extras>[^\]]*)\])?", req)
    assert m, f"{where}: cannot read requirement {req!r}"
    for e in filter(None, (m["extras"] or "").split(",")):
        assert e.strip() in _extras(), f"{where}: extra [{e}] is not in pyproject.toml's optional-dependencies"


def _build_wheel(src: Path, out: Path) -> Path:
    """`pip wheel --no-deps -w OUT SRC`, offline: from a copy of the sources (the build leaves build/ and
    *.egg-info beside them), with this environment's setuptools instead of an isolated download."""
    copy = out / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(
        "tests", "benchmarks", "examples", "docs", ".git", ".hypothesis", "reports", "build", "*.egg-info",
        "__pycache__", ".venv", ".ruff_cache"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-w", str(out), str(copy)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (wheel,) = out.glob("attnverify-*.whl")
    return wheel


@pytest.mark.parametrize("block", _install_blocks())
def test_install_blocks_are_sound(block, tmp_path):
    pips, wheels = [], {}
    for cmd in _commands(block.code):
        words = shlex.split(cmd.split(" #")[0])
        if words[:1] == ["bash"]:
            script = ROOT / words[1]
            assert script.is_file(), f"{block.where}: {words[1]} does not exist"
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, f"{block.where}: {words[1]} does not parse"
        elif words[:1] in (["source"], ["."]):
            assert words[1] == ".venv/bin/activate" and ".venv" in (ROOT / "scripts" / "setup.sh").read_text(), \
                f"{block.where}: {words[1]} is not what scripts/setup.sh makes"
        elif words[:2] == ["pip", "wheel"]:
            assert words[2:] == ["--no-deps", "-w", "dist", "$ATTNVERIFY_SRC"], f"{block.where}: {cmd}"
            wheel = _build_wheel(ROOT, tmp_path / "dist")
            wheels[f"dist/{wheel.name}"] = wheel
            assert wheel.name in cmd, f"{block.where}: the comment names another wheel than {wheel.name}"
        elif words[:2] == ["pip", "install"]:
            pips.append(words[2:])
        else:
            raise AssertionError(f"{block.where}: unexpected command in an install block: {cmd}")
    for args in pips:
        args = [a.replace("$ATTNVERIFY_SRC", str(ROOT)) for a in args]
        reqs = [a for a in args if not a.startswith("-")]
        for i, r in enumerate(reqs):
            base = r.split("[")[0]
            if base.endswith(".whl"):
                assert base in wheels, f"{block.where}: {base} is not the wheel the block builds ({list(wheels)})"
                _check_requirement("attnverify" + r[len(base):], block.where)
                args[args.index(r)] = str(wheels[base]) + r[len(base):]
                continue
            _check_requirement(os.path.basename(r) if r.startswith(str(ROOT)) else r, block.where)
            if r.startswith(str(ROOT)):
                assert Path(base).is_dir() and (Path(base) / "pyproject.toml").is_file(), f"{block.where}: {base}"
        # offline: every dependency (the extras' too) must already be satisfied here, and attnverify resolves
        res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                              "--no-index", *args], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and "Would install attnverify" in res.stdout, \
            f"{block.where}: pip install --dry-run {' '.join(args)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}"


# ------------------------------------------------------------------------------ guide stays in sync


def test_reference_names_every_property_profile_and_option():
    from attnverify.plugin import OPTIONS
    from attnverify.properties import PROPERTIES
    from attnverify.properties.driver import SHRINK_BUDGET_S
    from attnverify.strategies import PROFILES

    guide = (DOCS / "reference.md").read_text()
    missing = [p.name for p in PROPERTIES if f"`{p.name}`" not in guide]
    assert not missing, f"docs/reference.md does not describe these properties: {missing}"
    for lim in PROFILES.values():
        row = (f"| `{lim.name}` | {lim.max_examples} | {lim.max_len} | {lim.max_batch} | "
               f"{lim.max_heads_kv} x {lim.max_group} | {SHRINK_BUDGET_S[lim.name]:g} s |")
        assert row in guide, f"docs/reference.md's profile table is out of date; expected a row starting {row!r}"
    for o in OPTIONS:
        for token in (o.flag, o.ini, o.env):
            assert f"`{token}" in guide, f"docs/reference.md does not mention {token} ({o.dest})"


def test_adapters_page_names_every_claim_keyword():
    from attnverify.adapters.base import Claims

    page = (DOCS / "adapters.md").read_text()
    for f in dataclasses.fields(Claims):
        assert f"| `{f.name}` |" in page, f"docs/adapters.md's keyword table lacks {f.name}"
        default = Claims().__getattribute__(f.name)
        shown = repr(default).replace("'", '"') if not isinstance(default, str) else f'"{default}"'
        assert f"| `{f.name}` | `{shown}` |" in page, f"docs/adapters.md: the default of {f.name} is {shown}"


# ----------------------------------------------------------------------------------------- cookbook


def _recipe(name, monkeypatch):
    monkeypatch.syspath_prepend(str(COOKBOOK))
    return importlib.import_module(name)


def _here(a: Adapter) -> Adapter:
    """The recipe as written where its device is present; on a CPU, claims widened to cpu and float32
    (the stand-ins accept float32; the real libraries are CUDA-only)."""
    if any(d == "cpu" or (d == "cuda" and CUDA) for d in a.claims.devices):
        return a
    dt = tuple(dict.fromkeys(("float32",) + a.claims.dtypes))
    return Adapter(a.name + "-on-cpu", a.fn, dataclasses.replace(a.claims, devices=("cpu",), dtypes=dt),
                   description=a.description, refuses=a.refuses)


def _case(a: Adapter, **kw):
    dev = a.run_device("auto")
    kw.setdefault("dtype", "float32" if "float32" in a.claims.dtypes else a.claims.dtypes[0])
    if kw["dtype"] not in a.claims.dtypes:
        kw["dtype"] = a.claims.dtypes[0]
    return av.build_case(av.CaseRecipe(device=dev, **kw))


RECIPES = {
    "bshd": ("bshd_kernel", "gradients_match_reference", [
        dict(batch=2, heads_q=4, heads_kv=2, len_q=33, len_k=65, head_dim=64, causal="bottom_right", window=(8, 4),
             softcap=3.0, alibi=True, seed=1),
        dict(heads_q=2, heads_kv=2, len_q=40, len_k=24, head_dim=32, causal="bottom_right", dtype="float16", seed=2),
        dict(batch=2, heads_q=3, heads_kv=1, len_q=17, len_k=17, head_dim=40, window=(-1, 2), layout="transposed", seed=3),
    ]),
    "varlen": ("varlen_kernel", "forward_matches_reference", [
        dict(heads_q=4, heads_kv=2, len_q=40, len_k=50, head_dim=32, seqlens_q=[10, 0, 30], seqlens_k=[20, 5, 25],
             causal="bottom_right", seed=4),
        dict(heads_q=2, heads_kv=2, len_q=11, len_k=9, head_dim=16, seqlens_q=[5, 6], seqlens_k=[0, 9], seed=5),
        dict(batch=3, heads_q=2, heads_kv=1, len_q=17, len_k=17, head_dim=16, window=(3, 2), softcap=5.0,
             dtype="float16", seed=6),
    ]),
    "lse": ("lse_kernel", "lse_matches_reference", [
        dict(batch=2, heads_q=4, heads_kv=1, len_q=20, len_k=45, head_dim=64, causal="bottom_right", softcap=10.0,
             return_lse=True, seed=7),
        dict(len_q=16, len_k=16, head_dim=128, window=(5, -1), return_lse=True, dtype="float16", seed=8),
        dict(batch=2, heads_q=2, heads_kv=2, len_q=9, len_k=30, head_dim=64, seed=9),
    ]),
    "autograd_function": ("tiled_kernel", "gradients_match_reference", [
        dict(batch=2, heads_q=2, heads_kv=2, len_q=129, len_k=65, head_dim=32, causal="bottom_right", return_lse=True,
             seed=10),
        dict(len_q=127, len_k=193, head_dim=64, head_dim_v=32, causal="bottom_right", dtype="float16", seed=11),
        dict(len_q=1, len_k=200, head_dim=16, return_lse=True, seed=12),
    ]),
    "sink_fp8": ("sink_fp8", "fp8_matches_reference", [
        dict(batch=2, heads_q=4, heads_kv=2, len_q=40, len_k=30, head_dim=64, dtype="float8_e4m3fn", descales="amax",
             causal="bottom_right", sinks={"kind": "dominant", "level": 2.0, "seed": 3}, return_lse=True, seed=15),
        dict(batch=1, heads_q=2, heads_kv=1, len_q=17, len_k=130, head_dim=128, dtype="float8_e4m3fn", descales="random",
             layout="v_colmajor", dominant_key=77, dominant_gap=8.0, return_lse=True, seed=16),
        dict(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=37, head_dim=64, dtype="bfloat16", row_shift=-1000.0,
             sinks={"kind": "mixed", "level": 8.0, "seed": 1}, return_lse=True, seed=17),
    ]),
    "jax_function": ("jax_kernel", "forward_matches_reference", [
        dict(batch=2, heads_q=4, heads_kv=2, len_q=24, len_k=40, head_dim=32, causal="bottom_right", seed=13),
        dict(len_q=30, len_k=10, head_dim=16, head_dim_v=24, causal="bottom_right", dtype="bfloat16", seed=14),
    ]),
}


def _needs(module: str):
    if module == "jax_function":
        pytest.importorskip("jax", reason="the JAX recipe needs jax (pip install jax)")


@pytest.mark.parametrize("module", list(RECIPES))
def test_cookbook_recipe_checks_and_holds_a_property(module, monkeypatch):
    _needs(module)
    attr, prop_name, cases = RECIPES[module]
    adapter = _here(getattr(_recipe(module, monkeypatch), attr))
    for kw in cases:
        case = _case(adapter, **kw)
        res = av.check(adapter, case)
        assert res.passed, res.message()
        names = {c.name for c in res.comparisons}
        assert "out" in names
        if adapter.claims.backward:
            assert {"dq", "dk", "dv"} <= names, names
        if case.spec.return_lse:
            assert "lse" in names, names
    from attnverify.properties import get_property, run_property

    run = run_property(get_property(prop_name), adapter, profile="ci", max_examples=4, use_corpus=False,
                       database=None)
    assert run.examples >= 1


def test_lse_recipe_left_in_base_2_fails_and_is_diagnosed(monkeypatch):
    from attnverify.diagnose import diagnose_result

    good = _here(_recipe("lse", monkeypatch).lse_kernel)

    def base2(q, k, v, spec):
        o = good.fn(q, k, v, spec)
        return av.Output(o.out, lse=o.lse / math.log(2.0)) if spec.return_lse else o

    bad = Adapter("lse-kernel-base2", base2, good.claims)
    res = av.check(bad, _case(bad, len_q=16, len_k=24, head_dim=64, return_lse=True, seed=1))
    assert res.status == "failed" and [c.name for c in res.failing()] == ["lse"], res.message()
    assert "base 2" in diagnose_result(res, adapter=bad).summary


def test_varlen_recipe_without_cu_seqlens_fails(monkeypatch):
    good = _here(_recipe("varlen", monkeypatch).varlen_kernel)

    def one_document(q, k, v, spec):  # drops cu_seqlens: the whole pack attends as one document
        return good.fn(q, k, v, spec.replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None))

    bad = Adapter("varlen-one-document", one_document, good.claims)
    res = av.check(bad, _case(bad, len_q=20, len_k=20, head_dim=16, seqlens_q=[8, 12], seqlens_k=[10, 10], seed=2))
    assert res.status == "failed", res.message()


def test_sink_fp8_recipe_holds_the_sink_properties_and_wrong_glue_fails(monkeypatch):
    """The sink properties on the recipe (bfloat16); its glue with the sinks or v's descale dropped fails."""
    from attnverify.properties import get_property, run_property

    good = _recipe("sink_fp8", monkeypatch).sink_fp8
    for prop in ("sinks_match_reference", "sink_limits"):
        assert run_property(get_property(prop), good, profile="ci", max_examples=4, use_corpus=False,
                            database=None).examples >= 1
    no_sinks = Adapter("sink-fp8-no-sinks", lambda q, k, v, s: good.fn(q, k, v, s.replace(sinks=None)), good.claims)
    no_vd = Adapter("sink-fp8-no-v-descale", lambda q, k, v, s: good.fn(q, k, v, s.replace(v_descale=None)),
                    good.claims)
    kw = dict(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=37, head_dim=64, return_lse=True, seed=18)
    sinks = {"kind": "normal", "level": 2.0, "seed": 2}
    assert av.check(good, _case(good, dtype="bfloat16", sinks=sinks, **kw)).passed
    assert not av.check(no_sinks, _case(no_sinks, dtype="bfloat16", sinks=sinks, **kw)).passed
    fp8 = dict(dtype="float8_e4m3fn", descales="random", **kw)
    assert av.check(good, _case(good, **fp8)).passed
    assert not av.check(no_vd, _case(no_vd, **fp8)).passed


@pytest.mark.slow
def test_tiled_recipe_memory_is_linear(monkeypatch):
    from attnverify.properties import get_property, run_property

    tiled = _recipe("autograd_function", monkeypatch).tiled_kernel
    run_property(get_property("memory_scaling"), tiled, profile="ci", max_examples=1, database=None)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
@pytest.mark.parametrize("module", [m for m in RECIPES if m != "jax_function"])
def test_cookbook_recipe_as_written_on_the_gpu(module, monkeypatch):
    attr, prop_name, cases = RECIPES[module]
    adapter = getattr(_recipe(module, monkeypatch), attr)  # claims as written: cuda, fp16/bf16
    for kw in cases:
        if kw.get("dtype") not in adapter.claims.dtypes:  # the recipe's own dtype where claimed (fp8 for sink_fp8)
            kw = {**kw, "dtype": "float16" if "float16" in adapter.claims.dtypes else adapter.claims.dtypes[0]}
        res = av.check(adapter, _case(adapter, **kw))
        assert res.passed, res.message()


# ----------------------------------------------------------------------------------------------- CI


def _yaml(name):
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with attnverify's test extra: pip install -e '.[test]'")
    return yaml.safe_load((CI_DIR / name).read_text())


def _lines(script) -> list:
    if isinstance(script, str):
        script = script.splitlines()
    return [s.strip() for s in script or [] if s.strip() and not s.strip().startswith("#")]


def _github():
    wf = _yaml("github-actions.yml")
    jobs = wf["jobs"]
    return wf, jobs["attnverify-push"], jobs["attnverify-nightly"]


def _gitlab():
    ci = _yaml("gitlab-ci.yml")
    base = ci[".attnverify"]
    return ci, {**base, **ci["attnverify-push"]}, {**base, **ci["attnverify-nightly"]}


def _suite_commands(lines):
    return [x for x in lines if x.startswith(("pytest ", "attnverify "))]


def _check_suite_line(line: str, nightly: bool, where: str) -> None:
    assert "--adapter=$ADAPTER" in line and "--attn-only" in line, f"{where}: {line}"
    if nightly:
        assert "--attn-profile=thorough" in line and re.search(r"--attn-max-examples=\d+", line), f"{where}: {line}"
        assert "--attn-device=cuda" in line, f"{where}: {line}"
    else:
        assert "--attn-profile=ci" in line or "--attn-profile=dev" in line, f"{where}: {line}"
    assert "|| true" not in line and "--attn-allow-untested" not in line, f"{where}: a failure must fail the job"


def _check_installs(pips, env: dict, where: str) -> None:
    """attnverify comes from the committed wheel, never by name from an index where it is not published."""
    mine = [p for p in pips if "attnverify" in p.lower() or "ATTNVERIFY" in p]
    assert mine == ['pip install "$ATTNVERIFY_WHEEL[test]"'], f"{where}: {mine}"
    assert env["ATTNVERIFY_WHEEL"].endswith(".whl") and not os.path.isabs(env["ATTNVERIFY_WHEEL"]), where
    for p in pips:
        words = shlex.split(p)
        assert not any(w.split("[")[0] == "attnverify" for w in words), f"{where}: {p} installs attnverify from an index"


def test_github_actions_yaml_is_wired():
    from attnverify.plugin import DEFAULT_REPORT
    from attnverify.properties.profiles import DATABASE_DIR

    wf, push, nightly = _github()
    on = wf.get("on", wf.get(True))  # PyYAML reads the key `on` as True
    assert {"push", "pull_request", "schedule"} <= set(on) and on["schedule"][0]["cron"]
    assert wf["env"]["ADAPTER"]
    assert "schedule" in push["if"] and "!=" in push["if"] and "== 'schedule'" in nightly["if"]
    assert push["timeout-minutes"] == 30 and nightly["timeout-minutes"] == 240  # docs/ci.md states them
    assert push["env"]["TRITON_INTERPRET"] == "1" and "TRITON_INTERPRET" not in wf["env"]
    for job, nightly_job in ((push, False), (nightly, True)):
        steps = job["steps"]
        runs = [(i, s) for i, s in enumerate(steps) if "run" in s]
        test_i = [i for i, s in runs if any(x.startswith("pytest ") for x in _lines(s["run"]))]
        assert len(test_i) == 1
        t = test_i[0]
        test_step = steps[t]
        _check_suite_line(_suite_commands(_lines(test_step["run"]))[0], nightly_job, "github-actions.yml")
        assert not test_step.get("continue-on-error"), "a failure must fail the job"
        _check_installs([x for _, s in runs for x in _lines(s["run"]) if x.startswith("pip ")], wf["env"],
                        "github-actions.yml")
        uses = {i: s.get("uses", "") for i, s in enumerate(steps)}
        restore = [i for i, u in uses.items() if u.startswith("actions/cache/restore")]
        save = [i for i, u in uses.items() if u.startswith("actions/cache/save")]
        upload = [i for i, u in uses.items() if u.startswith("actions/upload-artifact")]
        assert restore and restore[0] < t and save and save[0] > t and upload and upload[0] > t
        assert not os.path.isabs(DATABASE_DIR)  # under the directory pytest runs in: the repo root in CI
        for i in restore + save:
            assert DATABASE_DIR.startswith(steps[i]["with"]["path"].rstrip("/")), steps[i]["with"]["path"]
        for i in save + upload:
            assert steps[i].get("if") == "always()", f"step {steps[i].get('name')} must run after a failure too"
        assert steps[upload[0]]["with"]["path"].rstrip("/") == DEFAULT_REPORT


def test_gitlab_ci_yaml_is_wired():
    from attnverify.plugin import DEFAULT_REPORT
    from attnverify.properties.profiles import DATABASE_DIR

    ci, push, nightly = _gitlab()
    assert ci["variables"]["ADAPTER"]
    assert push["rules"] == [{"if": '$CI_PIPELINE_SOURCE != "schedule"'}]
    assert nightly["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "schedule"'}]
    assert push["timeout"] == "30m" and nightly["timeout"] == "4h" and push["variables"]["TRITON_INTERPRET"] == "1"
    for job, nightly_job in ((push, False), (nightly, True)):
        tests = [x for x in _lines(job["script"]) if x.startswith("pytest ")]
        assert len(tests) == 1 and not job.get("allow_failure")
        _check_suite_line(tests[0], nightly_job, "gitlab-ci.yml")
        _check_installs([x for x in _lines(job["script"]) if x.startswith("pip ")], ci["variables"], "gitlab-ci.yml")
        assert job["cache"]["when"] == "always"
        assert any(DATABASE_DIR.startswith(p.rstrip("/")) for p in job["cache"]["paths"])
        assert job["artifacts"]["when"] == "always" and [p.rstrip("/") for p in job["artifacts"]["paths"]] == [DEFAULT_REPORT]


def test_ci_files_and_ci_page_run_the_same_commands():
    gh_wf, gh_push, gh_nightly = _github()
    gl_ci, gl_push, gl_nightly = _gitlab()
    gh = lambda job: _suite_commands(sum((_lines(s["run"]) for s in job["steps"] if "run" in s), []))  # noqa: E731
    gl = lambda job: _suite_commands(_lines(job["script"]))  # noqa: E731
    assert gh(gh_push) == gl(gl_push) and gh(gh_nightly) == gl(gl_nightly)
    pip_gh = [x for s in gh_push["steps"] if "run" in s for x in _lines(s["run"]) if x.startswith("pip ")]
    pip_gl = [x for x in _lines(gl_push["script"]) if x.startswith("pip ")]
    assert pip_gh == pip_gl and "pip install -e ." in pip_gh
    assert gh_wf["env"]["ATTNVERIFY_WHEEL"] == gl_ci["variables"]["ATTNVERIFY_WHEEL"]
    local = [b for b in parse_blocks(DOCS / "ci.md") if b.kind == "shell"]
    assert len(local) == 1
    assert _suite_commands(_commands(local[0].code)) == gh(gh_push), "docs/ci.md's local commands differ from the jobs'"
    page = (DOCS / "ci.md").read_text()
    assert "limit is 30 minutes" in page and "limit is 4 hours" in page  # the stated times are the files'


def test_ci_jobs_install_the_committed_wheel(tmp_path):
    """The wheel line of both jobs, run in a kernel repo holding the wheel the comment says to build
    (offline: --dry-run, every dependency already satisfied here)."""
    wf, push, _ = _github()
    repo = _example_repo(tmp_path)
    built = _build_wheel(ROOT, tmp_path / "built")
    wheel = repo / wf["env"]["ATTNVERIFY_WHEEL"]
    assert built.name == wheel.name, f"the CI files name {wheel.name}, the build makes {built.name}"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(built, wheel)
    line = next(x for s in push["steps"] if "run" in s for x in _lines(s["run"]) if "ATTNVERIFY_WHEEL" in x)
    cmd = line.replace("pip install", f"{shlex.quote(sys.executable)} -m pip install --dry-run --no-index", 1)
    (_, rc, out), = _run_lines([cmd], repo, ATTNVERIFY_WHEEL=wf["env"]["ATTNVERIFY_WHEEL"])
    assert rc == 0 and "Would install attnverify-" in out, out[-3000:]


def _example_repo(tmp_path) -> Path:
    repo = tmp_path / "kernel-repo"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("reports", ".hypothesis", "__pycache__"))
    return repo


def _run_lines(lines, cwd, **env):
    """Run CI lines one by one (each its own step), as the CI systems do; returns their exit statuses."""
    out = []
    for line in lines:
        r = subprocess.run(["bash", "-c", line], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=900)
        out.append((line, r.returncode, r.stdout + r.stderr))
    return out


def _pages_text(reports: Path) -> str:
    import html

    text = ""
    for f in sorted((reports / "cases").glob("*.html")):
        text += html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<(style|script)\b.*?</\1>", "", f.read_text(), flags=re.S)))
    return re.sub(r"\s+", " ", text)


FAST_K = "causal_alignment or fully_masked_rows"


@pytest.fixture(scope="module")
def ci_cpu_job_on_the_buggy_kernel(tmp_path_factory):
    """The push job's suite line, as the CI files run it, in a copy of the example repo with ADAPTER=mykernel
    (two properties, 3 generated examples each plus the corpus)."""
    _, push, _ = _gitlab()
    lines = _suite_commands(_lines(push["script"]))
    assert len(lines) == 1 and lines[0].startswith("pytest ")
    repo = _example_repo(tmp_path_factory.mktemp("buggy"))
    runs = _run_lines(lines, repo, ADAPTER="mykernel", PYTEST_ADDOPTS=f"-k '{FAST_K}'")
    return repo, runs


def test_ci_cpu_job_fails_on_the_buggy_kernel_and_keeps_a_report(ci_cpu_job_on_the_buggy_kernel):
    repo, ((_, test_rc, test_out),) = ci_cpu_job_on_the_buggy_kernel
    assert test_rc == 1, f"the job must fail on the buggy kernel; pytest exited {test_rc}:\n{test_out[-4000:]}"
    assert "FAILED attnverify::test_causal_alignment[mykernel]" in test_out
    assert "FAILED attnverify::test_fully_masked_rows[mykernel]" in test_out
    assert "causal_alignment[mykernel]: attnverify repro reports/cases/" in test_out
    # the plugin rendered the report itself: no `attnverify report` step is needed
    assert "attnverify report: reports/index.html" in test_out and (repo / "reports" / "index.html").is_file()
    index = (repo / "reports" / "index.html").read_text()
    assert "causal_alignment" in index and "fully_masked_rows" in index
    pages = _pages_text(repo / "reports")
    assert "attnverify repro reports/cases/" in pages and "Mismatched elements" in pages


def test_ci_report_pages_name_the_bugs(ci_cpu_job_on_the_buggy_kernel):
    repo, _ = ci_cpu_job_on_the_buggy_kernel
    pages = _pages_text(repo / "reports")
    assert "causal mask aligned top-left" in pages and "fully-masked rows give NaN" in pages, pages[:3000]


def test_ci_report_pages_show_every_output_against_its_tolerance(ci_cpu_job_on_the_buggy_kernel):
    repo, _ = ci_cpu_job_on_the_buggy_kernel
    assert "No comparison records" not in _pages_text(repo / "reports")


def test_repro_replays_a_saved_case_from_the_example_repo(ci_cpu_job_on_the_buggy_kernel):
    repo, _ = ci_cpu_job_on_the_buggy_kernel
    case = sorted((repo / "reports" / "cases").glob("*.json"))[0]
    still = subprocess.run(["attnverify", "repro", str(case)], cwd=repo, env=_env(), capture_output=True, text=True,
                           timeout=600)
    assert still.returncode == 1 and "STILL FAILS" in still.stdout, still.stdout[-2000:] + still.stderr[-2000:]
    held = subprocess.run(["attnverify", "repro", str(case), "--adapter", "mykernel-fixed"], cwd=repo, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert held.returncode == 0 and "HELD" in held.stdout, held.stdout[-2000:] + held.stderr[-2000:]


def test_attnverify_adapters_lists_the_example_adapters():
    r = subprocess.run(["attnverify", "adapters"], cwd=EXAMPLE, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines()[1:] if line.strip()]
    assert "mykernel" in names and "mykernel-fixed" in names, r.stdout


def test_ci_cpu_job_passes_on_the_fixed_kernel(tmp_path):
    _, push, _ = _gitlab()
    line = [x for x in _lines(push["script"]) if x.startswith("pytest ")]
    (_, rc, out), = _run_lines(line, _example_repo(tmp_path), ADAPTER="mykernel-fixed",
                               PYTEST_ADDOPTS=f"-k '{FAST_K} or forward_matches_reference'")
    assert rc == 0, f"the fixed kernel must pass; pytest exited {rc}:\n{out[-4000:]}"
    assert "3 passed" in out and "test_mykernel.py" not in out, out[-3000:]  # --attn-only: the suite alone


def test_ci_nightly_job_command_is_valid(tmp_path):
    _, _, nightly = _gitlab()
    (line,) = [x for x in _lines(nightly["script"]) if x.startswith("pytest ")]
    repo = _example_repo(tmp_path)
    if not CUDA:  # options, profile and device parse, the suite is collected; nothing runs on a CPU
        (_, rc, out), = _run_lines([line + " --collect-only"], repo, ADAPTER="mykernel-fixed")
        assert rc == 0, out[-3000:]
        assert "profile thorough" in out and "max examples 200" in out
        assert "test_forward_matches_reference[mykernel-fixed]" in out and "test_mykernel.py" not in out
    else:
        (_, rc, out), = _run_lines([line], repo, ADAPTER="mykernel-fixed", PYTEST_ADDOPTS=f"-k '{FAST_K}'")
        assert rc == 0, out[-3000:]


# -------------------------------------------------------------------------------- the example repo


def test_attnverify_run_fails_on_the_buggy_kernel_with_a_report(tmp_path):
    repo = _example_repo(tmp_path)
    r = subprocess.run(["attnverify", "run", "--adapter", "mykernel", "-k", "causal_alignment"], cwd=repo,
                       env=_env(), capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "report:" in out and (repo / "reports" / "index.html").is_file()
    assert "causal_alignment[mykernel]: attnverify repro reports/cases/" in out
    pages = _pages_text(repo / "reports")
    assert "causal mask aligned top-left" in pages, pages[:3000]


def test_example_kernels_raise_outside_their_claims():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import mykernel
        import mykernel_fixed
    finally:
        sys.path.remove(str(EXAMPLE))
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    for mod in (mykernel, mykernel_fixed):
        with pytest.raises(TypeError):
            mod.attention(q, q, q)
    # the documented bugs, and their fixes
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 4, 8)
    assert torch.isnan(mykernel.attention(q, k, k, attn_mask=torch.zeros(2, 4, dtype=torch.bool))).all()
    assert (mykernel_fixed.attention(q, k, k, attn_mask=torch.zeros(2, 4, dtype=torch.bool)) == 0).all()
    row0_buggy = mykernel.attention(q, k, k, causal=True)[0, 0, 0]
    row0_fixed = mykernel_fixed.attention(q, k, k, causal=True)[0, 0, 0]
    assert torch.allclose(row0_buggy, k[0, 0, 0])  # top-left: the first query sees only key 0
    assert not torch.allclose(row0_fixed, k[0, 0, 0])  # bottom-right: it sees keys 0..2


# ------------------------------------------------------------------- statements the code must not contradict


def test_links_and_named_files_exist():
    """Every relative link resolves, and every Markdown file a page names (SPEC.md, DESIGN.md, ...) is in
    the repository: the docs point at nothing a reader cannot open."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for name in set(re.findall(r"(?<![\w/.-])([A-Z][A-Za-z_]+\.md)\b", text)):
            if not ((ROOT / name).exists() or (DOCS / name).exists() or (page.parent / name).exists()):
                missing.append(f"{page.relative_to(ROOT)}: names {name}")
    assert not missing, missing


def test_the_tolerance_rule_is_written_once_and_matches_the_code():
    from attnverify import tolerances as T

    for name in ("guide.md", "reference.md"):
        text = (DOCS / name).read_text()
        assert "rel_L2(x, ref)" not in text and "NORM_U" not in text, f"docs/{name} restates the tolerance rule"
    page = (DOCS / "tolerances.md").read_text()
    assert f"u_S = F * u + {T.SCORE_U:g} * u_fp32 * S" in page
    for o in T.OUTPUTS:
        row = f"| {o} | {T.NORM_U[o]:g} | {T.ELEM_U[o]:g} | {T.BASELINE_FACTOR[o]:g} |"
        assert row in page, f"docs/tolerances.md: expected the row {row!r}"
    assert f"{T.FLOOR_SCALE['float32']:g} for float32 and {T.FLOOR_SCALE['float64']:g} for float64" in page


def test_setup_statements_match_the_script():
    """scripts/setup.sh installs torch from pip's default index unless ATTNVERIFY_TORCH_INDEX is set: the
    docs must not promise the CPU build on a machine without a GPU."""
    script = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r'"torch==([\d.]+)"', script)
    assert pinned and "ATTNVERIFY_TORCH_INDEX" in script
    for page in (ROOT / "README.md", DOCS / "guide.md"):
        text = re.sub(r"\s+", " ", page.read_text())
        assert f"torch {pinned[1]} from pip's default index" in text and "ATTNVERIFY_TORCH_INDEX" in text, page.name
        assert not re.search(r"installs the CPU build of torch where there is no GPU|without a GPU the CPU build of "
                             r"torch is installed", text), f"{page.name} promises a CPU torch setup.sh does not install"


def test_a_plain_pytest_run_needs_no_report_command():
    """The plugin renders reports/index.html at the end of a run; the docs say so and do not send a plain
    pytest run to `attnverify report` (which re-renders from the journal)."""
    import inspect

    from attnverify import plugin

    assert "from .reports import render" in inspect.getsource(plugin.pytest_sessionfinish)
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        assert not re.search(r"after a plain `?pytest[^.]*use `attnverify report", text, re.I), page.name
    for name in ("github-actions.yml", "gitlab-ci.yml"):
        assert "attnverify report" not in "\n".join(_lines((CI_DIR / name).read_text())), name


def test_loosen_is_offered_only_where_it_exists():
    import inspect

    from attnverify import check
    from attnverify.plugin import OPTIONS

    assert "loosen" in inspect.signature(check).parameters
    assert not any("loosen" in o.dest for o in OPTIONS)
    for page in PAGES:
        for m in re.finditer(r"loosen", page.read_text()):
            line = page.read_text()[:m.start()].count("\n") + 1
            context = page.read_text().splitlines()[line - 1]
            assert "check" in context or "tolerance_for" in context or "loosen=1e4" in context \
                or "loosen=0.5" in context or "OPTIONS" in context, f"{page.relative_to(ROOT)}:{line}: {context}"


def test_nothing_tested_and_replay_are_documented_as_they_behave():
    from attnverify.untested import ALLOW_HINT, EXIT_UNTESTED

    ref = re.sub(r"\s+", " ", (DOCS / "reference.md").read_text())
    assert f"and {int(EXIT_UNTESTED)} when an adapter tested nothing" in ref and "NOTHING WAS TESTED" in ref
    assert "--attn-allow-untested" in ALLOW_HINT and "`ATTNVERIFY_ALLOW_UNTESTED`" in ref
    assert "`--attn-seed N` fixes the generation, not the database" in ref
    guide = re.sub(r"\s+", " ", (DOCS / "guide.md").read_text())
    assert "TRITON_INTERPRET=1" in guide and "XPASS(strict)" in guide


def test_the_projects_slow_job_is_the_one_docs_ci_shows():
    """issue 19: the slow tests run in a scheduled or manual job -- the project's own workflow file, which
    docs/ci.md shows whole; it runs exactly `bash scripts/test.sh -m slow`, by hand or nightly."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with attnverify's test extra: pip install -e '.[test]'")
    path = ROOT / ".github" / "workflows" / "slow-tests.yml"
    text = path.read_text()
    docs = (ROOT / "docs" / "ci.md").read_text()
    assert "```yaml\n" + text + "```" in docs, "docs/ci.md must show .github/workflows/slow-tests.yml whole"
    wf = yaml.safe_load(text)
    triggers = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert "workflow_dispatch" in triggers and triggers["schedule"][0]["cron"]
    (job,) = wf["jobs"].values()
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert runs == ["bash scripts/test.sh -m slow"] and job["timeout-minutes"] >= 120
