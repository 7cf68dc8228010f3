#!/usr/bin/env bash
# tools/gpu_check.sh's trace and ab steps on stand-in megamoe tools:
#   trace: the event logs' directory and the results file are made for the run, each log is
#          summarized, and a failed run or one that wrote no log fails the step;
#   ab:    each tree's rounds, medians against the first tree, and the noise floor between the two
#          trees built from one source; a second A/B into the same OUT goes to ab-2;
#   pack_trees/unpack: what is packed and left out, a tree kept as packed, one built again;
#   stress: the sequence runs, one bench with the library path the script was started with (as a
#          user starts the tool), and a failing run stops the step and is named.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "gpu_check_steps_test: $*" >&2; exit 1; }

# A stand-in for a traced build's megamoe: checks that --trace names an existing folder and --out is
# given, then writes one small event log there (a send unit and a routed L1 unit on CTA 0).
mkdir -p "$work/tree/build"
cat >"$work/tree/build/megamoe" <<'FAKE'
#!/usr/bin/env bash
trace="" out=""
while [ $# -gt 0 ]; do
  case $1 in --trace) trace=$2; shift ;; --out) out=$2; shift ;; esac
  shift
done
[ -d "$trace" ] && [ -n "$out" ] || { echo "fake megamoe: --trace DIR and --out FILE needed" >&2; exit 2; }
[ -n "${FAKE_NO_LOG:-}" ] || echo '{"tokens": 8, "rank": 0, "events": [[0, 1, 0, 0, 1000], [0, 1, 0, 2, 5000], [0, 2, 3, 0, 5000], [0, 2, 3, 1, 6000], [0, 2, 3, 2, 9000]]}' >"$trace/trace-8-r0.json"
echo '{"rows": []}' >"$out"
FAKE
chmod +x "$work/tree/build/megamoe"

OUT="$work/ok" bash "$repo/tools/gpu_check.sh" trace "$work/tree" -- --preset tiny --tokens 8 >"$work/ok.log" 2>&1 ||
  { cat "$work/ok.log"; fail "a traced run that wrote its log failed the step"; }
[ -s "$work/ok/trace/bench.json" ] || fail "no results file"
grep -q "routed L1" "$work/ok.log" || { cat "$work/ok.log"; fail "the log was not summarized"; }

if FAKE_NO_LOG=1 OUT="$work/none" bash "$repo/tools/gpu_check.sh" trace "$work/tree" -- --preset tiny >"$work/none.log" 2>&1; then
  fail "a run that wrote no event log passed"
fi
grep -q "no event log" "$work/none.log" || fail "the missing log was not named"

printf '#!/usr/bin/env bash\necho "bench: bad argument" >&2; exit 1\n' >"$work/tree/build/megamoe"
if OUT="$work/bad" bash "$repo/tools/gpu_check.sh" trace "$work/tree" -- --preset tiny >"$work/bad.log" 2>&1; then
  fail "a failed bench run passed"
fi
grep -q "bad argument" "$work/bad.log" || fail "the failed run's message was not shown"
# ab: trees "base" and "again" hold one source, "other" another; each tool reports its GRAPH_US.
for tree in base again other; do
  mkdir -p "$work/$tree/build" "$work/$tree/src"
  echo "one source" >"$work/$tree/src/kernel.cu"
  cat >"$work/$tree/build/megamoe" <<FAKE
