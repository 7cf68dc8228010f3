#!/usr/bin/env bash
# Registers, stack and spills of every kernel in one CUDA translation unit, from ptxas, compiled
# with the build's own command line into a scratch directory:
#   tools/ptxas_report.sh BUILD_DIR SOURCE      e.g. tools/ptxas_report.sh build src/kernels/gemm/gemm_fp8.cu
# The command's dependency-file flags are dropped, so the report never rewrites the build's
# depfiles: a copy of the command that kept them once left the build without the header
# dependencies of a kernel object, which then went stale.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BUILD_DIR SOURCE"; exit 2; }
build=$(cd "$1" && pwd)
source_path=$(realpath "$2")
target=""
for object in $(cd "$build" && ninja -t targets all | cut -d: -f1 | grep -F "/$(basename "$source_path").o" || true); do
  if (cd "$build" && ninja -t commands "$object" | tail -1 | grep -qF "$source_path"); then target=$object; break; fi
done
[ -n "$target" ] || { echo "ptxas_report: no object of $2 in $build"; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
command=$(cd "$build" && ninja -t commands "$target" | tail -1)
command=$(echo "$command" | sed -E "s# -o [^ ]+# -o $scratch/unit.o -Xptxas -v#; s# -MD##; s# -MT [^ ]+##; s# -MF [^ ]+##")
(cd "$build" && eval "$command") >"$scratch/ptxas.log" 2>&1 || { cat "$scratch/ptxas.log"; exit 1; }
# One line per kernel: registers, stack frame, spill stores and loads, then the (mangled) name.
awk '/Compiling entry function/ { name = $0; sub(/.*entry function .\047?/, "", name); sub(/\047? for .*/, "", name) }
     /bytes stack frame/ { stack = $1; stores = $5; loads = $9 }
     /Used [0-9]+ registers/ { for (i = 1; i <= NF; ++i) if ($i == "Used") regs = $(i + 1);
                               printf "%4s regs %4s stack %4s spill-st %4s spill-ld  %s\n", regs, stack, stores, loads, name }' \
  "$scratch/ptxas.log"
