"""pytest11 plugin: `pytest --adapter=mine` runs attnverify's properties against `mine`.

Without `--adapter` (or ATTNVERIFY_ADAPTER / the `attn_adapter` ini key) the plugin adds nothing.
With it, one test item per (property, adapter) joins the repo's own tests, named like
`attnverify::test_gradients_match_reference[mine]` (so `-k`, `-m attnverify` and pytest-xdist work).

Options (group "attnverify"; each also an ini key and an environment variable; the command line
wins, then the environment, then the ini file):

    --adapter NAME           attn_adapter        ATTNVERIFY_ADAPTER       repeatable, comma lists, `all`
    --attn-profile P         attn_profile        ATTNVERIFY_PROFILE       ci | dev | thorough (default dev)
    --attn-report DIR        attn_report         ATTNVERIFY_REPORT        default reports/
    --attn-seed N            attn_seed           ATTNVERIFY_SEED          default: a fresh one, printed
    --attn-device D          attn_device         ATTNVERIFY_DEVICE        auto | cpu | cuda
    --attn-max-examples N    attn_max_examples   ATTNVERIFY_MAX_EXAMPLES  override the profile's count
    --attn-isolate I         attn_isolate        ATTNVERIFY_ISOLATE       auto | subprocess | none
    --attn-timeout S         attn_timeout        ATTNVERIFY_TIMEOUT       per example, subprocess only (60)
    --attn-only              attn_only           ATTNVERIFY_ONLY          run only the suite (used by `attnverify run`)
    --attn-allow-untested    attn_allow_untested ATTNVERIFY_ALLOW_UNTESTED  pass although an adapter tested nothing
    --attn-max-bugs N        attn_max_bugs       ATTNVERIFY_MAX_BUGS      distinct bugs per property (ci 1, else 3)
    --attn-shard K/N         attn_shard          ATTNVERIFY_SHARD         run the K-th of N slices (attnverify.shards)
    --attn-db URL            attn_db             ATTNVERIFY_DB            shared example database (attnverify.exampledb)

A run in which a requested adapter tested nothing (unavailable here, or every property skipped) fails
with a message saying why and how to fix it (attnverify.untested) unless --attn-allow-untested is given.

Hooks for conftest.py (besides `@attnverify.adapter`, which registers on import):

    def pytest_attnverify_adapters(config): return [adapter, ...]     # register adapters
    def pytest_attnverify_properties(config): return [Property, ...]  # run extra properties

Crash isolation (`--attn-isolate=auto`, the default where fork exists): every drawn example is
judged in a forked child (attnverify.isolation); this process never touches the GPU (the plugin
sets PYTORCH_NVML_BASED_CUDA_CHECK=1 so that availability checks do not initialise CUDA).
Under pytest-xdist on a machine with several GPUs each worker is pinned to one GPU through
CUDA_VISIBLE_DEVICES before anything can initialise CUDA (an outer CUDA_VISIBLE_DEVICES is honoured;
the GPU count comes from ATTNVERIFY_GPU_COUNT or `nvidia-smi -L`; ATTNVERIFY_PIN_GPUS=0 turns it off).
"""
from __future__ import annotations

import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest

from .isolation import cuda_initialised

PROFILES = ("ci", "dev", "thorough")
DEVICES = ("auto", "cpu", "cuda")
ISOLATES = ("auto", "subprocess", "none")
DEFAULT_PROFILE = "dev"
DEFAULT_REPORT = "reports"
DEFAULT_TIMEOUT = 60.0


# --------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _Opt:
    dest: str
    flag: str
    ini: str
    env: str
    default: Any
    help: str
    choices: Optional[tuple] = None
    kind: str = "str"  # str | int | float | flag | list


