#!/usr/bin/env bash
# Registers, stack and spills of every kernel in one CUDA translation unit, from ptxas, compiled
# with the build's own command line into a scratch directory:
#   tools/ptxas_report.sh BUILD_DIR SOURCE      e.g. tools/ptxas_report.sh build src/kernels/gemm/gemm_fp8.cu
#   tools/ptxas_report.sh BUILD_DIR SOURCE --sites KERNEL_SUBSTRING
#     also: where the local-memory instructions (LDL/STL: spills) of the kernels whose mangled name
#     holds KERNEL_SUBSTRING come from, per innermost source line and per outermost one (in a
#     warp-specialized kernel, the role's call site). Needs cuobjdump and nvdisasm ($CUOBJDUMP,
#     $NVDISASM, else on PATH; the PyPI packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
#     have them where the toolkit does not).
# The command's dependency-file flags are dropped, so the report never rewrites the build's
# depfiles: a copy of the command that kept them once left the build without the header
# dependencies of a kernel object, which then went stale.
set -euo pipefail
[ $# -eq 2 ] || { [ $# -eq 4 ] && [ "$3" = --sites ]; } || { echo "usage: $0 BUILD_DIR SOURCE [--sites KERNEL_SUBSTRING]"; exit 2; }
sites=${4:-}
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
[ -n "$sites" ] || exit 0
cuobjdump=${CUOBJDUMP:-cuobjdump}
nvdisasm=${NVDISASM:-nvdisasm}
command -v "$cuobjdump" >/dev/null && command -v "$nvdisasm" >/dev/null ||
  { echo "ptxas_report: --sites needs cuobjdump and nvdisasm (set CUOBJDUMP and NVDISASM)"; exit 1; }
(cd "$scratch" && "$cuobjdump" -xelf all unit.o >/dev/null)
for cubin in "$scratch"/*.cubin; do "$nvdisasm" -gi -c "$cubin"; done >"$scratch/sass.txt"
# nvdisasm -gi puts before an instruction its source line, then the lines it is inlined at, the
# kernel's own line last.
awk -v pattern="$sites" '
  function site(line) { sub(/ inlined at.*/, "", line); sub(/.*\//, "", line); sub(/", line /, ":", line); return line }
  /^\.text\./ { inside = index($0, pattern) > 0; if (inside) kernels++ }
  !inside { next }
  /\/\/## File/ { if (!in_block) inner = site($0); outer = site($0); in_block = 1; next }
  { in_block = 0 }
  /[ ](LDL|STL)(\.[A-Z0-9]+)* / { total++; by_inner[inner]++; by_outer[outer]++ }
  END {
    printf "%d local-memory instructions in %d kernels matching %s\n", total, kernels, pattern > "/dev/stderr"
    for (s in by_outer) printf "  %5d  called from %s\n", by_outer[s], s
    for (s in by_inner) printf "  %5d  at %s\n", by_inner[s], s
  }' "$scratch/sass.txt" 2>&1 >"$scratch/sites.txt"
sort -k1,1nr -s "$scratch/sites.txt" | head -40
