#!/usr/bin/env bash
# Builds every target (CUDA sources for sm_90a included) and runs every test. GPU tests skip
# themselves on a machine without a Hopper GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)"
