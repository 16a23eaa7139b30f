#!/usr/bin/env bash
# CPU calibration of the per-case rule (docs/tolerances.md), rows of adapter x dtype run one after another
# in one chain that ends by a deadline: each row gets (time left) / (rows left) as its budget and stops at N
# cases, so a chain of cheap rows gives its spare time to the next. Run several chains side by side.
#   DEADLINE=$(date -d '+70 min' +%s) ROWS="naive:float16 naive:bfloat16" bash benchmarks/cpu_calibration.sh DIR
# env: N (1000), SEED (100), MAX_LEN (128; the Triton interpreter's cost grows with Lq x Lk), THREADS (1).
# POOL (0): --shape-pool, for adapters that compile per shape (jax: XLA compiles every new shape).
# FAMILY (plain): --family; dominant-key draws the backward precision corpus entries' values (file name _dominant-key).
# Writes DIR/cal_<adapter>_<dtype>_seed<SEED>.json (+ .log); shards of another SEED merge exactly
# (benchmarks/tolerance_tables.py --merge: the JSONs keep every case's ratios).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-1} TRITON_INTERPRET=1
R=${1:?results dir}; mkdir -p "$R"; PY=${PY:-python3}
set -- $ROWS; left=$#
for row in "$@"; do
  a=${row%%:*}; dt=${row#*:}
  budget=$(( (DEADLINE - $(date +%s)) / left )); left=$(( left - 1 ))
  [ "$budget" -gt 30 ] || { echo "$row: no time left" >&2; continue; }
  $PY benchmarks/calibrate_tolerances.py --adapters "$a" --dtypes "$dt" --n "${N:-1000}" --seed "${SEED:-100}" \
    --max-len "${MAX_LEN:-128}" --threads "${THREADS:-1}" --shape-pool "${POOL:-0}" --budget-s "$budget" \
    --family "${FAMILY:-plain}" --json "$R/cal_${a}_${dt}_seed${SEED:-100}${FAMILY:+_$FAMILY}.json" \
    > "$R/cal_${a}_${dt}_seed${SEED:-100}${FAMILY:+_$FAMILY}.log" 2>&1
done
