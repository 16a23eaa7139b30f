#!/usr/bin/env bash
# On the H200 (torch 2.11+cu130, attnverify not installed), from the repository root, in about 4 minutes:
#   bash benchmarks/h200_sdpa_rerun.sh            # results in $OUT (default /tmp/h200_sdpa_rerun)
# 1. the standalone repros of the SDPA CUDA findings (F10, F26, F31, F32, F33): repros.log, each with its exit status
#    (0 = the library still misbehaves, 1 = not reproduced, 2 = no GPU);
# 2. `attnverify run --profile ci` for sdpa-cudnn and sdpa (the H200 re-run of issue 24, same seed) and, beside it,
#    for sdpa-flash, sdpa-efficient and sdpa-math: run_*.log and the journals results_*.jsonl.gz;
# 3. summary.txt: per run the outcomes, and every failure that is NOT a declared finding (its message head and its
#    case file); cases.tgz holds those case files (replay: attnverify repro cases/ID.json).
# At most 7 files in $OUT. T bounds each run (seconds, default 200); MAX (default 8) the examples per property.
set -u
OUT=${OUT:-/tmp/h200_sdpa_rerun}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ATTNVERIFY_CHILD_THREADS=1
PY=${PYTHON:-python3}
T=${T:-200}; MAX=${MAX:-8}; SEED=${SEED:-1104844371}
W=/tmp/h200_sdpa_rerun_work; rm -rf "$W"; mkdir -p "$W"
t0=$(date +%s)
REPROS="repro_sdpa_key_broadcast_mask repro_cudnn_fully_masked repro_cudnn_dq_nan repro_cudnn_dropout"
for r in $REPROS; do  # side by side: each runs its calls in child processes of its own
  (echo "== benchmarks/$r.py"; timeout 180 "$PY" "benchmarks/$r.py"; echo "exit $? ($r)"; echo) > "$W/$r.log" 2>&1 &
done
run() {  # name adapters workers
  timeout -k 15 "$T" "$PY" -m attnverify.cli run --adapter "$2" --profile ci --seed "$SEED" --max-examples "$MAX" -n "$3" \
    --no-html --report "$W/rep_$1" > "$OUT/run_$1.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/run_$1.log"
  [ -f "$W/rep_$1/results.jsonl" ] && gzip -c "$W/rep_$1/results.jsonl" > "$OUT/results_$1.jsonl.gz"
}
run cudnn_dispatch sdpa-cudnn,sdpa 6 &
run other_backends sdpa-flash,sdpa-efficient,sdpa-math 5 &
wait
for r in $REPROS; do cat "$W/$r.log"; done > "$OUT/repros.log"
"$PY" - "$W" "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import collections, glob, json, os, sys, tarfile
work, out = sys.argv[1], sys.argv[2]
cases = []
for path in sorted(glob.glob(os.path.join(work, "rep_*", "results.jsonl"))):
    run = os.path.basename(os.path.dirname(path))[4:]
    ends, started = {}, set()
    for line in open(path, encoding="utf-8"):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "case_start":
            started.add((e["adapter"], e["property"]))
        if e.get("event") == "test_end":
            ends[(e["adapter"], e["property"])] = e
    count = collections.Counter((a, e["outcome"]) for (a, _), e in ends.items())
    print(f"## {run}")
    for a in sorted({a for a, _ in count}):
        print(f"  {a}: " + ", ".join(f"{n} {o}" for (b, o), n in sorted(count.items()) if b == a))
    bad = [(k, e) for k, e in sorted(ends.items()) if e["outcome"] in ("failed", "xpass", "error")]
    print(f"  not declared (failed / xpass): {len(bad)}")
    for (a, p), e in bad:
        head = [x for x in (e.get("message") or "").splitlines() if x.strip()][:4]
        print(f"  - {p}[{a}] {e['outcome']}: " + "\n      ".join(head))
        if e.get("case_file") and os.path.exists(e["case_file"]):
            cases.append(e["case_file"])
    known = sorted(f"{p}[{a}]" for (a, p), e in ends.items() if e["outcome"] == "known")
    print(f"  known ({len(known)}): " + ", ".join(known))
    unfinished = sorted(f"{p}[{a}]" for a, p in started - set(ends))
    if unfinished:
        print(f"  started, not finished within T (timeout): " + ", ".join(unfinished))
if cases:
    with tarfile.open(os.path.join(out, "cases.tgz"), "w:gz") as t:
        for c in cases:
            t.add(c, arcname="cases/" + os.path.basename(c))
print("repros:", ", ".join(l.strip() for l in open(os.path.join(out, "repros.log")) if l.startswith("exit ")))
PY
echo "total $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
