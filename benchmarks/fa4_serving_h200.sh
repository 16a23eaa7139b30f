#!/usr/bin/env bash
# flash-attn4's serving claims (KV caches paged and contiguous, num_splits, learnable sinks: claims read from
# FA4 4.0.0b36's source, attnverify/adapters/flash_attn4_serving.py) judged on one H200, in the second of two
# calls to the same warm machine (the FA4 wheels travel in two halves: benchmarks/fa4_wheels.sh):
#
#   call 1 (carry .whl1):  bash benchmarks/fa4_wheels.sh stash
#   call 2 (carry .whl2):  export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; bash benchmarks/fa4_serving_h200.sh
#
# Call 2 installs the wheels (fa4_wheels.sh install, ~40 s), runs `benchmarks/repro_fa4.py sink_lse` and `dv_bwd` (F37,
# F40, standalone, 90 s at most each -> repro_sink_lse.log), then, side by side (170 s at most, RUN_BUDGET):
# 1. `attnverify run --adapter flash-attn4 --profile ci` on the serving and sink properties, plus the gradient
#    properties that the LSE's new gradient path touches (gradients_match_reference, fully_masked_rows) ->
#    run_fa4.log, reports.tgz (the report folder: results.jsonl, the shrunk cases, summaries);
# 2. the gpu-marked tests of tests/test_fa4_serving.py (each property at the ci profile, a failure accepted only
#    when flash-attn4 declares it) -> pytest_gpu.log.
# Also versions.txt and install.log: 6 files under $OUT. A run cut by its time limit says so at the end of its log.
set -u
OUT=${OUT:-fa4_serving_out}
PY=${PYTHON:-python3}
RUN_BUDGET=${RUN_BUDGET:-170}     # seconds for each of the two runs (in parallel)
MAX_EXAMPLES=${MAX_EXAMPLES:-6}   # per property, besides the corpus cases (about 200 examples in all)
WORKERS=${WORKERS:-10}
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the plugin by name (an installed attnverify's entry point has the same name: registered once)
export PYTEST_PLUGINS=attnverify.plugin

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "fa4_serving_h200: no CUDA GPU here (torch.cuda.is_available() is False): nothing run" | tee "$OUT/install.log"
    exit 0
fi
# shellcheck disable=SC1091
source benchmarks/fa4_wheels.sh install > "$OUT/install.log" 2>&1
rc=$?
if [ $rc != 0 ]; then
    echo "fa4_serving_h200: the wheels did not install (exit $rc): $(tail -n 2 "$OUT/install.log")"
    exit $rc
fi
$PY - > "$OUT/versions.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0),
      "capability", torch.cuda.get_device_capability(0))
for d in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi"):
    try:
        print(d, m.version(d))
    except Exception as e:
        print(d, "?", e)
from attnverify.adapters.registry import get
a = get("flash-attn4")
print("flash-attn4:", a.unavailable_reason() or "available", "|", a.claims.summary())
PY
cat "$OUT/versions.txt"
( timeout 90 $PY benchmarks/repro_fa4.py sink_lse; echo "exit $?"
  timeout 90 $PY benchmarks/repro_fa4.py dv_bwd; echo "exit $?" ) > "$OUT/repro_sink_lse.log" 2>&1

PROPS="paged_equals_contiguous or batch_invariance or split_invariance or lse_merge or sinks_match_reference"
PROPS="$PROPS or sink_as_extra_key or sink_limits or sinks_paged or gradients_match_reference or fully_masked_rows"
cmd=($PY -m attnverify.cli run --adapter flash-attn4 --profile ci --device cuda --max-examples "$MAX_EXAMPLES"
     -n "$WORKERS" -k "$PROPS" --report "$OUT/rep_fa4" --no-html)
( echo "${cmd[*]}"; timeout "$RUN_BUDGET" "${cmd[@]}"; rc=$?
  echo; echo "exit $rc$([ $rc = 124 ] && echo ' (time limit: the properties not listed above did not finish)')" ) \
  > "$OUT/run_fa4.log" 2>&1 &
p1=$!
( timeout "$RUN_BUDGET" $PY -m pytest -q -p no:cacheprovider -m gpu -n 4 -rA tests/test_fa4_serving.py; rc=$?
  echo; echo "exit $rc$([ $rc = 124 ] && echo ' (time limit)')" ) > "$OUT/pytest_gpu.log" 2>&1 &
p2=$!
wait $p1 $p2

if [ -d "$OUT/rep_fa4" ]; then
    (cd "$OUT" && tar czf reports.tgz rep_fa4 && rm -rf rep_fa4)
fi
for log in "$OUT/repro_sink_lse.log" "$OUT/run_fa4.log" "$OUT/pytest_gpu.log"; do
    echo "--- $(basename "$log") (tail)"
    grep -v '^\s*$' "$log" | tail -20
done
echo "fa4_serving_h200: $(( $(date +%s) - start )) s; files: $(ls "$OUT" | tr '\n' ' ')"
