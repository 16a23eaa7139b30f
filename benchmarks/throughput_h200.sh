#!/usr/bin/env bash
# The fuzzer's own speed on one GPU (issue 25 item 3), in one go, under 5 minutes; results in $OUT.
#
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; FLASH_T=0 bash benchmarks/throughput_h200.sh
#
# 1. (skipped with FLASH_T=0) sdpa-flash, forward_matches_reference, dev profile, one worker (-n 1), judged in a
#    forked child (crash isolation, the default): examples/s of the property (examples / the test item's wall
#    time). Target: >= 100 examples/s per worker. Then the same with --isolate none, for the cost of isolation.
#    With FLASH_AB=1 instead: the forked-child run twice, with ATTNVERIFY_JUDGE_ON=device (the judge on the GPU) and
#    =auto (small cases judged on a CPU twin: attnverify/judge_twin.py), each printing its rate, its verdict digest
#    (benchmarks/journal_digest.py) and where its checks were judged (CheckResult.judged_on); then an A/B section:
#    both rates, both digests, and over the examples both runs drew alike (same index, same draw: Hypothesis's
#    targeting follows the severities, so the draws may part later) the statuses that differ and the severity
#    ratios auto/device. No --isolate none run then (and no PROFILE_FLASH). The calibration check before flipping
#    judge_twin.JUDGE_SMALL_ON_CPU: no status differs, and the severities stay near (the twin's baseline rounds in
#    the CPU's order).
# 2. triton, the whole dev profile (every property, 25 examples each: --max-examples 25), 4 workers (-n 4),
#    seed 1, three ways, each against the target <= 120 s wall: (a) an empty Triton cache (TRITON_CACHE_DIR in a
#    fresh folder) with --prewarm (the run's kernels compiled on every core before the workers start: its time is
#    part of the wall); (b) a second run on the cache (a) left (every compile a disk-cache hit: a cache kept
#    between runs); (c) an empty cache without the pre-warm (every compile paid in the run, as on a new machine).
#    (a) is stopped at PREWARM_T seconds (default 200: the pre-warm of about 620 kernels on 16 cores and the run
#    after it must both end, so that (b) measures a complete cache), (b) at WARM_T (default 90), (c) only with
#    COLD_T > 0 (default 0: measured 2026-12-05, 88 examples in 60 s); the split of what a stopped run judged is
#    printed all the same; a cap of 0 skips that run. The kernels run are the default configuration's (the specialised ones until the perf
#    gate times the nospec twins: launch.NOSPEC_ON_GPU); ATTNVERIFY_TRITON_VARIANT=nospec runs the twins (662 kernels
#    for the dev profile instead of 954), for an A/B.
# Each run's time split (attnverify/timesplit.py: draw, journal, transfer, case, adapter, compile,
# reference, baseline, compare, other; mean ms per example) is printed from its journal, with the pre-warm's
# own counts (seconds, compiles) and the kernels in the cache afterwards.
#
# $OUT (at most 8 files): summary.md, versions.txt, triton.log (the three runs' output), triton_journals.tar.gz
# (their journals); with FLASH_T > 0 also flash.log, flash_none.log, flash_results.jsonl, and with
# PROFILE_FLASH=1 flash_profile.txt: the --isolate none run under cProfile, its top functions; with FLASH_AB=1
# flash.log and flash_results.jsonl (the device-judge run), flash_auto.log and flash_auto_results.jsonl instead.
# Only the A/B, about 2 minutes: FLASH_AB=1 PREWARM_T=0 WARM_T=0 bash benchmarks/throughput_h200.sh
#
# Dry run on a CPU (no GPU: the interpreter compiles nothing, so the pre-warm only draws; a few properties):
#   FLASH=sdpa-math FLASH_T=20 TRITON_K="forward_matches or lse_matches" PREWARM_T=200 WARM_T=60 COLD_T=60 \
#     PY=/path/to/.venv/bin/python TRITON_INTERPRET=1 bash benchmarks/throughput_h200.sh
set -u
OUT=${OUT:-/tmp/throughput}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTEST_PLUGINS=${PYTEST_PLUGINS-attnverify.plugin} PYTHONUNBUFFERED=1
FLASH_T=${FLASH_T:-45}  # each sdpa-flash run (0: none); FLASH_T=0: 150 + 150 + the rest of 300 s, about 5 minutes
FLASH=${FLASH:-sdpa-flash}
W=$(mktemp -d /tmp/throughput.XXXXXX)
py=${PY:-python3}

