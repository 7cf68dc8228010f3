#!/usr/bin/env bash
# The one script run on the lent GPU machine: environment, then each named step, logs under $OUT.
#   tools/gpu_check.sh STEP...   steps: info | sass BIN | test BIN [gtest args] | test-each BIN |
#                                       tests DIR | ctest | sanitize DIR OUTFILE | stress N
#     sanitize DIR OUTFILE: every GPU test binary under DIR under the four compute-sanitizer tools
#                           (reduced runs, $SANITIZE_SECONDS in all, default 480; $SANITIZE_TOOLS
#                           and $SANITIZE_BINARIES: fewer), and the sanitizer probe under racecheck;
#                           rows {binary, tool, errors, explained}
#     stress N:             issue 33's run/dump/bench sequence N times, stopping at the first failure
#                           (one bench with the library path the script was started with)
#                           ($MEGAMOE: the tool, default $BUILD/megamoe; $STRESS_STREAMS sequences at
#                           once, $STRESS_SECONDS a time limit; $STRESS_TREE: the source tree it
#                           was built from, default this script's checkout); $OUT/stress.json
#   tools/gpu_check.sh trees TREE...              builds each source tree (made by tools/ab_tree.sh DIR REV
#                                                 [PATCH...]) into TREE/build at once, the machine's cores
#                                                 shared: the megamoe tool and the layer bench ($TARGETS:
#                                                 more targets, `all` for the tests; $CMAKE_ARGS: e.g.
#                                                 -DMEGAMOE_FUSED_TRACE=ON) (last step)
#   tools/gpu_check.sh unpack PACK                 the trees packed by tools/pack_trees.sh (built on the CPU
#                                                 machine), unpacked where they were packed from; a tree whose
#                                                 megamoe does not start here is built here instead (`trees`)
#   tools/gpu_check.sh ab ROUNDS TREE... -- ARGS   `megamoe bench ARGS` from each tree's build, the trees
#                                                 taking turns ROUNDS times (same-run A/B); prints each
#                                                 tree's kernel-source digest (naming trees of one source),
#                                                 then graph µs per row and tree (min-max, median, ratio
#                                                 to the first tree) and the noise floor between trees
#                                                 of one source (tools/ab_summary.py); JSON in $OUT/ab
#                                                 (ab-2, ab-3, ... for a call's later A/Bs) (last step)
#   tools/gpu_check.sh trace TREE -- ARGS          `megamoe bench ARGS --schedule fused` from TREE's build (made
#                                                 by `trees` with CMAKE_ARGS=-DMEGAMOE_FUSED_TRACE=ON), each
#                                                 size's event log and the bench JSON in $OUT/trace, then
#                                                 tools/plot_trace.py on each log (last step)
#   tools/gpu_check.sh gemm-ab ROUNDS TREE... -- ARGS  `megamoe_gemm_bench ARGS` the same way; prints each
#                                                 row's TFLOP/s against same-shape plain FP8 per tree, and
#                                                 each tree's median per recipe and stage (last step)
#   tools/gpu_check.sh refresh TREE COMMIT [SERIES...]  the plain results files the README's tables read (one
#                                                 GPU: layer-*, gemm-decode, gemm-prefill-*), from TREE's build, named for
#                                                 this board and today, into $OUT/results with their "command" and
#                                                 "commit" as committed files carry them; SERIES picks some (layer-deepseek-v3
#                                                 layer-qwen3 layer-gpt-oss-fp8 layer-gpt-oss-fp8_fp4 layer-mixtral
#                                                 gemm-decode gemm-prefill-fp8 gemm-prefill-fp8_fp4) (last step)
#   tools/gpu_check.sh gemm-guard               a small GEMM benchmark (every recipe, 32 experts, 1 and 16 tokens
#                                                 per expert, then 1024, uniform) from $BUILD, checked against the
#                                                 committed results by tools/perf_guard.py: run it first in a session
#   tools/gpu_check.sh clocks CMD...             CMD with the SM clock and board power logged
#   tools/gpu_check.sh ncu NAME REGEX SKIP CMD...  one launch of a kernel, profiled, with tools/ncu_waits.py's
#                                                 summary of its mbarrier waits (last step: takes the rest)
# Binaries are built on this machine and carried with the call: copy the GPU test binaries, the
# megamoe tool and the benchmarks into an ignored folder (e.g. out/) and name it in `carry`; `megamoe bench`
# runs megamoe_layer_bench from beside the tool (or from its bench/layer/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The library path this script was started with: the stress step also runs the tool as a user
# would start it, without the venv's NCCL added below (the build must find its own NCCL).
STARTED_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
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