OPTIONS = (
    _Opt("attn_adapter", "--adapter", "attn_adapter", "ATTNVERIFY_ADAPTER", None,
         "attention adapter to test: a built-in or registered name, package.module:attr, path/to/file.py:attr, "
         "or `all`; repeat or give a comma list", kind="list"),
    _Opt("attn_profile", "--attn-profile", "attn_profile", "ATTNVERIFY_PROFILE", DEFAULT_PROFILE,
         "how hard to search: ci (fast), dev (default), thorough", choices=PROFILES),
    _Opt("attn_report", "--attn-report", "attn_report", "ATTNVERIFY_REPORT", DEFAULT_REPORT,
         "report folder: results.jsonl journal and cases/ (default reports/)"),
    _Opt("attn_seed", "--attn-seed", "attn_seed", "ATTNVERIFY_SEED", None,
         "Hypothesis seed (default: a fresh one, printed in the header)", kind="int"),
    _Opt("attn_device", "--attn-device", "attn_device", "ATTNVERIFY_DEVICE", "auto",
         "device cases are made on: auto (cuda where claimed and present), cpu, cuda", choices=DEVICES),
    _Opt("attn_max_examples", "--attn-max-examples", "attn_max_examples", "ATTNVERIFY_MAX_EXAMPLES", None,
         "examples per property (overrides the profile)", kind="int"),
    _Opt("attn_isolate", "--attn-isolate", "attn_isolate", "ATTNVERIFY_ISOLATE", "auto",
         "judge each example in a forked child so a crash or hang costs one case: auto, subprocess, none",
         choices=ISOLATES),
    _Opt("attn_timeout", "--attn-timeout", "attn_timeout", "ATTNVERIFY_TIMEOUT", DEFAULT_TIMEOUT,
         "seconds one example may take under subprocess isolation before it fails as a timeout (0: none)",
         kind="float"),
    _Opt("attn_only", "--attn-only", "attn_only", "ATTNVERIFY_ONLY", False,
         "collect only the attnverify suite, not the repo's own tests", kind="flag"),
    _Opt("attn_allow_untested", "--attn-allow-untested", "attn_allow_untested", "ATTNVERIFY_ALLOW_UNTESTED", False,
         "let a run pass in which an adapter tested nothing (unavailable here, or every property skipped); "
         "by default such a run fails", kind="flag"),
    _Opt("attn_max_bugs", "--attn-max-bugs", "attn_max_bugs", "ATTNVERIFY_MAX_BUGS", None,
         "distinct bugs to look for per property: after a failure the search goes on outside the found bug's "
         "needs (default: the profile's, 1 in ci, 3 in dev and thorough)", kind="int"),
    _Opt("attn_shard", "--attn-shard", "attn_shard", "ATTNVERIFY_SHARD", None,
         "run only shard K of N (e.g. 2/4): a stable slice of the (adapter, property) pairs; N jobs cover the run"),
    _Opt("attn_db", "--attn-db", "attn_db", "ATTNVERIFY_DB", None,
         "shared example database beside the local one: redis://HOST:PORT/N or github:OWNER/REPO[/ARTIFACT]"),
)


class Hookspecs:
    @pytest.hookspec
    def pytest_attnverify_adapters(self, config):
        """Return an iterable of attnverify Adapters to register (so --adapter finds them by name)."""

    @pytest.hookspec
    def pytest_attnverify_properties(self, config):
        """Return an iterable of extra attnverify Property objects to run for every adapter."""


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(Hookspecs)


def pytest_addoption(parser):
    group = parser.getgroup("attnverify", "attnverify: attention correctness and fuzz testing")
    for o in OPTIONS:
        env = f" [env {o.env}, ini {o.ini}]"
        if o.kind == "list":
            group.addoption(o.flag, action="append", dest=o.dest, default=None, metavar="NAME", help=o.help + env)
        elif o.kind == "flag":
            group.addoption(o.flag, action="store_true", dest=o.dest, default=None, help=o.help + env)
        else:
            group.addoption(o.flag, dest=o.dest, default=None, choices=o.choices,
                            metavar=o.flag.split("-")[-1].upper() if not o.choices else None, help=o.help + env)
        parser.addini(o.ini, o.help, type="string", default="")


def _raw_value(config, o: _Opt):
    v = config.getoption(o.dest, default=None)
    if v not in (None, []):
        return v, o.flag
    ev = os.environ.get(o.env)
    if ev not in (None, ""):
        return ev, o.env
    try:
        iv = config.getini(o.ini)
    except (ValueError, KeyError):
        iv = ""
    if iv not in (None, ""):
        return iv, f"ini {o.ini}"
    return o.default, None


