#!/usr/bin/env bash
# Serving on one H200 in one go (about 4 minutes), results under $OUT (7 files):
#
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin
#   OUT=/path/to/out bash benchmarks/serving_h200.sh
#
# 1. decode timings, alone on the GPU (~100 s): benchmarks/decode_bench.py --no-check, the bundled Triton split-KV
#    decode (contiguous, paged p16/p64 with scrambled tables) against SDPA (flash, efficient, cudnn) and flex
#    decoding (torch.compile(flex_attention), flex's PagedAttention) -> decode_bench.md, decode_bench.json,
#    versions.txt
# 2. the serving properties, thorough profile, explicit --max-examples, the three adapters side by side (~120 s):
#    triton (3 workers), naive on cuda (2), flex-paged (2, if this torch has PagedAttention) -> run_triton.log,
#    run_naive.log, run_flex_paged.log, reports.tgz (the three report folders: results.jsonl, cases, summaries)
# A run cut by its time limit says so at the end of its log ("exit 124"); the properties it finished are listed.
set -u
OUT=${OUT:-serving_h200_out}
TIME_BUDGET=${TIME_BUDGET:-95}      # seconds of decode timing
CHECK_BUDGET=${CHECK_BUDGET:-120}   # seconds for the three property runs (in parallel)
MAX_EXAMPLES=${MAX_EXAMPLES:-15}    # per property: the thorough profile's shapes, this many examples each
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the plugin by name (an installed attnverify's entry point has the same name: registered once)
export PYTEST_PLUGINS=attnverify.plugin
start=$(date +%s)

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "serving_h200: no CUDA GPU here (torch.cuda.is_available() is False): nothing run"
    exit 0
fi

timeout $((TIME_BUDGET + 45)) $PY benchmarks/decode_bench.py --out "$OUT" --time-budget "$TIME_BUDGET" --no-check \
    || echo "decode_bench exited $?"

PROPS="paged_equals_contiguous or kv_cache_append or kv_cache_leftpad or split_invariance or lse_merge or batch_invariance or sinks_paged"
FLEX_PAGED_WHY=$($PY -c "from attnverify.adapters.registry import get; print(get('flex-paged').unavailable_reason() or '')")
pids=()
for spec in triton:3 naive:2 flex-paged:2; do
    name=${spec%%:*}; workers=${spec##*:}; log="$OUT/run_${name//-/_}.log"
    if [ "$name" = flex-paged ] && [ -n "$FLEX_PAGED_WHY" ]; then
        echo "flex-paged not run: $FLEX_PAGED_WHY" > "$log"
        continue
    fi
    cmd=($PY -m attnverify.cli run --adapter "$name" --profile thorough --device cuda --max-examples "$MAX_EXAMPLES"
         -n "$workers" -k "$PROPS" --report "$OUT/rep_${name//-/_}" --no-html)
    ( echo "${cmd[*]}"; timeout "$CHECK_BUDGET" "${cmd[@]}"; rc=$?
      echo; echo "exit $rc$([ $rc = 124 ] && echo ' (time limit: the properties not listed above did not finish)')" ) > "$log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

dirs=$(cd "$OUT" && ls -d rep_* 2>/dev/null)
if [ -n "$dirs" ]; then
    (cd "$OUT" && tar czf reports.tgz $dirs && rm -rf $dirs)
fi
for log in "$OUT"/run_*.log; do
    echo "--- $(basename "$log") (tail)"
    grep -v '^\s*$' "$log" | tail -14
done
echo "serving_h200: $(( $(date +%s) - start )) s; files: $(ls "$OUT" | tr '\n' ' ')"