# Each TREE's BINARY (a path inside the tree) with ARGS and --out $AB_DIR/TREE-rROUND.json, the trees
# taking turns ROUNDS times: ab_rounds STEP ROUNDS BINARY TREE... -- ARGS (for tools/ab_results.py).
# AB_DIR is $OUT/ab, or $OUT/ab-2, -3, ... when an earlier A/B of the same call holds it (a call that
# runs the script several times had each A/B overwrite the one before).
ab_rounds() {
  local step=$1 rounds=$2 binary=$3 trees=() round tree
  shift 3
  while [ $# -gt 0 ] && [ "$1" != -- ]; do trees+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  AB_DIR="$OUT/ab"
  local next=2
  while compgen -G "$AB_DIR/*.json" >/dev/null; do AB_DIR="$OUT/ab-$next"; next=$((next + 1)); done
  mkdir -p "$AB_DIR"
  # Each tree's kernel sources, so that trees meant to differ but built from one source show at once.
  # AB_TREES and AB_SAME (TREE=TREE pairs of one source, by their files' names) are for the summary.
  local -A tree_of_digest=()
  local digest
  AB_TREES=() AB_SAME=()
  for tree in "${trees[@]}"; do
    digest=$(kernel_sources_digest "$tree")
    echo "$step: $tree kernel sources $digest${tree_of_digest[$digest]:+ (the same as ${tree_of_digest[$digest]})}"
    AB_TREES+=("$(basename "$tree")")
    [ -n "${tree_of_digest[$digest]:-}" ] && AB_SAME+=(--same "$(basename "${tree_of_digest[$digest]}")=$(basename "$tree")")
    tree_of_digest[$digest]=${tree_of_digest[$digest]:-$tree}
  done
  for round in $(seq 1 "$rounds"); do
    for tree in "${trees[@]}"; do
      local name; name=$(basename "$tree")-r$round
      timeout 300 "$tree/$binary" "$@" --out "$AB_DIR/$name.json" >"$AB_DIR/$name.log" 2>&1 ||
        { echo "$step: $name failed"; tail -5 "$AB_DIR/$name.log"; status=1; }
    done
  done
}

# A small GEMM run checked against the committed results (tools/perf_guard.py), so that a slower
# recipe shows on the day its kernel changed, not when someone next benchmarks it.
# The decode rows run first, in their own run: right after minutes of prefill at the board's power
# cap, fp8_fp4's decode rows (whose expansion is bound by the SM clock) read 0.6 of the HBM copy rate
# against 0.74 in a run of decode rows alone, and the guard flagged them.
step_gemm_guard() {
  local tokens
  for tokens in 1,16 1024; do
    timeout 300 "$BUILD/bench/gemm/megamoe_gemm_bench" --recipes fp8,fp8_fp4,bf16 --experts 32 --tokens $tokens \
      --routing uniform --out "$OUT/gemm_guard-$tokens.json" >>"$OUT/gemm_guard.log" 2>&1 ||
      { echo "gemm-guard: the benchmark failed"; tail -5 "$OUT/gemm_guard.log"; status=1; return; }
  done
  python3 tools/perf_guard.py "$OUT"/gemm_guard-*.json | tee "$OUT/gemm_guard.txt" | grep -E "REGRESSION|median|perf_guard"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
# The GEMM benchmark's same-run A/B: each tree's build/bench/gemm binary.
step_gemm_ab() {
  ab_rounds gemm-ab "$1" build/bench/gemm/megamoe_gemm_bench "${@:2}"
  python3 - "$AB_DIR" <<'SUMMARY'
import collections, glob, json, os, statistics, sys
ratios = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*.json'))):
    tree = os.path.basename(path)[:-5].rsplit('-r', 1)[0]
    for row in json.load(open(path)).get('rows', []):
        key = (row['recipe'], row['stage'], row['experts'], row['tokens_per_expert'], row['routing'])
        # Prefill rows: TFLOP/s over same-shape plain GEMM; decode rows: weight GB/s over the HBM copy rate.
        ratio = row.get('tflops_vs_dense_same_shape') or row.get('weight_gbps_vs_hbm_copy')
        if ratio is not None: ratios[key][tree].append(ratio)
for key in sorted(ratios, key=str):
    print(*key, ' | '.join(f'{tree} ' + ' '.join(f'{v:.3f}' for v in vs) for tree, vs in ratios[key].items()))
medians = collections.defaultdict(list)
for key, trees in ratios.items():
    for tree, vs in trees.items():
        medians[(tree, key[0], key[1])] += vs
for (tree, recipe, stage), vs in sorted(medians.items()):
    print(tree, recipe, stage, 'median', round(statistics.median(vs), 3), 'min', round(min(vs), 3))
SUMMARY
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

# Profiles launch SKIP (0-based) of the kernels whose demangled name (template arguments included,
# e.g. "grouped_gemm_kernel.*SwigluEpilogue" for an L1 GEMM) matches REGEX in CMD: the full section
# set with source correlation (NAME.ncu-rep), the headline metrics, and the SASS page with its
# stall samples (NAME.sass.csv).
step_ncu() {
  local name=$1 regex=$2 skip=$3; shift 3
  ncu --clock-control none --set full --import-source yes --kernel-name-base demangled -k "regex:$regex" \
    --launch-skip "$skip" --launch-count 1 \
    -f -o "$OUT/$name" "$@" >"$OUT/$name.ncu.log" 2>&1 || { tail -20 "$OUT/$name.ncu.log"; status=1; return; }
  # ncu exits 0 when no launch matched the filter.
  [ -f "$OUT/$name.ncu-rep" ] || { grep -E "==(WARNING|ERROR)==" "$OUT/$name.ncu.log" | head -5; status=1; return; }
  ncu -i "$OUT/$name.ncu-rep" --page details --csv >"$OUT/$name.details.csv" 2>/dev/null
  ncu -i "$OUT/$name.ncu-rep" --page raw --csv >"$OUT/$name.raw.csv" 2>/dev/null  # every metric: pipes, shared memory
  python3 "$(dirname "$0")/ncu_stalls.py" "$OUT/$name.raw.csv" || true  # why the warps were not issuing
  grep -E '"(Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Issue Slots Busy)"|[Tt]ensor' "$OUT/$name.details.csv" | cut -d, -f5- | head -20
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name.sass.csv" 2>&1 ||
    ncu -i "$OUT/$name.ncu-rep" --page source --csv >"$OUT/$name.sass.csv" 2>&1
  wc -c "$OUT/$name.sass.csv"
  python3 "$(dirname "$0")/ncu_waits.py" "$OUT/$name.sass.csv" || true  # where the warps wait
}

# The head of a results file (/work/shared/bench-results.md's format) up to the rows' opening bracket.
results_header() {
  local device
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | awk '{ name = $0; n++ } END { printf "%s x %d", name, n }')
  printf '{\n  "benchmark": "%s",\n  "commit": "%s",\n  "device": "%s",\n  "command": "%s",\n  "date": "%s",\n  "rows": [\n' \
    "$1" "${MEGAMOE_COMMIT:-unknown}" "$device" "$2" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}

# The GPU test binaries under DIR (a build folder, or a folder the binaries were copied into): those
# ctest labels gpu when DIR has a CTestTestfile.cmake, else every *_test.
gpu_test_binaries() {
  local dir=$1 names=""
  if [ -f "$dir/CTestTestfile.cmake" ]; then
    names=$(cd "$dir" && ctest -N -L gpu 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: *//p')
  fi
  local binary base
  while IFS= read -r binary; do
    base=$(basename "$binary")
    if [ -z "$names" ] || grep -q "^${base}\(_.*\)\?$" <<<"$names"; then echo "$binary"; fi
  done < <(find "$dir" -maxdepth 3 -type f -name '*_test' -perm -u+x | sort)
}

# Reduced runs under the sanitizers (which slow wgmma kernels 10-1000x; racecheck most): a GoogleTest
# filter per binary and tool, with MEGAMOE_TEST_QUICK=1 (small layer cases, few calls).
sanitize_filter() {
  local base=$1 tool=$2
  case $base in
    grouped_gemm_test)
      if [ "$tool" = memcheck ]; then echo '*TokenTile16*:*TokensOnMFromFortyRows*:*SplitKDecode*:*AllGroupsEmpty*'
      else echo '*TokenTile16Swiglu/*:*TokensOnMFromFortyRowsStore/*'; fi ;;
    layer_emulated_test)
      if [ "$tool" = memcheck ]; then echo '*EveryCase/2_ranks:*LateRank*'; else echo '*EveryCase/1_ranks'; fi ;;
    layer_process_test) echo '*EveryCase/1_gpus' ;;  # with sanitize_cases' few cases
    streamed_layer_gpu_test) echo '*/1_ranks:*Arguments*' ;;  # whole layers: one rank's calls
    streamed_process_test) echo '*/1_gpus' ;;  # forks a rank per GPU: one GPU's
    comm_emulated_test) echo '*/2ranks:EmulatedLauncher.*:-*10000Times*:*100Times*:*Timeout*' ;;
    # A communicator per case, which the tools make take 15-20 s: the buffer's creation and the
    # pulls through it; the other cases' kernels run in-process in comm_emulated_test.
    comm_process_test) echo '*BufferZeroedAtCreation/1gpus:*PullRowsBulkAndVector/1gpus' ;;
    # Consumers that spin on other ranks' producers: two ranks where the tool keeps streams concurrent
    # (memcheck, as layer_emulated_test), one rank under the others.
    front_ring_gpu_test)
      if [ "$tool" = memcheck ]; then echo '*/2_ranks:FrontRingGraph.*:FrontRingTimeouts.*:FrontRingArguments.*'
      else echo '*/1_ranks:FrontRingGraph.*:FrontRingArguments.*'; fi ;;
    *) echo '*' ;;
  esac
}

