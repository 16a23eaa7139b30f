"""A run's journal made small enough to keep in the repository, and its per-property table.

    PYTHONPATH=. python benchmarks/compact_journal.py REPORT_DIR [REPORT_DIR ...] --out results.jsonl.gz
    PYTHONPATH=. python benchmarks/compact_journal.py a.jsonl.gz b.jsonl.gz     # compact journals kept earlier: one table

Keeps, per judged example: property, adapter, index, status, seconds, time split and severity; for an example that
did not pass also its message and the case's recipe (enough for `attnverify repro` of a saved case, and to read
what failed); per test item its end (status, examples, message, repro line). Prints a markdown table per
(adapter, property): examples, passed, failed, out of memory (an error or a failure whose message says the
device ran out of memory), other non-passes (errors, crashes, timeouts, skips), median seconds. Inputs may be
report folders, journals, or compact journals (.jsonl.gz) written by this script: several runs, one table.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attnverify.device_memory import says_out_of_memory  # noqa: E402


def compact(paths):
    out, table = [], defaultdict(lambda: {"n": 0, "passed": 0, "failed": 0, "oom": 0, "other": 0, "seconds": []})
    for p in paths:
        path = os.path.join(p, "results.jsonl") if os.path.isdir(p) else p
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:  # a line cut by a stopped run
                    continue
                ev = d.get("event")
                if ev is None and "index" in d and "status" in d:
                    ev = "result"  # a compact record written before they kept their event
                if ev == "result":
                    if d.get("status") == "stopped":
                        continue  # the example being judged when the run was stopped: not judged
                    keep = {k: d.get(k) for k in ("property", "adapter", "index", "status", "seconds", "split", "severity",
                                                  "retried") if d.get(k) is not None}
                    keep["event"] = "result"
                    if d.get("status") != "passed":
                        keep["message"] = d.get("message")
                        keep["recipe"] = d.get("recipe") or ((d.get("case") or {}).get("recipe")
                                                             if isinstance(d.get("case"), dict) else None)
                    out.append(keep)
                    row = table[(d.get("adapter"), d.get("property"))]
                    row["n"] += 1
                    st = d.get("status")
                    if st == "passed":
                        row["passed"] += 1
                    elif st in ("failed", "error") and says_out_of_memory(d.get("message") or ""):
                        row["oom"] += 1
                    else:
                        row["failed" if st == "failed" else "other"] += 1
                    row["seconds"].append(float(d.get("seconds") or 0.0))
                elif ev in ("test_end", "run_start", "run_end"):
                    out.append({k: v for k, v in d.items() if k not in ("env",)})
    return out, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", default=None, help="write the compact journal here (.jsonl.gz)")
    args = ap.parse_args(argv)
    out, table = compact(args.reports)
    if args.out:
        with gzip.open(args.out, "wt") as f:
            for d in out:
                f.write(json.dumps(d, default=str) + "\n")
    print("| adapter | property | examples | passed | failed | out of memory | other | median s |")
    print("|---|---|---|---|---|---|---|---|")
    for (a, prop), r in sorted(table.items(), key=lambda kv: (kv[0][0] or "", -kv[1]["n"])):
        med = statistics.median(r["seconds"]) if r["seconds"] else 0.0
        print(f"| {a} | {prop} | {r['n']} | {r['passed']} | {r['failed']} | {r['oom']} | {r['other']} | {med:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
