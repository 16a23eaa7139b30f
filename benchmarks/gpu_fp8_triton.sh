#!/usr/bin/env bash
# On a GPU of compute capability 8.9+ (the H200): the bundled Triton kernel's fp8 inputs with descales, in one go
# (~3 minutes; correctness only, nothing timed). Writes 8 files into $1 (default $OUT):
#   fp8_claims.txt      versions, GPU, and the triton adapter's claims (fp8 dtypes + descales expected on sm_89+)
#   tests_fp8.log       pytest -v tests/test_triton_fp8.py (compiled kernels; a user's conftest adapter over them)
#   run_fp8.log         attnverify run --adapter triton --profile thorough -k "fp8 or descale" (MAX examples, seed 0)
#   rep_fp8.tgz         that run's report folder (journal, saved cases)
#   cal_triton_<dtype>.json / .log  calibration of the fp8 tolerance on the GPU, e4m3fn and e5m2
#                       (benchmarks/calibrate_tolerances.py; docs/tolerances.md "fp8 calibration")
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; bash benchmarks/gpu_fp8_triton.sh $OUT
# env: T (170: seconds each part may run), MAX (80: examples per property of the thorough run), DEVICE (cuda).
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
(timeout "$T" python3 -m pytest -v -p no:randomly -p no:cacheprovider -rs tests/test_triton_fp8.py \
   > "$R/tests_fp8.log" 2>&1; echo "exit $?" >> "$R/tests_fp8.log") &
(timeout "$T" python3 -m attnverify.cli run --adapter triton --profile thorough -k "fp8 or descale" --device "${DEVICE:-cuda}" \
   --max-examples "${MAX:-80}" --seed 0 --no-html --report rep_fp8 > "$R/run_fp8.log" 2>&1; echo "exit $?" >> "$R/run_fp8.log";
 tar czf "$R/rep_fp8.tgz" rep_fp8 2>/dev/null) &
for dt in float8_e4m3fn float8_e5m2; do  # one process per dtype: the budget is per process
  (timeout $((T + 10)) python3 benchmarks/calibrate_tolerances.py --adapters triton --dtypes $dt --forward-only \
     --n 1000 --seed 11 --threads 2 --budget-s $((T - 20)) --json "$R/cal_triton_$dt.json" > "$R/cal_triton_$dt.log" 2>&1) &
done
wait
tail -n 3 "$R"/*.log
