#!/usr/bin/env bash
# Set up .venv with attnverify and everything its tests need, on a fresh machine.
# - A torch that already sees CUDA is reused (the venv sees system packages): never replaced.
# - Without a GPU, the CPU build of torch is installed first, so no multi-GB CUDA build is pulled.
#   Set ATTNVERIFY_TORCH_INDEX to PyTorch's CPU wheel index where PyPI's default build is CUDA.
# - triton is installed for the interpreter (TRITON_INTERPRET=1) that runs the bundled kernel on CPU.
# - jax (CPU) is installed for the `jax` adapter.
# - CPU libraries with an adapter each (issue 24), each skipped by its opt-out variable:
#   onnx + onnxruntime (onnx-attention, ort-mha, ort-gqa)  ATTNVERIFY_NO_ONNX=1
#   tinygrad (+ clang through apt, its CPU compiler)        ATTNVERIFY_NO_TINYGRAD=1
#   keras (keras-torch; keras-jax with jax)                  ATTNVERIFY_NO_KERAS=1
#   transformers (hf-sdpa, hf-eager)                         ATTNVERIFY_NO_TRANSFORMERS=1
#   ATTNVERIFY_NO_CPU_CLIENTS=1 skips all four. A failed install leaves that adapter unavailable, saying why.
# - ray[default] for `attnverify run --ray` and its tests (issue 26)     ATTNVERIFY_NO_RAY=1
#   Without it `--ray` says how to install it and the Ray tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${ATTNVERIFY_TORCH_INDEX:-}" ]; then
    "$VPY" -m pip install -q torch --index-url "$ATTNVERIFY_TORCH_INDEX"
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
if ! "$VPY" -c "import triton" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "triton==3.9.0" || echo "setup: triton not installed; the 'triton' adapter will be unavailable"
fi
"$VPY" -m pip install -q -e ".[test,xdist,html]"
# JAX (CPU) so the `jax` adapter joins the default run; where a CUDA torch is reused, the machine's
# own JAX (if any) is used instead. Set ATTNVERIFY_NO_JAX=1 to skip it.
if [ -z "${ATTNVERIFY_NO_JAX:-}" ] && ! "$VPY" -c "import jax" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "jax[cpu]>=0.4.30" || echo "setup: jax not installed; the 'jax' adapter will be unavailable"
fi
# Third-party CPU clients (issue 24): pinned to the versions whose claims docs/compatibility.md audits
cpu_client() {  # opt-out variable, import name, pip requirement(s)...
  local optout=$1 mod=$2
  shift 2
  if [ -n "${ATTNVERIFY_NO_CPU_CLIENTS:-}" ] || [ -n "${!optout:-}" ]; then
    return 0
  fi
  if ! "$VPY" -c "import $mod" >/dev/null 2>&1; then
    "$VPY" -m pip install -q "$@" || echo "setup: $* not installed; its adapters will be unavailable ($optout=1 skips it)"
  fi
}
cpu_client ATTNVERIFY_NO_ONNX onnxruntime "onnx==1.23.2" "onnxruntime==1.31.1"
cpu_client ATTNVERIFY_NO_TINYGRAD tinygrad "tinygrad==0.14.0"
cpu_client ATTNVERIFY_NO_KERAS keras "keras==3.15.1"
cpu_client ATTNVERIFY_NO_TRANSFORMERS transformers "transformers==5.23.0"
# Ray: one task per shard on a local instance or a cluster (attnverify run --ray); the tests start a local one
if [ -z "${ATTNVERIFY_NO_RAY:-}" ] && ! "$VPY" -c "import ray" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "ray[default]==2.60.0" || echo "setup: ray not installed; attnverify run --ray and its tests are unavailable (ATTNVERIFY_NO_RAY=1 skips it)"
fi
# tinygrad's CPU device compiles with clang (a Debian package, not a pip one)
if [ -z "${ATTNVERIFY_NO_CPU_CLIENTS:-}${ATTNVERIFY_NO_TINYGRAD:-}" ] && ! command -v clang >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null) \
    || echo "setup: clang not installed; the 'tinygrad' adapter will be unavailable (it says so)"
fi
echo "setup: $("$VPY" -c 'import torch, attnverify; print("torch", torch.__version__, "attnverify", attnverify.__version__)')"
