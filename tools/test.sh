#!/usr/bin/env bash
# The test command: installs the test tools, builds every target (CUDA sources for sm_90a included)
# and runs every test but the full model check (label model_full; .ci/run adds it). GPU tests skip
# themselves without a Hopper GPU, and ctest reports them as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --tests
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" 2>&1 | tee build/build.log
# ptxas only informs (C7514), and carries on, when it must serialize a kernel's wgmmas because an
# instruction touches an in-flight accumulator: the wgmmas then no longer overlap anything. A
# clean build (CI's) compiles every kernel, so its log shows any.
if grep -q "C7514" build/build.log; then
  grep "C7514" build/build.log | sed -E "s/.*function '([^']*)'.*/serialized wgmmas in \1/" | sort -u
  exit 1
fi
ctest --test-dir build --output-on-failure -j"$(nproc)" -LE model_full
# The Python package (pip install . on this build tree, pytest) and the installed CMake package.
bash tools/python_test.sh
