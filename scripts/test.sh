#!/usr/bin/env bash
# The project's test suite (what CI runs): set-up, then pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (seconds): pyflakes and pycodestyle as configured in pyproject.toml [tool.ruff]
.venv/bin/python -m ruff check attnverify tests benchmarks
# without a GPU the bundled Triton kernel runs under the interpreter, which must be on before
# anything imports triton
command -v nvidia-smi >/dev/null 2>&1 || export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec .venv/bin/python -m pytest -q -n 2 -m "not slow" tests "$@"
