# Sourced by the model checks: `spin_workdir SCRIPT MODEL` exits 77 (ctest's SKIP_RETURN_CODE: skipped,
# not passed) where spin or a C compiler is missing, else copies MODEL (beside this file) into a
# temporary directory, removed at exit, and enters it.
spin_workdir() {
  command -v spin >/dev/null || { echo "$1: spin is not installed (tools/setup.sh --tests): skipped"; exit 77; }
  command -v cc >/dev/null || { echo "$1: no C compiler (cc): skipped"; exit 77; }
  local models
  models=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  spin_work=$(mktemp -d)
  trap 'rm -rf "$spin_work"' EXIT
  cp "$models/$2" "$spin_work/"
  cd "$spin_work"
}
