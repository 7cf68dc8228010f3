#!/usr/bin/env bash
# Model-checks consecutive fused calls' use of the route tables and counts (models/fused_calls.pml,
# docs/fused.md) with spin: the protocol must pass an exhaustive search (no assertion violation, no
# invalid end state), and every mutant must be rejected by an assertion.
# Exits 0 only then; 77 (skipped) without spin or a C compiler. Seconds.
set -euo pipefail
source "$(dirname "$0")/spin_workdir.sh"
spin_workdir models/check_fused_calls.sh fused_calls.pml
failures=0

# run NAME EXPECT RANK0_EMPTY RANK1_EMPTY [FLAGS...]; EXPECT: pass or assertion
run() {
  local name=$1 expect=$2 empty0=$3 empty1=$4
  shift 4
  local flags=("$@" "-DRANK0_EMPTY=$empty0" "-DRANK1_EMPTY=$empty1") pan_args=(-m10000)
  [[ $expect == assertion ]] && pan_args+=(-E)
  spin -a "${flags[@]}" fused_calls.pml >/dev/null
  cc -O2 -w -DSAFETY -o pan pan.c
  ./pan "${pan_args[@]}" >"$name.log" 2>&1 || true
  local errors states verdict
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$name.log" | head -1)
  states=$(awk '/states, stored/ {print $1; exit}' "$name.log")
  if [[ -z $errors ]] || grep -q "max search depth too small" "$name.log"; then
    verdict="FAIL (no complete search)"
  elif [[ $expect == pass ]]; then
    if [[ $errors == 0 ]]; then verdict=ok; else verdict="FAIL (errors: $errors)"; fi
  elif grep -q "assertion violated" "$name.log"; then
    verdict="rejected (assertion)"
  else
    verdict="FAIL (not rejected)"
  fi
  printf '%-52s %8s states  %s\n' "$name" "${states:-?}" "$verdict"
  if [[ $verdict == FAIL* ]]; then
    failures=$((failures + 1))
    sed -n '1,30p' "$name.log"
    [[ -f fused_calls.pml.trail ]] && spin -t -p "${flags[@]}" fused_calls.pml | tail -40
  fi
  rm -f fused_calls.pml.trail
}

echo "spin: $(spin -V)"
# With every call waiting at epoch + 2, an empty call runs as any other: one search covers every plan
# of empty calls (bit n: call n has none; the calls are batch, streamed, batch, batch).
run "protocol" pass 5 10
# The code before d75f665: an empty streamed call followed by a batch call (what stop 71 saw), and an
# empty batch call followed by a batch call.
run "mutant_empty_rank_leaves_early[0,2]" assertion 0 2 -DMUTANT_EMPTY_RANK_LEAVES_EARLY
run "mutant_empty_rank_leaves_early[0,4]" assertion 0 4 -DMUTANT_EMPTY_RANK_LEAVES_EARLY
run "mutant_read_after_arrival" assertion 0 0 -DMUTANT_READ_AFTER_ARRIVAL

if ((failures > 0)); then
  echo "fused calls model check: $failures failure(s)"
  exit 1
fi
echo "fused calls model check: every plan verified, every mutant rejected"
