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
    --attn-prewarm           attn_prewarm        ATTNVERIFY_PREWARM       compile the run's kernels first (attnverify.prewarm)
    --attn-prewarm-budget S  attn_prewarm_budget ATTNVERIFY_PREWARM_BUDGET  the pre-warm's seconds (300); the flag turns it on

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

This module holds the hooks; the options are in pytest_options.py, the pinning in gpu_pinning.py, the run's
settings in plugin_settings.py, the test items in plugin_items.py and the summary table in plugin_summary.py.
It is light: without an attnverify option nothing imports torch, Hypothesis or the properties.
"""
from __future__ import annotations

import os
import random
import sys
import time
from typing import Dict

import pytest

# light on purpose: pytest loads this module (entry point pytest11) in every run; torch, hypothesis and the
# properties are imported only once an attnverify option is given
from .gpu_pinning import gpu_count_without_cuda, gpu_for_worker, pin_worker_gpu, visible_devices
from .origin import display_path as _rel
from .plugin_items import AttnFailure, AttnSuite, KnownFinding, PropertyItem
from .plugin_settings import (
    Settings, _adapter_info, _load_properties, _resolve_adapters, _XdistHooks, get_settings,
    settings_key,
)
from .plugin_summary import _Reporter
from .pytest_options import (
    DEFAULT_PROFILE, DEFAULT_REPORT, DEFAULT_TIMEOUT, DEVICES, ISOLATES, OPTIONS, PROFILES, Hookspecs, add_options,
    option_values,
)


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(Hookspecs)


def pytest_addoption(parser):
    add_options(parser)


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
        from .device_memory import cuda_initialised

        if cuda_initialised():
            early_config.issue_config_time_warning(
                pytest.PytestConfigWarning("attnverify: CUDA was initialised before the worker could be pinned to one GPU"), 2)
            return
        pin_worker_gpu()


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
        from .lifeline import sigint_once, worker_dies_with_controller

        # a worker left behind by a killed controller ends now, not 15 s later with its judge orphaned
        worker_dies_with_controller(winput.get("attnverify_controller"))
        sigint_once()
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
        max_bugs=vals["attn_max_bugs"], prewarm=bool(vals["attn_prewarm"]),
    )
    _shard_db(config, s)
    _prewarm_budget(config, s)
    if s.max_bugs is not None and s.max_bugs < 1:
        raise pytest.UsageError(f"--attn-max-bugs={s.max_bugs}: give 1 or more (1 stops at the first failure)")
    try:  # read again at each out-of-memory error; a bad value is told now, not at the first one
        from .device_memory import retry_mode

        retry_mode()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[settings_key] = s
    config.pluginmanager.register(_Reporter(s), "attnverify-reporter")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(s), "attnverify-xdist")


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
        if s.prewarm:  # before xdist starts its workers (its sessionstart runs last) and before any judge forks
            _prewarm(session, s)


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
                why = why or p.why_skipped(a)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
            elif a.known_failures.get(p.name) and p.name not in a.known_not_strict:
                # declared: a pass must surface (strict XPASS), so it gets removed; a finding declared not strict
                # (a run may not show it) gets no marker: a pass is a pass, a matching failure xfails in runtest
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


def pytest_collection_finish(session):
    """Start the judging child as soon as the run's items are known, so that it warms the judge while the
    rest of the session's set-up and the first draws go on (attnverify.judge_warmup). Not in xdist's
    controller (it collects nothing) nor for --collect-only; only when an attnverify item is to run."""
    s = get_settings(session.config)
    if s is None or s.runner is not None or session.config.option.collectonly:
        return
    from .plugin_items import PropertyItem, start_runner

    mine = [i for i in session.items if isinstance(i, PropertyItem) and i.get_closest_marker("skip") is None]
    if mine:
        start_runner(s, backward=any(getattr(i.prop, "backward_cases", False) for i in mine))


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
    stopped = int(session.exitstatus) == int(pytest.ExitCode.INTERRUPTED)  # what was judged before a stop is shown
    if not s.is_worker and (s.outcomes or stopped) and os.environ.get("ATTNVERIFY_NO_HTML") != "1":
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


__all__ = [
    "OPTIONS", "PROFILES", "DEVICES", "ISOLATES", "DEFAULT_PROFILE", "DEFAULT_REPORT", "DEFAULT_TIMEOUT", "Hookspecs",
    "option_values", "Settings", "settings_key", "get_settings", "AttnSuite", "AttnFailure", "KnownFinding",
    "PropertyItem", "gpu_count_without_cuda", "gpu_for_worker", "pin_worker_gpu", "visible_devices",
]


def _prewarm(session, s) -> None:
    """--attn-prewarm: compile what the run will launch (attnverify.prewarm), journaled and said on the terminal."""
    from . import prewarm

    pairs = [(a, p) for a in s.adapters for p in s.properties]
    if s.shard is not None:
        mine = set(_shards().shard_pairs([a.name for a in s.adapters], [p.name for p in s.properties], s.shard))
        pairs = [(a, p) for a, p in pairs if (a.name, p.name) in mine]
    pairs = prewarm.keyword_selected(pairs, session.config.getoption("keyword", ""))
    db = s.database
    if db is ...:  # the profiles' own (a folder under the run's directory), as the run's properties get it
        from .properties.profiles import example_database

        db = example_database()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:  # now, not when the buffer fills: the session's header comes only after the pre-warm
        if tr is not None:
            tr.write_line(line)
            getattr(tr, "flush", lambda: None)()
        else:
            print(line, file=sys.stderr, flush=True)

    res = prewarm.run_prewarm(pairs, profile=s.profile, seed=s.seed, max_examples=s.max_examples, device=s.device,
                              database=db, budget_s=s.prewarm_budget, progress=say)
    # budget_s and stopped among them: how long it could take and whether the budget ended it
    s.journal.write({"event": "prewarm", **{k: v for k, v in res.items() if k != "per_property"},
                     "per_property": res["per_property"]})
    say(prewarm.summary_line(res))


def _prewarm_budget(config, s) -> None:
    """--attn-prewarm-budget: the pre-warm's seconds (attnverify.prewarm.parse_budget: a number above 0). Given on the
    command line it turns the pre-warm on (asking for a budget is asking for a pre-warm); from the environment or the
    ini file it only bounds a pre-warm turned on (a CI-wide setting must not turn it on in every job)."""
    from .prewarm import BUDGET_OPTION, default_budget, parse_budget
    from .pytest_options import _raw_value

    raw, src = _raw_value(config, next(o for o in OPTIONS if o.dest == "attn_prewarm_budget"))
    if raw is None:  # none given: the default, or less where pytest-timeout's --session-timeout would be eaten by it
        s.prewarm_budget = default_budget(_session_timeout(config))
        return
    try:
        s.prewarm_budget = parse_budget(raw, src or BUDGET_OPTION)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if src == BUDGET_OPTION:
        s.prewarm = True


def _session_timeout(config):
    """pytest-timeout's --session-timeout (or its ini key) in seconds, None without one or without the plugin."""
    try:
        v = config.getoption("session_timeout", None)
        if v in (None, ""):
            v = config.getini("session_timeout")
        return float(v) if v not in (None, "") else None
    except (ValueError, TypeError):  # no such ini key: pytest-timeout is not installed
        return None


def _shards():
    from . import shards  # --attn-shard: which (adapter, property) pairs this run takes

    return shards


def _shard_db(config, s) -> None:
    from .exampledb import DatabaseError, open_database
    from .pytest_options import _raw_value

    (shard, src), (db, db_src) = (_raw_value(config, o) for o in OPTIONS if o.dest in ("attn_shard", "attn_db"))
    try:
        s.shard = _shards().parse_shard(shard, src or "--attn-shard")
        s.database = open_database(db, db_src or "--attn-db")
    except (_shards().ShardError, DatabaseError) as e:
        raise pytest.UsageError(str(e)) from None