# The process layer test forks a rank process (and creates a communicator) per case and schedule,
# which the tools slow most: there it runs the three recipes' basic case and a refused call, which
# reach every kernel and the process path; the emulated test runs every case in-process.
sanitize_cases() {
  case $1 in
    layer_process_test) echo 'basic_shared,capacity_one_below' ;;
    *) echo '' ;;
  esac
}

# A binary's share of the step's time: the layer tests run whole layers, the others a few kernels.
sanitize_weight() {
  case $1 in
    layer_emulated_test|layer_process_test|streamed_layer_gpu_test|streamed_process_test) echo 4 ;;
    *) echo 1 ;;
  esac
}

# compute-sanitizer's reports in LOG, one record per "========= " line that starts a report; those from
# NCCL's own host-side probes at communicator creation (no kernel image for this device in
# ncclInitKernelsForDevice, cuMemCreate not permitted) are counted apart. Prints "ERRORS FILTERED".
count_reports() {
  awk '
    function close_record() { if (open) { if (nccl) filtered++; else errors++ } open = 0; nccl = 0 }
    /^========= [^ ]/ && !/ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER|LEAK SUMMARY/ { close_record(); open = 1 }
    /^========= *$/ { close_record() }
    open && (/ncclInitKernelsForDevice/ || (/cuMemCreate/ && /NOT_PERMITTED/)) { nccl = 1 }
    END { close_record(); printf "%d %d\n", errors, filtered }
  ' "$1"
}