#!/usr/bin/env bash
out=""
while [ \$# -gt 0 ]; do [ "\$1" = --out ] && out=\$2; shift; done
echo '{"rows": [{"preset": "tiny", "recipe": "fp8", "tokens_per_rank": 8, "schedule": "fused", "graph_us": GRAPH_US}]}' >"\$out"
FAKE
  chmod +x "$work/$tree/build/megamoe"
done
echo "another source" >"$work/other/src/kernel.cu"
sed -i 's/GRAPH_US/100/' "$work/base/build/megamoe"
sed -i 's/GRAPH_US/102/' "$work/again/build/megamoe"
sed -i 's/GRAPH_US/90/' "$work/other/build/megamoe"
OUT="$work/ab" bash "$repo/tools/gpu_check.sh" ab 2 "$work/base" "$work/other" "$work/again" -- --preset tiny \
  >"$work/ab.log" 2>&1 || { cat "$work/ab.log"; fail "the ab step failed"; }
[ "$(ls "$work/ab/ab"/*.json | wc -l)" -eq 6 ] || fail "not two rounds of three trees"
grep -q "again kernel sources .* (the same as $work/base)" "$work/ab.log" || { cat "$work/ab.log"; fail "one source not named"; }
grep -q "tiny fp8 8 fused | base 100.0-100.0 (median 100.0) | other 90.0-90.0 (median 90.0, 0.900x) | again 102.0-102.0 (median 102.0, 1.020x)" \
  "$work/ab.log" || { cat "$work/ab.log"; fail "the row's summary is not the trees' medians and ratios in order"; }
grep -q "noise floor (again against base, one source): medians differ by up to 2.0% over 1 rows" "$work/ab.log" ||
  { cat "$work/ab.log"; fail "no noise floor"; }
# A second A/B into the same OUT (a call that runs the script again) keeps the first one's files.
OUT="$work/ab" bash "$repo/tools/gpu_check.sh" ab 1 "$work/other" "$work/base" -- --preset tiny >"$work/ab2.log" 2>&1 ||
  { cat "$work/ab2.log"; fail "the second ab step failed"; }
[ "$(ls "$work/ab/ab"/*.json | wc -l)" -eq 6 ] || fail "the second A/B overwrote the first one's files"
[ "$(ls "$work/ab/ab-2"/*.json | wc -l)" -eq 2 ] || fail "the second A/B's files are not in ab-2"
grep -q "tiny fp8 8 fused | other 90.0-90.0 (median 90.0) | base 100.0-100.0 (median 100.0, 1.111x)" "$work/ab2.log" ||
  { cat "$work/ab2.log"; fail "the second A/B's summary did not read its own files"; }
# stress: a stand-in tool that logs each bench's LD_LIBRARY_PATH, and fails when told to.
mkdir -p "$work/stress/src"
cat >"$work/stress/megamoe" <<FAKE
#!/usr/bin/env bash
[ "\$1" = bench ] && echo "\${LD_LIBRARY_PATH:-}" >>"$work/stress/paths"
[ -z "\${FAKE_FAULT:-}" ] || { echo "rank 0: status failed: cudaErrorIllegalAddress: an illegal memory access was encountered"; exit 1; }
[ -z "\${FAKE_SLEEP:-}" ] || sleep "\$FAKE_SLEEP"
exit 0
FAKE
chmod +x "$work/stress/megamoe"
LD_LIBRARY_PATH=/started/lib OUT="$work/stress/out" MEGAMOE="$work/stress/megamoe" STRESS_TREE="$work/stress" \
  bash "$repo/tools/gpu_check.sh" stress 2 >"$work/stress.log" 2>&1 || { cat "$work/stress.log"; fail "the stress step failed"; }
grep -q '"runs": 2, "failures": 0' "$work/stress/out/stress.json" || { cat "$work/stress/out/stress.json"; fail "not two clean runs"; }
[ "$(grep -cx "/started/lib" "$work/stress/paths")" -ge 2 ] || { cat "$work/stress/paths"; fail "no bench ran with the started library path"; }
if FAKE_FAULT=1 OUT="$work/stress/bad" MEGAMOE="$work/stress/megamoe" STRESS_TREE="$work/stress" \
    bash "$repo/tools/gpu_check.sh" stress 2 >"$work/stress-bad.log" 2>&1; then
  fail "a faulting run passed the stress step"
fi
grep -q '"runs": 0, "failures": 1' "$work/stress/bad/stress.json" || { cat "$work/stress/bad/stress.json"; fail "the fault was not counted"; }
# A run takes 3 s (six commands of 0.5 s); with 4 s allowed, a second run would end past them: one run.
FAKE_SLEEP=0.5 STRESS_SECONDS=4 OUT="$work/stress/timed" MEGAMOE="$work/stress/megamoe" STRESS_TREE="$work/stress" \
  bash "$repo/tools/gpu_check.sh" stress 5 >"$work/stress-timed.log" 2>&1 || { cat "$work/stress-timed.log"; fail "the timed stress step failed"; }
grep -q '"runs": 1, "failures": 0' "$work/stress/timed/stress.json" ||
  { cat "$work/stress/timed/stress.json"; fail "a run was started that could not end within STRESS_SECONDS"; }
# pack_trees + unpack: trees packed here (already built: --no-build) unpack where they were packed
# from, without build logs, docs or results; a tree whose megamoe starts is kept as packed, and one
# whose megamoe does not start is built again (here it has no CMakeLists.txt, so that build fails).
mkdir -p "$work/pack/out" && cd "$work/pack"
for tree in good broken; do
  mkdir -p "out/$tree/build/tests" "out/$tree/src" "out/$tree/docs" "out/$tree/bench/results" "out/$tree/bench/layer"
  echo "kernel" >"out/$tree/src/kernel.cu"
  echo "log" >"out/$tree/docs/notes.md"
  echo "{}" >"out/$tree/bench/results/old.json"
  echo "bench source" >"out/$tree/bench/layer/bench.cpp"
  echo "log" >"out/$tree/build.log"
  printf '#!/usr/bin/env bash\nexit 0\n' >"out/$tree/build/megamoe"
  printf '#!/usr/bin/env bash\nexit 0\n' >"out/$tree/build/tests/one_test"
  echo "object" >"out/$tree/build/kernel.o"
  chmod +x "out/$tree/build/megamoe" "out/$tree/build/tests/one_test"
done
printf '#!/usr/bin/env bash\necho "libwhatever.so: cannot open shared object file" >&2; exit 127\n' >out/broken/build/megamoe
TARGETS=one_test bash "$repo/tools/pack_trees.sh" --no-build pack.tar.xz out/good out/broken >pack.log 2>&1 ||
  { cat pack.log; fail "pack_trees failed"; }
listing=$(tar tJf pack.tar.xz)
for expected in out/good/build/megamoe out/good/build/tests/one_test out/good/src/kernel.cu out/good/bench/layer/bench.cpp \
    out/broken/build/packed.targets; do
  grep -qx "$expected" <<<"$listing" || fail "$expected not packed"
done
for unwanted in out/good/docs/notes.md out/good/bench/results/old.json out/good/build.log out/good/build/kernel.o; do
  ! grep -qx "$unwanted" <<<"$listing" || fail "$unwanted packed"
done
if TARGETS=missing_test bash "$repo/tools/pack_trees.sh" --no-build bad.tar.xz out/good >bad.log 2>&1; then
  fail "a target without an executable was packed"
fi
grep -q "no executable missing_test" bad.log || { cat bad.log; fail "the missing target was not named"; }
mkdir -p "$work/device/out" && cd "$work/device"
cp "$work/pack/pack.tar.xz" .
if OUT="$work/device/log" bash "$repo/tools/gpu_check.sh" unpack pack.tar.xz >unpack.log 2>&1; then
  cat unpack.log; fail "a tree that could not be built again passed unpack"
fi
grep -q "unpack: out/good runs as packed" unpack.log || { cat unpack.log; fail "the good tree not kept as packed"; }
grep -q "unpack: out/broken/build/megamoe does not start here; building the tree here" unpack.log ||
  { cat unpack.log; fail "the broken tree not named"; }
grep -q "cannot open shared object file" unpack.log || { cat unpack.log; fail "why it does not start was not shown"; }
grep -q "trees: out/broken failed to build" unpack.log || { cat unpack.log; fail "the broken tree was not built again"; }
[ -x out/good/build/tests/one_test ] || fail "the good tree's test binary was not unpacked"
cd "$repo"
echo "gpu_check_steps_test: passed"
