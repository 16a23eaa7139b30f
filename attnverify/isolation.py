"""Crash isolation: judge each drawn example in a long-lived forked child process.

An adapter that dies by a signal (SIGSEGV, SIGFPE, SIGABRT, an illegal memory access that aborts),
exits the process, or hangs must cost exactly one failed example, not the run. `SubprocessRunner`
is a `runner(prop, adapter, drawn) -> ExampleResult` for the property driver:

- the child is created with fork, so it inherits every property and adapter object (adapters defined
  in a user's conftest.py need no pickling); only the drawn example (plain JSON-able data) and the
  result dict cross the pipe;
- the parent, which drives Hypothesis, never touches the GPU, so forking is safe; the child may
  initialise CUDA freely and a corrupted context dies with it;
- one child serves every example of every object it was forked with: the plugin `prepare`s every
  property and adapter of the session before the first fork, so a worker forks once (a fork per new
  property re-imported the adapter's libraries, started CUDA and reloaded compiled kernels each time);
  an object sent that the child lacks makes a fresh fork that holds it too;
- a child that dies is recreated at the next request; a child that does not answer within
  `timeout` seconds is killed (SIGKILL) and recreated; the time it spends compiling (Triton's JIT,
  torch.compile: the child tells the parent as each compile starts and ends) is not counted, up to
  COMPILE_CAP seconds per compile;
- the child dies with its parent (attnverify.lifeline: PR_SET_PDEATHSIG on Linux, else a watcher
  thread), so a killed run leaves no judge computing on; a run interrupted while a child judges (Ctrl-C,
  KeyboardInterrupt) kills the child before the interruption goes on;
- each result carries its time split (attnverify.timesplit), timed in the child; the parent adds
  `transfer`, its wait less the child's judging time (pipe, pickling, a fork);
- the dead example becomes `ExampleResult(passed=False, status="crashed" | "timeout")` whose message
  names the signal or the timeout, with the case (recipe) when the draw holds one, so the driver can
  shrink it like any failure and the journal keeps it for `attnverify repro`.

The child runs torch with one intra-op thread: GNU OpenMP (torch's CPU thread pool) is not fork-safe
once the parent has used it, and a forked child that enters a parallel region can hang. Set
ATTNVERIFY_CHILD_THREADS=N to override where you know the parent never ran a parallel torch op.
"""
from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any, Dict, Optional

from . import device_memory, timesplit
from .properties.base import ExampleResult, device_fault

DEFAULT_TIMEOUT = 60.0
# the judging child's message that a compile starts or ends (timesplit.on_compile): not an answer
COMPILE_EVENT = "__attnverify_compile__"
# seconds one compile may take before the child is taken for hung (the per-example timeout pauses while it runs)
COMPILE_CAP = 600.0
# the judging child's message that it judges the example again after running out of device memory
# (attnverify.device_memory): not an answer; the per-example timeout starts again for the new try
RETRY_EVENT = "__attnverify_oom_retry__"
RETRY_WAIT_CAP = 60.0  # seconds the wait before a retry (the cache returned, BACKOFF_S) may take


def signal_name(signum: int) -> str:
    try:
        sig = signal.Signals(signum)
        desc = signal.strsignal(signum) or ""
        return f"{sig.name} ({desc})" if desc else sig.name
    except (ValueError, AttributeError):
        return f"signal {signum}"


def fork_available() -> bool:
    import multiprocessing as mp

    return hasattr(os, "fork") and "fork" in mp.get_all_start_methods()


def _blame_lost_context(d: dict) -> dict:
    """The result of the example after which the context is lost says so (a device fault: the child then exits)."""
    if device_fault(d.get("message") or ""):
        return d
    lost = device_memory.lost_context()
    if not lost:
        return d
    # "CUDA error" in the note makes it a device fault: the child exits, the next example gets a fresh one
    note = f"after this example the process's CUDA context was lost (CUDA error on synchronize: {lost.splitlines()[0][:300]})"
    if d.get("passed"):
        return {**d, "passed": False, "status": "error", "severity": 1e30, "message": note}
    return {**d, "message": ((d.get("message") or "") + "\n" + note).lstrip("\n")}


