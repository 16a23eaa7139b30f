#!/usr/bin/env bash
# FlashAttention-4 onto a GPU machine that has no network and takes at most 64 MiB per call.
# Its CuTe-DSL library wheel (nvidia-cutlass-dsl-libs-cu13, 92 MB) travels in two halves, in two
# consecutive calls to the same (warm) machine, which keeps /tmp between them:
#   here:                bash benchmarks/fa4_wheels.sh prepare     # .whl1/ (half 1 + the small wheels), .whl2/ (half 2)
#   call 1 (carry .whl1): bash benchmarks/fa4_wheels.sh stash       # .whl1/* -> /tmp/fa4w
#   call 2 (carry .whl2): source benchmarks/fa4_wheels.sh install   # join, check SHA-256, pip --target /tmp/site, PYTHONPATH
# .whl1/ and .whl2/ must be git-ignored (e.g. echo /.whl1/ >> .git/info/exclude).
set -u
W=/tmp/fa4w
LIBS=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
case "${1:-}" in
prepare)
  rm -rf .whl1 .whl2 && mkdir -p .whl1 .whl2 "$W.dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$W.dl" \
    flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 || exit 1
  for f in "$W.dl"/*.whl; do [ "$(basename "$f")" = "$LIBS" ] || cp "$f" .whl1/; done
  sha256sum "$W.dl/$LIBS" | cut -d' ' -f1 > .whl2/libs.sha256
  split -b 46000000 -d "$W.dl/$LIBS" .whl1/libs.part && mv .whl1/libs.part01 .whl2/
  # each call carries the tracked tree too (11.6 MB): half 1 goes under 64 MiB with tvm-ffi in half 2
  mv .whl1/apache_tvm_ffi-*.whl .whl2/
  du -sh .whl1 .whl2 ;;
stash)
  mkdir -p "$W" && cp .whl1/* "$W"/ && ls "$W" ;;
install)
  [ -f "$W/libs.part00" ] || { echo "no half 1 in $W: the machine was not the one of the stash call"; return 3 2>/dev/null || exit 3; }
  cp .whl2/* "$W"/ && cat "$W/libs.part00" "$W/libs.part01" > "$W/$LIBS"
  [ "$(sha256sum "$W/$LIBS" | cut -d' ' -f1)" = "$(cat "$W/libs.sha256")" ] || { echo "SHA-256 mismatch"; return 4 2>/dev/null || exit 4; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl \
    || { echo "pip install failed (the wheels are for CPython 3.12 on x86-64)"; return 5 2>/dev/null || exit 5; }
  # pip --target does not run nvidia_cutlass_dsl's .pth file, which puts dsl_packages on sys.path
  export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;;
*)
  echo "usage: bash benchmarks/fa4_wheels.sh prepare|stash, or: source benchmarks/fa4_wheels.sh install"; exit 2 ;;
esac
