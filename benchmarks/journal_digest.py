"""Same seed, same verdicts? A digest of a run's journal record for record, and its first-use cost.

    python benchmarks/journal_digest.py REPORT_DIR [REPORT_DIR ...] [--first 20]

For each journal (a report folder or its results.jsonl; the last run in it) prints: the number of
examples, a digest of the `case_start` draws and one of the `result` statuses and severities (in journal
order: two runs that drew the same cases and judged them alike have the same two digests), and each
judge phase's mean ms over the first `--first` examples and over the rest (a cost that falls as the run
goes on is a first use: an import, a lazily loaded kernel, an allocation; attnverify/timesplit.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attnverify.timesplit import total  # noqa: E402


def _records(path: str):
    if os.path.isdir(path):
        path = os.path.join(path, "results.jsonl")
    recs = [json.loads(line) for line in open(path) if line.strip()]
    starts = [i for i, r in enumerate(recs) if r.get("event") == "run_start"]
    return recs[starts[-1]:] if starts else recs


def digest(path: str) -> dict:
    """{'examples', 'draws', 'verdicts', 'split'}: the two digests and the per-phase split of each result."""
    recs = _records(path)
    draws = [json.dumps([r.get("property"), r.get("adapter"), r.get("drawn")], sort_keys=True)
             for r in recs if r.get("event") == "case_start"]
    res = [r for r in recs if r.get("event") == "result"]
    verdicts = [json.dumps([r.get("property"), r.get("status"), round(float(r.get("severity") or 0.0), 9)])
                for r in res]
    h = lambda xs: hashlib.sha1("\n".join(xs).encode()).hexdigest()[:12]  # noqa: E731
    return {"examples": len(res), "draws": h(draws), "verdicts": h(verdicts),
            "split": [r.get("split") or {} for r in res]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--first", type=int, default=20, help="examples counted as the first ones")
    ns = ap.parse_args(argv)
    for p in ns.reports:
        d = digest(p)
        sp = d["split"]
        phases = sorted({k for s in sp for k in s}, key=lambda k: (k != "draw", k))

        def mean(xs, k):
            return 1000 * sum(float(s.get(k, 0.0)) for s in xs) / max(1, len(xs))
        head, rest = sp[:ns.first], sp[ns.first:]
        print(f"{p}: {d['examples']} examples; draws {d['draws']}; verdicts {d['verdicts']}")
        print(f"  mean ms, first {len(head)} / the rest: " + ", ".join(
            f"{k} {mean(head, k):.1f} / {mean(rest, k):.1f}" for k in phases))
        print(f"  sum s (phases, not their parts), first {len(head)} / the rest: "
              f"{sum(total(s) for s in head):.2f} / {sum(total(s) for s in rest):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
