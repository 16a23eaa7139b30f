"""Pre-warm (`attnverify run --prewarm`, `--attn-prewarm`): compile what a run will launch before it starts.

An adapter whose kernels compile on first use (a JIT: Triton, ...) pays every new specialisation inside the
run, once per pytest-xdist worker that meets it first. With the pre-warm, the run's session start (in the
process that drives the run, before any worker or judge starts) draws, for every selected property and every
adapter that has a `prewarm` hook, the examples the run will draw (the property's own strategy and corpus,
the run's seed, profile and example count, through `run_property` with a runner that judges nothing), and
runs each example's property once inside the hook's context, where the adapter's calls compile their kernels
and run none: every call the property makes (the case, its backward, the calls it derives: repeated KV heads,
the case inside a bigger buffer, other shapes in between) is compiled; its verdict is thrown away. The work is
spread over a pool of processes (every core): the compiles land in the adapter's shared cache (Triton:
TRITON_CACHE_DIR), where the run's workers then find them. Each pair's examples are warmed as soon as it is drawn, in
round-robin order (the first examples of every property first), and the whole pre-warm has a budget (DEFAULT_BUDGET_S,
--attn-prewarm-budget): when it ends the run starts, and compiles what is left itself. A line of progress goes out at
the start and at most every PROGRESS_EVERY_S seconds.

Only adapters that implement the hook are pre-warmed (the bundled `triton` does, attnverify/triton_prewarm.py);
under the Triton interpreter (no GPU) there is nothing to compile and only the draws are made. It changes no
verdict: the draws read a copy of the run's example database (private_copy: the run's is never written), and the
run's own draws are made afresh by the run (tests/test_prewarm.py checks both). Reading it matters: with a database
Hypothesis keeps a Pareto front of the examples, whose upkeep draws from the same random stream as generation, so a
pre-warm without one drew other cases than the run from the first generated example on (2026-12-05: 40% of the run's
kernels foreseen for four properties; BENCHMARKS.md). What the pre-warm cannot foresee is compiled in the run as
before: draws that depend on verdicts (the severities fed to targeting and to that Pareto front, a failure's shrinking).

The pool forks (the controlling process has touched no GPU: the plugin keeps it that way), so adapters and
properties registered by a conftest.py are there in the pool too; without fork (Windows) it does nothing.
"""
from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
import queue
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

# set in the controlling process right before the pool forks; the workers read their task from it
_PLAN: Dict[str, Any] = {}
# the pre-warm's budget unless one is given (--attn-prewarm-budget): 5 minutes covers the bundled triton kernel's whole
# dev profile from an empty cache on an H200 (about 1,000 kernels, 130-190 s on 16 cores: BENCHMARKS.md, "The pre-warm's
# own time") and keeps a thorough profile (1,000 examples a property) from spending a run's time before it starts
DEFAULT_BUDGET_S = 300.0
BUDGET_OPTION = "--attn-prewarm-budget"
SESSION_TIMEOUT_SHARE = 0.25  # without a budget given, at most this share of a session's time limit (default_budget)
PROGRESS_EVERY_S = 20.0  # a progress line at most this often: a user sees it working, a CI log stays short


def default_budget(session_timeout: Optional[float] = None) -> float:
    """The budget when none is given: DEFAULT_BUDGET_S, or a quarter of the session's time limit where it has one
    (pytest-timeout's --session-timeout, which counts the pre-warm's time) and that is less."""
    if session_timeout is not None and math.isfinite(session_timeout) and session_timeout > 0:
        return min(DEFAULT_BUDGET_S, SESSION_TIMEOUT_SHARE * session_timeout)
    return DEFAULT_BUDGET_S


def parse_budget(value: Any, source: str = BUDGET_OPTION) -> float:
    """The pre-warm's budget in seconds from `value` (a number or its text; None: DEFAULT_BUDGET_S): a finite number
    above 0, else ValueError naming `source` (the option, variable or argument it came from) and the fix."""
    if value is None:
        return DEFAULT_BUDGET_S
    try:
        b = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        b = None
    if b is None or not math.isfinite(b) or b <= 0:
        raise ValueError(f"{source}={value!r}: give the pre-warm's budget in seconds, a number above 0 (e.g. "
                         f"{BUDGET_OPTION}=600; default {DEFAULT_BUDGET_S:g}); when it ends, the run starts and "
                         "compiles the rest itself (to run without a pre-warm, leave out --attn-prewarm)")
    return b


