#!/usr/bin/env bash
# tools/ab_tree.sh: a patch lands in the A/B tree, and a patch that does not apply fails the tree.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$repo"
# A patch against HEAD's tools/test.sh that appends one line.
mkdir -p "$work/a/tools" "$work/b/tools"
git show HEAD:tools/test.sh >"$work/a/tools/test.sh"
{ cat "$work/a/tools/test.sh"; echo "# ab_tree_test"; } >"$work/b/tools/test.sh"
(cd "$work" && diff -u a/tools/test.sh b/tools/test.sh >one_line.patch) || true
fail() { echo "ab_tree_test: $*" >&2; exit 1; }

bash tools/ab_tree.sh "$work/plain" HEAD || fail "a tree without patches failed"
cmp -s "$work/plain/tools/test.sh" "$work/a/tools/test.sh" || fail "the plain tree is not HEAD's"
bash tools/ab_tree.sh "$work/patched" HEAD "$work/one_line.patch" || fail "a patch that applies failed"
grep -q "^# ab_tree_test$" "$work/patched/tools/test.sh" || fail "the patch is not in the tree"
if bash tools/ab_tree.sh "$work/twice" HEAD "$work/one_line.patch" "$work/one_line.patch" >/dev/null 2>&1; then
  fail "a patch applied twice (the second does not apply) passed"
fi
[ ! -e "$work/twice" ] || fail "the failed tree was left behind"
if bash tools/ab_tree.sh "$work/patched" HEAD 2>/dev/null; then fail "an existing folder was reused"; fi
# A patch of a benchmark's source alone lands too (it is not "unchanged").
mkdir -p "$work/c/bench/layer" "$work/d/bench/layer"
git show HEAD:bench/layer/layer_bench.cpp >"$work/c/bench/layer/layer_bench.cpp"
{ cat "$work/c/bench/layer/layer_bench.cpp"; echo "// ab_tree_test"; } >"$work/d/bench/layer/layer_bench.cpp"
(cd "$work" && diff -u c/bench/layer/layer_bench.cpp d/bench/layer/layer_bench.cpp | sed 's#^--- c/#--- a/#; s#^+++ d/#+++ b/#' \
  >bench.patch) || true
bash tools/ab_tree.sh "$work/bench_patched" HEAD "$work/bench.patch" || fail "a benchmark's patch failed"
grep -q "^// ab_tree_test$" "$work/bench_patched/bench/layer/layer_bench.cpp" || fail "the benchmark's patch is not in the tree"
echo "ab_tree_test: passed"
