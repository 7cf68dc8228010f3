#!/usr/bin/env bash
# Builds A/B source trees on this machine and packs them, binaries included, into one file to carry to
# the GPU machine, where `tools/gpu_check.sh unpack PACK` unpacks them (and builds there only a tree
# whose binaries do not start). A call then spends no device time building: three trees' megamoe,
# layer bench and emulated layer test pack into about 26 MB.
#   tools/pack_trees.sh [--no-build] PACK TREE...
# Run from the directory the trees' paths are relative to (the repository root for out/X). TREE is
# made by tools/ab_tree.sh; built with `tools/gpu_check.sh trees` ($TARGETS: more targets, whose
# executables are packed too). Each tree's sources go in without build/, docs/ and bench/results/.
set -euo pipefail
build=1
if [ "${1:-}" = --no-build ]; then build=0; shift; fi
[ $# -ge 2 ] || { echo "usage: tools/pack_trees.sh [--no-build] PACK TREE..." >&2; exit 2; }
pack=$1; shift
# The carry limit is 64 MiB for everything a call takes; leave room for the scripts beside the pack.
max_bytes=$((60 * 1024 * 1024))
if [ $build -eq 1 ]; then
  log=$(mktemp -d)
  OUT=$log bash "$(dirname "$0")/gpu_check.sh" trees "$@" || { rm -rf "$log"; exit 1; }
  rm -rf "$log"
fi
files=()
for tree in "$@"; do
  tree=${tree%/}
  [ -x "$tree/build/megamoe" ] || { echo "pack_trees: $tree/build/megamoe is missing: build the tree first" >&2; exit 1; }
  # What unpack rebuilds a tree with when its binaries do not start there.
  echo "${TARGETS:-}" >"$tree/build/packed.targets"
  files+=("$tree/build/packed.targets" "$tree/build/megamoe")
  [ ! -f "$tree/build/bench/layer/megamoe_layer_bench" ] || files+=("$tree/build/bench/layer/megamoe_layer_bench")
  for target in ${TARGETS:-}; do
    found=$(find "$tree/build" -name "$target" -type f -perm -u+x | head -1)
    [ -n "$found" ] || { echo "pack_trees: no executable $target in $tree/build" >&2; exit 1; }
    files+=("$found")
  done
  while IFS= read -r -d '' entry; do files+=("$entry"); done < <(
    find "$tree" -mindepth 1 -maxdepth 1 ! -name build ! -name docs ! -name bench ! -name 'build.*' -print0
    [ ! -d "$tree/bench" ] || find "$tree/bench" -mindepth 1 -maxdepth 1 ! -name results -print0)
done
tar cf - "${files[@]}" | xz -T0 -6 >"$pack"
bytes=$(stat -c %s "$pack")
if [ "$bytes" -gt "$max_bytes" ]; then
  rm -f "$pack"
  echo "pack_trees: $bytes bytes, over the $max_bytes a call can carry beside its scripts: pack fewer trees or targets" >&2
  exit 1
fi
echo "pack_trees: $pack, $bytes bytes, trees: $*"
