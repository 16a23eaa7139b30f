"""The CPU cost of judging a case on a CPU twin, by size: what sets attnverify/judge_twin.py's SMALL_WORK.

    PYTHONPATH=. python benchmarks/judge_twin_cost.py                 # the grid, then the dev profile's sizes
    PYTHONPATH=. python benchmarks/judge_twin_cost.py --no-grid --adapter triton --property gradients_match_reference

On one CPU thread (as a judging child runs: ATTNVERIFY_CHILD_THREADS defaults to 1) times, for bfloat16 cases of a
grid of shapes, the judge's own float work on the CPU: the float64 reference (forward; with --backward also its
gradients), the magnitudes and the same-dtype baseline (attnverify.check's _baseline), median of `--reps`; prints
each with the rule's measure, B*Hq*Lq*Lk*(D + Dv) (x3 with gradients: judge_twin.judge_work). Then draws
`-n` cases of a property with Hypothesis (seed fixed) and prints how many the rule takes as small, with
the largest measures, so the bound can be read against the cases a profile draws.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def judge_ms(case, backward: bool, reps: int) -> float:
    from attnverify.check import _baseline
    from attnverify.magnitudes import magnitudes
    from attnverify.reference import reference_backward, reference_forward
    import torch

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ref = reference_forward(case.q, case.k, case.v, case.spec)
        mags = magnitudes(case)
        if backward:
            gen = torch.Generator().manual_seed(1)
            d_out = torch.randn(ref.out.shape, generator=gen, dtype=torch.float64).to(case.q.dtype)
            reference_backward(case.q, case.k, case.v, case.spec, d_out)
        _baseline(case, None, {"ref": ref}, backward, floors=mags)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--adapter", default="sdpa-flash")
    ap.add_argument("--property", default="forward_matches_reference")
    ap.add_argument("--profile", default="dev")
    ap.add_argument("--device", default="cpu", help="the device the drawn cases stand for (probes: built on the CPU)")
    ap.add_argument("-n", type=int, default=150)
    ns = ap.parse_args(argv)
    import torch

    from attnverify.case import CaseRecipe, build_case, build_probe
    from attnverify.judge_twin import SMALL_WORK, is_small, judge_work

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f}; SMALL_WORK {SMALL_WORK:,}")
    if not ns.no_grid:
        print("| B*Hq | Lq=Lk | D | backward | work | ms (reference + magnitudes + baseline) | small |")
        print("|---|---|---|---|---|---|---|")
        for bwd in (False, True):
            for bh in (1, 4, 16):
                for lk in (16, 64, 128, 256):
                    for d in (32, 64, 128):
                        r = CaseRecipe(batch=1, heads_q=bh, heads_kv=bh, len_q=lk, len_k=lk, head_dim=d,
                                       dtype="bfloat16", seed=1)
                        case = build_case(r)
                        w = judge_work(case, bwd)
                        if w > 40 * SMALL_WORK:
                            continue
                        judge_ms(case, bwd, 1)  # first use
                        print(f"| {bh} | {lk} | {d} | {bwd} | {w:,} | {judge_ms(case, bwd, ns.reps):.2f} | "
                              f"{is_small(case, bwd)} |")
    if ns.n:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed

        from attnverify.adapters.registry import get
        from attnverify.properties import get_property

        adapter, prop = get(ns.adapter), get_property(ns.property)
        draws = []

        @hseed(1)
        @settings(max_examples=ns.n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
                  phases=(Phase.generate,))
        @given(prop.strategy(adapter, ns.profile, ns.device))
        def collect(d):
            draws.append(d)

        collect()
        bwd = bool(getattr(prop, "backward_cases", False)) and adapter.claims.backward
        works = []
        for d in draws:
            case = build_probe(CaseRecipe.from_dict(d["recipe"]))
            works.append((judge_work(case, bwd), is_small(case, bwd), case.describe()))
        small = sum(1 for _, s, _ in works if s)
        print(f"\n{ns.adapter} {ns.property} profile {ns.profile} ({ns.device}), {len(works)} drawn, backward {bwd}: "
              f"{small} small ({100 * small / max(1, len(works)):.0f}%); work median {statistics.median(w for w, _, _ in works):,.0f}")
        for w, s, desc in sorted(works, key=lambda t: t[0])[-5:]:
            print(f"  {w:>12,} small={s} {desc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
