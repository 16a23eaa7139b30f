#!/usr/bin/env bash
# On a GPU machine, one command, under 8 minutes on one H200: calibration of the tolerances (the per-case
# rule of docs/tolerances.md) over every SDPA backend, naive, triton, flex, and jax / flash-attn4 where they
# import (an unavailable adapter is skipped and says why in its log), one process per adapter x dtype, all
# in parallel, each stopped by its time budget T; plus the wrong-answer rejection tests on cuda.
#   bash benchmarks/gpu_calibration.sh [RESULTS_DIR]          (default /tmp/gpucal; T=300 N=1000 SEED=0)
# Writes RESULTS_DIR/cal_<adapter>_<dtype>.json (+ .log), RESULTS_DIR/gpu_calibration.json (every run's
# summary and failures, the input of the doc table) and RESULTS_DIR/table.md (benchmarks/tolerance_tables.py);
# with $OUT set, copies gpu_calibration.json, table.md and logs.tgz (every .log) there (3 files).
# POOL=K (default 0: off) gives the adapters that compile per shape (POOL_ADAPTERS, default triton flex jax
# flash-attn4) K shapes each (--shape-pool: shape, features, mask kind and scale drawn once per adapter x dtype,
# every case one of them with a fresh seed and fresh adversarial values), so that compiles do not eat T:
#   T=200 N=1200 POOL=8 ADAPTERS="triton flex jax" bash benchmarks/gpu_calibration.sh /tmp/gpucal
# FAMILY=dominant-key draws every case with the backward precision corpus entries' values (a dominant first key,
# a key offset; calibrate_tolerances.py --family), for false positives of correct kernels on them.
# HEAD_DIMS=24,32,56,64,96,128,160,192,256 draws only those head dims (--head-dims): flash-attn4's F18-free row.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
R=${1:-/tmp/gpucal}; N=${N:-1000}; T=${T:-300}; mkdir -p "$R"
ADAPTERS=${ADAPTERS:-naive sdpa-math sdpa-flash sdpa-efficient sdpa-cudnn sdpa triton flex jax flash-attn4}
# flash-attn4's wheels, installed on this machine by an earlier call (benchmarks/fa4_wheels.sh install: pip --target
# /tmp/site), are found the way that script exports them (a new shell does not inherit its PYTHONPATH)
case " $ADAPTERS " in *" flash-attn4 "*) [ -d /tmp/site ] && \
  export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PYTHONPATH;; esac
for a in $ADAPTERS; do
  pool=0; case " ${POOL_ADAPTERS:-triton flex jax flash-attn4} " in *" $a "*) pool=${POOL:-0};; esac
  for dt in ${DTYPES:-float16 bfloat16 float32}; do
    timeout $(( T + 60 )) python3 benchmarks/calibrate_tolerances.py --adapters "$a" --dtypes "$dt" --n "$N" --seed "${SEED:-0}" \
      --shape-pool "$pool" --budget-s "$T" --family "${FAMILY:-plain}" --head-dims "${HEAD_DIMS:-}" --json "$R/cal_${a}_$dt.json" > "$R/cal_${a}_$dt.log" 2>&1 &
  done
done
# SKIP_WRONG=1: no wrong-answer tests (several calibrations side by side on one GPU need them once)
[ -n "${SKIP_WRONG:-}" ] || (python3 -m pytest --version >/dev/null 2>&1 && timeout $(( T + 60 )) python3 -m pytest -q -p no:cacheprovider \
   tests/test_tolerances.py -k "rejects and cuda" > "$R/wrong_cuda.log" 2>&1) &
wait
python3 - "$R" <<'PY'
import glob, json, os, sys
r = sys.argv[1]
runs = {}
for p in sorted(glob.glob(os.path.join(r, "cal_*.json"))):
    try:
        runs[os.path.basename(p)[4:-5]] = json.load(open(p))
    except Exception as e:
        runs[os.path.basename(p)[4:-5]] = {"error": f"{type(e).__name__}: {e}"}
json.dump({"runs": runs}, open(os.path.join(r, "gpu_calibration.json"), "w"), indent=1)
print(f"{len(runs)} runs -> {r}/gpu_calibration.json")
PY
python3 benchmarks/tolerance_tables.py "$R"/cal_*.json > "$R/table.md" 2>/dev/null || true
grep -h "cases\|false\|unavailable" "$R"/cal_*.log; [ -n "${SKIP_WRONG:-}" ] || tail -n 3 "$R/wrong_cuda.log"
if [ -n "${OUT:-}" ]; then
  cp "$R/gpu_calibration.json" "$R/table.md" "$OUT"/ && tar czf "$OUT/logs.tgz" -C "$R" $(cd "$R" && ls *.log)
fi
