"""Where one example's time goes: the split the journal keeps on every `result` record (key `split`).

Phases, in seconds (each second counted once: a phase entered inside another pauses the outer one):

    draw       in Hypothesis between two examples: generating the next draw, its database, its targeting
               and shrinking bookkeeping (measured by the driver, from the end of the previous example)
    journal    writing the example's `case_start` record (the driver)
    transfer   handing the draw to the judging process and its result back: the runner's wall time less
               the judge's own (pipe, pickling, a fork when a child is started; 0 in process)
    case       building the case's tensors from its recipe (and the CPU probe of the claims)
    adapter    the adapter's calls (forward and backward), compile excluded
    compile    compiles during the adapter's calls, where the library says when one starts and ends:
               Triton's JIT hooks (`knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`, a compile or a
               load from Triton's disk cache) and torch.compile's (torch._dynamo's compile callbacks); an
               adapter whose library has neither (XLA, cuDNN plans) books its compiles to `adapter`, and the
               Triton interpreter compiles nothing
    reference  the float64 reference (forward, backward)
    baseline   the same-dtype eager baseline that sets the per-case tolerance (attnverify.check._baseline,
               the naive side of a metamorphic property)
    compare    comparing outputs with their expectation (attnverify.compare)
    oom_wait   after running out of device memory: returning this process's cache and waiting before the
               example is judged again (attnverify.device_memory; where the device's state decides against a
               retry, only the cache returned)
    other      the rest of the judge's time (tolerances, magnitudes, unclaimed checks, results to dicts)

`phase(name)` is a no-op unless an example is being timed (`begin` ... `take`), so library code can
wrap its parts unconditionally; the cost is two perf_counter calls per phase.

Parts of a phase (journaled beside the phases, never added to the total: they are inside their phase):

    draw.strategy        of `draw`: attnverify's case strategies (their Hypothesis draws, the claim probe); the
                         rest of `draw` is Hypothesis's engine between examples (database, targeting, Pareto
                         front, generation bookkeeping) and the properties' own parameter draws around the case
    transfer.to_judge    of `transfer`: the draw pickled, piped and unpickled, until the judging child has it (on
                         a child's first example also the rest of its warm-up, which it finishes first)
    transfer.judge_tail  of `transfer`: the child after its judge (the result to a dict, the context check)
    transfer.from_judge  of `transfer`: the result pickled, piped and unpickled, until the driver has it
                         (the rest of `transfer`: a judging child started for this example)
"""
from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

PHASES = ("draw", "journal", "transfer", "case", "adapter", "compile", "reference", "baseline", "compare", "oom_wait",
          "other")
PARTS = ("draw.strategy", "transfer.to_judge", "transfer.judge_tail", "transfer.from_judge")
JUDGE_PHASES = ("case", "adapter", "compile", "reference", "baseline", "compare", "oom_wait", "other")

_stack: Optional[List[list]] = None  # [[name, started], ...] while an example is timed
_acc: Dict[str, float] = {}
_hooks = {"triton": False, "dynamo": False}
# a phase entered inside another that stays the outer one's: the naive adapter called as a baseline
_STAYS = {("baseline", "adapter"): "baseline"}
# phases whose GPU work is waited for at their end, so it is not booked to the next phase (CUDA is asynchronous)
_DEVICE_PHASES = ("adapter", "compile", "reference", "baseline")


def begin() -> None:
    """Start timing an example in this process (its judge): time outside any phase is `other`."""
    global _stack, _acc
    _acc = {}
    _stack = [["other", time.perf_counter()]]
    watch_compiles()


def take() -> Dict[str, float]:
    """Stop timing; the seconds per phase (phases with no time left out)."""
    global _stack
    if _stack is None:
        return {}
    _wait_device(_stack[-1][0])
    now = time.perf_counter()
    top = _stack[-1]  # a phase left open (an exception mid-phase) keeps the time up to now
    _acc[top[0]] = _acc.get(top[0], 0.0) + now - top[1]
    _stack = None
    return {k: v for k, v in _acc.items() if v > 0}


def enter(name: str) -> None:
    if _stack is None:
        return
    top = _stack[-1]
    name = _STAYS.get((top[0], name), name)
    _wait_device(top[0])
    now = time.perf_counter()
    _acc[top[0]] = _acc.get(top[0], 0.0) + now - top[1]
    _stack.append([name, now])


def leave(name: str) -> None:
    """Leave the innermost `name` phase (and any left open inside it: a compile that raised)."""
    if _stack is None:
        return
    name = next((f[0] for f in reversed(_stack[1:]) if f[0] in (name, _STAYS.get((f[0], name)))), None)
    if name is None:
        return
    _wait_device(_stack[-1][0])
    now = time.perf_counter()
    while len(_stack) > 1:
        f = _stack.pop()
        _acc[f[0]] = _acc.get(f[0], 0.0) + now - f[1]
        if f[0] == name:
            break
    _stack[-1][1] = now


def current() -> Optional[str]:
    """The phase the time goes to now (None when no example is timed): for tools that count per phase."""
    return _stack[-1][0] if _stack else None


