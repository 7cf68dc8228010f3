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
echo "ab_tree_test: passed"