def forked_child_setup() -> None:
    """In a forked child (a judge, a pre-warm's pool process): Ctrl-C is the parent's to handle; torch on
    ATTNVERIFY_CHILD_THREADS threads (default 1: GNU OpenMP's pool, if the parent used it, hangs a forked child's first
    parallel op)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("ATTNVERIFY_CHILD_THREADS", "1")))
    except Exception:
        pass


def _child_main(conn, objects: Dict[int, Any], fault_path: Optional[str] = None,
                lifeline: Optional[tuple] = None, warm: Optional[list] = None) -> None:  # in the forked child
    if lifeline:  # first thing: a child of a killed parent must not judge on alone (attnverify.lifeline)
        from .lifeline import die_with_parent

        die_with_parent(lifeline[0], forked_from_main_thread=lifeline[1])
    forked_child_setup()
    if fault_path:  # a fatal signal's Python stack goes to a file the parent quotes (not to the terminal)
        import faulthandler

        try:
            faulthandler.enable(file=open(fault_path, "w"), all_threads=False)
        except Exception:
            pass
    if warm:  # the judge's first uses, paid while the parent draws (attnverify.judge_warmup)
        from .judge_warmup import warm_judge

        warm_judge(warm)
    # compiles are told to the parent as they start and end (after the warm-up: only an example's, which the parent
    # reads before its answer): its per-example timeout does not count them
    timesplit.on_compile(lambda kind: conn.send({COMPILE_EVENT: kind}))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            break
        if msg is None:
            break
        pkey, akey, drawn = msg
        t0 = time.perf_counter()  # also `t_recv`: the driver's clock is the same (timesplit.transfer_parts)
        timesplit.begin()
        try:
            res = device_memory.judge(objects[pkey], objects[akey], drawn,
                                      on_retry=lambda step, n: conn.send({RETRY_EVENT: (step, n)}))
            if not isinstance(res, ExampleResult):
                raise TypeError(f"{type(objects[pkey]).__name__}.run_example returned {type(res).__name__}, not ExampleResult")
            d = res.to_dict()
        except BaseException as e:  # noqa: BLE001 - anything raised is the example's error, not the child's
            d = ExampleResult(False, message="".join(traceback.format_exception(type(e), e, e.__traceback__)[-8:]),
                              severity=1e30, status="error").to_dict()
        d["split"] = {**timesplit.take(), **(d.get("split") or {})}
        d["judge_seconds"] = time.perf_counter() - t0  # the parent books the rest of its wait to `transfer`
        if not d.get("seconds"):
            d["seconds"] = d["judge_seconds"]
        d = _blame_lost_context(d)
        d["t_recv"], d["t_send"] = t0, time.perf_counter()
        try:
            conn.send(d)
        except Exception as e:  # unpicklable records: send what can be sent
            d = {**d, "records": [], "message": (d.get("message") or "") + f"\n(records dropped: {e})"}
            conn.send(d)
        if device_fault(d.get("message") or ""):
            break  # this process's CUDA context is lost: the next example gets a fresh child


class SubprocessRunner:
    """`runner(prop, adapter, drawn) -> ExampleResult`, judging in a forked child (see module doc)."""

    def __init__(self, timeout: Optional[float] = DEFAULT_TIMEOUT):
        if not fork_available():
            raise RuntimeError("SubprocessRunner needs os.fork (POSIX); use --attn-isolate=none here")
        self.timeout = None if (timeout is None or timeout <= 0) else float(timeout)
        self._objects: Dict[int, Any] = {}
        self._proc = None
        self._conn = None
        self._child_keys: frozenset = frozenset()
        self._fault_path: Optional[str] = None
        self._last_fault = ""
        self.in_process_fallback = 0  # examples judged here because CUDA was already initialised here
        self.restarts = 0  # children started after the first (crashes, timeouts, new objects)
        self.started = 0
        self._warm: Optional[list] = None  # the first child's warm-up plan (warm())
        self.compile_cap = COMPILE_CAP

    # -- child management
    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe(duplex=True)
        objects = dict(self._objects)
        import tempfile

        remove_stale_fault_files(tempfile.gettempdir())
        fd, self._fault_path = tempfile.mkstemp(prefix=f"attnverify-fault-{os.getpid()}-", suffix=".txt")
        os.close(fd)
        import threading

        # the child dies with this process (PR_SET_PDEATHSIG is tied to the forking thread: main thread only)
        lifeline = (os.getpid(), threading.current_thread() is threading.main_thread())
        warm, self._warm = self._warm, None  # the first child only: a child restarted after a crash judges at once
        proc = ctx.Process(target=_child_main, args=(child, objects, self._fault_path, lifeline, warm), daemon=True,
                           name="attnverify-judge")
        proc.start()
        child.close()
        self._proc, self._conn, self._child_keys = proc, parent, frozenset(objects)
        if self.started:
            self.restarts += 1
        self.started += 1

    def _stop(self, kill: bool = False) -> Optional[int]:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return None
        if kill and proc.is_alive():
            proc.kill()
        elif proc.is_alive():
            try:
                conn.send(None)
            except Exception:
                pass
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
        proc.join(5.0)
        try:
            conn.close()
        except Exception:
            pass
        self._last_fault = _read_fault(self._fault_path)
        return proc.exitcode

    def close(self) -> None:
        self._stop()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self._stop(kill=True)
        except Exception:
            pass

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    def prepare(self, *objects) -> None:
        """Hand objects (jobs the run will send later: evidence, convention probes) to the next child
        forked, so sending them after a failure does not need a fork of its own."""
        for o in objects:
            self._objects.setdefault(id(o), o)

    def warm(self, plan) -> None:
        """Fork the judging child now and have it warm the judge (attnverify.judge_warmup) with `plan` before
        its first example, while this process goes on drawing. Nothing when a child runs already, the plan is
        empty, CUDA started here (no child can be forked), or ATTNVERIFY_JUDGE_WARMUP=0."""
        if self._proc is not None or not plan or os.environ.get("ATTNVERIFY_JUDGE_WARMUP", "1") == "0":
            return
        if device_memory.cuda_initialised():
            return
        self._warm = list(plan)
        self._start()

    # -- one example
    def timeout_for(self, prop, adapter=None) -> Optional[float]:
        """The per-example timeout, scaled by the property's cost in adapter calls per example (a
        property that calls the adapter a dozen times gets a dozen calls' time). An adapter whose
        calls may legitimately take longer (a cold compile) raises the base with `min_timeout`."""
        if self.timeout is None:
            return None
        # the floor is per example, not per call: a compile happens once however many calls follow
        return max(self.timeout * max(1.0, float(getattr(prop, "cost", 1.0))),
                   float(getattr(adapter, "min_timeout", None) or 0.0))

    def _in_process(self, prop, adapter, drawn) -> ExampleResult:
        """A child forked now could not use CUDA ("Cannot re-initialize CUDA in forked subprocess"):
        judge in this process, without crash isolation, and say so once."""
        if not self.in_process_fallback:
            import warnings

            warnings.warn("attnverify: CUDA was initialised in the process that drives the examples, so they "
                          "are judged in it without crash isolation (a crash ends the run)", RuntimeWarning, 3)
        self.in_process_fallback += 1
        return InProcessRunner()(prop, adapter, drawn)

    def __call__(self, prop, adapter, drawn) -> ExampleResult:
        try:
            return self._judge(prop, adapter, drawn)
        except BaseException:
            # interrupted (Ctrl-C, a SIGTERM turned into KeyboardInterrupt) while the child judges: its answer
            # would be read as the next request's, and the user wants it stopped, so the child goes now
            self._stop(kill=True)
            raise

    def _judge(self, prop, adapter, drawn) -> ExampleResult:
        pk, ak = id(prop), id(adapter)
        self._objects.setdefault(pk, prop)
        self._objects.setdefault(ak, adapter)
        t0 = time.perf_counter()
        if self._proc is not None and not ({pk, ak} <= self._child_keys and self._proc.is_alive()):
            self._stop()  # a new property/adapter since the fork (or a dead child): fork afresh
        if self._proc is None:
            if device_memory.cuda_initialised():  # checked before every fork, restarts included
                return self._in_process(prop, adapter, drawn)
            self._start()
        t_sent = time.perf_counter()
        try:
            self._conn.send((pk, ak, drawn))
        except (BrokenPipeError, OSError):
            self._stop(kill=True)
            if device_memory.cuda_initialised():
                return self._in_process(prop, adapter, drawn)
            self._start()
            self._conn.send((pk, ak, drawn))
        d = self._answer(prop, adapter, drawn, t0)
        if isinstance(d, ExampleResult):
            return d
        t_got = time.perf_counter()
        wall = t_got - t0
        if device_fault(d.get("message") or ""):
            self._stop()  # the child exits after a device fault (its CUDA context is lost): wait for it here,
            # so the next example starts a fresh child instead of being sent to one that is leaving
        res = ExampleResult.from_dict(d)
        res.split = {**res.split, "transfer": max(0.0, wall - float(d.get("judge_seconds") or 0.0)),
                     **timesplit.transfer_parts(t_sent, d, t_got)}
        return res

    def _answer(self, prop, adapter, drawn, t0: float):
        """The child's answer (a dict), or the ExampleResult of a child that timed out or died. The timeout runs
        only while the child is not compiling (COMPILE_EVENT messages: a cold Triton compile of one specialisation
        took 60+ s on the H200 for a float32 D = 160 split-KV example); a compile is given COMPILE_CAP seconds."""
        limit = self.timeout_for(prop, adapter)
        deadline = None if limit is None else time.perf_counter() + limit
        compiling = None  # when the compile under way started
        while True:
            now = time.perf_counter()
            if compiling is not None:
                wait = max(0.0, compiling + self.compile_cap - now)
            else:
                wait = None if deadline is None else max(0.0, deadline - now)
            if not self._conn.poll(wait):
                self._stop(kill=True)
                return self._dead(prop, adapter, drawn, time.perf_counter() - t0, timeout=True,
                                  compiling=compiling is not None)
            try:
                d = self._conn.recv()
            except (EOFError, OSError, ConnectionResetError):
                code = self._stop(kill=True)
                return self._dead(prop, adapter, drawn, time.perf_counter() - t0, exitcode=code)
            if isinstance(d, dict) and RETRY_EVENT in d:  # ("wait", n): the wait gets RETRY_WAIT_CAP; ("go", n): a try
                cap = RETRY_WAIT_CAP if d[RETRY_EVENT][0] == "wait" else limit
                deadline, compiling = (None if limit is None else time.perf_counter() + cap), None
                continue
            if not (isinstance(d, dict) and COMPILE_EVENT in d):
                return d
            now = time.perf_counter()
            if d[COMPILE_EVENT] == "start" and compiling is None:
                compiling = now
            elif d[COMPILE_EVENT] == "end" and compiling is not None:
                if deadline is not None:
                    deadline += now - compiling  # the compile's time is not the example's
                compiling = None

    def _dead(self, prop, adapter, drawn, seconds: float, *, timeout: bool = False, compiling: bool = False,
              exitcode: Optional[int] = None) -> ExampleResult:
        from .journal import case_hint

        case = case_hint(drawn)
        where = f"{getattr(adapter, 'name', adapter)} on {getattr(prop, 'name', prop)}"
        shape = "" if case else f"\ndrawn: {drawn!r}"[:2000]
        if timeout and compiling:
            status = "timeout"
            msg = (f"TIMEOUT: {where}: one compile ran past {self.compile_cap:g} s (a compile pauses the per-example "
                   f"timeout, up to that cap); the judging process was killed and restarted{shape}")
        elif timeout:
            status = "timeout"
            msg = (f"TIMEOUT: {where} did not finish within {self.timeout_for(prop, adapter):g} s, compiles not "
                   f"counted (--attn-timeout, or the adapter's min_timeout, times the property's cost); the judging "
                   f"process was killed and restarted{shape}")
        else:
            status = "crashed"
            if exitcode is not None and exitcode < 0:
                how = f"killed by signal {signal_name(-exitcode)}"
            elif exitcode is None:
                how = "vanished (no exit status)"
            else:
                how = f"exited with status {exitcode}"
            msg = f"CRASHED: the process judging {where} {how}; it was restarted{shape}"
            if self._last_fault:
                msg += "\nwhere it died (innermost first):\n" + self._last_fault
        return ExampleResult(False, message=msg, severity=1e30, case=case, status=status, seconds=seconds)


def remove_stale_fault_files(folder: str) -> int:
    """Remove the fault files (`attnverify-fault-<pid>-*.txt`) of judging parents that no longer run: a parent
    killed with SIGKILL never reads and removes its own. Returns how many were removed."""
    import re

    gone = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        m = re.fullmatch(r"attnverify-fault-(\d+)-\w+\.txt", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            gone += 1
        except OSError:
            pass
    return gone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _read_fault(path: Optional[str], max_frames: int = 8) -> str:
    """The innermost frames of a faulthandler dump, up to the judge's own loop; removes the file."""
    if not path:
        return ""
    try:
        with open(path) as f:
            text = f.read()
        os.unlink(path)
    except OSError:
        return ""
    frames = []
    for ln in text.splitlines():
        ln = ln.rstrip()
        if ln.strip().startswith("File "):
            if ln.endswith(" in _child_main") or __file__ in ln:
                break
            frames.append("  " + ln.strip())
            if len(frames) >= max_frames:
                break
    return "\n".join(frames)


