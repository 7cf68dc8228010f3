#!/usr/bin/env bash
# Installs what the build needs on a Debian/Ubuntu machine (as root, through apt) and checks for the
# CUDA toolkit and NCCL, which it cannot install.
#   tools/setup.sh            cmake, ninja, g++: enough to build the library and the megamoe tool
#   tools/setup.sh --python   also python3 with venv and its headers: pip install . (the Python package)
#   tools/setup.sh --tests    also GoogleTest, spin (the model check), NumPy (tools/check_dump.py) and
#                             what --python installs (tools/python_test.sh)
set -euo pipefail
tests=0
python=0
for arg in "$@"; do
  case $arg in
    --tests) tests=1; python=1 ;;
    --python) python=1 ;;
    *) echo "usage: tools/setup.sh [--python] [--tests]"; exit 2 ;;
  esac
done
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
if ((tests)); then
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  command -v spin >/dev/null || missing+=(spin)
  python3 -c "import numpy" 2>/dev/null || missing+=(python3-numpy)
fi
if ((python)); then
  command -v python3 >/dev/null || missing+=(python3)
  python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
  python3 -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
    2>/dev/null || missing+=(python3-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt() { if [ "$(id -u)" -eq 0 ]; then apt-get "$@"; else sudo apt-get "$@"; fi; }
  apt install -y --no-install-recommends "${missing[@]}" >/dev/null ||
    { apt update >/dev/null && apt install -y --no-install-recommends "${missing[@]}" >/dev/null; }
fi
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "setup: the CUDA 13 toolkit (nvcc) is required: install it to /usr/local/cuda"; exit 1; }
echo "setup: $(nvcc --version | tail -1), cmake $(cmake --version | head -1 | cut -d' ' -f3)"