def _convert(o: _Opt, v, source):
    if v is None:
        return None
    try:
        if o.kind == "list":
            items = v if isinstance(v, list) else [v]
            out = []
            for x in items:
                out += [s.strip() for s in str(x).split(",") if s.strip()]
            return out
        if o.kind == "flag":
            return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")
        if o.kind == "int":
            return int(v)
        if o.kind == "float":
            return float(v)
    except ValueError:
        raise pytest.UsageError(f"{source}={v!r}: expected {'an integer' if o.kind == 'int' else 'a number'}") from None
    v = str(v)
    if o.choices and v not in o.choices:
        raise pytest.UsageError(f"{source}={v!r}: choose from {', '.join(o.choices)}")
    return v


def option_values(config) -> Dict[str, Any]:
    out = {}
    for o in OPTIONS:
        raw, src = _raw_value(config, o)
        out[o.dest] = _convert(o, raw, src or o.flag)
    return out


# ----------------------------------------------------------------------------- GPU pinning (xdist)


def _worker_index(worker_id: str) -> int:
    m = re.search(r"(\d+)$", worker_id or "")
    return int(m.group(1)) if m else 0


def gpu_count_without_cuda(environ=None) -> int:
    """GPUs on this machine without initialising CUDA: ATTNVERIFY_GPU_COUNT, else `nvidia-smi -L`."""
    environ = os.environ if environ is None else environ
    if environ.get("ATTNVERIFY_GPU_COUNT", "") != "":
        return int(environ["ATTNVERIFY_GPU_COUNT"])
    from .journal import gpu_names

    return len(gpu_names())


def visible_devices(outer: Optional[str]) -> List[str]:
    """The device list an outer CUDA_VISIBLE_DEVICES names (CUDA stops at the first invalid entry)."""
    devs = []
    for tok in (outer or "").split(","):
        tok = tok.strip()
        if not tok or tok.startswith("-"):
            break
        devs.append(tok)
    return devs


def gpu_for_worker(worker_id: str, outer_visible: Optional[str], gpu_count: int) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES value for one xdist worker, or None to leave it alone.

    Workers take the visible GPUs round robin (gw0 -> first, gw1 -> second, ...); an outer
    CUDA_VISIBLE_DEVICES restricts and orders the choice; with one GPU or none nothing changes."""
    devs = visible_devices(outer_visible) if outer_visible is not None else [str(i) for i in range(gpu_count)]
    if len(devs) <= 1:
        return None
    return devs[_worker_index(worker_id) % len(devs)]


def pin_worker_gpu(environ=None, gpu_count: Optional[int] = None) -> Optional[str]:
    """Set CUDA_VISIBLE_DEVICES for this xdist worker (no-op outside xdist); returns what it set."""
    environ = os.environ if environ is None else environ
    wid = environ.get("PYTEST_XDIST_WORKER")
    if not wid or environ.get("ATTNVERIFY_PIN_GPUS", "1") == "0" or "ATTNVERIFY_PINNED_GPU" in environ:
        return environ.get("ATTNVERIFY_PINNED_GPU") or None
    outer = environ.get("CUDA_VISIBLE_DEVICES")
    n = 0 if outer is not None else (gpu_count if gpu_count is not None else gpu_count_without_cuda(environ))
    chosen = gpu_for_worker(wid, outer, n)
    environ["ATTNVERIFY_PINNED_GPU"] = chosen or ""
    if chosen is not None:
        if outer is not None:
            environ["ATTNVERIFY_OUTER_CUDA_VISIBLE_DEVICES"] = outer
        environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Before any conftest.py is imported: keep this process fork-safe and pin the xdist worker's GPU."""
    ns = early_config.known_args_namespace
    active = bool(getattr(ns, "attn_adapter", None)) or bool(os.environ.get("ATTNVERIFY_ADAPTER"))
    if not active:
        try:
            active = bool(early_config.getini("attn_adapter"))
        except Exception:
            active = False
    if not active:
        return
    # torch.cuda.is_available() then asks NVML instead of cuInit: forking a judge stays safe
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        if cuda_initialised():
            early_config.issue_config_time_warning(
                pytest.PytestConfigWarning("attnverify: CUDA was initialised before the worker could be pinned to one GPU"), 2)
            return
        pin_worker_gpu()


