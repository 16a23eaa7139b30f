"""The pre-warm's budget, progress and order (attnverify/prewarm.py, `--attn-prewarm-budget`, `run --prewarm-budget`).

On an H200 (2026-12-05) a thorough pre-warm of 11 properties (1,000 examples each) spent 480 s compiling, printed
nothing, and was killed before a single example ran. Now:

- a budget ends the pre-warm (default prewarm.DEFAULT_BUDGET_S), the run starts and compiles the rest itself, and its
  verdicts are those of a run without the pre-warm; the journal's `prewarm` event has the budget and `stopped`;
- a line of progress at the start and then at most every PROGRESS_EVERY_S seconds;
- the examples are warmed round-robin (the first examples of every property first), so that a stopped pre-warm has
  warmed the first examples of every property, not all those of the first few;
- a bad budget (not a number, 0, negative, nan, inf) is refused naming the option or variable and the fix; the flag
  on the command line turns the pre-warm on, the environment variable only bounds one turned on.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import attnverify as av
from attnverify import prewarm
from attnverify.journal import read_journal
from attnverify.prewarm import RoundRobin, drawn_examples, parse_budget, run_prewarm
from attnverify.properties import get_property
from _run_verdicts import run_verdicts  # noqa: E402

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="the pre-warm's pool forks; this platform has no fork")

# a user's eager kernel with a prewarm hook whose context takes 2 s an example (a slow compile), a planted bug (the
# last key lost on long rows), and progress lines every second instead of every 20
CONFTEST = """
import os, time, torch, attnverify as av, attnverify.prewarm

attnverify.prewarm.PROGRESS_EVERY_S = 1.0

def _attn(q, k, v, spec):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if k.shape[2] > 20:
        k, v = k[:, :, :-1], v[:, :, :-1]
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1) @ v

class _SlowCompile:
    claimed = 0

    def __enter__(self):
        time.sleep(2.0)
        self.claimed = 1
        return self

    def __exit__(self, *exc):
        return None

@av.adapter("eager_slow_hook", dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64,
            prewarm=lambda scratch: _SlowCompile())
def eager_slow_hook(q, k, v, spec):
    return _attn(q, k, v, spec)
"""



def _cli_run(where, *args) -> subprocess.CompletedProcess:
    """`attnverify run ARGS` in `where` (this checkout's attnverify), as a user runs it: SIGTERM becomes a KeyboardInterrupt
    there (lifeline.SigtermStopsRun), which the pre-warm's forked pool inherits."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", "import sys; from attnverify import cli; sys.exit(cli.main(sys.argv[1:]))",
                           "run", *args], cwd=where, env=env, capture_output=True, text=True, timeout=600)


@needs_fork
def test_the_budget_stops_a_longer_prewarm_and_the_run_gives_the_same_verdicts(pytester):
    pytester.makeconftest(CONFTEST)
    args = ("--adapter=eager_slow_hook", "--profile=ci", "--device=cpu", "--max-examples=6", "--seed=7", "--no-html",
            "-k", "forward_matches or value_scaling", "--", "-p", "no:randomly")
    plain = _cli_run(pytester.path, "--report=plain", *args)
    shutil.rmtree(pytester.path / ".hypothesis", ignore_errors=True)  # the first run's failure would be replayed first
    # the budget alone turns the pre-warm on
    warmed = _cli_run(pytester.path, "--report=warmed", "--prewarm-budget=3", *args)
    assert plain.returncode == warmed.returncode == 1, warmed.stdout[-3000:] + warmed.stderr[-3000:]  # the planted bug
    a, b = run_verdicts(pytester.path / "plain"), run_verdicts(pytester.path / "warmed")
    assert a and a == b
    events = [r for r in read_journal(str(pytester.path / "warmed")) if r.get("event") == "prewarm"]
    assert len(events) == 1, events
    ev = events[0]
    # it would have taken 2 s an example (on every core of this machine): the budget stopped it
    assert ev["budget_s"] == 3 and ev["stopped"] is True, ev
    assert ev["distinct"] > ev["warmed"] and 2 * ev["distinct"] / ev["workers"] > 3, ev
    assert ev["seconds"] < 3 + 30, ev  # the budget, the pool's start and end
    out = warmed.stdout + warmed.stderr
    assert "attnverify prewarm: drawing and compiling the examples of 2 (adapter, property) pairs" in out, out
    assert re.search(r"attnverify prewarm: \d+ s of 3 s: \d+ of 2 properties drawn \(\d+ examples, \d+ distinct\), "
                     r"\d+ of \d+ warmed, \d+ kernels compiled", out), out
    assert re.search(r"attnverify prewarm: eager_slow_hook: .* of its 3 s budget .*; stopped after 3 s, its budget "
                     r"\(--attn-prewarm-budget\), \d+ of \d+ distinct examples warmed \(the run compiles the rest\)", out), out
    # and quietly: no traceback from the pool's processes as the budget ends them (the run's SIGTERM handler, inherited
    # through the fork, raised KeyboardInterrupt in each), nor Hypothesis' warnings about draws at the session's start
    prewarm_part = out[:out.index("attnverify prewarm: eager_slow_hook:")]
    assert "Traceback" not in prewarm_part and "HypothesisSideeffectWarning" not in out, prewarm_part[-3000:]


