#!/usr/bin/env bash
# Builds every target (CUDA sources for sm_90a included) and runs every test: ctest, then the Python
# package's pytest and a consumer of the installed package (tools/python_test.sh). GPU tests skip
# themselves on a machine without a Hopper GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)"
# The Python package (pip install . on this build tree, pytest) and the installed CMake package.
bash tools/python_test.sh
