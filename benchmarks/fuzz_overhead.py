"""The fuzzer's own cost per example, in process, on fixed-seed draws: CPU milliseconds per phase and the
torch operations (and host round trips) each phase issues, a device-independent proxy for kernel launches and
synchronisations on a GPU (issue 25 item 3).

    PYTHONPATH=. python benchmarks/fuzz_overhead.py                          # sdpa-flash, forward_matches_reference, dev
    PYTHONPATH=. python benchmarks/fuzz_overhead.py --adapter naive -n 200 --property gradients_match_reference

Draws `-n` recipes with Hypothesis (seed fixed, generate phase only: no shrinking, no targeting), timing the
CPU per draw (the strategy, its claim filter, Hypothesis's own bookkeeping); then judges each (after warming
up on the first ones: imports and first calls are not an example's cost), timing the CPU per phase of
attnverify.timesplit and counting the aten operations dispatched in each phase (`syncs`: those that hand a
value to the host, .item()/float()/int()/bool(), tolist(), torch.equal, nonzero: one GPU round trip each). Prints one table and a
digest of the verdicts (same seed, same code: same digest; a speed-up must keep it).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# operations that wait for the device and hand the host a value: .item()/float()/int()/bool() (one
# _local_scalar_dense each), torch.equal, and those whose output size depends on the data
SYNC_OPS = ("_local_scalar_dense", "equal", "nonzero", "masked_select", "is_nonzero")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", default="sdpa-flash")
    ap.add_argument("--property", default="forward_matches_reference")
    ap.add_argument("--profile", default="dev")
    ap.add_argument("-n", type=int, default=150, help="examples drawn and judged")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=20, help="examples judged first, not counted")
    ap.add_argument("--no-count", action="store_true", help="time only (the op counter costs CPU itself)")
    ns = ap.parse_args(argv)

    import torch
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from torch.utils._python_dispatch import TorchDispatchMode

    from attnverify import timesplit
    from attnverify.adapters.registry import get
    from attnverify.properties import get_property

    torch.set_num_threads(int(os.environ.get("ATTNVERIFY_CHILD_THREADS", "1")))  # as a judging child does
    adapter, prop = get(ns.adapter), get_property(ns.property)
    strategy = prop.strategy(adapter, ns.profile, ns.device)
    draws = []

    @hseed(ns.seed)
    @settings(max_examples=ns.n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,))
    @given(strategy)
    def collect(d):
        draws.append(d)

    c0 = time.process_time()
    collect()
    draw_ms = 1000 * (time.process_time() - c0) / max(1, len(draws))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.syncs = {}, {}

        def __enter__(self):
            # Tensor.tolist reads the data without an operation the mode sees (on a GPU: one copy to the host)
            self._tolist = torch.Tensor.tolist
            mode = self

            def tolist(t):
                ph = timesplit.current() or "outside"
                mode.syncs[ph] = mode.syncs.get(ph, 0) + 1
                return mode._tolist(t)

            torch.Tensor.tolist = tolist
            return super().__enter__()

        def __exit__(self, *exc):
            torch.Tensor.tolist = self._tolist
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ph = timesplit.current() or "outside"
            self.ops[ph] = self.ops.get(ph, 0) + 1
            if func.__name__.split(".")[0] in SYNC_OPS:
                self.syncs[ph] = self.syncs.get(ph, 0) + 1
            return func(*args, **(kwargs or {}))

    for d in draws[:ns.warmup]:
        prop.run_example(adapter, d)
    cpu, verdicts = {}, []
    counter = Count()
    c0 = time.process_time()
    for d in draws:
        timesplit.begin()
        p0 = time.process_time()
        r = prop.run_example(adapter, d)
        cpu["judge"] = cpu.get("judge", 0.0) + time.process_time() - p0
        for k, v in timesplit.take().items():
            cpu[k] = cpu.get(k, 0.0) + v
        verdicts.append((r.status, float(r.severity)))
    judge_ms = 1000 * (time.process_time() - c0) / len(draws)
    if not ns.no_count:
        with counter:
            for d in draws:
                timesplit.begin()
                prop.run_example(adapter, d)
                timesplit.take()
    n = len(draws)
    phases = [p for p in timesplit.JUDGE_PHASES if p in cpu or p in counter.ops]
    print(f"{ns.adapter} {ns.property} profile {ns.profile}, {n} examples (seed {ns.seed}, {ns.device}); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"CPU ms per example: draw {draw_ms:.2f}, judge {judge_ms:.2f} (judge phases below: wall ms of the same run)")
    print("| phase | wall ms | torch ops | host syncs |")
    print("|---|---|---|---|")
    for p in phases:
        print(f"| {p} | {1000 * cpu.get(p, 0.0) / n:.2f} | {counter.ops.get(p, 0) / n:.1f} | {counter.syncs.get(p, 0) / n:.1f} |")
    print(f"| all | {sum(1000 * cpu.get(p, 0.0) for p in phases) / n:.2f} | {sum(counter.ops.values()) / n:.1f} | "
          f"{sum(counter.syncs.values()) / n:.1f} |")
    statuses = {}
    for s, _ in verdicts:
        statuses[s] = statuses.get(s, 0) + 1
    print(f"verdicts {statuses}; digest {hashlib.sha1(repr([(s, round(v, 9)) for s, v in verdicts]).encode()).hexdigest()[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
