#!/usr/bin/env bash
# The project's test suite (what CI runs): set-up, then pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 -m "not slow" tests "$@"
