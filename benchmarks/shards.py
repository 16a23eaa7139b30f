"""Wall time of one `attnverify run` against N shard processes started at once (--shard K/N), and against
`attnverify run --ray --ray-shards N` (a local Ray instance, N CPU tasks), same seed.

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/shards.py --adapter naive --shards 4 --max-examples 10
    ... --ray            # also the Ray run (needs ray: pip install 'attnverify[ray]')
    ... --ray-only       # the single run and the Ray run only

Each run (the single one, every shard, the Ray run) starts from a bare example database, as a fresh CI
job would. Prints one JSON line: single, sharded and Ray wall seconds (the Ray figure includes starting
the local instance and merging), the speed-ups, whether each judged the single run's (adapter,
property, example) set, the per-shard wall seconds, the CPU count and the load average before and after.
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


def _examples(report, merged=False):
    from attnverify.journal import last_run, read_journal

    recs = read_journal(report) if merged else last_run(report)
    return {(r["adapter"], r["property"], json.dumps(r["drawn"], sort_keys=True))
            for r in recs if r.get("event") == "case_start"}


def _ray(args, root, env):
    """Wall seconds of `attnverify run --ray --ray-shards N` and its examples (from the merged journal)."""
    d = os.path.join(root, "ray")
    os.makedirs(d)
    cmd = _cmd(args, os.path.join(d, "reports")) + ["--ray", f"--ray-shards={args.shards}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=d, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, _examples(os.path.join(d, "reports"), merged=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="naive")
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--max-examples", type=int, default=10)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--ray", action="store_true", help="also time the shards as Ray tasks (a local instance)")
    ap.add_argument("--ray-only", action="store_true", help="the single run and the Ray run only")
    args = ap.parse_args()
    load0 = os.getloadavg()
    root = tempfile.mkdtemp(prefix="attn-shards-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    one = os.path.join(root, "single")
    os.makedirs(one)
    t0 = time.perf_counter()
    subprocess.run(_cmd(args, os.path.join(one, "reports")), cwd=one, env=env, stdout=subprocess.DEVNULL)
    single = time.perf_counter() - t0
    result = {"adapter": args.adapter, "profile": args.profile, "max_examples": args.max_examples,
              "cpus": os.cpu_count(), "single_s": round(single, 1), "shards": args.shards}
    one_examples = _examples(os.path.join(one, "reports"))
    if not args.ray_only:
        result.update(_processes(args, root, env, single, one_examples))
    if args.ray or args.ray_only:
        ray_s, ray_examples = _ray(args, root, env)
        result.update({"ray_wall_s": round(ray_s, 1), "ray_speedup": round(single / ray_s, 2),
                       "ray_same_examples": ray_examples == one_examples})
    result.update({"examples": len(one_examples), "loadavg_before": [round(x, 1) for x in load0],
                   "loadavg_after": [round(x, 1) for x in os.getloadavg()]})
    print(json.dumps(result))
    shutil.rmtree(root, ignore_errors=True)


def _processes(args, root, env, single, one_examples):
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
    return {"sharded_wall_s": round(sharded, 1), "speedup": round(single / sharded, 2),
            "shard_end_s": {k: round(v, 1) for k, v in ends.items()}, "same_examples": union == one_examples}


if __name__ == "__main__":
    main()
