"""Where a run's time went, per (adapter, property), from its journal's time split (attnverify.timesplit).

    PYTHONPATH=. python benchmarks/time_split.py reports            # the last run, mean ms per example
    PYTHONPATH=. python benchmarks/time_split.py reports --share     # each phase's share of the time
    PYTHONPATH=. python benchmarks/time_split.py reports --run-id 20261204-170102-ab12cd

Columns: examples judged, the test items' wall seconds, examples/s (examples / wall), then per phase
(draw, journal, transfer, case, adapter, compile, reference, baseline, compare, other; see
attnverify/timesplit.py for what each one measures) the mean milliseconds per example.
With several workers (-n N) the wall seconds are summed over workers: examples/s is per worker.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from attnverify.split_table import journal_split_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a report folder (or its results.jsonl)")
    ap.add_argument("--run-id", default=None, help="a run of the journal (default: the last one)")
    ap.add_argument("--share", action="store_true", help="each phase's share of the time instead of mean ms")
    ns = ap.parse_args(argv)
    path = ns.report if not os.path.isdir(ns.report) else os.path.join(ns.report, "results.jsonl")
    if not os.path.exists(path):
        print(f"time_split: no journal at {path}: give the --report folder of a run", file=sys.stderr)
        return 2
    print(journal_split_table(path, run_id=ns.run_id, per="share" if ns.share else "ms"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
