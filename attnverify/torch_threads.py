"""torch's intra-op thread count for a block of work in the process that forks the judges."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread for the block. A probe is built in the process that drives the examples and
    forks the judges: a parallel op there starts GNU OpenMP's thread pool, which is not fork-safe (a forked
    child entering a parallel region can hang) and whose threads spin after each op (issue 25: a dev draw's
    probe on a loaded 2-core machine cost up to 2 ms of waiting on the pool for a memset of 90,000 elements)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