# ------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    adapter_names: List[str]
    profile: str
    report: str  # absolute
    report_arg: str  # as given (relative paths stay relative in messages)
    seed: int
    seed_given: bool
    device: str
    max_examples: Optional[int]
    isolate: str  # subprocess | none (resolved)
    timeout: float
    only: bool
    run_id: str
    worker: Optional[str]
    adapters: list = field(default_factory=list)
    properties: list = field(default_factory=list)
    properties_note: str = ""
    journal: Any = None
    runner: Any = None
    t0: float = field(default_factory=time.time)
    outcomes: Dict[str, dict] = field(default_factory=dict)  # nodeid -> info (controller side)
    allow_untested: bool = False
    untested_lines: List[str] = field(default_factory=list)  # "nothing was tested" (attnverify.untested)
    probed: set = field(default_factory=set)  # (adapter, device) whose conventions this process journaled
    cwd: str = ""  # the folder pytest was invoked from (adapter origins are recorded relative to it)
    max_bugs: Optional[int] = None  # --attn-max-bugs (None: the profile's, attnverify.properties.profiles.MAX_BUGS)
    shard: Optional[tuple] = None  # --attn-shard (K, N) (attnverify.shards); database: --attn-db's (attnverify.exampledb)
    database: Any = ...

    @property
    def is_worker(self) -> bool:
        return self.worker is not None


settings_key = pytest.StashKey[Settings]()


def get_settings(config) -> Optional[Settings]:
    return config.stash.get(settings_key, None)


def pytest_configure(config):
    config.addinivalue_line("markers", "attnverify: a property of the attnverify suite (added by --adapter)")
    vals = option_values(config)
    names = vals["attn_adapter"] or []
    if not names:
        return  # without --adapter the plugin adds nothing
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    winput = getattr(config, "workerinput", None)
    worker = winput.get("workerid") if winput else None
    seed_given = vals["attn_seed"] is not None
    seed = vals["attn_seed"] if seed_given else random.randrange(2**31)
    from .journal import new_run_id

    run_id = new_run_id()
    if winput:
        seed = int(winput.get("attnverify_seed", seed))
        run_id = winput.get("attnverify_run_id", run_id)
    isolate = vals["attn_isolate"]
    if isolate == "auto":
        from .isolation import fork_available

        isolate = "subprocess" if fork_available() else "none"
    report_arg = vals["attn_report"]
    report = report_arg if os.path.isabs(report_arg) else os.path.join(str(config.invocation_params.dir), report_arg)
    s = Settings(
        adapter_names=names, profile=vals["attn_profile"], report=os.path.abspath(report), report_arg=report_arg,
        seed=int(seed), seed_given=seed_given, device=vals["attn_device"], max_examples=vals["attn_max_examples"],
        isolate=isolate, timeout=float(vals["attn_timeout"]), only=bool(vals["attn_only"]), run_id=run_id,
        worker=worker, allow_untested=bool(vals["attn_allow_untested"]), cwd=str(config.invocation_params.dir),
        max_bugs=vals["attn_max_bugs"],
    )
    _shard_db(config, s)
    if s.max_bugs is not None and s.max_bugs < 1:
        raise pytest.UsageError(f"--attn-max-bugs={s.max_bugs}: give 1 or more (1 stops at the first failure)")
    config.stash[settings_key] = s
    config.pluginmanager.register(_Reporter(s), "attnverify-reporter")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(s), "attnverify-xdist")


class _XdistHooks:
    def __init__(self, s: Settings):
        self.s = s

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput["attnverify_seed"] = self.s.seed
        node.workerinput["attnverify_run_id"] = self.s.run_id


def _load_properties(config, s: Settings) -> None:
    props: list = []
    try:
        from .properties import PROPERTIES  # written beside the strategies

        props = list(PROPERTIES)
    except ImportError as e:
        s.properties_note = f"built-in properties unavailable ({e})"
    for extra in config.hook.pytest_attnverify_properties(config=config):
        props += list(extra or [])
    seen, out = set(), []
    for p in props:
        if p.name not in seen:
            seen.add(p.name)
            out.append(p)
    s.properties = out


