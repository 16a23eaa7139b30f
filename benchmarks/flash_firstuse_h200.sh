#!/bin/bash
# The sdpa-flash throughput target's first-use costs on a GPU, judge warm-up on and off (issue 25 item 3),
# in about a minute; results in $OUT (summary.md, flash_warm.jsonl, flash_nowarm.jsonl, two logs):
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; OUT=/tmp/fu bash benchmarks/flash_firstuse_h200.sh
# Runs `attnverify run --adapter sdpa-flash --profile dev -n 1 -k forward_matches_reference --seed 1` (forked
# judge) twice, ATTNVERIFY_JUDGE_WARMUP=1 then =0, each capped at FLASH_T s (default 25), and prints for each:
# the command's wall, the examples/s of the test item, each phase's mean ms over the first 20 examples and the
# rest, and the digests of the drawn cases and of the verdicts (benchmarks/journal_digest.py). The 2026-12-05
# H200 run (before this round) had draws 9fa76736557a, verdicts 85aaecb5b33d, 112 examples: the same seed
# must give the same two digests. CPU dry run: FLASH=sdpa-math or leave sdpa-flash (it runs on the CPU too).
set -u
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
FLASH_T=${FLASH_T:-25}
FLASH=${FLASH:-sdpa-flash}
py=${PY:-python3}
W=$(mktemp -d /tmp/firstuse.XXXXXX)
summary="$OUT/summary.md"
here=$(pwd)
{ echo "# sdpa first uses, judge warm-up on/off, $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  $py -c "import torch; print('torch', torch.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
  echo; } > "$summary"
for warm in 1 0; do
  tag=warm; [ "$warm" = 0 ] && tag=nowarm
  rep="$W/$tag/report"
  mkdir -p "$W/$tag"
  t0=$(date +%s.%N)
  # each run in its own folder: an empty Hypothesis example database each, so that the seed draws alike
  (cd "$W/$tag" && ATTNVERIFY_JUDGE_WARMUP=$warm timeout -s INT -k 10 "$FLASH_T" $py -m attnverify.cli run --adapter "$FLASH" \
     --profile dev -n 1 --isolate subprocess -k forward_matches_reference --seed 1 --report "$rep" --no-html -q) \
     > "$OUT/flash_$tag.log" 2>&1
  rc=$?; t1=$(date +%s.%N)
  cp "$rep/results.jsonl" "$OUT/flash_$tag.jsonl" 2>/dev/null
  { echo "## ATTNVERIFY_JUDGE_WARMUP=$warm: exit $rc, command wall $($py -c "print(round($t1 - $t0, 1))") s"
    $py - "$rep" <<'PY'
import sys
from attnverify.journal import last_run
recs = last_run(sys.argv[1])
res = [r for r in recs if r.get("event") == "result"]
ts = [float(r["t"]) for r in recs if r.get("event") in ("case_start", "result") and "t" in r]
if res and ts:
    print(f"{len(res)} examples in {max(ts) - min(ts):.2f} s of examples: {len(res) / max(1e-9, max(ts) - min(ts)):.1f} examples/s")
PY
    $py "$here/benchmarks/journal_digest.py" "$rep" | sed 's/^/    /'
    echo; } >> "$summary" 2>&1
done
cat "$summary"