class _Sleeps:
    claimed = 0

    def __enter__(self):
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        return None


@av.adapter("sleeps_in_prewarm", register=False, dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64,
            prewarm=lambda scratch: _Sleeps())
def sleeps_in_prewarm(q, k, v, spec):
    return q


@needs_fork
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, when another test of this worker imported it
def test_progress_lines_at_the_start_and_at_most_every_interval():
    got = []
    t0 = time.monotonic()
    res = run_prewarm([(sleeps_in_prewarm, get_property("forward_matches_reference"))], profile="ci", seed=1,
                      max_examples=8, device="cpu", workers=1, budget_s=30,
                      progress=lambda line: got.append((time.monotonic() - t0, line)), progress_every_s=1.0)
    assert not res["stopped"] and res["warmed"] == res["distinct"] > 6, res  # 0.3 s each: 2 s or more in all
    assert got[0][1].startswith("attnverify prewarm: drawing and compiling the examples of 1 (adapter, property) "
                                "pairs (sleeps_in_prewarm) on 1 process before the run starts, for at most 30 s"), got
    ticks = [(t, line) for t, line in got[1:]]
    assert len(ticks) >= 1, got
    for _, line in ticks:
        assert re.fullmatch(r"attnverify prewarm: \d+ s of 30 s: 1 of 1 properties drawn \(\d+ examples, \d+ distinct\), "
                            r"\d+ of \d+ warmed, \d+ kernels compiled", line), line
    # quiet: never two within the interval, and not more than the seconds it ran allow
    assert all(b - a >= 0.9 for (a, _), (b, _) in zip(ticks, ticks[1:])), ticks
    assert len(ticks) <= res["seconds"] / 1.0 + 1, (len(ticks), res["seconds"])


def test_round_robin_hands_out_the_first_examples_of_every_pair_first():
    rr = RoundRobin()
    rr.add(0, ["a0", "a1", "a2", "a3"])
    rr.add(1, ["b0", "b1"])
    rr.add(2, ["c0", "c1", "c2"])
    assert [rr.pop() for _ in range(3)] == ["a0", "b0", "c0"]
    assert rr.pop() == "a1"
    rr.add(3, ["d0", "d1"])  # drawn late: its first example comes before the others' later ones
    assert [rr.pop() for _ in range(6)] == ["d0", "b1", "c1", "d1", "a2", "c2"]
    assert rr.pop() == "a3" and not rr and rr.pop() is None


def _warm_logged(adapter, prop, drawn, scratch):
    """In place of prewarm.warm_example in the pool's processes (forked from this one): notes what it warms, slowly."""
    with open(os.environ["PREWARM_ORDER_LOG"], "a") as f:
        f.write(json.dumps([prop.name, json.dumps(drawn, sort_keys=True, default=str)]) + "\n")
    time.sleep(0.3)
    return True, 1, ""


@needs_fork
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_stopped_prewarm_warmed_the_first_examples_of_every_property(monkeypatch, tmp_path):
    log = tmp_path / "order.log"
    monkeypatch.setenv("PREWARM_ORDER_LOG", str(log))
    monkeypatch.setattr(prewarm, "warm_example", _warm_logged)
    names = ("forward_matches_reference", "value_scaling", "gqa_equals_repeated_kv")
    props = [get_property(n) for n in names]
    kw = dict(profile="ci", seed=3, max_examples=10, device="cpu")
    res = run_prewarm([(sleeps_in_prewarm, p) for p in props], workers=1, budget_s=6, **kw)
    order = [tuple(json.loads(x)) for x in log.read_text().splitlines()]
    # what each property draws, its repeats left out: the rank of each warmed example among its property's
    rank = {}
    for p in props:
        distinct = list(dict.fromkeys(json.dumps(d, sort_keys=True, default=str)
                                      for d in drawn_examples(p, sleeps_in_prewarm, **kw)))
        rank.update({(p.name, key): r for r, key in enumerate(distinct)})
    assert res["stopped"] and 3 <= len(order) < res["distinct"], (res, len(order))
    ranks = [rank[x] for x in order]
    # every property's first example was warmed, and each property's examples in the order they were drawn
    assert {name for name, _ in order} == set(names)
    for n in names:
        mine = [r for (name, _), r in zip(order, ranks) if name == n]
        assert mine == list(range(len(mine))), (n, mine)
    # round robin: no property more than the pool's queue (2 per process) ahead of another
    counts = {n: 0 for n in names}
    for name, _ in order:
        counts[name] += 1
        assert max(counts.values()) - min(counts.values()) <= 2, (counts, order)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_budget_is_refused_naming_the_option_and_the_fix(value):
    with pytest.raises(ValueError) as e:
        parse_budget(value, "--attn-prewarm-budget")
    msg = str(e.value)
    assert msg.startswith(f"--attn-prewarm-budget={value!r}: give the pre-warm's budget in seconds, a number above 0")
    assert "--attn-prewarm-budget=600" in msg and "default 300" in msg
    assert parse_budget("90") == 90.0 and parse_budget(None) == prewarm.DEFAULT_BUDGET_S == 300.0
    with pytest.raises(ValueError, match=r"run_prewarm\(budget_s\)=-1"):
        run_prewarm([(sleeps_in_prewarm, get_property("forward_matches_reference"))], profile="ci", seed=1, budget_s=-1)