def _resolve_adapters(config, s: Settings) -> None:
    from .adapters.base import Adapter
    from .adapters.registry import UnknownAdapterError, register_adapter, resolve

    for extra in config.hook.pytest_attnverify_adapters(config=config):
        for a in extra or []:
            if not isinstance(a, Adapter):
                raise pytest.UsageError(f"pytest_attnverify_adapters returned {a!r}, not an attnverify adapter")
            register_adapter(a)
    try:
        s.adapters = resolve(s.adapter_names)
    except UnknownAdapterError as e:
        raise pytest.UsageError(str(e)) from None
    except Exception as e:  # the user's adapter module failed to import: a usage problem, said plainly
        raise pytest.UsageError(f"--adapter {','.join(s.adapter_names)}: loading failed: {type(e).__name__}: {e}") from None
    if not s.adapters:
        raise pytest.UsageError(f"--adapter {','.join(s.adapter_names)}: no available adapter matched")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    config = session.config
    s = get_settings(config)
    if s is None:
        return
    _resolve_adapters(config, s)
    _load_properties(config, s)
    from .journal import Journal, env_info

    s.journal = Journal(s.report, run_id=s.run_id, worker=s.worker)
    if not s.is_worker:
        s.journal.write({
            "event": "run_start", "env": env_info(), "seed": s.seed, "profile": s.profile, "device": s.device,
            "isolate": s.isolate, "timeout": s.timeout if s.isolate == "subprocess" else None,
            "max_examples": s.max_examples,
            "adapters": [_adapter_info(a, s) for a in s.adapters],
            "properties": [p.name for p in s.properties],
            "argv": list(config.invocation_params.args),
            **_shards().run_start_record([a.name for a in s.adapters], [p.name for p in s.properties], s.shard),
        })


def _adapter_info(a, s: Settings) -> dict:
    why = a.unavailable_reason()
    try:
        dev = a.run_device(s.device) if why is None else None
    except Exception:
        dev = None
    return {"name": a.name, "available": why is None, "reason": why, "claims": a.claims.summary(), "device": dev,
            "origin": _origin(a, s)}


def _origin(adapter, s: Settings) -> dict:
    from .recording import origin_of

    return origin_of(adapter, s.adapter_names, s.cwd or None)


def pytest_report_header(config):
    s = get_settings(config)
    if s is None:
        return None
    from .journal import env_info

    env = env_info()
    ads = []
    for a in s.adapters:
        why = a.unavailable_reason()
        ads.append(a.name if why is None else f"{a.name} (unavailable: {why})")
    lines = [
        f"attnverify: adapters {', '.join(ads) or ', '.join(s.adapter_names)}; "
        f"{len(s.properties)} properties; profile {s.profile}; seed {s.seed}"
        + ("" if s.seed_given else f" (replay with --attn-seed {s.seed})"),
        f"attnverify: device {s.device}; isolate {s.isolate}"
        + (f" (timeout {s.timeout:g} s per example)" if s.isolate == "subprocess" else "")
        + (f"; max examples {s.max_examples}" if s.max_examples else "")
        + f"; report {s.report_arg}",
        "attnverify: " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "triton", "hypothesis") if env.get(k))
        + (f"; cuda {env['cuda']}" if env.get("cuda") else "") + (f"; gpus {len(env['gpu'])} x {env['gpu'][0]}" if env.get("gpu") else ""),
    ]
    if s.properties_note:
        lines.append(f"attnverify: {s.properties_note}")
    return lines


# ------------------------------------------------------------------------------------ collection


class AttnSuite(pytest.Collector):
    """The virtual module holding the property items (node id `attnverify`)."""

    def collect(self):  # items are made in pytest_collection_modifyitems
        return []

    def reportinfo(self):
        return self.path, 0, "attnverify"


class AttnFailure(AssertionError):
    pass


class KnownFinding(AssertionError):
    """Only the target of the strict xfail marker a declared finding gets: a pass is a strict XPASS, and any
    other failure (AttnFailure) stays a failure."""