$py - > "$OUT/versions.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton unavailable:", e)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY
nproc >> "$OUT/versions.txt"

now() { date +%s.%N; }
summary="$OUT/summary.md"
{ echo "# Fuzzer throughput, $(date -u +%Y-%m-%dT%H:%MZ), $(grep '^gpu' "$OUT/versions.txt")"; echo; } > "$summary"

# Every run's folder has its own, empty example database but shares Hypothesis's cache of the source code's
# constants (.hypothesis/constants, by source hash: in a repository where the tests ran once it is there), filled
# first by a throwaway run: cold, its scan cost 27 of the first 20 draws' 35 ms each on a 2-core CPU (2026-12-05,
# same draws and verdicts warm or cold). CONSTANTS=cold gives each run an empty one (a new checkout).
mkdir -p "$W/constants"
with_constants() {  # a run's folder, with the shared constants cache unless CONSTANTS=cold
  mkdir -p "$1/.hypothesis"
  [ "${CONSTANTS:-warm}" = cold ] || ln -sfn "$W/constants" "$1/.hypothesis/constants"
}
if [ "${CONSTANTS:-warm}" != cold ]; then
  with_constants "$W/cwd_constants"
  (cd "$W/cwd_constants" && timeout 120 $py -m attnverify.cli run --adapter "$FLASH" --profile dev -n 0 --isolate none \
     -k forward_matches_reference --seed 99 --max-examples 3 --report rep --no-html -q > /dev/null 2>&1)
  echo "Hypothesis's constants cache filled by a throwaway run: $(ls "$W/constants" | wc -l) files" >> "$summary"; echo >> "$summary"
fi