def default_workers() -> int:
    """Every core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def keyword_selected(pairs, keyword: str) -> list:
    """The (adapter, property) pairs whose test item `-k keyword` keeps (its id `test_<property>[<adapter>]`, the
    suite's name and marker `attnverify`; substrings, case-insensitive, as pytest matches); all when it cannot tell."""
    if not keyword:
        return list(pairs)
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(keyword)
    except Exception:  # noqa: BLE001 - pytest reports a bad -k itself; pre-warming more is harmless
        return list(pairs)

    def keep(a, p) -> bool:
        names = (f"test_{p.name}[{a.name}]", "attnverify")
        return expr.evaluate(lambda sub, **_: any(sub.lower() in n.lower() for n in names))

    return [(a, p) for a, p in pairs if keep(a, p)]


def drawn_examples(prop, adapter, *, profile: str, seed: int, max_examples: Optional[int], device: str,
                   database: Any = ..., copy: bool = True) -> List[Any]:
    """The values `prop` draws for `adapter` in a run with this seed, profile and example count: its corpus, then
    Hypothesis' draws (run_property with a runner that judges nothing; targeting, the Pareto front's upkeep and a
    failure's shrinking, which depend on verdicts, are what may draw differently in the run). `database`: the run's
    example database (a private copy is used: see private_copy), None for a run without one; `...`: an empty one (a
    run in a fresh folder); `copy=False`: `database` is the pre-warm's own copy already (drawn into as it is)."""
    from .properties.base import ExampleResult
    from .properties.driver import PropertySkipped, run_property

    out: List[Any] = []

    def collect(_prop, _adapter, drawn):
        out.append(drawn)
        return ExampleResult(True, status="passed")

    with (private_copy(database) if copy else contextlib.nullcontext(database)) as db:
        try:
            run_property(prop, adapter, profile=profile, seed=seed, max_examples=max_examples, device=device,
                         runner=collect, max_bugs=1, database=db)
        except PropertySkipped:
            pass
    return out


@contextlib.contextmanager
def private_copy(database: Any):
    """A copy of `database` as it is now, which the pre-warm's draws may write to as the run writes to its own (a run
    reads back what it saved moments before: the Pareto front's entries): an example database in memory or in a folder
    is copied (the run's is never touched); any other is read through hypothesis' ReadOnlyDatabase (writes dropped:
    the draws may then differ from the run's where it reads back its own writes). None stays None; `...`: empty."""
    from hypothesis.database import DirectoryBasedExampleDatabase, InMemoryExampleDatabase, ReadOnlyDatabase

    if database is None or database is ...:
        yield None if database is None else InMemoryExampleDatabase()
    elif isinstance(database, InMemoryExampleDatabase):
        copy = InMemoryExampleDatabase()
        copy.data = {k: v.copy() for k, v in database.data.items()}  # set.copy keeps the order fetch gives
        yield copy
    elif isinstance(database, DirectoryBasedExampleDatabase):
        with tempfile.TemporaryDirectory(prefix="attnverify_prewarm_db_") as tmp:
            path = os.path.join(tmp, "db")
            if os.path.isdir(database.path):
                shutil.copytree(database.path, path)
            yield DirectoryBasedExampleDatabase(path)
    else:
        yield ReadOnlyDatabase(database)


def _shared_copy(database: Any, scratch: str) -> Any:
    """One private copy of the run's database for all the pool's draws (made before the fork; each property draws
    under its own keys, so they share it as the run's properties share the run's): a folder copied into `scratch`
    once, not once per property; any other kind as private_copy makes it (a forked process's memory is its own)."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    if isinstance(database, DirectoryBasedExampleDatabase):
        path = os.path.join(scratch, "example_db")
        if os.path.isdir(database.path):
            shutil.copytree(database.path, path)
        return DirectoryBasedExampleDatabase(path)
    with private_copy(database) as db:  # in memory, read-only or None: nothing to clean up after the block
        return db


def _pool_setup() -> None:
    """Each pool process as it starts: a judging child's set-up (isolation.forked_child_setup); SIGTERM ends it at once
    and quietly (the budget's end terminates the pool, and `attnverify run` turns SIGTERM into a KeyboardInterrupt,
    which the fork inherited: each process printed its traceback); Hypothesis' warning that strategies are evaluated
    during pytest's initialisation left out (the pre-warm runs at the session's start, before Hypothesis' plugin counts
    initialisation as over, and its draws are meant: each warning printed a whole adapter's repr, 18 of them a run)."""
    import signal
    import warnings

    from .isolation import forked_child_setup

    forked_child_setup()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        from hypothesis.errors import HypothesisSideeffectWarning
    except ImportError:  # an older Hypothesis: it has no such warning
        return
    warnings.filterwarnings("ignore", category=HypothesisSideeffectWarning)


def _draw_pair(i: int) -> tuple:
    """In a pool process: the i-th pair's drawn examples, or the drawing's error."""
    adapter, prop = _PLAN["pairs"][i]
    try:
        return drawn_examples(prop, adapter, **_PLAN["settings"]), ""
    except Exception as e:  # noqa: BLE001 - a property that cannot draw here pre-warms nothing; the run says why
        return [], f"drawing: {type(e).__name__}: {e}"


def _warm(task: tuple) -> tuple:
    """In a pool process: one example of the plan -> (judged, compiles, error, pid, seconds)."""
    i, drawn = task
    adapter, prop = _PLAN["pairs"][i]
    t0 = time.perf_counter()
    return (*warm_example(adapter, prop, drawn, _PLAN["scratch"]), os.getpid(), time.perf_counter() - t0)


def warm_example(adapter, prop, drawn, scratch: str) -> tuple:
    """Judge one drawn example of `prop` inside the adapter's prewarm context, in this process: each call the property
    makes compiles its kernels and runs none; the verdict is thrown away. -> (judged, compiles, error); judged is
    False when the hook says there is nothing to compile here (an interpreter: no context)."""
    ctx = adapter.prewarm(scratch)
    if ctx is None:
        return False, 0, ""
    try:
        with ctx as counter:
            prop.run_example(adapter, drawn)
        return True, int(getattr(counter, "claimed", 0) or 0), ""
    except Exception as e:  # noqa: BLE001 - what fails to compile here fails in the run, where it is judged
        return True, 0, f"{prop.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class RoundRobin:
    """The warm tasks in the order they are handed out: the k-th distinct example of every pair drawn so far before the
    (k+1)-th of any (ties: the pairs' order), so that a pre-warm its budget stops has warmed the first examples of every
    property (what a run meets first: its corpus, then its first draws) rather than all the examples of a few. A pair
    whose draws come later starts at its first example, ahead of the others' later ones."""

    def __init__(self):
        self._heap: list = []
        self._tasks: Dict[int, list] = {}

    def add(self, i: int, tasks: list) -> None:
        if tasks:
            self._tasks[i] = tasks
            heapq.heappush(self._heap, (0, i))

    def __bool__(self) -> bool:
        return bool(self._heap)

    def pop(self):
        """The next task, or None when every task added is handed out."""
        if not self._heap:
            return None
        k, i = heapq.heappop(self._heap)
        if k + 1 < len(self._tasks[i]):
            heapq.heappush(self._heap, (k + 1, i))
        return self._tasks[i][k]


def _distinct(i: int, examples: list) -> list:
    """The pair's warm tasks: an example drawn twice (the corpus, a replay) is judged once; the draws' order kept."""
    seen, out = set(), []
    for ex in examples:
        key = json.dumps(ex, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append((i, ex))
    return out


def progress_line(st: dict, elapsed: float, budget_s: float) -> str:
    """One line of the pre-warm's progress (at most one each PROGRESS_EVERY_S): examples drawn and warmed, kernels
    compiled, seconds spent of the budget."""
    drawn = (f"{st['drawn']} of {st['pairs']} properties drawn ({st['examples']} examples, "
             f"{st['distinct']} distinct)")
    return (f"attnverify prewarm: {elapsed:.0f} s of {budget_s:g} s: {drawn}, {st['warmed']} of {st['distinct']} "
            f"warmed, {st['compiles']} kernels compiled")


def run_prewarm(pairs, *, profile: str, seed: int, max_examples: Optional[int] = None, device: str = "auto",
                workers: Optional[int] = None, budget_s: float = DEFAULT_BUDGET_S, database: Any = ...,
                progress: Optional[Callable[[str], None]] = None,
                progress_every_s: Optional[float] = None) -> dict:
    """Pre-warm the (adapter, property) pairs of a run (Adapter and Property objects; pairs whose adapter has no
    `prewarm` hook, is unavailable here or is skipped by the property are left out) with the run's profile, seed,
    example count, device and example database (a private copy; `...`: an empty one), on `workers` processes (default:
    every core): each pair's draws, and each drawn example judged inside the adapter's prewarm context as soon as its
    pair is drawn, in round-robin order (RoundRobin: the first examples of every property first). It stops after
    `budget_s` seconds (parse_budget; the run then compiles the rest itself, and a hang cannot hold the run).
    `progress(line)` is called once at the start and then at most every `progress_every_s` seconds (default
    PROGRESS_EVERY_S) with progress_line's line. Returns {"adapters": [names], "workers", "seconds", "draw_seconds",
    "budget_s", "stopped" (the budget ended it), "examples" (drawn), "distinct" (distinct ones, the tasks), "warmed"
    (tasks done), "calls" (examples judged), "compiles", "compiles_per_process", "busy_seconds_per_process" (each
    process's seconds judging examples), "errors", "note", "per_property": [{adapter, property, examples}]}."""
    t0 = time.perf_counter()
    budget_s = parse_budget(budget_s, "run_prewarm(budget_s)")
    every = PROGRESS_EVERY_S if progress_every_s is None else float(progress_every_s)
    pairs = [(a, p) for a, p in pairs if getattr(a, "prewarm", None) is not None and a.unavailable_reason() is None
             and p.why_skipped(a) is None]
    res: Dict[str, Any] = {"adapters": list(dict.fromkeys(a.name for a, _ in pairs)), "workers": 0, "seconds": 0.0,
                           "draw_seconds": 0.0, "budget_s": budget_s, "stopped": False, "examples": 0, "distinct": 0,
                           "warmed": 0, "calls": 0, "compiles": 0, "compiles_per_process": [],
                           "busy_seconds_per_process": [], "errors": 0, "note": "", "per_property": []}
    if not pairs:
        res["note"] = ("no adapter of this run has a prewarm hook (only adapters with a JIT implement one, the bundled "
                       "triton does) or no property selected runs for one: nothing to do")
        return res
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"run_prewarm(workers={workers!r}): give a number of processes >= 1, or None for every core")
    from .device_memory import cuda_initialised
    from .isolation import fork_available

    if not fork_available():
        res["note"] = "the pre-warm's pool forks, and this platform cannot fork: nothing done"
        return res
    if cuda_initialised():  # a forked child of a process with a CUDA context cannot use CUDA
        res["note"] = "CUDA is already initialised in this process, so its pool cannot fork: nothing done"
        return res

    def say(line: str) -> None:
        if progress is not None:
            try:
                progress(line)
            except Exception:  # noqa: BLE001 - a progress line that cannot be written never stops the pre-warm
                pass

    n = workers or default_workers()
    scratch = tempfile.mkdtemp(prefix="attnverify_prewarm_")
    adapters: List[Any] = []
    for a, _ in pairs:
        if not any(a is x for x in adapters):
            adapters.append(a)
    _PLAN.update(pairs=pairs, adapters=adapters, scratch=scratch,
                 settings=dict(profile=profile, seed=seed, max_examples=max_examples, device=device,
                               database=_shared_copy(database, scratch), copy=False))
    say(f"attnverify prewarm: drawing and compiling the examples of {len(pairs)} (adapter, property) pairs "
        f"({', '.join(res['adapters'])}) on {n} process{'es' if n != 1 else ''} before the run starts, for at most {budget_s:g} s "
        f"({BUDGET_OPTION}; then the run starts and compiles the rest)")
    errors: List[str] = []
    st = {"pairs": len(pairs), "drawn": 0, "examples": 0, "distinct": 0, "warmed": 0, "compiles": 0}
    per_property: List[Optional[dict]] = [None] * len(pairs)
    by_process: Dict[int, int] = {}
    busy: Dict[int, float] = {}
    start = time.monotonic()
    deadline, next_line = start + budget_s, start + every
    done: "queue.Queue[tuple]" = queue.Queue()  # filled by the pool's result thread
    import multiprocessing

    # each process as a judging child starts (one torch thread: a parent that ran a parallel op left OpenMP's pool in
    # a state its forked children hang on; Ctrl-C left to this process), and quiet when the budget ends it
    pool = multiprocessing.get_context("fork").Pool(n, initializer=_pool_setup)
    try:
        for i in range(len(pairs)):  # all the draws first: the pool's queue is first come, first served
            pool.apply_async(_draw_pair, (i,), callback=lambda r, i=i: done.put(("drawn", i, r)),
                             error_callback=lambda e, i=i: done.put(("drawn", i, ([], f"drawing: {type(e).__name__}: {e}"))))
        feed, in_flight = RoundRobin(), 0
        while st["drawn"] < len(pairs) or in_flight or feed:
            while in_flight < 2 * n:  # a few queued beyond the busy processes, so that none waits for this loop
                task = feed.pop()
                if task is None:
                    break
                pool.apply_async(_warm, (task,), callback=lambda r: done.put(("warmed", r)),
                                 error_callback=lambda e: done.put(("warmed", (False, 0, f"{type(e).__name__}: {e}", 0, 0.0))))
                in_flight += 1
            now = time.monotonic()
            if now >= next_line:
                say(progress_line(st, now - start, budget_s))
                next_line = now + every
            if now >= deadline:  # what is compiled is kept; the run compiles the rest
                res["stopped"] = True
                break
            try:
                msg = done.get(timeout=max(0.01, min(deadline, next_line) - now))
            except queue.Empty:
                continue
            if msg[0] == "drawn":
                i, (examples, err) = msg[1], msg[2]
                a, p = pairs[i]
                per_property[i] = {"adapter": a.name, "property": p.name, "examples": len(examples)}
                if err:
                    errors.append(f"{p.name}: {err}")
                tasks = _distinct(i, examples)
                feed.add(i, tasks)
                st["drawn"] += 1
                st["examples"] += len(examples)
                st["distinct"] += len(tasks)
                if st["drawn"] == len(pairs):
                    res["draw_seconds"] = round(time.perf_counter() - t0, 3)
            else:
                judged, compiles, err, pid, secs = msg[1]
                in_flight -= 1
                st["warmed"] += 1
                res["calls"] += int(judged)
                st["compiles"] += compiles
                by_process[pid] = by_process.get(pid, 0) + compiles
                busy[pid] = busy.get(pid, 0.0) + secs
                if err:
                    errors.append(err)
    finally:
        pool.terminate()
        pool.join()
        _PLAN.clear()
        shutil.rmtree(scratch, ignore_errors=True)
    res["per_property"] = [x for x in per_property if x is not None]
    res.update(examples=st["examples"], distinct=st["distinct"], warmed=st["warmed"], compiles=st["compiles"],
               compiles_per_process=sorted((c for c in by_process.values() if c), reverse=True),
               # how evenly the work was shared: a busiest process far above the least busy is a tail to shorten
               busy_seconds_per_process=sorted((round(b, 3) for b in busy.values() if b), reverse=True),
               workers=n, errors=len(errors), seconds=round(time.perf_counter() - t0, 3))
    notes = []
    if res["stopped"]:
        drawn = "" if st["drawn"] == len(pairs) else f"{st['drawn']} of {len(pairs)} properties drawn, "
        notes.append(f"stopped after {budget_s:g} s, its budget ({BUDGET_OPTION}), {drawn}{st['warmed']} of "
                     f"{st['distinct']} distinct examples warmed (the run compiles the rest)")
    if errors:
        notes.append(f"{len(errors)} examples raised here (they are judged in the run): {errors[0]}")
    elif st["warmed"] and not res["calls"]:
        notes.append("nothing to compile here (the adapters' hooks gave no context: an interpreter, no GPU)")
    res["note"] = "; ".join(notes)
    return res


def summary_line(res: dict) -> str:
    """One line for the terminal and the journal's reader."""
    if not res["workers"]:
        return f"attnverify prewarm: {res['note']}"
    return (f"attnverify prewarm: {', '.join(res['adapters'])}: {res['examples']} examples drawn, {res['calls']} distinct "
            f"ones judged compile-only, {res['compiles']} compiles in {res['seconds']:.1f} s of its {res['budget_s']:g} s "
            f"budget ({res['draw_seconds']:.1f} s drawing) on {res['workers']} processes"
            + (f"; {res['note']}" if res["note"] else ""))
