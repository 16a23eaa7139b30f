"""The pre-warm hook of adapters built on Triton kernels (the bundled `triton` uses it; yours may too).

    @av.adapter("mine", ..., prewarm=lambda q, k, v, spec, *, backward, scratch:
                triton_prewarm.compile_call(mine_fn, q, k, v, spec, backward=backward, scratch=scratch))

`compile_call` calls the adapter's function on the case with every Triton launch turned into a compile
(`JITFunction.warmup`'s path: the kernel is compiled, or found in the disk cache, and not run; outputs stay
uninitialised) and, with `backward`, its backward on a zero dO. Processes of one pre-warm share `scratch`: the
first to reach a kernel's key claims it there (an empty file named by the key's hash, created exclusively) and
compiles it, the others skip it, so each distinct key is compiled once however many processes meet it
(Triton's `knobs.runtime.jit_cache_hook`, Triton 3.4+; without it every process compiles what it meets).
The compiles land in Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache), where the run finds them.
Under the Triton interpreter (TRITON_INTERPRET=1: no GPU) nothing is compiled and it returns 0.
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
    counter (`.claimed`: the kernels this process compiled, or read from the disk cache, for the pre-warm)."""
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


def call_with_backward(fn, q, k, v, spec, *, backward: bool) -> None:
    """`fn(q, k, v, spec)` and, with `backward`, its backward on a zero dO (the launches a property's call makes)."""
    import torch

    from .check import unpack_output

    if backward:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad() if backward else torch.no_grad():
        out, _, _ = unpack_output(fn(q, k, v, spec))
    if backward and out.requires_grad:
        torch.autograd.grad([out], [q, k, v], [torch.zeros_like(out)], allow_unused=True)


def compile_call(fn, q, k, v, spec, *, backward: bool, scratch: str) -> int:
    """Compile what `fn(q, k, v, spec)` (and with `backward` its backward) launches, without running a kernel.
    Returns the number of kernels this call claimed and compiled (0 under the interpreter)."""
    if interpreting():
        return 0
    with compile_only(scratch) as claims:
        call_with_backward(fn, q, k, v, spec, backward=backward)
    return claims.claimed