class InProcessRunner:
    """The plain runner (`--attn-isolate=none`): prop.run_example in this process."""

    def __call__(self, prop, adapter, drawn) -> ExampleResult:
        t0 = time.perf_counter()
        timesplit.begin()
        try:
            res = device_memory.judge(prop, adapter, drawn)
        except Exception as e:  # noqa: BLE001
            res = ExampleResult(False, message="".join(traceback.format_exception(type(e), e, e.__traceback__)[-8:]),
                                severity=1e30, status="error")
        res.split = {**timesplit.take(), **(res.split or {})}
        if not res.seconds:
            res.seconds = time.perf_counter() - t0
        return res

    def prepare(self, *objects) -> None:
        pass

    def warm(self, plan) -> None:
        """Nothing: in process, a warm-up would be paid in line with the draws (nothing to overlap)."""

    def close(self) -> None:
        pass


def make_runner(isolate: str = "auto", timeout: Optional[float] = DEFAULT_TIMEOUT):
    """auto -> subprocess where fork exists, else in-process."""
    if isolate not in ("auto", "subprocess", "none"):
        raise ValueError(f"isolate={isolate!r}: use auto, subprocess or none")
    if isolate == "none" or (isolate == "auto" and not fork_available()):
        return InProcessRunner()
    return SubprocessRunner(timeout=timeout)