class PropertyItem(pytest.Item):
    def __init__(self, *, prop, adapter, **kw):
        super().__init__(**kw)
        self.prop = prop
        self.adapter = adapter
        self.extra_keyword_matches.update({prop.name, adapter.name, "attnverify"})
        self.add_marker(pytest.mark.attnverify)

    def reportinfo(self):
        return self.path, 0, f"attnverify: {self.name}"

    def runtest(self):
        s = get_settings(self.config)
        from .journal import save_case
        from .properties.driver import run_property

        if s.runner is None:
            from .evidence import EVIDENCE_JOB
            from .isolation import make_runner
            from .probes import CONVENTIONS_JOB

            s.runner = make_runner(s.isolate, s.timeout)
            s.runner.prepare(EVIDENCE_JOB, CONVENTIONS_JOB)  # the judging child holds them from its first fork
        t0 = time.perf_counter()
        in_process0 = getattr(s.runner, "in_process_fallback", 0)
        drawn_by_index: Dict[Any, Any] = {}
        state: Dict[str, Any] = {"examples": 0, "last_fail": None}

        def journal(ev: dict) -> None:
            ev = dict(ev)
            ev.setdefault("property", self.prop.name)
            ev.setdefault("adapter", self.adapter.name)
            ev["test"] = self.nodeid
            if ev.get("event") == "case_start":
                state["examples"] += 1
                drawn_by_index[ev.get("index", state["examples"])] = ev.get("drawn")
                state["last_start"] = ev
            elif ev.get("event") == "result" and not ev.get("passed", True) and ev.get("status") != "skipped":
                state["last_fail"] = ev
            s.journal.write(ev)

        info = {"property": self.prop.name, "adapter": self.adapter.name, "test": self.nodeid,
                "outcome": "passed", "examples": 0, "message": None, "case_file": None, "repro": None, "status": None}
        try:
            run_property(self.prop, self.adapter, profile=s.profile, seed=s.seed, max_examples=s.max_examples,
                         device=s.device, runner=s.runner, journal=journal, report_dir=_report_for_messages(s),
                         database=s.database,
                         max_bugs=s.max_bugs, on_bug=lambda bug: _bugs().record_bug(
                             bug, s=s, prop=self.prop, adapter=self.adapter, journal_write=journal,
                             origin=_origin(self.adapter, s)))
            outcome, note = self.adapter.classify(self.prop.name, None)
            if outcome == "xpass":  # pytest's strict xfail marker (collection) fails the test: XPASS(strict)
                info.update(outcome="xpass", status="xpass", message=f"XPASS(strict): {note}")
        except AssertionError as e:
            msg = str(e)
            fail = state["last_fail"] or {}
            drawn = drawn_by_index.get(fail.get("index"), (state.get("last_start") or {}).get("drawn"))
            bugs = getattr(e, "bugs", None) or []
            if bugs:  # distinct bugs found (attnverify.bugs): the first one is the item's case
                fail, drawn = dict(bugs[0]["result"], index=None), bugs[0]["drawn"]
                info["bugs"] = [_bugs().brief(b) for b in bugs]
            info.update(outcome="failed", message=msg, status=fail.get("status"))
            try:
                path = save_case(s.report, prop_name=self.prop.name, adapter_name=self.adapter.name, drawn=drawn,
                                 result=fail, run_id=s.run_id, seed=s.seed,
                                 extra={"adapter_origin": _origin(self.adapter, s), "records": fail.get("records")})
                info["case_file"] = path
                info["repro"] = f"attnverify repro {_rel(path)}"
                # point the replay line at the file keyed by (property, adapter, example)
                msg, n = re.subn(r"(?m)^replay: .*$", lambda m: f"replay: {info['repro']}", msg, count=1)
                if not n:
                    msg += f"\nreplay: {info['repro']}"
            except Exception as se:  # noqa: BLE001 - the failure matters more than its saving
                msg += f"\n(could not save the case: {type(se).__name__}: {se})"
            outcome, note = self.adapter.classify(self.prop.name, msg)  # the adapter's one classifier
            if outcome == "failed" and note:  # a declared finding narrower than this failure: new, said so
                msg += "\n" + note
            info["message"] = msg
            known = note if outcome == "known" else None
            if known:  # a documented finding: reported, not a new failure (a strict XPASS once it is fixed)
                info.update(outcome="known", status="known", message=f"known finding: {known}\n{msg}")
                pytest.xfail(f"known finding: {known}")
            _record().store_evidence(s.runner, self.adapter, fail, info.get("case_file"))
            raise AttnFailure(msg) from None
        except BaseException as e:
            skipped = isinstance(e, pytest.skip.Exception) or type(e).__name__ in ("PropertySkipped", "SkipTest")
            info.update(outcome="skipped" if skipped else "error", message=f"{type(e).__name__}: {e}")
            raise
        finally:
            info["examples"] = state["examples"]
            info["seconds"] = time.perf_counter() - t0
            # examples judged in this process because CUDA was initialised here: no crash isolation for them
            n_in_process = getattr(s.runner, "in_process_fallback", 0) - in_process0
            if n_in_process:
                info["judged_in_process"] = n_in_process
            s.journal.write({"event": "test_end", **info})
            self.user_properties.append(("attnverify", info))
            _record().probe_conventions(s.runner, s.journal, self.adapter, s.device, s.probed)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AttnFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


