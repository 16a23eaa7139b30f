"""Distinct bugs (issue 21): per multi-bug zoo member, bugs planted / found and wall time under dev; and
the cost of the continued search on a correct adapter (max_bugs 1 vs 3: it only runs after a failure).

    TRITON_INTERPRET=1 python benchmarks/distinct_bugs.py [--max-examples 40] [--members] [--only-members]
        [--every-property]

--every-property runs every property on the members (what `attnverify selftest --profile dev` runs), not
only their expected ones and batch_head_independence.
"""
from __future__ import annotations

import argparse
import time
import warnings


def correct_cost(max_examples: int, seed: int = 0):
    from attnverify.adapters.registry import get
    from attnverify.isolation import make_runner
    from attnverify.properties import get_property
    from attnverify.properties.driver import run_property

    a = get("naive")
    rows = []
    for name in ("forward_matches_reference", "gradients_match_reference"):
        for k in (1, 3, 1, 3):
            runner = make_runner("auto")
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = run_property(get_property(name), a, profile="dev", seed=seed, database=None, runner=runner,
                                   max_examples=max_examples, max_bugs=k)
            rows.append((name, k, run.examples, time.perf_counter() - t0))
            runner.close()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-examples", type=int, default=40)
    ap.add_argument("--members", action="store_true", help="also the multi-bug members (minutes)")
    ap.add_argument("--only-members", action="store_true", help="the multi-bug members, not the correct adapter")
    ap.add_argument("--every-property", action="store_true", help="every property on the members (as selftest)")
    a = ap.parse_args()
    for name, k, n, s in ([] if a.only_members else correct_cost(a.max_examples)):
        print(f"correct naive  {name:28s} max_bugs={k}  {n} examples  {s:6.2f} s")
    if a.members or a.only_members:
        from attnverify.zoo import ZOO
        from attnverify.zoo.bugcount import count_bugs, row_text

        for m in [m for m in ZOO if m.planted]:
            c = count_bugs(m, profile="dev", max_examples=a.max_examples, shrink_budget_s=15,
                           properties=None if a.every_property else list(m.expected) + ["batch_head_independence"])
            hit = sum(1 for v in c.matched.values() if v)
            print(f"{m.name:24s} planted {len(c.planted)} found {hit} as own entries ({len(c.found)} distinct in all)"
                  f"  {'found == planted' if c.exact else 'FOUND != PLANTED'}  {c.examples} examples"
                  f"  {len(c.properties_run)} properties  {c.seconds:.1f} s")
            print(row_text(c).split("\n", 1)[-1])  # each planted bug's entry, its needs, the extra entries


if __name__ == "__main__":
    main()
