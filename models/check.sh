#!/usr/bin/env bash
# Model-checks the streaming front-ring protocol (models/streaming.pml, docs/streaming.md) with spin.
# Every launch schedule and call plan of the real protocol must pass an exhaustive search (no
# assertion violation, no invalid end state, no cycle), and every mutant must be rejected for the
# reason it exists. Exits 0 only then. Needs spin and a C compiler (tools/setup.sh --tests installs spin).
#
#   models/check.sh           the full check: exhaustive searches, cycle checks (minutes)
#   models/check.sh --quick   the default test's check (under 30 s): every mutant rejected (exhaustive),
#                             the real protocol's free schedule searched to depth 120 (a bounded
#                             search: no violation within that depth); no other schedules, no cycles
set -euo pipefail
quick=0
if [[ ${1:-} == --quick ]]; then quick=1; shift; fi
[[ $# -eq 0 ]] || { echo "usage: models/check.sh [--quick]"; exit 2; }
source "$(dirname "$0")/spin_workdir.sh"
spin_workdir models/check.sh streaming.pml

# Search limits: a search that hits one of them is a failure, never a pass. State vectors are
# stored compressed (COLLAPSE), so the largest search stays under 1 GB.
depth=20000
memory_mb=2048
full_depth=$depth
optimize=-O2
if ((quick)); then depth=120; optimize=-O0; fi
failures=0

# run NAME EXPECT PLAN [FLAGS...]
#   EXPECT: pass; cycles (pass, searching for cycles instead of safety violations); assertion
#   (rejected by an assertion: invalid end states are not reported, so the search goes on to the
#   safety violation); deadlock (rejected by an invalid end state: assertions are ignored).
#   PLAN: source 1's three calls, "a b c" (0 = no tokens, else a chunk count).
run() {
  local name=$1 expect=$2 plan=$3
  shift 3
  local a b c
  read -r a b c <<<"$plan"
  local flags=("$@" "-DRANK1_CALL0=$a" "-DRANK1_CALL1=$b" "-DRANK1_CALL2=$c")
  local search_depth=$depth
  [[ $name == mutant_* ]] && search_depth=$full_depth  # counterexamples lie deeper than the quick depth
  local compile=(-DSAFETY) pan_args=(-m$search_depth)
  case $expect in
    cycles) compile=(-DNP); pan_args+=(-l); expect=pass ;;
    assertion) pan_args+=(-E) ;;
    deadlock) pan_args+=(-A) ;;
  esac
  spin -a "${flags[@]}" streaming.pml >/dev/null
  cc $optimize -w "${compile[@]}" -DCOLLAPSE -DMEMLIM=$memory_mb -o pan pan.c

  local log="$name.log" start end
  start=$(date +%s.%N)
  ./pan "${pan_args[@]}" >"$log" 2>&1 || true
  end=$(date +%s.%N)
  local states errors seconds verdict
  states=$(awk '/states, stored/ {print $1; exit}' "$log")
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$log" | head -1)
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
  if grep -q -e "MEMLIM" -e "out of memory" "$log" || { ((!quick)) && grep -q "max search depth too small" "$log"; }; then
    verdict="FAIL (search truncated)"
  elif [[ -z $errors ]]; then
    verdict="FAIL (no verdict from pan)"
  elif [[ $expect == pass ]]; then
    if [[ $errors != 0 ]]; then verdict="FAIL (errors: $errors)"
    elif grep -q "max search depth too small" "$log"; then verdict="ok to depth $search_depth"
    else verdict=ok; fi
  elif [[ $expect == assertion ]]; then
    if grep -q "assertion violated" "$log"; then verdict="rejected (assertion)"; else verdict="FAIL (not rejected)"; fi
  else
    if grep -q "invalid end state" "$log"; then verdict="rejected (deadlock)"; else verdict="FAIL (not rejected)"; fi
  fi
  printf '%-46s %10s states %6ss  %s\n' "$name" "${states:-?}" "$seconds" "$verdict"
  if [[ $verdict == FAIL* ]]; then
    failures=$((failures + 1))
    sed -n '1,40p' "$log"
    if [[ -f streaming.pml.trail ]]; then spin -t -p "${flags[@]}" streaming.pml | tail -60; fi
  fi
  rm -f streaming.pml.trail
}

# Source 1's call plans: a rank with no tokens at all, an uneven rank whose empty call sits between
# others, and a rank that wraps its ring as often as source 0 (which always runs 2, 1, 2 chunks).
plans=("0 0 0" "1 0 2" "2 2 1")

echo "spin: $(spin -V)"
for plan in "${plans[@]}"; do
  name="plan[${plan// /,}]"
  run "protocol_free_$name" pass "$plan"
  ((quick)) && continue
  run "protocol_late_producer_$name" pass "$plan" -DLATE_PRODUCER
  run "protocol_serialized_$name" pass "$plan" -DSERIALIZED
done

# A call holding more chunks than slots (3 on 2): the protocol itself handles the wrap while
# producers and consumers run concurrently; only a serialized launch deadlocks on it (the last
# mutant), which is why docs/streaming.md forbids it.
run "protocol_free_wrap_within_call" pass "2 2 1" -DMAXCH=3
((quick)) || run "protocol_late_producer_wrap_within_call" pass "2 2 1" -DLATE_PRODUCER -DMAXCH=3

# No cycles: every run of the real protocol is finite, so (with no invalid end state) every process
# reaches its end. The other schedules only remove transitions, so they have no cycles either.
if ((!quick)); then
  for plan in "${plans[@]}"; do
    run "protocol_free_plan[${plan// /,}]_no_cycles" cycles "$plan"
  done
fi

run "mutant_single_ack" assertion "2 2 1" -DMUTANT_SINGLE_ACK
run "mutant_combined_ready" assertion "2 2 1" -DMUTANT_COMBINED_READY
run "mutant_early_ack" assertion "2 2 1" -DMUTANT_EARLY_ACK
run "mutant_replayed_generation" assertion "2 2 1" -DMUTANT_REPLAYED_GENERATION
run "mutant_wrap_within_serialized_call" deadlock "2 2 1" -DSERIALIZED -DMAXCH=3

if ((failures > 0)); then
  echo "streaming model check: $failures failure(s)"
  exit 1
fi
if ((quick)); then
  echo "streaming model check (quick): no violation to depth $depth, every mutant rejected"
else
  echo "streaming model check: protocol verified, every mutant rejected"
fi
