"""`--attn-prewarm` (attnverify/prewarm.py, attnverify/triton_prewarm.py): the run's kernels compiled before it starts.

- through the real Triton JIT for sm_90 on this CPU (a stand-in driver that compiles and never launches): a run
  on an empty Triton cache compiles (the control), a pre-warm on 2 processes compiles each distinct kernel once,
  and the same run afterwards on its cache compiles nothing: every launch is a disk-cache hit;
- the same seed gives the same verdicts with and without the pre-warm (a user's conftest adapter with a hook and
  a planted bug, through the plugin), and the hook ran in the pre-warm;
- under the interpreter the bundled triton adapter's hook compiles nothing, an adapter without a hook is left
  alone, and a bad hook or worker count is refused naming the argument.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import attnverify as av
from attnverify.journal import read_journal
from attnverify.prewarm import keyword_selected, run_prewarm
from attnverify.properties import get_property
from attnverify.triton_prewarm import compile_only_here
from _run_verdicts import run_verdicts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia.driver") is not None
    except ImportError:
        return False


def _standin(step: str, cache, workers: int = 2, props: str = "gradients_match_reference",
             examples: int = 2) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, os.path.join(HERE, "_prewarm_standin.py"), step, str(workers), props,
                          str(examples)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _nvidia_backend(), reason="needs Triton's NVIDIA backend (the pip wheel has it) to compile "
                                                   "for sm_90 without a GPU")
def test_after_the_prewarm_every_launch_of_the_run_is_a_disk_cache_hit(tmp_path):
    cold = _standin("run", tmp_path / "cold")
    assert cold["new_kernels"], "the control: a run on an empty Triton cache must compile"
    warm = tmp_path / "warm"
    pre = _standin("prewarm", warm)
    assert pre["workers"] == 2 and pre["errors"] == 0, pre
    # each distinct kernel compiled by one process: the claims made equal the kernels in the cache
    assert pre["compiles"] == len(pre["new_kernels"]) > 0, pre
    # and the work was shared: both processes compiled (the wall-time gain is measured in benchmarks/prewarm_cpu.py)
    assert len(pre["compiles_per_process"]) == 2 and min(pre["compiles_per_process"]) > 0, pre
    assert set(cold["new_kernels"]) <= set(pre["new_kernels"])
    after = _standin("run", warm)
    assert after["new_kernels"] == [], f"the run compiled {len(after['new_kernels'])} kernels the pre-warm did not"


# a user's eager kernel in a conftest.py with a prewarm hook (inside its context a call "compiles": it is noted in
# PREWARM_LOG and counted) and a planted bug: the last key is lost on long rows
CONFTEST = """
import os, torch, attnverify as av

def _attn(q, k, v, spec):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if k.shape[2] > 20:
        k, v = k[:, :, :-1], v[:, :, :-1]
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1) @ v

class _Compiling:  # "compiles" each call: notes it in PREWARM_LOG, one line per call
    claimed = 0

    def __enter__(self):
        global _compiling
        _compiling = self
        return self

    def __exit__(self, *exc):
        global _compiling
        _compiling = None

_compiling = None

def _prewarm(scratch):
    assert os.path.isdir(scratch)
    return _Compiling()

@av.adapter("eager_with_hook", dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64, prewarm=_prewarm)
def eager_with_hook(q, k, v, spec):
    if _compiling is not None:
        _compiling.claimed += 1
        with open(os.environ["PREWARM_LOG"], "a") as f:
            f.write(f"{os.getpid()} {tuple(q.shape)}\\n")
    return _attn(q, k, v, spec)
