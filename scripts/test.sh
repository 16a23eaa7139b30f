#!/usr/bin/env bash
# The project's test suite (what CI runs): set-up, then pytest on 2 workers.
# Arguments go after the script's own, and pytest keeps the last value of an option it is given more than
# once: `bash scripts/test.sh -m slow` runs the slow tests, `bash scripts/test.sh -m slow -n 14` on 14 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (seconds): pyflakes and pycodestyle as configured in pyproject.toml [tool.ruff]
.venv/bin/python -m ruff check attnverify tests benchmarks
# without a visible GPU the bundled Triton kernel runs under the interpreter, which must be on before anything
# imports triton. What counts is the GPU torch sees, not the driver being installed: a GPU machine run with
# CUDA_VISIBLE_DEVICES= is a CPU machine here
if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
fi
exec .venv/bin/python -m pytest -q -n 2 -m "not slow" tests "$@"
