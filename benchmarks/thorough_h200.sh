#!/usr/bin/env bash
# The thorough profile of the serving, sink, fp8 and MLA properties (issues 22 and 23) on one GPU, inside one device
# call (at most 600 s), results in $OUT:
#
#   export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin; ADAPTER=triton T=500 OUT=$OUT bash benchmarks/thorough_h200.sh
#
# A property is one test item, judged by one worker, example after example: the slow ones (the bundled kernel's
# split_invariance: 0.66 s median per example on the H200, 2026-12-05) cannot judge 1,000 examples in one call. So the
# FAST properties run as one `attnverify run` with the thorough profile as it is (1,000 examples each), and each SLOW
# property as SEEDS runs of PER_SEED examples with distinct seeds (SEEDS x PER_SEED = 1,000 by default), all at once,
# each run on its own workers (W_FAST for the fast run, W_SLOW for each slow one). Every run is stopped by SIGINT at
# T seconds (it then journals and reports what it judged). $OUT: table.md (per adapter and property: examples,
# passed, failed, errors, median seconds; from benchmarks/compact_journal.py), results.jsonl.gz (the runs' compact
# journals), runs.log (each run's last lines), versions.txt.
# Memory: every worker holds its own CUDA context and thorough cases (lengths to 8,192, batch to 32). On an 80 GB H100
# (2026-12-05) 19 processes (W_FAST=7, 6 slow properties x 2 seeds) ran out of device memory in 233 of 4,668 examples
# (shrunk as failures where the backward raised it, before check called that an error); naive and the float64
# reference at W_FAST=5 x 2 adapters, 232 of 8,333. The defaults keep to 14 processes (one seed of 1,000 per slow
# property: it then runs until T, whatever it reaches). A worker judges one property to its end: with fewer workers
# than FAST properties the last ones may never start before T (2026-12-05, session 11: 3 of 8 at W_FAST=4), so
# W_FAST is one per fast property. Since session 11 an example out of memory is judged again after its process
# returns its cache (attnverify/device_memory.py); on an 80 GB card 11-14 processes still ran out in ~1% before it.
set -u
OUT=${OUT:-/tmp/thorough}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTEST_PLUGINS=${PYTEST_PLUGINS-attnverify.plugin} PYTHONUNBUFFERED=1
py=${PY:-python3}
ADAPTER=${ADAPTER:-triton}
T=${T:-500}
FAST=${FAST:-"sinks_paged or sink_as_extra_key or kv_cache_append or mla_latent_views or sink_limits or lse_merge or sinks_match_reference or chunked_matches_reference"}
SLOW=${SLOW:-"paged_equals_contiguous kv_cache_leftpad batch_invariance split_invariance fp8_matches_reference descale_linearity"}
SEEDS=${SEEDS:-"11"}
PER_SEED=${PER_SEED:-1000}
W_FAST=${W_FAST:-$(( $(grep -o " or " <<< "$FAST" | wc -l) + 1 ))}  # one worker per fast property
W_SLOW=${W_SLOW:-1}
DEVICE=${DEVICE:-cuda}
W=$(mktemp -d /tmp/thorough.XXXXXX)
$py -c "import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" > "$OUT/versions.txt" 2>&1
nproc >> "$OUT/versions.txt"

runs=()
start() {  # name, then attnverify run's arguments
  local name=$1; shift
  ( timeout -s INT "$T" $py -m attnverify run --adapter "$ADAPTER" --profile thorough --device "$DEVICE" \
      --report "$W/$name" "$@" > "$W/$name.log" 2>&1; echo "exit $?" >> "$W/$name.log" ) &
  runs+=("$name")
}
[ -n "$FAST" ] && start fast -n "$W_FAST" --seed 7 -k "$FAST"
for p in $SLOW; do
  for s in $SEEDS; do start "${p}_s$s" -n "$W_SLOW" --seed "$s" --max-examples "$PER_SEED" -k "$p"; done
done
wait
: > "$OUT/runs.log"
reports=()
for n in "${runs[@]}"; do
  { echo "=== $n"; tail -n 25 "$W/$n.log"; } >> "$OUT/runs.log"
  [ -f "$W/$n/results.jsonl" ] && reports+=("$W/$n")
done
$py benchmarks/compact_journal.py "${reports[@]}" --out "$OUT/results.jsonl.gz" > "$OUT/table.md" 2>&1
cat "$OUT/table.md"
