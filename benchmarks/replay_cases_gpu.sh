#!/usr/bin/env bash
# Replays every saved case (*.json: a report's cases/ or a journal excerpt's) on the GPU, one `attnverify repro`
# each, through the adapter named in the file or ADAPTER, into ONE log (a device call returns at most 8 files):
#
#   PYTHONPATH=$PWD bash benchmarks/replay_cases_gpu.sh benchmarks/results/h200_2026-12-05/session9/cases > $OUT/replays.log
#
# PY picks the interpreter (default python3). Each replay is bounded by T seconds (default 120) and ends with HELD / STILL FAILS / NOT RUN (attnverify repro);
# a last summary line counts them. A file whose recorded property is gone replays as a plain check.
set -u
DIR=${1:?usage: replay_cases_gpu.sh DIR [ADAPTER]}
A=${2:-}
held=0; fails=0; other=0
for f in "$DIR"/*.json; do
  [ -e "$f" ] || continue
  echo "=== $f"
  out=$(timeout "${T:-120}" "${PY:-python3}" -m attnverify repro "$f" --device "${DEVICE:-cuda}" ${A:+--adapter "$A"} 2>&1)
  rc=$?
  echo "$out" | tail -n "${TAIL:-40}"
  case "$out" in
    *"HELD:"*) held=$((held + 1));;
    *"STILL FAILS"*) fails=$((fails + 1));;
    *) other=$((other + 1)); echo "(exit $rc: neither held nor failed)";;
  esac
done
echo "replayed: $held held, $fails still fail, $other other"
