#!/usr/bin/env bash
# Runs CI (.ci/run) as CI does, on a clean clone of REV (default HEAD) in a temporary folder, and
# removes the clone afterwards whatever the outcome: each clone holds about 6 GB (the build and the
# Python venv with torch), and clones left behind once filled the disk that the CI machine shares,
# so that CI's Python step failed for want of space.
#   tools/ci_clone.sh [REV] [LOG]   (LOG: where the run's output goes; default ci-REV.log in $TMPDIR)
set -euo pipefail
rev=${1:-HEAD}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse --short "$rev")
log=${2:-${TMPDIR:-/tmp}/ci-$commit.log}
clone=$(mktemp -d "${TMPDIR:-/tmp}/megamoe-ci.XXXXXX")
trap 'rm -rf "$clone"' EXIT
git clone --quiet --no-checkout "$repo" "$clone"
git -C "$clone" checkout --quiet "$commit"
echo "ci_clone: $commit in $clone, output in $log"
status=0
(cd "$clone" && CI=true bash .ci/run) >"$log" 2>&1 || status=$?
tail -n 5 "$log"
echo "ci_clone: $commit exit $status"
exit "$status"
