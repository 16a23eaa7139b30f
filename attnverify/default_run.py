"""Which built-in adapters the README's main command (`attnverify run`, no --adapter) runs on this machine.

Every built-in this machine can run, except on a machine without a GPU an adapter that compiles every
new shape (it declares `min_timeout`, the time one example may take while it compiles): flex on a 2-core
CPU takes about 21 minutes from a cold compile cache, twice the default run's budget of 10 minutes. Such
an adapter is listed "on request", with the command that adds it and its measured time. So is a CPU
client whose own ci profile takes minutes there (it declares `on_request_cpu`, the reason: its time
measured 2026-12-04 on a shared, loaded machine, so upper bounds; docs/compatibility.md): the eager,
SDPA, Triton and JAX adapters already take about 6 of the 10 minutes.
"""
from __future__ import annotations

from typing import List, Tuple

# measured whole ci-profile time of an adapter left out on a CPU (BENCHMARKS.md)
MEASURED_CPU = {
    "flex": "about 21 min cold (1,256 s), 3 min with a warm compile cache, on a 2-core CPU (BENCHMARKS.md)",
}


def split_default(adapters, gpu: bool) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(names the default run takes, [(name, why it is on request)]) among available `adapters`."""
    run, on_request = [], []
    for a in adapters:
        if not gpu and a.min_timeout is not None:
            on_request.append((a.name, f"compiles every new shape: {MEASURED_CPU.get(a.name, 'minutes per shape cold')}"))
        elif not gpu and a.on_request_cpu:
            on_request.append((a.name, a.on_request_cpu))
        else:
            run.append(a.name)
    return run, on_request


def on_request_lines(on_request: List[Tuple[str, str]]) -> List[str]:
    return [f"attnverify run: on request: {n} ({why}); add it with: attnverify run --adapter {n}"
            for n, why in on_request]
