#!/usr/bin/env bash
# Makes a source tree for a same-run A/B: REV's files (git archive) in DIR, then each PATCH applied.
#   tools/ab_tree.sh DIR REV [PATCH...]
# Fails if a patch does not apply or leaves the tree unchanged. (`git apply` run inside a folder of
# this repository skips, without a word, every path outside that folder: A/B trees made that way
# came out identical to main.)
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: tools/ab_tree.sh DIR REV [PATCH...]" >&2; exit 2; }
dir=$1 rev=$2
shift 2
[ ! -e "$dir" ] || { echo "ab_tree: $dir exists; remove it first" >&2; exit 2; }
mkdir -p "$dir"
trap '[ $? -eq 0 ] || rm -rf "$dir"' EXIT  # no half-made tree left to build by mistake
git archive "$rev" | tar -x -C "$dir"
# The sources a patch may change: the library, its tools, tests and benchmarks.
tree_digest() { (cd "$dir" && find src include tools tests bench -type f | LC_ALL=C sort | xargs sha256sum | sha256sum); }
for patch in "$@"; do
  before=$(tree_digest)
  patch --quiet --batch --forward -p1 -d "$dir" <"$patch" || { echo "ab_tree: $patch does not apply to $rev" >&2; exit 1; }
  after=$(tree_digest)
  [ "$before" != "$after" ] || { echo "ab_tree: $patch changed nothing in $dir" >&2; exit 1; }
done
