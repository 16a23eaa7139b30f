#!/usr/bin/env bash
# On a GPU of compute capability 8.9+ (the H200): the bundled Triton kernel's fp8 inputs with descales, in one go
# (~3 minutes; correctness only, nothing timed). Writes at most 6 files into $1 (default $OUT):
#   fp8_claims.txt      versions, GPU, and the triton adapter's claims (fp8 dtypes + descales expected on sm_89+)
#   tests_fp8.log       pytest -v tests/test_triton_fp8.py (compiled kernels; a user's conftest adapter over them)
#   run_fp8.log         attnverify run --adapter triton --profile thorough -k "fp8 or descale" (MAX examples, seed 0)
#   rep_fp8.tgz         that run's report folder (journal, saved cases)
#   cal.tgz             calibration of the fp8 tolerance on the GPU, e4m3fn and e5m2: SHARDS processes per dtype
#                       (seeds 11, 12, ...), each cal_triton_<dtype>_s<seed>.json / .log
#                       (benchmarks/calibrate_tolerances.py; docs/tolerances.md "fp8 calibration")
#   cal_summary.md      those shards merged, a row per dtype (benchmarks/tolerance_tables.py --merge)
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; bash benchmarks/gpu_fp8_triton.sh $OUT
# env: T (170: seconds each part may run), MAX (80: examples per property of the thorough run), DEVICE (cuda),
#      PARTS (tests run cal: which parts), SHARDS (1: calibration processes per dtype), POOL (0: --shape-pool, shapes
#      per process: compiled kernels reused across cases). 1,000+ cases per dtype in one call (~6 minutes):
#   PARTS=cal SHARDS=6 POOL=8 T=330 bash benchmarks/gpu_fp8_triton.sh $OUT
set -u
R=${1:-${OUT:?give a results folder}}; mkdir -p "$R"
T=${T:-170}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 - > "$R/fp8_claims.txt" 2>&1 <<'PY'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
      torch.cuda.get_device_capability(0) if torch.cuda.is_available() else "")
from attnverify.adapters.triton_fp8 import nvml_capabilities
print("nvml capabilities", nvml_capabilities())
from attnverify.adapters.registry import get
c = get("triton").claims
print("triton claims dtypes", c.dtypes, "descales", c.descales, "devices", c.devices)
PY
PARTS=" ${PARTS:-tests run cal} "
case $PARTS in *" tests "*)
(timeout "$T" python3 -m pytest -v -p no:randomly -p no:cacheprovider -rs tests/test_triton_fp8.py \
   > "$R/tests_fp8.log" 2>&1; echo "exit $?" >> "$R/tests_fp8.log") & ;; esac
case $PARTS in *" run "*)
(timeout "$T" python3 -m attnverify.cli run --adapter triton --profile thorough -k "fp8 or descale" --device "${DEVICE:-cuda}" \
   --max-examples "${MAX:-80}" --seed 0 --no-html --report rep_fp8 > "$R/run_fp8.log" 2>&1; echo "exit $?" >> "$R/run_fp8.log";
 tar czf "$R/rep_fp8.tgz" rep_fp8 2>/dev/null) & ;; esac
C=$(mktemp -d /tmp/fp8cal.XXXXXX)
case $PARTS in *" cal "*)
for dt in float8_e4m3fn float8_e5m2; do  # processes per dtype and shard: the budget is per process
  for i in $(seq 0 $(( ${SHARDS:-1} - 1 ))); do
    seed=$(( 11 + i ))
    (timeout $((T + 10)) python3 benchmarks/calibrate_tolerances.py --adapters triton --dtypes $dt --forward-only \
       --n 1000 --seed $seed --threads 2 --shape-pool "${POOL:-0}" --budget-s $((T - 20)) \
       --json "$C/cal_triton_${dt}_s$seed.json" > "$C/cal_triton_${dt}_s$seed.log" 2>&1) &
  done
done ;; esac
wait
if ls "$C"/cal_*.json >/dev/null 2>&1; then
  python3 benchmarks/tolerance_tables.py --merge "$C"/cal_*.json > "$R/cal_summary.md" 2>&1
  tar czf "$R/cal.tgz" -C "$C" .
fi
tail -n 3 "$R"/*.log "$R"/cal_summary.md 2>/dev/null
