#!/usr/bin/env bash
# Runs one GoogleTest binary for ctest and reports it honestly:
#   any failure (non-zero exit)           -> the exit code: ctest reports Failed
#   no failure, one or more cases skipped -> 77: ctest reports Skipped (SKIP_RETURN_CODE), e.g. the GPU
#                                            cases of a machine without a Hopper GPU
#   every case ran and passed             -> 0
# A skip never hides a failure: the exit code is checked first.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" --gtest_color=no 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || exit "$rc"
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -1)
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below.*/\1/p' "$log" | tail -1)
if [ -n "$skipped" ] && [ "$skipped" -gt 0 ]; then
  echo "run_gtest: ${passed:-0} passed, $skipped skipped: reported as skipped"
  exit 77
fi
exit 0