def _bugs():
    from . import bugs  # distinct bugs: journaled as found, grouped, summarised

    return bugs


def _shards():
    from . import shards  # --attn-shard: which (adapter, property) pairs this run takes

    return shards


def _shard_db(config, s: Settings) -> None:
    from .exampledb import DatabaseError, open_database

    (shard, src), (db, db_src) = (_raw_value(config, o) for o in OPTIONS if o.dest in ("attn_shard", "attn_db"))
    try:
        s.shard = _shards().parse_shard(shard, src or "--attn-shard")
        s.database = open_database(db, db_src or "--attn-db")
    except (_shards().ShardError, DatabaseError) as e:
        raise pytest.UsageError(str(e)) from None


def _record():
    from . import recording  # what the run stores for its report: evidence, convention probes, origins

    return recording


def _rel(path: str) -> str:
    try:
        r = os.path.relpath(path)
        return path if r.startswith("..") else r
    except ValueError:
        return path


def _report_for_messages(s: Settings) -> str:
    return s.report_arg if not os.path.isabs(s.report_arg) and os.path.abspath(s.report_arg) == s.report else s.report


def pytest_ignore_collect(collection_path, config):
    s = get_settings(config)
    if s is not None and s.only:
        return True  # `attnverify run`: the suite only, none of the repo's own test files
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    s = get_settings(config)
    if s is None:
        return
    suite = AttnSuite.from_parent(session, name="attnverify", nodeid="attnverify", path=config.rootpath)
    new = []
    for a in s.adapters:
        unavailable = a.unavailable_reason()
        for p in s.properties:
            item = PropertyItem.from_parent(suite, name=f"{p.test_name}[{a.name}]", prop=p, adapter=a)
            why = None
            if unavailable:
                why = f"adapter {a.name} is unavailable here: {unavailable}"
            else:
                try:
                    dev = a.run_device(s.device)
                except ValueError as e:
                    dev, why = None, str(e)
                if dev is not None and dev not in a.claims.devices:
                    why = f"{a.name} does not claim device {dev}"
                why = why or p.skip_reason(a)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
            elif a.known_failures.get(p.name):  # declared: a pass must surface (strict XPASS), so it gets removed
                item.add_marker(pytest.mark.xfail(strict=True, raises=KnownFinding,
                                                  reason=f"known finding: {a.known_failures[p.name]}"))
            new.append(item)
    mine = _shards().select(config, new, s.shard, [a.name for a in s.adapters], [p.name for p in s.properties])
    if s.only:
        items[:] = mine
    else:
        items.extend(mine)
    # count them like collected tests ("collected N items", exit status, -k's "deselected")
    from _pytest.reports import CollectReport

    config.hook.pytest_collectreport(report=CollectReport(suite.nodeid, "passed", None, new))


# --------------------------------------------------------------------------------------- summary


