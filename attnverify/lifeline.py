"""Nothing a run started outlives it: a process ends when the process that started it dies.

A run is a tree: `attnverify run` (or pytest) drives; under `-n N` it starts pytest-xdist workers
(execnet's `python -c "import sys;exec(eval(sys.stdin.readline()))"`); each driving process forks one
judging child (attnverify/isolation.py). When the top process is killed (SIGTERM's default action,
SIGKILL, the OOM killer), nothing tells the processes below: a judging child inside a long torch op
computes on as an orphan until its op returns, and an xdist worker notices only when execnet's own
shutdown runs out (5 s, a SIGINT to itself, 10 s more, `os._exit`) -- leaving its judging child behind.

`die_with_parent(parent_pid)` makes the calling process die (SIGKILL by default) as soon as its
parent does:

- on Linux, `prctl(PR_SET_PDEATHSIG, sig)`: the kernel sends `sig` when the parent dies, wherever this
  process is (a C call, a CUDA kernel launch, a sleep). The kernel ties it to the parent's *thread*
  that forked this process, so it is used only when that thread was the parent's main thread (the
  caller says so); then `os.getppid()` is checked again, since the parent may have died before the
  prctl (the race every PDEATHSIG user has);
- elsewhere (no prctl; macOS, the BSDs) or when the fork came from another thread: a daemon thread
  that checks `os.getppid()` every `poll` seconds and kills this process when it changes (the parent
  died and the process was re-parented). It needs the GIL, which torch and JAX release in their ops.

Results are never lost by this: the journal's records are each one `os.write` to an O_APPEND file
(attnverify/journal.py), on disk the moment they are written, whoever dies afterwards.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent (the forking thread) dies; False where
    prctl is unavailable or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - no libc prctl here: the watcher thread takes over
        return False


def _die(sig: int) -> None:
    os.kill(os.getpid(), sig)
    os._exit(128 + int(sig))  # a signal this process handles or ignores must not keep it alive


def _watch(parent_pid: int, sig: int, poll: float) -> None:
    import time

    while os.getppid() == parent_pid:
        time.sleep(poll)
    _die(sig)


def die_with_parent(parent_pid: int, *, sig: int = signal.SIGKILL, forked_from_main_thread: bool = True,
                    poll: float = 0.5, use_prctl: Optional[bool] = None) -> str:
    """Make this process die by `sig` when the process `parent_pid` (its parent) dies; returns how:
    "prctl" or "watcher". Dies at once when the parent is already gone. `use_prctl=False` forces the
    portable watcher (tests use it to prove the fallback works)."""
    if use_prctl is None:
        use_prctl = forked_from_main_thread
    how = "prctl" if use_prctl and parent_death_signal(sig) else "watcher"
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        _die(sig)
    if how == "watcher":
        threading.Thread(target=_watch, args=(parent_pid, sig, poll), name="attnverify-lifeline", daemon=True).start()
    return how


def controller_identity() -> dict:
    """What an xdist worker needs to tie itself to this (controller) process: its host, pid, and whether
    the calling thread (the one that starts the workers) is the main thread."""
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid(),
            "main_thread": threading.current_thread() is threading.main_thread()}


def worker_dies_with_controller(ident: Optional[dict]) -> Optional[str]:
    """In an xdist worker: die with the controller described by `controller_identity()`. Only for a
    worker the controller started itself on this host (popen); a worker behind ssh or a wrapper process
    keeps execnet's own shutdown. Returns how, or None when not applied."""
    import socket

    if not isinstance(ident, dict) or ident.get("host") != socket.gethostname():
        return None
    try:
        pid = int(ident["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    if os.getppid() != pid:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # the controller died while this worker started
            _die(signal.SIGKILL)
        except PermissionError:
            pass
        return None  # started through something in between: execnet's shutdown applies
    return die_with_parent(pid, forked_from_main_thread=bool(ident.get("main_thread", True)))


def _children() -> list:
    """This process's direct children (Linux /proc), [] where that cannot be read."""
    pids = []
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []
    return pids


def interrupt_children() -> None:
    """Pass a KeyboardInterrupt on to this process's direct children (the xdist workers of a controller),
    as a terminal's Ctrl-C does: they stop at once instead of after execnet's 5 s. A judging child
    ignores SIGINT (its runner kills it)."""
    for pid in _children():
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass


def sigint_once() -> None:
    """In an xdist worker: the first SIGINT interrupts, later ones are ignored, so a Ctrl-C that reaches
    the worker from the terminal and again from its controller (interrupt_children) does not break
    off the cleanup the first one started (the stopped property's journal record). A worker that does
    not end is still killed: by its controller after 10 s, or by execnet, or with the controller."""
    def _first(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _first)


class SigtermStopsRun:
    """`with SigtermStopsRun(): pytest.main(...)` (what `attnverify run` does): the first SIGTERM stops the run
    the way Ctrl-C does (a KeyboardInterrupt; the plugin passes it on to the xdist workers), so the
    stopped property is journaled as `stopped`, the run_end record is written and the HTML rendered.
    A second SIGTERM kills as before. Outside the main thread (a notebook's worker thread) it does
    nothing: signal handlers live in the main thread."""

    def __init__(self):
        self._old = None

    def _handler(self, signum, frame):
        signal.signal(signal.SIGTERM, self._old if self._old is not None else signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None
        return False
