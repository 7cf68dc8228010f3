#!/usr/bin/env bash
# The one script run on the lent GPU machine: environment, then each named step, logs under $OUT.
#   tools/gpu_check.sh STEP...   steps: info | sass BIN | test BIN [gtest args] | test-each BIN |
#                                       tests DIR | ctest
#   tools/gpu_check.sh clocks CMD...             CMD with the SM clock and board power logged
#   tools/gpu_check.sh ncu NAME REGEX SKIP CMD...  one launch of a kernel, profiled (last step: takes the rest)
# Binaries are built on this machine and carried with the call: copy the GPU test binaries, the
# megamoe tool and the benchmarks into an ignored folder (e.g. out/) and name it in `carry`; `megamoe bench`
# runs megamoe_layer_bench from beside the tool (or from its bench/layer/).
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

# Runs a command while nvidia-smi logs the SM clock, power and throttle reasons every 100 ms
# (clocks.csv); its output lines get timestamps, so rows can be matched to the clocks they ran at.
step_clocks() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 100 >"$OUT/clocks.csv" 2>&1 &
  local logger=$!
  "$@" 2>&1 | while IFS= read -r line; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $line"; done | tee "$OUT/clocked.log"
  kill $logger 2>/dev/null
  awk -F', ' '{ split($2, c, " "); split($3, p, " "); print c[1], p[1] }' "$OUT/clocks.csv" | sort -n |
    awk '{ clock[NR] = $1; power += $2 } END { if (NR) printf "SM clock MHz min %d median %d max %d, mean power %.0f W over %d samples\n", clock[1], clock[int((NR + 1) / 2)], clock[NR], power / NR, NR }'
}

# Profiles launch SKIP (0-based) of the kernels whose name matches REGEX in CMD: the full section
# set with source correlation (NAME.ncu-rep), the headline metrics, and the SASS page with its
# stall samples (NAME.sass.csv).
step_ncu() {
  local name=$1 regex=$2 skip=$3; shift 3
  ncu --clock-control none --set full --import-source yes -k "regex:$regex" --launch-skip "$skip" --launch-count 1 \
    -f -o "$OUT/$name" "$@" >"$OUT/$name.ncu.log" 2>&1 || { tail -20 "$OUT/$name.ncu.log"; status=1; return; }
  ncu -i "$OUT/$name.ncu-rep" --page details --csv 2>/dev/null |
    grep -E '"(Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Issue Slots Busy)"|[Tt]ensor' | cut -d, -f5- | head -20
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name.sass.csv" 2>&1 ||
    ncu -i "$OUT/$name.ncu-rep" --page source --csv >"$OUT/$name.sass.csv" 2>&1
  wc -c "$OUT/$name.sass.csv"
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
    clocks) step_clocks "$@"; shift $# ;;
    ncu) step_ncu "$@"; shift $# ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
