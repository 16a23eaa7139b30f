"""Wall time of one `attnverify run` against N shard processes started at once (--shard K/N), same seed.

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/shards.py --adapter naive --shards 4 --max-examples 10

Each run (the single one and every shard) starts from a bare example database, as a fresh CI job would.
Prints one JSON line: single and sharded wall seconds, the speed-up, the (adapter, property, example)
sets compared, and the per-shard wall seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _cmd(args, report, shard=None):
    cmd = [sys.executable, "-m", "attnverify.cli", "run", f"--adapter={args.adapter}", f"--profile={args.profile}",
           f"--seed={args.seed}", f"--max-examples={args.max_examples}", f"--report={report}", "--no-html", "-q",
           "--allow-untested"]
    return cmd + ([f"--shard={shard}"] if shard else [])


def _examples(report):
    from attnverify.journal import last_run

    return {(r["adapter"], r["property"], json.dumps(r["drawn"], sort_keys=True))
            for r in last_run(report) if r.get("event") == "case_start"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="naive")
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--max-examples", type=int, default=10)
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="attn-shards-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    one = os.path.join(root, "single")
    os.makedirs(one)
    t0 = time.perf_counter()
    subprocess.run(_cmd(args, os.path.join(one, "reports")), cwd=one, env=env, stdout=subprocess.DEVNULL)
    single = time.perf_counter() - t0
    procs, ends = [], {}
    t0 = time.perf_counter()
    for k in range(1, args.shards + 1):
        d = os.path.join(root, f"s{k}")
        os.makedirs(d)
        procs.append(subprocess.Popen(_cmd(args, os.path.join(d, "reports"), f"{k}/{args.shards}"), cwd=d, env=env,
                                      stdout=subprocess.DEVNULL))
    while len(ends) < len(procs):  # each shard's own end (polled: the slowest is not always the first)
        for k, p in enumerate(procs, start=1):
            if k not in ends and p.poll() is not None:
                ends[k] = time.perf_counter() - t0
        time.sleep(0.1)
    sharded = time.perf_counter() - t0
    union = set()
    for k in range(1, args.shards + 1):
        union |= _examples(os.path.join(root, f"s{k}", "reports"))
    same = union == _examples(os.path.join(one, "reports"))
    print(json.dumps({"adapter": args.adapter, "profile": args.profile, "max_examples": args.max_examples,
                      "cpus": os.cpu_count(), "single_s": round(single, 1), "shards": args.shards,
                      "sharded_wall_s": round(sharded, 1), "speedup": round(single / sharded, 2),
                      "shard_end_s": {k: round(v, 1) for k, v in ends.items()}, "same_examples": same,
                      "examples": len(union)}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