"""



@pytest.mark.skipif(not hasattr(os, "fork"), reason="the pre-warm's pool forks; this platform has no fork")
def test_same_seed_same_verdicts_with_and_without_the_prewarm(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    log = pytester.path / "prewarm.log"
    monkeypatch.setenv("PREWARM_LOG", str(log))
    args = ("--adapter=eager_with_hook", "--attn-only", "--attn-profile=ci", "--attn-max-examples=6", "--attn-seed=7",
            "-k", "forward_matches or value_scaling", "-p", "no:randomly", "-p", "no:cacheprovider")
    plain = pytester.runpytest_subprocess(*args, "--attn-report=plain")
    assert not log.exists(), "without --attn-prewarm the hook must not run"
    # a fresh example database: the first run saved its failure there, which the second would replay first
    import shutil

    shutil.rmtree(pytester.path / ".hypothesis", ignore_errors=True)
    warmed = pytester.runpytest_subprocess(*args, "--attn-report=warmed", "--attn-prewarm")
    assert plain.ret == warmed.ret == 1  # the planted bug is found both times
    calls = log.read_text().splitlines()
    assert calls, "the hook never ran"
    assert warmed.stdout.fnmatch_lines(["*attnverify prewarm: eager_with_hook: * examples drawn, * compiles*"]) is None
    a, b = run_verdicts(pytester.path / "plain"), run_verdicts(pytester.path / "warmed")
    assert a and a == b
    assert {"passed", "failed"} <= {s for _, _, _, s, _ in a}, a
    events = [r for r in read_journal(str(pytester.path / "warmed")) if r.get("event") == "prewarm"]
    assert len(events) == 1 and events[0]["compiles"] == len(calls) and events[0]["examples"] > 0, events
    assert events[0]["errors"] == 0, events
    busy = events[0]["busy_seconds_per_process"]  # each pool process's time judging examples (the tail's measure)
    assert 0 < len(busy) <= events[0]["workers"] and busy == sorted(busy, reverse=True) and sum(busy) > 0, events
    # the comparison can fail: another seed draws other examples
    shutil.rmtree(pytester.path / ".hypothesis", ignore_errors=True)
    other = pytester.runpytest_subprocess(*[x if x != "--attn-seed=7" else "--attn-seed=8" for x in args],
                                          "--attn-report=other")
    assert other.ret == 1 and run_verdicts(pytester.path / "other") != b
    # -k is honoured: only the two selected properties were drawn
    assert {p["property"] for p in events[0]["per_property"]} == {"forward_matches_reference", "value_scaling"}


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, when another test of this worker imported it
def test_under_the_interpreter_the_triton_hook_compiles_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_only_here("/nonexistent") is None
    from attnverify.adapters.registry import get

    triton = get("triton")
    if triton.unavailable_reason():
        pytest.skip(f"the bundled triton adapter is unavailable here: {triton.unavailable_reason()}")
    res = run_prewarm([(triton, get_property("forward_matches_reference"))], profile="ci", seed=1, max_examples=2,
                      device="cpu", workers=1)
    assert res["examples"] > 0 and res["calls"] == res["compiles"] == res["errors"] == 0, res
    assert "nothing to compile here" in res["note"]


@av.adapter("no_hook_f32", register=False, dtypes=("float32",), devices=("cpu",))
def no_hook_f32(q, k, v, spec):
    return q


def test_an_adapter_without_a_hook_is_left_alone():
    res = run_prewarm([(no_hook_f32, get_property("forward_matches_reference"))], profile="ci", seed=1)
    assert res["workers"] == 0 and res["examples"] == 0 and "nothing to do" in res["note"]


def test_bad_hook_and_worker_count_are_refused():
    with pytest.raises(TypeError, match=r"prewarm=3.*give a function \(scratch folder\)"):
        av.adapter("bad_hook", register=False, prewarm=3)(lambda q, k, v, spec: q)
    hooked = av.adapter("hooked", register=False, prewarm=lambda scratch: None)(lambda q, k, v, spec: q)
    with pytest.raises(ValueError, match=r"workers=0"):
        run_prewarm([(hooked, get_property("forward_matches_reference"))], profile="ci", seed=1, workers=0)


def test_keyword_selection_follows_pytest_k():
    props = [get_property(n) for n in ("forward_matches_reference", "gradients_match_reference", "value_scaling")]
    pairs = [(no_hook_f32, p) for p in props]
    assert [p.name for _, p in keyword_selected(pairs, "")] == [p.name for p in props]
    assert [p.name for _, p in keyword_selected(pairs, "matches and not gradients")] == ["forward_matches_reference"]
    assert [p.name for _, p in keyword_selected(pairs, "no_hook_f32 and scaling")] == ["value_scaling"]
    assert keyword_selected(pairs, "nothing_like_this") == []


def test_the_cli_passes_prewarm_to_the_plugin():
    from attnverify import cli

    ns, _ = cli.build_parser().parse_known_args(["run", "--adapter", "triton", "--prewarm"])
    assert "--attn-prewarm" in cli.pytest_args_for_run(ns, [], gpu=True)
    ns, _ = cli.build_parser().parse_known_args(["run", "--adapter", "triton"])
    assert "--attn-prewarm" not in cli.pytest_args_for_run(ns, [], gpu=True)


class _Hangs:
    def __enter__(self):
        import time

        time.sleep(120)

    def __exit__(self, *exc):
        return None


@av.adapter("hangs_in_prewarm", register=False, dtypes=("float32",), devices=("cpu",), prewarm=lambda scratch: _Hangs())
def hangs_in_prewarm(q, k, v, spec):
    return q


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the pre-warm's pool forks; this platform has no fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, when another test of this worker imported it
def test_a_hang_in_the_prewarm_does_not_hold_the_run():
    import time

    t0 = time.monotonic()
    res = run_prewarm([(hangs_in_prewarm, get_property("forward_matches_reference"))], profile="ci", seed=1,
                      max_examples=2, workers=2, budget_s=5)
    assert time.monotonic() - t0 < 60
    assert res["examples"] > 0 and res["stopped"] and "stopped after 5 s" in res["note"], res


PARALLEL_PARENT = r'''
import torch, attnverify as av
from attnverify.prewarm import run_prewarm
from attnverify.properties import get_property

torch.set_num_threads(2)
(torch.randn(2_000_000) * 2).sum()  # the parent's own parallel op: OpenMP's pool started here


class Ctx:
    claimed = 1

    def __enter__(self):
        (torch.randn(2_000_000) * 2).sum()  # a parallel op in the forked pool process: hung there before
        return self

    def __exit__(self, *exc):
        return None


@av.adapter("par", register=False, dtypes=("float32",), devices=("cpu",), prewarm=lambda scratch: Ctx())
def par(q, k, v, spec):
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1) @ v


res = run_prewarm([(par, get_property("forward_matches_reference"))], profile="ci", seed=1, max_examples=3,
                  workers=2, budget_s=40)
print("RESULT", res["calls"], res["errors"], repr(res["note"]))
'''


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the pre-warm's pool forks; this platform has no fork")
def test_the_prewarm_pool_works_after_the_parent_ran_parallel_torch_ops(tmp_path):
    """A process that ran a parallel torch op before the pre-warm (a user's script, a conftest) left GNU OpenMP's
    pool in a state that hangs a forked child's first parallel op: the pool's processes start on one torch thread,
    as the judging children do (before: every example stopped at the timeout, nothing compiled)."""
    script = tmp_path / "par.py"
    script.write_text(PARALLEL_PARENT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("ATTNVERIFY_CHILD_THREADS", None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    calls, errors, note = line[0].split(" ", 3)[1:]
    assert int(calls) > 0 and int(errors) == 0 and "stopped" not in note, line[0]