# Every GPU test binary under DIR under memcheck, racecheck, synccheck and initcheck (reduced runs;
# $SANITIZE_TOOLS and $SANITIZE_BINARIES (a regex of names) pick fewer, so that one sweep can span
# several device calls); rows {binary, tool, errors, explained, filtered, exit, seconds} in OUTFILE.
# Runs that did not start within the step's $SANITIZE_SECONDS are rows with errors -1 and the reason
# in explained.
step_sanitize() {
  local dir=$1 outfile=$2 budget=${SANITIZE_SECONDS:-480} start=$SECONDS first=1
  local tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
  # The logs travel as one archive beside the JSON: the device machine returns at most 8 files.
  local logs="$OUT/sanitize-logs"
  mkdir -p "$logs"
  local binaries; mapfile -t binaries < <(gpu_test_binaries "$dir" | grep -E "/(${SANITIZE_BINARIES:-.*})$")
  if [ ${#binaries[@]} -eq 0 ]; then echo "sanitize: no GPU test binaries under $dir"; status=1; return; fi
  mkdir -p "$(dirname "$outfile")"
  results_header sanitizer "tools/gpu_check.sh sanitize $dir $outfile" >"$outfile"
  local binary tool weights_left=0
  for tool in $tools; do
    for binary in "${binaries[@]}"; do weights_left=$((weights_left + $(sanitize_weight "$(basename "$binary")"))); done
  done
  for tool in $tools; do
    for binary in "${binaries[@]}"; do
      local base; base=$(basename "$binary")
      local log="$logs/$tool-$base.log" errors=-1 filtered=0 rc=-1 explained="" took=0
      local left=$((budget - (SECONDS - start))) weight; weight=$(sanitize_weight "$base")
      # Each run may take twice its share of what is left (at least 15 s), so that a slow run cannot
      # starve the tools after it.
      local cap=$((2 * left * weight / weights_left))
      [ $cap -ge 15 ] || cap=15
      [ $cap -le $left ] || cap=$left
      weights_left=$((weights_left - weight))
      if [ $left -lt 10 ]; then
        explained="not run: the step's ${budget} s were spent"
      else
        local t0=$SECONDS
        MEGAMOE_TEST_QUICK=1 MEGAMOE_TIMEOUT_MS=120000 MEGAMOE_TEST_CASES=$(sanitize_cases "$base") timeout "$cap" \
          compute-sanitizer --tool "$tool" --target-processes all "$binary" --gtest_color=no \
          --gtest_filter="$(sanitize_filter "$base" "$tool")" >"$log" 2>&1
        rc=$?
        took=$((SECONDS - t0))
        read -r errors filtered < <(count_reports "$log")
        if [ $rc -eq 124 ]; then explained="timed out after ${took} s; reports until then counted"
        elif [ "$filtered" -gt 0 ]; then explained="$filtered NCCL host-side probe reports at communicator creation filtered"; fi
      fi
      printf '%s    {"binary": "%s", "tool": "%s", "errors": %d, "explained": "%s", "filtered": %d, "exit": %d, "seconds": %d}' \
        "$([ $first -eq 1 ] || echo ',')" "$base" "$tool" "$errors" "$explained" "$filtered" "$rc" "$took" >>"$outfile"
      printf '\n' >>"$outfile"
      first=0
      printf '%-10s %-22s errors %3d filtered %3d exit %4d %4d s %s\n' "$tool" "$base" "$errors" "$filtered" "$rc" \
        "$took" "$explained"
      if [ "$errors" -ne 0 ] || { [ $rc -ne 0 ] && [ $rc -ne 124 ]; }; then
        status=1
        grep -E "^========= [^ ]" "$log" | grep -vE "SUMMARY|COMPUTE-SANITIZER|NoKernelImageForDevice|cuMemCreate" | head -5
      fi
    done
  done
  # The probe's hand-overs are correct by construction and check their results: what racecheck
  # reports on them, it also reports on the kernels' same hand-overs without a race.
  local probe; probe=$(find "$dir" -maxdepth 3 -type f -name megamoe_sanitizer_probe -perm -u+x | head -1)
  if [ -n "$probe" ] && [[ " $tools " == *" racecheck "* ]]; then
    local log="$logs/racecheck-megamoe_sanitizer_probe.log" errors=-1 filtered=0 rc=-1 t0=$SECONDS
    timeout 60 compute-sanitizer --tool racecheck "$probe" >"$log" 2>&1
    rc=$?
    read -r errors filtered < <(count_reports "$log")
    local wrong; wrong=$(grep -c "WRONG" "$log")
    printf ',    {"binary": "megamoe_sanitizer_probe", "tool": "racecheck", "errors": %d, "explained": "%s", "filtered": %d, "exit": %d, "seconds": %d}\n' \
      "$errors" "reference hand-overs, each checking what it read ($wrong wrong); reports per kernel: $(grep -E "Race reported" "$log" | grep -oE "::[a-z_]+[(<]" | sort | uniq -c | tr -s ' ' | tr '\n' ';' | tr -d '(<:')" \
      "$filtered" "$rc" "$((SECONDS - t0))" >>"$outfile"
    echo "racecheck  megamoe_sanitizer_probe errors $errors ($wrong wrong)"
    [ "$wrong" -eq 0 ] && [ $rc -eq 0 ] || status=1
  fi
  printf '  ]\n}\n' >>"$outfile"
  tar czf "$OUT/sanitize-logs.tar.gz" -C "$logs" . && rm -rf "$logs"
  echo "wrote $outfile and $OUT/sanitize-logs.tar.gz"
}

# Prints where each GPU core file of a stream's failed run points (kernel, PC, exception), by cuda-gdb.
stress_core_report() {
  local core
  for core in "$OUT"/stress-core-"$1".*; do
    [ -f "$core" ] || continue
    ls -l "$core"
    command -v cuda-gdb >/dev/null || { echo "no cuda-gdb to read $core"; continue; }
    timeout 120 cuda-gdb -batch -ex "target cudacore $core" -ex "info cuda kernels" -ex "where" -ex "x/8i \$pc-64" \
      2>&1 | tail -40
  done
}

# The sequence that once ended in an illegal address (issue 33), reduced, N times; stops at the first
# failing command and prints its output. MEGAMOE: the tool (megamoe_layer_bench beside it or in its
# bench/layer/). STRESS_STREAMS=K runs K copies of the sequence at once, N in all (the GPU idles
# through most of one sequence's host work, so K streams do more runs per device second, and their
# kernels overlap each other's); STRESS_SECONDS: no stream starts a run that its longest run so far
# would carry past that long, so that a call's time limit still leaves the JSON. Each stream's count
# is in $OUT/stress-STREAM.result after every run, so a call killed by its limit still says what
# finished. Writes $OUT/stress.json, one row {runs, failures, streams, failed_command, first_failure}.
stress_stream() {  # STREAM RUNS END_SECONDS: one stream's runs; its result line in $OUT/stress-STREAM.result
  local stream=$1 n=$2 end=$3 megamoe=${MEGAMOE:-$BUILD/megamoe} run=0 failure="" failed_command=""
  local dump="$OUT/stress-dump-$stream" log="$OUT/stress-$stream.log"
  local commands=(
    "$megamoe run --preset deepseek-v3 --tokens 8 --ranks 2"
    "$megamoe run --preset tiny --tokens 300 --ranks 2 --backend gpu --dump $dump --recipe fp8"
    "$megamoe run --preset tiny --tokens 300 --ranks 2 --backend gpu --dump $dump --recipe bf16"
    "$megamoe run --preset tiny --tokens 300 --ranks 2 --backend gpu --dump $dump --recipe fp8_fp4"
    "$megamoe bench --preset deepseek-v3 --ranks 1 --tokens 1,8,128,512,2048,8192 --repeats 3
     --out $OUT/stress-bench-$stream.json"
    "env LD_LIBRARY_PATH=$STARTED_LD_LIBRARY_PATH $megamoe bench --preset deepseek-v3 --ranks 1 --tokens 1,8
     --repeats 1 --out $OUT/stress-bench-$stream.json"
  )
  # A GPU exception writes a small core file (kernel, PC and faulting address; no memory images) to
  # $OUT, for cuda-gdb: the one fault this step hunts left only a sticky error behind.
  local -x CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_COREDUMP_FILE="$OUT/stress-core-$stream.%p"
  local -x CUDA_COREDUMP_GENERATION_FLAGS=skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory
  CUDA_COREDUMP_GENERATION_FLAGS+=,skip_local_memory,skip_constbank_memory
  local longest=0 started
  printf '0\t\t\n' >"$OUT/stress-$stream.result"
  while [ $run -lt "$n" ] && [ -z "$failure" ] && [ $((SECONDS + longest)) -lt "$end" ]; do
    local command
    started=$SECONDS
    for command in "${commands[@]}"; do
      rm -rf "$dump"
      # shellcheck disable=SC2086  # each command is a word list
      timeout 300 $command >"$log" 2>&1
      local rc=$?
      if [ $rc -ne 0 ] || grep -qiE "illegal (memory )?address|cudaError|compute-sanitizer" "$log"; then
        failure="exit $rc: $(grep -iE "error|illegal" "$log" | head -1 | tr -d '"\134')"  # no quote or backslash in the JSON
        failed_command=$command
        echo "stress: stream $stream, run $((run + 1)) failed: $command"
        tail -30 "$log"
        stress_core_report "$stream"
        break
      fi
    done
    [ -n "$failure" ] || run=$((run + 1))
    [ $((SECONDS - started)) -le "$longest" ] || longest=$((SECONDS - started))
    printf '%d\t%s\t%s\n' "$run" "$failed_command" "$failure" >"$OUT/stress-$stream.result"
  done
  rm -rf "$dump" "$OUT/stress-bench-$stream.json"
  [ -n "$failure" ] || rm -f "$log"
}

# A digest of the sources the kernels compile from (src/ and include/ of DIR): runs with the same
# digest ran the same kernels, so a stress count may add up over calls and sessions.
kernel_sources_digest() {
  [ -d "$1/src" ] || { echo "no-sources-in-$1"; return; }
  (cd "$1" && find src include -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | LC_ALL=C sort |
    xargs sha256sum | sha256sum | cut -c1-16)
}

# GiB one stress stream may hold at once: the DeepSeek-V3 bench's weights (15 GB) and one rank's
# buffer and inputs at 8192 tokens. Four streams fit an H200; on an 80 GB H100 four ran out of memory.
STRESS_STREAM_GIB=34

step_stress() {
  local n=$1 streams=${STRESS_STREAMS:-1} end=$((SECONDS + ${STRESS_SECONDS:-1000000000})) stream
  local gib fit
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | awk '{print int($1 / 1024)}')
  fit=$((${gib:-0} / STRESS_STREAM_GIB))
  if [ "$fit" -ge 1 ] && [ "$streams" -gt "$fit" ]; then
    echo "stress: $streams streams asked for, $fit fit the GPU's $gib GiB: running $fit"
    streams=$fit
  fi
  for stream in $(seq 1 "$streams"); do
    stress_stream "$stream" $(((n + streams - stream) / streams)) "$end" &
  done
  wait
  local runs=0 failures=0 failed_command="" failure="" r c f
  for stream in $(seq 1 "$streams"); do
    IFS=$'\t' read -r r c f <"$OUT/stress-$stream.result"
    runs=$((runs + r))
    if [ -n "$c" ]; then failures=$((failures + 1)); failed_command=$c; failure=$f; fi
    rm -f "$OUT/stress-$stream.result"
  done
  echo "stress: $runs of $n runs passed in $streams stream(s)${failed_command:+; failed: $failed_command}"
  {
    results_header stress "tools/gpu_check.sh stress $n (STRESS_STREAMS=$streams)"
    local row='    {"runs": %d, "failures": %d, "streams": %d, "kernel_sources": "%s", "failed_command": "%s", '
    printf "$row"'"first_failure": "%s"}\n  ]\n}\n' \
      "$runs" "$failures" "$streams" "$(kernel_sources_digest "${STRESS_TREE:-$(dirname "$0")/..}")" "$failed_command" "$failure"
  } >"$OUT/stress.json"
  [ "$failures" -eq 0 ] || status=1
}

# Unpacks tools/pack_trees.sh's trees where they were packed from; builds here (step_trees, with the
# targets they were packed with) only those whose megamoe does not start on this machine.
step_unpack() {
  local pack=$1 tree rebuild=()
  local -a trees
  mapfile -t trees < <(tar tJf "$pack" | sed -n 's#/build/packed.targets$##p')
  [ ${#trees[@]} -gt 0 ] || { echo "unpack: no trees in $pack"; status=1; return; }
  tar xJf "$pack" || { echo "unpack: $pack does not unpack"; status=1; return; }
  for tree in "${trees[@]}"; do
    if "$tree/build/megamoe" --help >/dev/null 2>&1; then
      echo "unpack: $tree runs as packed"
    else
      echo "unpack: $tree/build/megamoe does not start here; building the tree here"
      "$tree/build/megamoe" --help 2>&1 | head -3
      rebuild+=("$tree")
    fi
  done
  [ ${#rebuild[@]} -eq 0 ] && return
  local targets; targets=$(cat "${rebuild[0]}/build/packed.targets")
  for tree in "${rebuild[@]}"; do rm -rf "$tree/build"; done
  TARGETS=$targets step_trees "${rebuild[@]}"
}

# Builds every source tree at once into TREE/build, the cores shared; TREE/build.log has the output.
step_trees() {
  local jobs=$(( $(nproc) / $# )) tree
  [ $jobs -ge 1 ] || jobs=1
  for tree in "$@"; do
    rm -f "$tree/build.ok"
    # shellcheck disable=SC2086  # CMAKE_ARGS and TARGETS are word lists
    ( cd "$tree" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_TSAN=OFF ${CMAKE_ARGS:-} \
        >build.log 2>&1 &&
      cmake --build build -j"$jobs" --target megamoe megamoe_layer_bench ${TARGETS:-} >>build.log 2>&1 &&
      touch build.ok ) &
  done
  wait
  for tree in "$@"; do
    [ -f "$tree/build.ok" ] || { echo "trees: $tree failed to build"; tail -20 "$tree/build.log"; status=1; }
  done
}

# Same-run A/B of the layer: ROUNDS x every tree's `megamoe bench ARGS`, the trees taking turns so
# that the board's clock and power state fall on all of them alike.
step_ab() {
  local rounds=$1 trees=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do trees+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  ab_rounds ab "$rounds" build/megamoe "${trees[@]}" -- bench "$@"
  python3 "$(dirname "$0")/ab_summary.py" "$AB_DIR" --order "${AB_TREES[@]}" "${AB_SAME[@]}" || status=1
}

# The one-GPU results files behind the README's tables, re-run from one tree's build, each with the
# command it would carry when run from the repository root, so a refresh is one step on the day's board.
step_refresh() {
  local tree=$1 commit=$2 series
  shift 2
  local all=(layer-deepseek-v3 layer-qwen3 layer-gpt-oss-fp8 layer-gpt-oss-fp8_fp4 layer-mixtral
             gemm-decode gemm-prefill-fp8 gemm-prefill-fp8_fp4)
  [ $# -gt 0 ] && all=("$@")
  local board=1xh100 day; day=$(date -u +%F)
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H200 && board=1xh200
  mkdir -p "$OUT/results"
  local layer="--ranks 1 --tokens 1,8,128,512,2048,8192 --repeats 5"
  for series in "${all[@]}"; do
    local args name
    case $series in
      layer-deepseek-v3) args="bench --preset deepseek-v3 $layer"; name=layer-$board-$day ;;
      layer-qwen3) args="bench --preset qwen3-235b-a22b --recipe fp8 $layer"; name=layer-qwen3-235b-a22b-fp8-$board-$day ;;
      layer-gpt-oss-fp8) args="bench --preset gpt-oss-120b --recipe fp8 $layer"; name=layer-gpt-oss-120b-fp8-$board-$day ;;
      layer-gpt-oss-fp8_fp4) args="bench --preset gpt-oss-120b --recipe fp8_fp4 $layer"; name=layer-gpt-oss-120b-fp8_fp4-$board-$day ;;
      layer-mixtral) args="bench --preset mixtral-8x7b --recipe bf16 ${layer/,8192/}"; name=layer-mixtral-8x7b-bf16-$board-$day ;;
      gemm-decode) name=gemm-decode-$board-$day
        args="--recipes fp8_fp4,fp8 --experts 32,128 --tokens 1,4,16 --routing uniform,random,skewed" ;;
      gemm-prefill-fp8) name=gemm-prefill-fp8-$board-$day
        args="--recipes fp8 --experts 32,128 --tokens 1024,4096 --routing uniform,random" ;;
      gemm-prefill-fp8_fp4) name=gemm-prefill-fp8_fp4-$board-$day
        args="--recipes fp8_fp4 --experts 32,128 --tokens 1024,4096 --routing uniform,random,skewed" ;;
      *) echo "refresh: unknown series $series"; status=1; continue ;;
    esac
    local tool=megamoe binary=$tree/build/megamoe
    [[ $series == gemm-* ]] && tool=megamoe_gemm_bench binary=$tree/build/bench/gemm/megamoe_gemm_bench
    local file=$OUT/results/$name.json
    # shellcheck disable=SC2086  # args are words
    if ! timeout 540 "$binary" $args --out "$file" >"$OUT/results/$name.log" 2>&1; then
      echo "refresh: $series failed"; tail -5 "$OUT/results/$name.log"; status=1; continue
    fi
    python3 - "$file" "$tool $args --out bench/results/$name.json" "$commit" <<'FIX'
import json, sys
path, command, commit = sys.argv[1:]
data = json.load(open(path))
data["command"], data["commit"] = command, commit
json.dump(data, open(path, "w"), indent=1)
FIX
    echo "refresh: $name.json"
  done
}

