#!/usr/bin/env bash
# On a GPU machine: the GPU-side verification in one go, everything in parallel on one GPU
# (correctness only: nothing here is timed). Results (logs, report folders as tarballs) in $1.
#   - the GPU tests (compiled Triton kernel, contract properties, external adapters, tolerances on cuda)
#   - `attnverify run --adapter all --profile thorough` with MAX_ALL examples per property
#   - `attnverify run --adapter triton --profile thorough` with MAX_TRITON examples per property
# Budget each part with T (seconds).
set -u
R=${1:-/tmp/gpuverify}; mkdir -p "$R"
T=${T:-500}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ATTNVERIFY_CHILD_THREADS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/pip.log" 2>&1 || echo "pip -e failed: see pip.log"
python3 - > "$R/versions.txt" 2>&1 <<'PY'
import torch, triton, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
try:
    import jax; print("jax", jax.__version__, jax.devices())
except Exception as e: print("jax unavailable:", e)
PY
python3 -m attnverify.cli adapters > "$R/adapters.txt" 2>&1
(timeout "$T" python3 -m pytest -q -n 4 -p no:randomly -m "not slow" tests/test_triton_kernel.py tests/test_contract.py \
   tests/test_external_adapters.py tests/test_tolerances.py -rs > "$R/tests_gpu.log" 2>&1; echo "exit $?" >> "$R/tests_gpu.log") &
(timeout "$T" python3 -m attnverify.cli run --adapter all --profile thorough --max-examples "${MAX_ALL:-12}" -n 6 \
   --report rep_all > "$R/run_all.log" 2>&1; echo "exit $?" >> "$R/run_all.log"; python3 -m attnverify.cli report rep_all >/dev/null 2>&1;
 tar czf "$R/rep_all.tgz" rep_all) &
(timeout "$T" python3 -m attnverify.cli run --adapter triton --profile thorough --max-examples "${MAX_TRITON:-60}" -n 4 \
   --report rep_triton > "$R/run_triton.log" 2>&1; echo "exit $?" >> "$R/run_triton.log"; python3 -m attnverify.cli report rep_triton >/dev/null 2>&1;
 tar czf "$R/rep_triton.tgz" rep_triton) &
wait
tail -n 3 "$R/tests_gpu.log" "$R/run_all.log" "$R/run_triton.log"
