#!/usr/bin/env bash
# On a GPU machine: the GPU-side verification in one go, everything in parallel on one GPU
# (correctness only: nothing here is timed). Results (logs, report folders as tarballs) in $1.
#   - the GPU tests (compiled Triton kernel, contract properties, external adapters, tolerances on cuda), -v
#   - `attnverify run --profile thorough` over every other available adapter, MAX_ALL examples per property
#   - `attnverify run --adapter triton --profile thorough` with MAX_TRITON examples per property
#   - optionally calibration (CAL_ADAPTERS, CAL_SEED) beside them, budgeted like the rest
# TRITON_K (a -k expression) narrows the triton run. Budget each part with T (seconds); PIP_LOG, CAL_DIR, REPORT_T move or bound the side outputs; TESTS=0 skips the tests.
set -u
R=${1:-/tmp/gpuverify}; mkdir -p "$R"
T=${T:-500}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ATTNVERIFY_CHILD_THREADS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "${PIP_LOG:-$R/pip.log}" 2>&1 || echo "pip -e failed: see pip.log"
python3 - > "$R/versions.txt" 2>&1 <<'PY'
import torch, triton, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
try:
    import jax; print("jax", jax.__version__, jax.devices())
except Exception as e: print("jax unavailable:", e)
PY
python3 -m attnverify.cli adapters > "$R/adapters.txt" 2>&1
OTHERS=$(python3 -c "from attnverify.adapters.registry import available_builtins as a; print(','.join(x.name for x in a() if x.name != 'triton'))")
[ "${TESTS:-1}" = 1 ] && (timeout "$T" python3 -m pytest -v -n "${TEST_WORKERS:-3}" -p no:randomly -m "not slow" tests/test_triton_kernel.py tests/test_contract.py \
   tests/test_external_adapters.py tests/test_tolerances.py -rs > "$R/tests_gpu.log" 2>&1; echo "exit $?" >> "$R/tests_gpu.log"
   # crash isolation forks, so it runs in a process where no GPU test has started CUDA
   timeout 120 python3 -m pytest -q -p no:randomly tests/test_isolation.py -rs >> "$R/tests_gpu.log" 2>&1; echo "exit $?" >> "$R/tests_gpu.log") &
(timeout "$T" python3 -m attnverify.cli run --adapter "$OTHERS" --profile thorough --max-examples "${MAX_ALL:-12}" -n "${ALL_WORKERS:-5}" \
   --report rep_all > "$R/run_all.log" 2>&1; echo "exit $?" >> "$R/run_all.log"; timeout "${REPORT_T:-60}" python3 -m attnverify.cli report rep_all >/dev/null 2>&1;
 tar czf "$R/rep_all.tgz" rep_all) &
(timeout "$T" python3 -m attnverify.cli run --adapter triton --profile thorough --max-examples "${MAX_TRITON:-60}" -n "${TRITON_WORKERS:-4}" \
   ${TRITON_K:+-k "$TRITON_K"} --report rep_triton > "$R/run_triton.log" 2>&1; echo "exit $?" >> "$R/run_triton.log"; timeout "${REPORT_T:-60}" python3 -m attnverify.cli report rep_triton >/dev/null 2>&1;
 tar czf "$R/rep_triton.tgz" rep_triton) &
[ -n "${CAL_ADAPTERS:-}" ] && mkdir -p "${CAL_DIR:-$R}"
for spec in ${CAL_ADAPTERS:-}; do  # adapter:dtype
  a=${spec%%:*}; dt=${spec##*:}
  (timeout $((T + 30)) python3 benchmarks/calibrate_tolerances.py --adapters "$a" --dtypes "$dt" --n 1000 --seed "${CAL_SEED:-1}" \
     --budget-s $((T - 40)) --json "${CAL_DIR:-$R}/cal_${a}_${dt}.json" > "${CAL_DIR:-$R}/cal_${a}_${dt}.log" 2>&1) &
done
wait
tail -n 3 "$R/tests_gpu.log" "$R/run_all.log" "$R/run_triton.log"
