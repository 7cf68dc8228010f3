#!/usr/bin/env bash
# The Python package and the installed C++ package, on the build tree of tools/test.sh (run after it):
#   1. `pip install .` into a venv (build/pyvenv), reusing the CMake build tree `build`, so that only
#      the extension compiles (the library, tests and tools are already built there);
#   2. `python -c "import megamoe"` and the pytest suite (python/tests, with torch installed; its GPU tests
#      skip without a Hopper GPU);
#   3. `cmake --install` into build/install and a consumer project (examples/cmake_consumer) that finds it with
#      find_package(megamoe CONFIG), builds, links and runs.
# Needs python3 (3.9+) with venv and its headers (python3-dev, python3-venv: tools/setup.sh --python), and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
build=build

# 1. The package, in the build tree's venv (kept between runs: its Python stays in CMake's cache).
if [ ! -x "$build/pyvenv/bin/python" ]; then
  python3 -m venv "$build/pyvenv"
fi
py="$build/pyvenv/bin/python"
"$py" -m pip install --quiet --disable-pip-version-check numpy pytest "nanobind>=2.4" "scikit-build-core>=0.10"
# torch too (about a minute from PyPI; used on the CPU here): megamoe.torch's calls inside torch.compile
# are tested with a stand-in for the extension's buffer (python/tests/test_torch_compile.py). PyPI's Linux
# wheel is the CUDA build: about 3 GB downloaded and 5.5 GB installed with its NVIDIA libraries, so say so
# up front rather than fail inside pip with "No space left on device"; no pip cache, which would keep
# another copy of the download.
if ! "$py" -c "import torch" 2>/dev/null; then
  free_gb=$(df -Pk "$build" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gb" -lt 10 ]; then
    echo "python_test: installing torch needs about 10 GB free under $build/ (PyPI's CUDA build, about 9 GB"
    echo "  while pip installs it); $free_gb GB are free. Free some disk and run again."
    exit 1
  fi
fi
"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch>=2.5"
# The same options as tools/test.sh's configure, so the build tree is reused as it is.
MEGAMOE_BUILD_TESTS=ON MEGAMOE_BUILD_TOOLS=ON MEGAMOE_TSAN=ON \
  "$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  --config-settings=build-dir="$build" .

# 2. Import it from outside the source tree, then the tests.
(cd /tmp && "$OLDPWD/$py" -c "import megamoe, megamoe.reference; print('megamoe', megamoe.__version__, 'imported from', megamoe.__file__)")
(cd python/tests && "$OLDPWD/$py" -m pytest -q -p no:cacheprovider)

# 3. The installed C++ package and a project that consumes it.
rm -rf "$build/install" "$build/consumer"
cmake --install "$build" --prefix "$build/install" --component development > /dev/null
cmake -S examples/cmake_consumer -B "$build/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/$build/install" > /dev/null
cmake --build "$build/consumer" > /dev/null
"$build/consumer/megamoe_consumer"
