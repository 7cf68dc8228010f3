#!/usr/bin/env bash
# The one script run on the lent GPU machine: environment, then each named step, logs under $OUT.
#   tools/gpu_check.sh STEP...   steps: info | sass BIN | test BIN [gtest args] | test-each BIN |
#                                       tests DIR | ctest
# Binaries are built on this machine and carried with the call: copy the GPU test binaries, the
# megamoe tool and the benchmarks into an ignored folder (e.g. out/) and name it in `carry`.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_ROOT=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
if [ -n "$NCCL_ROOT" ]; then export LD_LIBRARY_PATH="$NCCL_ROOT/lib:${LD_LIBRARY_PATH:-}"; fi
OUT=${OUT:-/tmp/megamoe-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
status=0

step_info() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
}

step_sass() {  # instruction mix of a binary's kernels: proves wgmma (QGMMA/HGMMA) and setmaxnreg are there
  cuobjdump --dump-sass "$1" | grep -oE "QGMMA[.A-Z0-9x]*|HGMMA[.A-Z0-9x]*|USETMAXREG[.A-Z0-9]*|UTMALDG[.A-Z0-9]*|LDL|STL" |
    sort | uniq -c
}

step_test() {
  local binary=$1; shift
  local name; name=$(basename "$binary")
  timeout 540 "$binary" --gtest_color=no "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |normalized error|Failure|error|random seed" "$OUT/$name.log" | tail -40
  echo "$name exit $rc"
  [ $rc -eq 0 ] || status=1
}

# Each test of a GoogleTest binary in its own process (a fault in one cannot hide the others); the
# first failing one runs again under compute-sanitizer.
step_test_each() {
  local binary=$1 name; name=$(basename "$binary")
  local sanitized=0
  for test in $("$binary" --gtest_list_tests | awk '/^[^ ]/{suite=$1} /^  /{print suite $1}'); do
    timeout 300 "$binary" --gtest_color=no --gtest_filter="$test" >"$OUT/one.log" 2>&1
    local rc=$?
    cat "$OUT/one.log" >>"$OUT/$name.log"
    if [ $rc -eq 0 ]; then echo "ok   $test"; else
      status=1; echo "FAIL $test (exit $rc)"
      grep -E "Failure|error|Expected|Which is|exception" "$OUT/one.log" | head -8
      if [ $sanitized -eq 0 ]; then
        sanitized=1
        timeout 300 compute-sanitizer --tool memcheck "$binary" --gtest_filter="$test" >"$OUT/$name.sanitizer.log" 2>&1
        grep -vE "^\[|^$|Running main" "$OUT/$name.sanitizer.log" | head -40
      fi
    fi
  done
}

while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    info) step_info ;;
    sass) step_sass "$1"; shift ;;
    test) bin=$1; shift; args=(); while [ $# -gt 0 ] && [[ $1 == --gtest* ]]; do args+=("$1"); shift; done
          step_test "$bin" "${args[@]}" ;;
    test-each) step_test_each "$1"; shift ;;
    tests) for binary in "$1"/*_test; do step_test "$binary"; done; shift ;;
    ctest) (cd "$BUILD" && timeout 560 ctest -L gpu --output-on-failure >"$OUT/ctest.log" 2>&1); rc=$?
           tail -30 "$OUT/ctest.log"; [ $rc -eq 0 ] || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
