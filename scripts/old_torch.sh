#!/usr/bin/env bash
# The oldest torch the README supports, on the CPU: a second venv with torch ${ATTNVERIFY_OLD_TORCH:-2.3.1}
# and attnverify (this checkout, editable), then the ci profile of every built-in adapter available there.
# Errors of the suite's own claims (a claimed case the library refuses) are defects of attnverify; library
# bugs are declared on the adapter as known findings. Not part of scripts/test.sh (it downloads a second
# torch, ~3 GB with PyPI's CUDA-built wheel, and the run takes ~10 min on 2 cores); run it by hand or from a
# scheduled CI job:
#
#   bash scripts/old_torch.sh                      # torch 2.3.1, report in reports/old-torch-2.3.1/
#   ATTNVERIFY_OLD_TORCH=2.5.1 bash scripts/old_torch.sh
#   ATTNVERIFY_TORCH_INDEX=<PyTorch's CPU wheel index> bash scripts/old_torch.sh   # the small CPU wheel
#
# Extra arguments go to `attnverify run` (e.g. `--seed 0`, `-- -k forward`).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${ATTNVERIFY_OLD_TORCH:-2.3.1}
VENV=${ATTNVERIFY_OLD_TORCH_VENV:-.venv-torch-$TORCH_VERSION}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" >/dev/null 2>&1; then
  if [ -n "${ATTNVERIFY_TORCH_INDEX:-}" ]; then
    "$VPY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$ATTNVERIFY_TORCH_INDEX"
  else
    "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi
# torch < 2.4 was built against NumPy 1.x; keep that torch (never let the editable install replace it)
"$VPY" -m pip install -q "numpy<2" -e ".[test,xdist,html]" "torch==$TORCH_VERSION" ${ATTNVERIFY_TORCH_INDEX:+--extra-index-url "$ATTNVERIFY_TORCH_INDEX"}
"$VPY" -c "import torch; print('old_torch: torch', torch.__version__)"
ADAPTERS=$("$VPY" - <<'EOF'
from attnverify.adapters.registry import BUILTINS, get
names = []
for n in BUILTINS:
    try:
        why = get(n).unavailable_reason()
    except Exception as e:  # an adapter module that does not import on this torch is a defect: show it
        why = f"failed to load: {type(e).__name__}: {e}"
    if why:
        print(f"old_torch: {n}: unavailable ({why})", file=__import__("sys").stderr)
    else:
        names.append(n)
print(",".join(names))
EOF
)
echo "old_torch: running the ci profile of: $ADAPTERS"
command -v nvidia-smi >/dev/null 2>&1 || export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec "$VENV/bin/attnverify" run --adapter "$ADAPTERS" --profile ci --report "reports/old-torch-$TORCH_VERSION" "$@"
