"""Nothing a run started outlives it, and nothing a user ran is lost when it is stopped.

A stranger's file adapter answers its first few calls at once and then sits in long C calls (a loop of
big float64 matmuls, minutes of them). A real `attnverify run` (or plain pytest) is started in a session
of its own, its top process is sent SIGTERM, SIGINT or SIGKILL once results are journaled and a judging
child is inside the slow part, and then:

- no process of the run (the session: top, xdist workers, judging children) is left: the judging
  children within JUDGE_BOUND s, every process but the top one within RUN_BOUND s, and the top one (its run_end
  record and report) within TOP_GRACE s more;
- the journal holds every result written before the stop, every line parses, and `attnverify report`
  renders it; after SIGTERM/SIGINT the stopped property says `stopped` and the run_end record says so.

Before attnverify.lifeline the judging children (and for a while the workers) computed on as orphans.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnverify import cli
from attnverify.isolation import SubprocessRunner
from attnverify.properties.base import ExampleResult, Property

pytestmark = pytest.mark.skipif(not (hasattr(os, "fork") and os.path.isdir("/proc/self/task")),
                                reason="these tests find a run's processes through Linux /proc and fork")

ROOT = Path(__file__).resolve().parents[1]
# seconds after the signal: the processes inside the adapter's slow part are gone within JUDGE_BOUND (before
# attnverify.lifeline they computed on as orphans), every process of the run within RUN_BOUND (after Ctrl-C a
# worker still formats its KeyboardInterrupt and the top process renders the report: 1-3 s on an idle
# machine, up to 7-11 s on this project's shared 2 cores; execnet alone used to take 15 s)
JUDGE_BOUND = 5.0
RUN_BOUND = 15.0
# the top process alone (writing the run_end record and rendering the report once the rest are gone) may take this
# much longer on a loaded machine: the processes that used to linger (workers, judges) are held to RUN_BOUND
TOP_GRACE = 10.0
FAST_CALLS = 3  # calls each process answers at once before the slow part

SLOW_ADAPTER = '''
"""My kernel: correct, but after a few calls every call takes minutes inside C (big float64 matmuls)."""
import os, time
import torch
import attnverify as av

_calls = [0]

@av.adapter("slowpoke", dtypes=("float32",), devices=("cpu",), causal=("none",))
def slowpoke(q, k, v, spec):
    _calls[0] += 1
    if _calls[0] > int(os.environ["SLOW_AFTER"]):
        with open(os.path.join(os.environ["SLOW_MARKS"], str(os.getpid())), "w") as f:
            f.write("slow")
        a = torch.randn(1500, 1500, dtype=torch.float64)
        t0 = time.time()
        while time.time() - t0 < 600:
            a = torch.tanh(a @ a)
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return torch.softmax(s, -1) @ v
'''


def _stat(pid: int):
    """(state, session id) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[3])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _session(sid: int):
    """Live (not zombie) processes of session `sid`, with their command lines."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st and st[1] == sid and st[0] not in ("Z", "X"):
                try:
                    out[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                except OSError:
                    pass
    return out


def _results(journal: Path):
    if not journal.exists():
        return []
    return [json.loads(ln) for ln in journal.read_text().splitlines() if ln.strip()]


def _launch(tmp_path: Path, how: str, n: int):
    (tmp_path / "slow_kernel.py").write_text(SLOW_ADAPTER)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SLOW_AFTER": str(FAST_CALLS), "SLOW_MARKS": str(marks), "ATTNVERIFY_CHILD_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    common = ["--adapter=slow_kernel.py:slowpoke", "-k", "forward_matches_reference", "-n", str(n)]
    if how == "run":
        argv = [sys.executable, "-c", "import sys; from attnverify.cli import main; sys.exit(main(sys.argv[1:]))",
                "run", *common, "--profile", "ci", "--report", "rep", "--timeout", "900"]
    else:
        plugin = ["-p", "attnverify.plugin"]
        argv = [sys.executable, "-m", "pytest", *plugin, *common, "--attn-profile=ci", "--attn-report=rep",
                "--attn-timeout=900", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "none")]
        (tmp_path / "none").mkdir()

    def default_sigint():  # a test runner started in the background may hand on an ignored SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=default_sigint)
    return proc, marks


def _stop_and_watch(tmp_path: Path, how: str, n: int, sig: int):
    proc, marks = _launch(tmp_path, how, n)
    journal = tmp_path / "rep" / "results.jsonl"
    sid = proc.pid
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (list(marks.iterdir()) and _results(journal)):
            if proc.poll() is not None:
                pytest.fail("the run ended before it reached the slow part:\n" + (tmp_path / "log.txt").read_text()[-3000:])
            time.sleep(0.3)
        slow = [int(p.name) for p in marks.iterdir()]
        assert slow, "no judging process reached the slow part within 240 s"
        time.sleep(0.5)
        before = [r for r in _results(journal) if r["event"] == "result"]
        running = _session(sid)
        assert all(p in running for p in slow), (slow, running)
        os.kill(proc.pid, sig)
        t0 = time.time()
        left, judges_left, judges_took, others_took = running, slow, None, None
        while left and time.time() - t0 < (RUN_BOUND if others_took is None else RUN_BOUND + TOP_GRACE):
            time.sleep(0.2)
            proc.poll()
            left = _session(sid)
            judges_left = [p for p in slow if p in left]
            if judges_took is None and not judges_left:
                judges_took = time.time() - t0
            if others_took is None and not [p for p in left if p != proc.pid]:
                others_took = time.time() - t0  # only the top process (if any) is left
            if judges_left and time.time() - t0 > JUDGE_BOUND:
                break
        took = time.time() - t0
        print(f"{how} -n {n}, {signal.Signals(sig).name}: judges gone after "
              f"{'(not yet)' if judges_took is None else f'{judges_took:.1f}'} s, "
              f"the rest but the top process after {'(not yet)' if others_took is None else f'{others_took:.1f}'} s, "
              f"{len(left)} process(es) left after {took:.1f} s")
    finally:
        for pid in _session(sid):  # whatever is left (the test then fails): never leave it computing
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    log = (tmp_path / "log.txt").read_text()
    assert not left, (f"{len(left)} process(es) of the run still alive {took:.1f} s after {signal.Signals(sig).name} to "
                      f"the top process (judging pids {slow}, in the slow part):\n"
                      + "\n".join(f"  {p} {c}" for p, c in left.items()) + "\n--- log tail:\n" + log[-1500:])
    recs = _results(journal)  # every line parses (json.loads above) and nothing judged before the stop is lost
    after = [r for r in recs if r["event"] == "result"]
    assert len(after) >= len(before) >= 1
    assert [json.dumps(r, sort_keys=True) for r in after[:len(before)]] == [json.dumps(r, sort_keys=True) for r in before]
    return recs, proc.returncode, log


def _assert_renders(tmp_path: Path, expect_status: str):
    p = subprocess.run([sys.executable, "-c", "import sys; from attnverify.cli import main; sys.exit(main(sys.argv[1:]))",
                        "report", "rep"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert p.returncode == 0, p.stdout + p.stderr
    html = (tmp_path / "rep" / "index.html").read_text()
    assert "slowpoke" in html and f'class="st-{expect_status}"' in html, html[-3000:]
    return html


def _assert_stopped(recs, log):
    ends = [r for r in recs if r["event"] == "run_end"]
    assert ends and ends[-1]["exit_status"] == 2, log[-2000:]  # pytest's "interrupted"
    stopped = [r for r in recs if r["event"] == "test_end" and r.get("outcome") == "stopped"]
    assert stopped and "results judged before the stop are in the journal" in stopped[0]["message"], log[-2000:]
    judged = [r for r in recs if r["event"] == "result" and r.get("test") == stopped[0]["test"]]
    assert f"after {len(judged)} judged example(s)" in stopped[0]["message"], stopped[0]["message"]


# ---- end to end: a real run, stopped three ways -------------------------------------------------------------

@pytest.mark.parametrize("n", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_sigterm_to_attnverify_run_leaves_nothing_and_keeps_every_result(tmp_path, n):
    recs, code, log = _stop_and_watch(tmp_path, "run", n, signal.SIGTERM)
    _assert_stopped(recs, log)
    assert code == cli.EXIT_STOPPED, (code, log[-2000:])
    html = _assert_renders(tmp_path, "stopped")
    assert 'id="stopped"' in html  # the banner says the run was stopped, not that it crashed


@pytest.mark.parametrize("n", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_sigint_to_attnverify_run_leaves_nothing_and_keeps_every_result(tmp_path, n):
    recs, code, log = _stop_and_watch(tmp_path, "run", n, signal.SIGINT)
    _assert_stopped(recs, log)
    assert code == cli.EXIT_STOPPED, (code, log[-2000:])
    _assert_renders(tmp_path, "stopped")


@pytest.mark.slow
@pytest.mark.parametrize("n", [0, 2])
def test_sigkill_of_the_top_process_leaves_nothing(tmp_path, n):
    recs, code, log = _stop_and_watch(tmp_path, "run", n, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert not [r for r in recs if r["event"] == "run_end"]
    _assert_renders(tmp_path, "crashed")  # the example being judged is shown as the one the process died on


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_plain_pytest_with_xdist_leaves_nothing(tmp_path, sig):
    recs, code, log = _stop_and_watch(tmp_path, "pytest", 2, sig)
    assert code == (pytest.ExitCode.INTERRUPTED if sig == signal.SIGINT else -signal.SIGTERM)  # plain pytest dies of SIGTERM
    if sig == signal.SIGINT:
        _assert_stopped(recs, log)


# ---- the parts: a judging child dies with its parent, an interrupted runner kills its child -----------------

def _grandchild_survives_parent(use_prctl: bool) -> bool:
    """Fork a middle process whose child calls die_with_parent and sleeps; SIGKILL the middle; is the child
    still there 3 s later?"""
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:  # the middle process
        os.close(r)
        child = os.fork()
        if child == 0:
            try:
                from attnverify.lifeline import die_with_parent

                die_with_parent(os.getppid(), use_prctl=use_prctl, poll=0.1)
                time.sleep(60)
            finally:
                os._exit(0)
        os.write(w, f"{child}\n".encode())
        time.sleep(60)
        os._exit(0)
    os.close(w)
    child = int(os.read(r, 64).decode())
    os.close(r)
    time.sleep(0.5)  # the child has called die_with_parent
    assert _alive(child)
    os.kill(mid, signal.SIGKILL)
    os.waitpid(mid, 0)
    t0 = time.time()
    while time.time() - t0 < 3 and _alive(child):
        time.sleep(0.05)
    survived = _alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    return survived


@pytest.mark.parametrize("use_prctl", [True, False], ids=["prctl", "watcher-thread"])
def test_a_process_dies_with_its_parent(use_prctl):
    if use_prctl and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    assert not _grandchild_survives_parent(use_prctl)


class Hang(Property):
    name = "hang_or_pid"

    def run_example(self, adapter, drawn):
        if drawn == "hang":
            time.sleep(600)
        return ExampleResult(True, message=f"{drawn}:{os.getpid()}")


class Adapter:
    name = "stranger"


def test_interrupting_the_runner_kills_its_child_and_the_next_answer_is_its_own():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread for SIGINT")
    runner = SubprocessRunner(timeout=120)
    try:
        p, a = Hang(), Adapter()
        assert runner(p, a, "one").message.startswith("one:")
        child = runner.pid
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            runner(p, a, "hang")
        timer.join()
        t0 = time.time()
        while time.time() - t0 < 3 and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the judging child outlived the interruption"
        res = runner(p, a, "two")
        assert res.passed and res.message.startswith("two:"), res.message  # not the hung example's late answer
        assert runner.pid != child
    finally:
        runner.close()


def test_a_stop_while_shrinking_stops_the_property():
    """Ctrl-C with a failure in hand used to be swallowed: the driver returned the failure, attributed it
    (more adapter calls) and the run went on."""
    from attnverify.properties import PROPERTIES
    from attnverify.adapters.registry import get
    from attnverify.properties.driver import run_property

    prop = next(p for p in PROPERTIES if p.name == "forward_matches_reference")
    calls = []

    def runner(prop_, adapter, drawn):
        calls.append(drawn)
        if len(calls) == 1:
            return ExampleResult(False, message="wrong answer", severity=5.0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_property(prop, get("naive"), profile="ci", seed=1, runner=runner, database=None, max_bugs=1,
                     use_corpus=False)  # a generated failure: Hypothesis shrinks it, and the stop comes then
    assert len(calls) == 2  # nothing ran after the stop


def test_fault_files_of_dead_parents_are_removed_and_live_ones_kept(tmp_path):
    """A judging parent killed with SIGKILL never removes its fault file; the next runner's start does, and leaves
    the files of parents still running (and anything else in the folder) alone."""
    from attnverify.isolation import remove_stale_fault_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"attnverify-fault-{dead.pid}-ab_12x.txt"
    live = tmp_path / f"attnverify-fault-{os.getpid()}-cd34y.txt"
    other = tmp_path / "attnverify-fault-legacy.txt"
    for p in (stale, live, other):
        p.write_text("x")
    assert remove_stale_fault_files(str(tmp_path)) == 1
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_fault_files(str(tmp_path / "missing")) == 0
