"""The pre-warm hook of adapters built on Triton kernels (the bundled `triton` uses it; yours may too).

    @av.adapter("mine", ..., prewarm=attnverify.triton_prewarm.compile_only_here)

The hook is given the folder a pre-warm's processes share and returns a context manager (attnverify/prewarm.py
runs each drawn example's property inside it), or None where there is nothing to compile (the interpreter:
TRITON_INTERPRET=1, no GPU). Inside `compile_only(scratch)` every Triton launch of the process compiles and
does not run (`JITFunction.warmup`'s path: the kernel is compiled, or found in the disk cache; outputs stay
uninitialised), forward and backward alike. Processes of one pre-warm share `scratch`: the first to reach a
kernel's key claims it there (an empty file named by the key's hash, created exclusively) and compiles it, the
others skip it, so each distinct key is compiled once however many processes meet it (Triton's
`knobs.runtime.jit_cache_hook`, Triton 3.4+; without it every process compiles what it meets). The compiles
land in Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache), where the run finds them.
"""
from __future__ import annotations

import contextlib
import hashlib
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _Claims:
    """jit_cache_hook: True (skip the compile) for a key another process of this pre-warm claimed first."""

    def __init__(self, scratch: str):
        self.scratch, self.claimed = scratch, 0

    def __call__(self, *, key, fn, **_):
        name = hashlib.sha256(f"{fn.module}:{fn.name}:{key}".encode()).hexdigest()[:32]
        try:
            os.close(os.open(os.path.join(self.scratch, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return True
        self.claimed += 1
        return False


@contextlib.contextmanager
def compile_only(scratch: str):
    """Within: every Triton launch in this process compiles and returns without running; yields the claims
    counter (`.claimed`: the kernels compiled, or read from the disk cache, inside this context)."""
    from triton.runtime.jit import JITFunction

    claims = _Claims(scratch)
    run = JITFunction.run

    def warm_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4: no hook, no deduplication across processes
        knobs = None
    hook = knobs.runtime.jit_cache_hook if knobs is not None else None
    JITFunction.run = warm_only
    if knobs is not None:
        knobs.runtime.jit_cache_hook = claims
    try:
        yield claims
    finally:
        JITFunction.run = run
        if knobs is not None:
            knobs.runtime.jit_cache_hook = hook


def compile_only_here(scratch: str):
    """The prewarm hook: `compile_only(scratch)`, or None under the interpreter (it compiles nothing)."""
    return None if interpreting() else compile_only(scratch)

