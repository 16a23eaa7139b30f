#!/usr/bin/env bash
# Set up .venv with attnverify and everything its tests need, on a fresh machine.
# - A torch that already sees CUDA is reused (the venv sees system packages): never replaced.
# - Without a GPU, the CPU build of torch is installed first, so no multi-GB CUDA build is pulled.
#   Set ATTNVERIFY_TORCH_INDEX to PyTorch's CPU wheel index where PyPI's default build is CUDA.
# - triton is installed for the interpreter (TRITON_INTERPRET=1) that runs the bundled kernel on CPU.
# - jax (CPU) is installed for the `jax` adapter.
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
echo "setup: $("$VPY" -c 'import torch, attnverify; print("torch", torch.__version__, "attnverify", attnverify.__version__)')"
