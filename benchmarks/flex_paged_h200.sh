#!/usr/bin/env bash
# flex-paged (PyTorch's PagedAttention on compiled flex_attention) on one H200 in one go (about 4 minutes), results
# under $OUT (4 files):
#
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin
#   OUT=/path/to/out bash benchmarks/flex_paged_h200.sh
#
# 1. benchmarks/repro_flex_paged_nan.py (F38, standalone, 90 s at most) -> repro_flex_paged_nan.log
# 2. `attnverify run --adapter flex-paged --profile thorough` on the serving properties it claims, with the F38
#    declarations (paged_equals_contiguous, kv_cache_append: known when the failure is NaN garbage in a partly used
#    page) -> run_flex_paged.log, reports.tgz (serving_h200.sh ran flex-paged beside two other adapters in 120 s and
#    did not finish; here it has the GPU alone and RUN_BUDGET seconds)
# Also versions.txt. A run cut by its time limit says so at the end of its log ("exit 124").
set -u
OUT=${OUT:-flex_paged_h200_out}
PY=${PYTHON:-python}
RUN_BUDGET=${RUN_BUDGET:-170}
MAX_EXAMPLES=${MAX_EXAMPLES:-8}
WORKERS=${WORKERS:-4}
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1
# the plugin by name (an installed attnverify's entry point has the same name: registered once)
export PYTEST_PLUGINS=attnverify.plugin
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "flex_paged_h200: no CUDA GPU here (torch.cuda.is_available() is False): nothing run"
    exit 0
fi
$PY -c "
import torch
from attnverify.adapters.registry import get
a = get('flex-paged')
print('torch', torch.__version__, 'gpu', torch.cuda.get_device_name(0))
print('flex-paged:', a.unavailable_reason() or 'available', '|', a.claims.summary(), '| known:', sorted(a.known_failures))
" > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
( timeout 90 $PY benchmarks/repro_flex_paged_nan.py; echo "exit $?" ) > "$OUT/repro_flex_paged_nan.log" 2>&1
PROPS="paged_equals_contiguous or kv_cache_append or batch_invariance or lse_merge"
cmd=($PY -m attnverify.cli run --adapter flex-paged --profile thorough --device cuda --max-examples "$MAX_EXAMPLES"
     -n "$WORKERS" -k "$PROPS" --report "$OUT/rep_flex_paged" --no-html)
( echo "${cmd[*]}"; timeout "$RUN_BUDGET" "${cmd[@]}"; rc=$?
  echo; echo "exit $rc$([ $rc = 124 ] && echo ' (time limit: the properties not listed above did not finish)')" ) \
  > "$OUT/run_flex_paged.log" 2>&1
if [ -d "$OUT/rep_flex_paged" ]; then
    (cd "$OUT" && tar czf reports.tgz rep_flex_paged && rm -rf rep_flex_paged)
fi
for log in "$OUT/repro_flex_paged_nan.log" "$OUT/run_flex_paged.log"; do
    echo "--- $(basename "$log") (tail)"
    grep -v '^\s*$' "$log" | tail -20
done
echo "flex_paged_h200: $(( $(date +%s) - start )) s; files: $(ls "$OUT" | tr '\n' ' ')"