# 1. sdpa-flash, forward_matches_reference, one worker; each run is ISOLATION:JUDGE (JUDGE: ATTNVERIFY_JUDGE_ON, or
#    "default": left unset)
runs="subprocess:default none:default"
[ "${FLASH_AB:-0}" = 1 ] && runs="subprocess:device subprocess:auto"
[ "$FLASH_T" = 0 ] && runs=""
for run in $runs; do
  iso=${run%%:*}; judge=${run#*:}
  log="$OUT/flash.log"; [ "$iso" = none ] && log="$OUT/flash_none.log"; [ "$judge" = auto ] && log="$OUT/flash_auto.log"
  rep="$W/flash_$iso"; [ "$judge" != default ] && rep="$W/flash_${iso}_$judge"
  prof=()
  [ "$iso" = none ] && [ "${PROFILE_FLASH:-0}" = 1 ] && prof=(-m cProfile -o "$W/flash.prof")
  jenv=(env); [ "$judge" != default ] && jenv=(env ATTNVERIFY_JUDGE_ON="$judge")
  t0=$(now)
  # SIGINT at the cap: pytest stops, cProfile still writes its profile (it would not on SIGTERM)
  # --isolate none runs in this process (-n 0): with -n 1 cProfile would see only xdist's controller waiting
  nw=1; [ "$iso" = none ] && nw=0
  # each run in its own folder: its own (empty) Hypothesis example database, so that the seed draws alike (in one
  # folder the second run replayed what the first had saved, and its draws parted from the 17th example on)
  cwd="$W/cwd_flash_${iso}_$judge"; mkdir -p "$cwd"; with_constants "$cwd"
  (cd "$cwd" && timeout -s INT -k 10 "$FLASH_T" "${jenv[@]}" $py "${prof[@]}" -m attnverify.cli run --adapter "$FLASH" --profile dev -n "$nw" --isolate "$iso" \
     -k forward_matches_reference --seed 1 --report "$rep" --no-html -q) > "$log" 2>&1
  rc=$?; t1=$(now)
  if [ -f "$W/flash.prof" ]; then
    $py - "$W/flash.prof" > "$OUT/flash_profile.txt" 2>&1 <<'PY'
import pstats, sys
st = pstats.Stats(sys.argv[1])
print("--isolate none under cProfile (timings inflated by the profiler; compare shares, not seconds)")
st.sort_stats("tottime").print_stats(40)
st.sort_stats("cumulative").print_stats("attnverify|hypothesis/internal/conjecture/(engine|pareto)", 60)
PY
  fi
  res_name=flash_results.jsonl; [ "$judge" = auto ] && res_name=flash_auto_results.jsonl
  [ "$iso" = subprocess ] && cp "$rep/results.jsonl" "$OUT/$res_name" 2>/dev/null
  $py - "$rep" "$iso" "$rc" "$t0" "$t1" "$FLASH" "${#prof[@]}" "$judge" >> "$summary" <<'PY'
import sys
from collections import Counter
from attnverify.journal import last_run
from attnverify.split_table import split_rows, split_table
from benchmarks.journal_digest import digest
rep, iso, rc, t0, t1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
judge = sys.argv[8]
recs = last_run(rep)
rows = [r for r in split_rows(recs) if r["property"] == "forward_matches_reference"]
rate = rows[0]["per_s"] if rows else 0.0
verdict = ("MET" if rate >= 100 else "NOT MET") if rows else f"NOT MEASURED (exit {rc}, see the log)"
# steady state: from the first example's result to the last one's (the judging child's start, CUDA's
# initialisation and first imports left out), from the records' own timestamps
ts = sorted(float(r["t"]) for r in recs if r.get("event") == "result" and r.get("property") == "forward_matches_reference")
steady = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 2 and ts[-1] > ts[0] else 0.0
print(f"## {sys.argv[6]} forward_matches_reference, dev profile, -n {1 if iso != 'none' else 0}, --isolate {iso}"
      + (f", ATTNVERIFY_JUDGE_ON={judge}" if judge != "default" else "")
      + (" (under cProfile: slower than without it)" if sys.argv[7] != "0" else "") + "\n")
print(f"exit {rc}; command wall {t1 - t0:.1f} s (startup included); "
      f"{rows[0]['examples'] if rows else 0} examples in {rows[0]['wall'] if rows else 0:.2f} s of the test item: "
      f"**{rate:.1f} examples/s per worker** (target >= 100: {verdict}); after the first example "
      f"(the child's start and first imports left out): {steady:.1f} examples/s\n")
print(split_table(recs))
# a cost that falls as the run goes on is a first use (a kernel loaded, a cuBLAS plan, an allocation), not per example
res = [r for r in recs if r.get("event") == "result" and r.get("property") == "forward_matches_reference"]
dg = digest(rep)
on = Counter(c.get("judged_on") or "?" for r in res for c in (r.get("records") or []) if isinstance(c, dict))
print(f"\nverdict digest {dg['verdicts']} (draws {dg['draws']}) over {dg['examples']} examples; checks judged on: {dict(on)}")
if len(res) > 40:
    def mean(rs, k):
        return 1000 * sum((r.get("split") or {}).get(k, 0.0) for r in rs) / len(rs)
    print("\nmean ms, first 20 examples / the rest: " + ", ".join(
        f"{k} {mean(res[:20], k):.1f} / {mean(res[20:], k):.1f}" for k in ("draw", "case", "adapter", "reference", "baseline", "compare", "other")))
print()
PY
done

# 1b. the A/B of the judge's device (FLASH_AB=1): both rates and digests, and the examples both runs drew alike
if [ "${FLASH_AB:-0}" = 1 ] && [ "$FLASH_T" != 0 ]; then
  $py - "$W/flash_subprocess_device" "$W/flash_subprocess_auto" >> "$summary" <<'PY'
import json, os, sys
from attnverify.journal import last_run
from attnverify.split_table import split_rows
from benchmarks.journal_digest import digest
print("## A/B: ATTNVERIFY_JUDGE_ON=device vs auto (sdpa-flash forward_matches_reference, dev, -n 1)\n")
runs = {}
for label, path in zip(("device", "auto"), sys.argv[1:3]):
    if not os.path.exists(os.path.join(path, "results.jsonl")):
        print(f"{label}: no journal (the run did not start; see its log)\n")
        continue
    recs = last_run(path)
    rows = [r for r in split_rows(recs) if r["property"] == "forward_matches_reference"]
    ts = sorted(float(r["t"]) for r in recs if r.get("event") == "result" and r.get("property") == "forward_matches_reference")
    steady = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 2 and ts[-1] > ts[0] else 0.0
    dg = digest(path)
    print(f"- {label}: **{rows[0]['per_s'] if rows else 0.0:.1f} examples/s** (after the first example {steady:.1f}/s), "
          f"{dg['examples']} examples, verdict digest {dg['verdicts']}, draws digest {dg['draws']}")
    drawn = {(r.get("property"), r.get("index")): json.dumps(r.get("drawn"), sort_keys=True) for r in recs
             if r.get("event") == "case_start"}
    runs[label] = {k: (drawn.get(k), r.get("status"), float(r.get("severity") or 0.0)) for r in recs
                   if r.get("event") == "result" for k in [(r.get("property"), r.get("index"))]}
if len(runs) == 2:
    a, b = runs["device"], runs["auto"]
    alike = sorted(k for k in set(a) & set(b) if a[k][0] == b[k][0])
    parted = sorted(k for k in set(a) & set(b) if a[k][0] != b[k][0])
    differ = [k for k in alike if a[k][1] != b[k][1]]
    ratios = sorted(b[k][2] / a[k][2] for k in alike if a[k][2] > 0 and b[k][2] > 0)
    print(f"\n{len(alike)} examples drawn alike by both (first parting draw: {parted[0] if parted else 'none'}): "
          f"**{len(differ)} statuses differ**{' ' + str([(k, a[k][1], b[k][1]) for k in differ[:5]]) if differ else ''}; "
          + (f"severity auto/device min {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, max {ratios[-1]:.3f} "
             f"over {len(ratios)}" if ratios else "no severities to compare") + "\n")
PY
fi

# 2. triton, every property of the dev profile, 25 examples each, 4 workers, seed 1, three ways:
#    prewarm: an empty Triton cache and --prewarm (the run's kernels compiled on every core first; its time counts)
#    warm:    a second run on the cache the first left (every compile a disk-cache hit)
#    cold:    an empty Triton cache, no pre-warm (every compile paid inside the run, by each worker that meets it)
# Each is stopped at its cap (PREWARM_T, default 200 s; WARM_T, default 90 s; COLD_T, default 0: not run), and
# said MET or NOT MET against 120 s with its time split.
run_triton() {  # $1 label, $2 cache folder, $3 cap in s, $4.. extra run options
  local label=$1 cache=$2 cap=$3; shift 3
  local rep="$W/triton_$label"
  export TRITON_CACHE_DIR="$cache"
  local t0; t0=$(now)
  echo "=== $label: TRITON_CACHE_DIR=$cache, cap $cap s, options: $*" >> "$OUT/triton.log"
  mkdir -p "$W/cwd_$label"; with_constants "$W/cwd_$label"  # its own folder: its own (empty) Hypothesis example database, so the same seed draws alike
  (cd "$W/cwd_$label" && timeout "$cap" $py -m attnverify.cli run --adapter triton --profile dev --max-examples 25 -n 4 \
     ${TRITON_K:+-k "$TRITON_K"} --seed 1 --report "$rep" --no-html -q "$@") >> "$OUT/triton.log" 2>&1
  local rc=$? t1; t1=$(now)
  $py - "$rep" "$rc" "$t0" "$t1" "$cap" "$label" "$cache" >> "$summary" <<'PY'
import os, sys
from attnverify.journal import last_run
from attnverify.split_table import split_rows, split_table
rep, rc, t0, t1, cap, label, cache = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]
recs = last_run(rep) if os.path.exists(os.path.join(rep, "results.jsonl")) else []
wall = t1 - t0
ends = [r for r in recs if r.get("event") == "test_end"]
outcomes = {}
for r in ends:
    outcomes[r.get("outcome")] = outcomes.get(r.get("outcome"), 0) + 1
stopped = rc in (124, 137)
if stopped:
    verdict = (f"NOT MET (stopped at the {cap} s cap)" if float(cap) >= 120
               else f"NOT MEASURED (stopped at the {cap} s cap, before 120 s)")
elif rc not in (0, 1) or not ends:  # 1: a property failed (a finding), the run itself completed
    verdict = f"NOT MEASURED (the run did not complete: exit {rc}, see triton.log)"
else:
    verdict = "MET" if wall <= 120 else "NOT MET"
kernels = sum(1 for r, _, fs in os.walk(cache) for f in fs if f.endswith(".cubin"))
how = {"prewarm": "empty Triton cache, --prewarm", "warm": "second run on the cache the first left",
       "cold": "empty Triton cache, no pre-warm"}[label]
print(f"## triton, whole dev profile, --max-examples 25, -n 4, seed 1: {label} ({how})\n")
print(f"exit {rc}{' (stopped at ' + cap + ' s)' if stopped else ''}; **wall {wall:.1f} s** (target <= 120 s: **{verdict}**); "
      f"{len(ends)} property items ended: {outcomes}; "
      f"{sum(1 for r in recs if r.get('event') == 'result')} examples judged; {kernels} kernels in the cache afterwards\n")
pre = [r for r in recs if r.get("event") == "prewarm"]
if pre:
    p = pre[-1]
    print(f"pre-warm (inside the wall time): {p.get('seconds', 0):.1f} s ({p.get('draw_seconds', 0):.1f} s drawing) on "
          f"{p.get('workers')} processes: {p.get('examples')} examples drawn, {p.get('calls')} calls, "
          f"{p.get('compiles')} compiles, {p.get('errors')} errors{'; ' + p['note'] if p.get('note') else ''}; "
          f"compiles per process {p.get('compiles_per_process')}, busy s per process {p.get('busy_seconds_per_process')}\n")
print(split_table(recs))
print()
rows = sorted(split_rows(recs), key=lambda r: -r["wall"])[:5]
print("slowest items (wall s summed over workers): " + ", ".join(f"{r['property']} {r['wall']:.1f}" for r in rows))
print()
PY
}
PREWARM_T=${PREWARM_T:-${TRITON_T:-200}}
WARM_T=${WARM_T:-90}
COLD_T=${COLD_T:-0}
s0=$(now)
[ "$PREWARM_T" -gt 0 ] && run_triton prewarm "$W/cache_a" "$PREWARM_T" --prewarm
[ "$WARM_T" -gt 0 ] && run_triton warm "$W/cache_a" "$WARM_T"
[ "$COLD_T" -gt 0 ] && run_triton cold "$W/cache_b" "$COLD_T"
# same seed, same draws and verdicts? (the examples every run judged, by property and index)
$py - "$W" >> "$summary" <<'PY'
import json, os, sys
from attnverify.journal import last_run
runs = {}
for label in ("prewarm", "warm", "cold"):
    path = os.path.join(sys.argv[1], "triton_" + label)
    if not os.path.exists(os.path.join(path, "results.jsonl")):
        continue  # not run (COLD_T=0)
    recs = last_run(path)
    drawn = {(r.get("property"), r.get("index")): json.dumps(r.get("drawn"), sort_keys=True) for r in recs
             if r.get("event") == "case_start"}
    runs[label] = {(r.get("property"), r.get("index")): (drawn.get((r.get("property"), r.get("index"))), r.get("status"),
                   round(float(r.get("severity") or 0), 9)) for r in recs if r.get("event") == "result"}
if not runs:
    print("## Same seed, same verdicts\n\n(no triton run: PREWARM_T=WARM_T=COLD_T=0)\n")
    sys.exit(0)
common = set.intersection(*(set(v) for v in runs.values()))
differ = sorted(k for k in common if len({runs[l][k] for l in runs}) > 1)
print(f"## Same seed, same verdicts\n\n{len(common)} examples judged by all {len(runs)} runs ({', '.join(runs)}; same property and index): "
      f"{'all alike (drawn case, status, severity)' if not differ else f'{len(differ)} differ, first {differ[:3]}'}\n")
PY
(cd "$W" && tar czf "$OUT/triton_journals.tar.gz" triton_prewarm/results.jsonl triton_warm/results.jsonl \
   triton_cold/results.jsonl 2>/dev/null)
cat "$summary"
rm -rf "$W"