@contextmanager
def phase(name: str):
    enter(name)
    try:
        yield
    finally:
        leave(name)


def timed(name: str):
    """Decorator: the function's time is the `name` phase (free when no example is timed)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if _stack is None:
                return fn(*a, **kw)
            enter(name)
            try:
                return fn(*a, **kw)
            finally:
                leave(name)
        return wrapper
    return deco


def _wait_device(name: str) -> None:
    """Wait for the GPU work queued in a device phase that is ending (only where CUDA is initialised)."""
    if name not in _DEVICE_PHASES:
        return
    t = sys.modules.get("torch")
    try:
        if t is not None and t.cuda.is_initialized():
            t.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a device fault is the example's to report, not the timer's
        pass


def total(split: Dict[str, float]) -> float:
    """An example's seconds from its split: its phases summed, never their parts (each is inside its phase)."""
    return sum(float(v) for k, v in split.items() if k not in PARTS)


def rounded(split: Dict[str, float]) -> Dict[str, float]:
    """The journal's form: seconds to 0.1 ms, phases in PHASES order, then their PARTS."""
    return {k: round(split[k], 4) for k in PHASES + PARTS if split.get(k)}


_strategy = {"seconds": 0.0, "depth": 0}


@contextmanager
def strategy_clock():
    """Around a case strategy's body (inside its `st.composite` function): its time, outermost use only, adds
    to `strategy_seconds()` (the driver books the difference between two examples to `draw.strategy`)."""
    _strategy["depth"] += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _strategy["depth"] -= 1
        if not _strategy["depth"]:
            _strategy["seconds"] += time.perf_counter() - t0


def strategy_seconds() -> float:
    """Seconds this process has spent in `strategy_timed` functions so far."""
    return _strategy["seconds"]


def transfer_parts(parent_sent: float, child: dict, parent_got: float) -> Dict[str, float]:
    """`transfer`'s parts from the driver's clock (before its send, after its receive) and the child's
    (`t_recv`, `t_send`, `judge_seconds` in its answer). perf_counter is one system-wide monotonic clock on
    Linux and macOS; where the numbers do not fit one clock (a part below zero), no parts."""
    try:
        t_recv, t_send, judge = float(child["t_recv"]), float(child["t_send"]), float(child["judge_seconds"])
    except (KeyError, TypeError, ValueError):
        return {}
    parts = {"transfer.to_judge": t_recv - parent_sent, "transfer.judge_tail": t_send - t_recv - judge,
             "transfer.from_judge": parent_got - t_send}
    return parts if min(parts.values()) >= -1e-4 else {}


# ------------------------------------------------------------------------------ compile hooks


def watch_compiles() -> None:
    """Hook the compilers already imported in this process (never imports one): Triton's JIT and
    torch.compile. A compile made while its library is first imported is booked to `adapter`."""
    if not _hooks["triton"] and "triton" in sys.modules:
        _hooks["triton"] = _hook_triton()
    if not _hooks["dynamo"] and "torch._dynamo.callback" in sys.modules:
        _hooks["dynamo"] = _hook_dynamo()


# who hears of compiles (the judging child tells its parent, whose per-example timeout does not count them:
# attnverify.isolation); one listener per process, called with "start" or "end"
_listener = {"fn": None}


def on_compile(fn) -> None:
    """Call `fn("start")` / `fn("end")` around every compile the hooks see (None: nobody listens)."""
    _listener["fn"] = fn


def compile_event(kind: str) -> None:
    """A compile starts ("start") or ends ("end"): book the time to `compile` and tell the listener."""
    (enter if kind == "start" else leave)("compile")
    fn = _listener["fn"]
    if fn is not None:
        try:
            fn(kind)
        except Exception:  # noqa: BLE001 - telling is information, never a failure
            pass


def _chain(old, mine):
    def hook(*a, **kw):
        mine()
        return old(*a, **kw) if old is not None else None  # a truthy answer skips the compile: the user's only
    return hook


def _hook_triton() -> bool:
    triton = sys.modules["triton"]
    start, end = (lambda: compile_event("start")), (lambda: compile_event("end"))
    knobs = getattr(triton, "knobs", None)
    rt = getattr(knobs, "runtime", None)
    try:
        if rt is not None and hasattr(rt, "jit_cache_hook"):  # triton >= 3.4
            rt.jit_cache_hook = _chain(rt.jit_cache_hook, start)
            rt.jit_post_compile_hook = _chain(rt.jit_post_compile_hook, end)
            return True
        from triton.runtime.jit import JITFunction  # older: class attributes

        JITFunction.cache_hook = _chain(getattr(JITFunction, "cache_hook", None), start)
        JITFunction.compiled_hook = _chain(getattr(JITFunction, "compiled_hook", None), end)
        return True
    except Exception:  # noqa: BLE001 - timing is information, never a failure
        return True  # do not try again on every example


def _hook_dynamo() -> bool:
    try:
        cb = sys.modules["torch._dynamo.callback"]
        cb.on_compile_start(lambda *a: compile_event("start"))
        cb.on_compile_end(lambda *a: compile_event("end"))
    except Exception:  # noqa: BLE001
        pass
    return True
