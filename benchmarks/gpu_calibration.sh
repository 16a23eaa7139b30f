#!/usr/bin/env bash
# On a GPU machine: calibration of every SDPA backend and naive, one process per adapter x dtype,
# plus the wrong-answer rejection tests on cuda. Results in $1 (default /tmp/gpucal).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
R=${1:-/tmp/gpucal}; N=${N:-1000}; mkdir -p $R
for a in ${ADAPTERS:-naive sdpa-math sdpa-flash sdpa-efficient sdpa-cudnn sdpa triton}; do
  for dt in float32 float16 bfloat16; do
    timeout $(( ${T:-260} + 60 )) python3 benchmarks/calibrate_tolerances.py --adapters $a --dtypes $dt --n $N --seed ${SEED:-0} --budget-s ${T:-260} \
      --json $R/cal_${a}_$dt.json > $R/cal_${a}_$dt.log 2>&1 &
  done
done
(python3 -m pytest --version >/dev/null 2>&1 && timeout 250 python3 -m pytest -q -p no:cacheprovider \
   tests/test_tolerances.py -k "rejects and cuda" > $R/wrong_cuda.log 2>&1) &
wait
grep -h "cases\|false" $R/cal_*.log; tail -n 3 $R/wrong_cuda.log