# The directory and the results file are made here: a trace run missing either stops at once.
step_trace() {
  local tree=$1
  shift
  [ "${1:-}" = -- ] && shift
  mkdir -p "$OUT/trace"
  if ! "$tree/build/megamoe" bench "$@" --schedule fused --trace "$OUT/trace" --out "$OUT/trace/bench.json" \
      >"$OUT/trace/bench.log" 2>&1; then
    echo "trace: megamoe bench failed:"; tail -5 "$OUT/trace/bench.log"; status=1; return
  fi
  for log in "$OUT"/trace/trace-*.json; do
    [ -e "$log" ] || { echo "trace: no event log written"; status=1; return; }
    python3 "$(dirname "$0")/plot_trace.py" "$log" || status=1
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
    sanitize) step_sanitize "$1" "$2"; shift 2 ;;
    stress) step_stress "$1"; shift ;;
    trees) step_trees "$@"; shift $# ;;
    unpack) step_unpack "$1"; shift ;;
    ab) step_ab "$@"; shift $# ;;
    trace) step_trace "$@"; shift $# ;;
    refresh) step_refresh "$@"; shift $# ;;
    gemm-guard) step_gemm_guard ;;
    gemm-ab) step_gemm_ab "$@"; shift $# ;;
    clocks) step_clocks "$@"; shift $# ;;
    ncu) step_ncu "$@"; shift $# ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
