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
# Empty calls (bit n: call n has none; the calls are batch, streamed, batch, batch): none, each of rank
# 1's alone, rank 0 empty throughout, both empty in the streamed call, mixed.
for plan in "0 0" "0 1" "0 2" "0 4" "15 0" "2 2" "5 10"; do
  read -r e0 e1 <<<"$plan"
  run "protocol_empty[$e0,$e1]" pass "$e0" "$e1"
done
# Sends at once: an empty streamed call followed by a batch call (what stop 71 saw on the GPU), an
# empty batch call followed by another; and sends after the peers' L2 tiles only (a late CTA's build).
run "mutant_sends_dont_wait[0,2]" assertion 0 2 -DMUTANT_SENDS_DONT_WAIT
run "mutant_sends_dont_wait[0,4]" assertion 0 4 -DMUTANT_SENDS_DONT_WAIT
run "mutant_wait_for_l2_only" assertion 0 0 -DMUTANT_WAIT_FOR_L2_ONLY

if ((failures > 0)); then
  echo "fused calls model check: $failures failure(s)"
  exit 1
fi
echo "fused calls model check: every plan verified, every mutant rejected"