class _Reporter:
    """Collects per-item outcomes (also from xdist workers) and prints the adapters x properties table."""

    def __init__(self, s: Settings):
        self.s = s

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        for name, info in getattr(report, "user_properties", ()):
            if name == "attnverify":
                self.s.outcomes[report.nodeid] = info
                return
        if report.when == "setup" and report.skipped and report.nodeid.startswith("attnverify::"):
            m = re.match(r"attnverify::test_(.+)\[(.+)\]$", report.nodeid)
            if m:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.s.outcomes[report.nodeid] = ({"property": m.group(1), "adapter": m.group(2), "outcome": "skipped",
                                                       "message": reason, "examples": 0, "seconds": 0.0})

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        s = self.s
        if s.is_worker:
            return
        rows = dict(s.outcomes)
        if not rows:
            return
        tr = terminalreporter
        tr.section("attnverify")
        for line in _bugs().summary_lines(rows.values()):  # "3 distinct bugs (seen by 26 properties)", each
            tr.write_line(line, red=not line.startswith(" "), bold=not line.startswith(" "))
        adapters = list(dict.fromkeys(i["adapter"] for i in rows.values()))
        props = list(dict.fromkeys(i["property"] for i in rows.values()))
        w = max(len(p) for p in props) + 2
        tr.write_line("property".ljust(w) + "".join(a[:18].ljust(20) for a in adapters))
        by = {(i["property"], i["adapter"]): i for i in rows.values()}
        for p in props:
            cells = []
            for a in adapters:
                i = by.get((p, a))
                if i is None:
                    cells.append("-".ljust(20))
                    continue
                o = i["outcome"]
                cell = {"passed": "ok", "failed": "FAIL", "skipped": "skip", "error": "ERROR", "known": "known",
                        "xpass": "XPASS"}.get(o, o)
                if o in ("passed", "failed"):
                    cell += f" {i.get('examples', 0)}ex {i.get('seconds', 0):.1f}s"
                if i.get("status") in ("crashed", "timeout"):
                    cell = f"{i['status'].upper()} {i.get('examples', 0)}ex"
                cells.append(cell[:19].ljust(20))
            tr.write_line(p.ljust(w) + "".join(cells))
        for i in rows.values():
            if i.get("repro"):
                tr.write_line(f"{i['property']}[{i['adapter']}]: {i['repro']}")
            if i.get("outcome") == "xpass":
                tr.write_line(f"{i['property']}[{i['adapter']}]: {i.get('message')}")
        unisolated = sum(int(i.get("judged_in_process") or 0) for i in rows.values())
        if unisolated:
            tr.write_line(f"WARNING: {unisolated} example(s) were judged in the process that drives the run, without "
                          f"crash isolation: CUDA had been initialised there, so no judge could be forked (a device "
                          f"fault there fails every later test of that worker)")
        tr.write_line(f"journal: {_rel(os.path.join(s.report, 'results.jsonl'))}  seed: {s.seed}")
        for line in s.untested_lines:
            tr.write_line(line, red=True, bold=line.startswith("NOTHING"))


def pytest_sessionfinish(session, exitstatus):
    s = get_settings(session.config)
    if s is None:
        return
    if s.runner is not None:
        try:
            s.runner.close()
        except Exception:
            pass
        s.runner = None
    if not s.is_worker:  # an adapter that tested nothing fails the run, saying why (attnverify.untested)
        from .untested import fail_if_untested

        s.untested_lines = fail_if_untested(session, list(s.outcomes.values()), s.allow_untested)
    if s.journal is not None:
        if not s.is_worker:
            counts: Dict[str, int] = {}
            for info in s.outcomes.values():
                counts[info["outcome"]] = counts.get(info["outcome"], 0) + 1
            s.journal.write({"event": "run_end", "exit_status": int(session.exitstatus), "seconds": time.time() - s.t0,
                             "counts": counts, **({"untested": s.untested_lines} if s.untested_lines else {})})
        s.journal.close()
    if not s.is_worker and s.outcomes and os.environ.get("ATTNVERIFY_NO_HTML") != "1":
        # the HTML report, rendered from the journal just closed (reports read only journaled records)
        try:
            from .reports import render

            path = render(s.report)
            tr = session.config.pluginmanager.get_plugin("terminalreporter")
            if tr is not None and path:
                tr.write_line(f"attnverify report: {_rel(str(path))}")
        except Exception as e:  # noqa: BLE001 - a rendering problem never hides the test results
            print(f"attnverify: could not render the HTML report: {type(e).__name__}: {e}", file=sys.stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With pytest-html active (--html), attach the stored diagnosis and heatmaps of a failing property as
    extras: read from the evidence the judging child wrote, never computed here."""
    outcome = yield
    if not isinstance(item, PropertyItem) or call.when != "call":
        return
    report = outcome.get_result()
    info = next((v for k, v in reversed(item.user_properties) if k == "attnverify"), None)
    if (report.failed and info is not None and info.get("outcome") != "xpass"
            and getattr(item.config.option, "htmlpath", None)):
        item.attnverify_result = {"adapter": info.get("adapter"), "property": info.get("property"),
                                  "result": {"status": info.get("status") or "failed"},
                                  "case_file": info.get("case_file")}
        try:
            from .reports import attach_extras

            attach_extras(item, report, get_settings(item.config).report)
        except Exception as e:  # noqa: BLE001 - extras are a convenience, never a failure
            print(f"attnverify: no pytest-html extras: {type(e).__name__}: {e}", file=sys.stderr)
