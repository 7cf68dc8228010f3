#!/usr/bin/env bash
# Installs what the build and the tests need on a Debian/Ubuntu machine (as root, through apt), and
# checks for the CUDA toolkit and NCCL, which it cannot install.
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v spin >/dev/null || missing+=(spin)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# The Python package (tools/python_test.sh): python3 with venv and its headers.
command -v python3 >/dev/null || missing+=(python3)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
python3 -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
  2>/dev/null || missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -eq 0 ]; then
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    sudo apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "setup: the CUDA 13 toolkit (nvcc) is required: install it to /usr/local/cuda"; exit 1; }
echo "setup: $(nvcc --version | tail -1), cmake $(cmake --version | head -1 | cut -d' ' -f3)"