def test_the_plugin_refuses_a_bad_budget_naming_where_it_came_from(pytester, monkeypatch):
    r = pytester.runpytest_subprocess("--adapter=naive", "--attn-only", "--attn-prewarm", "--attn-prewarm-budget=-5",
                                      "-p", "no:randomly", "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--attn-prewarm-budget='-5': give the pre-warm's budget in seconds, a number above 0*"])
    monkeypatch.setenv("ATTNVERIFY_PREWARM_BUDGET", "soon")
    r = pytester.runpytest_subprocess("--adapter=naive", "--attn-only", "-p", "no:randomly", "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*ATTNVERIFY_PREWARM_BUDGET='soon': give the pre-warm's budget in seconds*"])


def test_the_budget_flag_turns_the_prewarm_on_and_the_variable_only_bounds_it(pytester, monkeypatch):
    from attnverify.plugin_settings import get_settings

    config = pytester.parseconfigure("--adapter=naive", "--attn-prewarm-budget=45")
    s = get_settings(config)
    assert s.prewarm is True and s.prewarm_budget == 45.0
    monkeypatch.setenv("ATTNVERIFY_PREWARM_BUDGET", "45")
    config = pytester.parseconfigure("--adapter=naive")
    s = get_settings(config)
    assert s.prewarm is False and s.prewarm_budget == 45.0
    config = pytester.parseconfigure("--adapter=naive", "--attn-prewarm")
    s = get_settings(config)
    assert s.prewarm is True and s.prewarm_budget == 45.0
    monkeypatch.delenv("ATTNVERIFY_PREWARM_BUDGET")
    s = get_settings(pytester.parseconfigure("--adapter=naive", "--attn-prewarm"))
    assert s.prewarm is True and s.prewarm_budget == prewarm.DEFAULT_BUDGET_S


def test_without_a_budget_a_session_timeout_gets_at_most_a_quarter_of_it(pytester):
    pytest.importorskip("pytest_timeout", reason="--session-timeout is pytest-timeout's option")
    from attnverify.plugin_settings import get_settings

    s = get_settings(pytester.parseconfigure("--adapter=naive", "--attn-prewarm", "--session-timeout=200"))
    assert s.prewarm_budget == 50.0  # a quarter: the run keeps the rest
    s = get_settings(pytester.parseconfigure("--adapter=naive", "--attn-prewarm", "--session-timeout=7200"))
    assert s.prewarm_budget == prewarm.DEFAULT_BUDGET_S
    s = get_settings(pytester.parseconfigure("--adapter=naive", "--attn-prewarm-budget=120", "--session-timeout=200"))
    assert s.prewarm_budget == 120.0  # a budget given is kept


def test_the_cli_passes_the_budget_and_refuses_a_bad_one(capsys):
    from attnverify import cli

    ns, _ = cli.build_parser().parse_known_args(["run", "--adapter", "triton", "--prewarm-budget", "600"])
    args = cli.pytest_args_for_run(ns, [], gpu=True)
    assert "--attn-prewarm" in args and "--attn-prewarm-budget=600" in args
    ns, _ = cli.build_parser().parse_known_args(["run", "--adapter", "triton", "--prewarm"])
    assert not any(a.startswith("--attn-prewarm-budget") for a in cli.pytest_args_for_run(ns, [], gpu=True))
    assert cli.main(["run", "--adapter", "triton", "--prewarm-budget", "-5"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--prewarm-budget='-5': give the pre-warm's budget in seconds, a number above 0" in err, err
