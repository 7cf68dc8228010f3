#!/usr/bin/env bash
# The Python package on a lent GPU machine: builds it with the machine's PyTorch venv (pip install .,
# offline, wheels carried in .whl/), then runs the pytest suite (CPU tests, and the GPU tests: one
# process, 2 and 4 emulated ranks, torchrun with 1 process and, on two GPUs, 2), the quick start of
# docs/python.md and examples/torch_moe.py with torchrun on 1 GPU (also with --compile) and, if present, 2.
# Logs to $OUT.
#
#   run(command="bash tools/gpu_python_check.sh", carry=[".whl"])     # nvidia-h200 or nvidia-h200-x2
#
# Phases: build, test, examples (default: all three). All of them take about 6-9 minutes; to stay
# inside one call's 10 minutes with margin, run `... gpu_python_check.sh build test` and then
# `... gpu_python_check.sh examples` on the same warm machine (a later phase reuses the venv and the
# build tree an earlier one left, and builds them again when they are missing).
#
# .whl/ holds the wheels of the offline build (python3.12): `bash tools/gpu_python_check.sh --wheels`
# prints the pip download command. Exits non-zero when a step fails; each step's log stays in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheels" ]; then
  echo "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\"
  echo "  --platform manylinux_2_28_x86_64 -d .whl nanobind==3.1.0 scikit-build-core==1.1.2 packaging==26.4 \\"
  echo "  pathspec==1.1.1 pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 pygments==2.21.0 numpy==2.5.5 pip==25.3"
  exit 0
fi
phases=" ${*:-build test examples} "
has_phase() { [[ "$phases" == *" $1 "* ]]; }
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
BASE_PY="${MEGAMOE_TORCH_PYTHON:-/opt/torch/.venv/bin/python}"
VENV=/tmp/megamoe-py
PY="$VENV/bin/python"
export PATH="/usr/local/cuda/bin:$(dirname "$BASE_PY"):$PATH"
export NCCL_NVLS_ENABLE=0  # leave NVLink multicast off
export PYTHONUNBUFFERED=1
# An older libstdc++ loaded ahead of the system's can crash an extension in locale code (ceilings.md).
if [ -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6 ]; then export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6; fi
status=0

step() {  # step NAME TIMEOUT COMMAND...: runs it, logs to $OUT/NAME.log, records the outcome
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout cannot run it
    "$@" > "$OUT/$name.log" 2>&1
  else
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  if [ $rc -ne 0 ]; then
    status=1
    tail -40 "$OUT/$name.log"
  fi
  return $rc
}

{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown), phases:$phases"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  cmake --version | head -1
  "$BASE_PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. A venv over the PyTorch one (torch stays importable) with the carried build and test wheels,
#    then pip install . (the library and the extension only) in the build tree build-gpu-python.
export NCCL_ROOT="$("$BASE_PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || echo /usr/local/cuda)"
setup() {
  rm -rf "$VENV"
  # ensurepip may be missing from the base Python: then pip comes from its carried wheel.
  "$BASE_PY" -m venv --system-site-packages "$VENV" ||
    { rm -rf "$VENV" && "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV" &&
      "$PY" "$(ls .whl/pip-*.whl | head -1)/pip" install -q --no-index .whl/pip-*.whl; } || return 1
  # The base may itself be a venv, whose packages (torch) --system-site-packages does not reach: a
  # .pth file adds its site-packages behind the new venv's own.
  "$BASE_PY" -c "import site; print(site.getsitepackages()[0])" > \
    "$("$PY" -c "import site; print(site.getsitepackages()[0])")/megamoe_base_venv.pth" || return 1
  "$PY" -m pip install -q --no-index --find-links .whl nanobind scikit-build-core packaging pathspec pytest \
      iniconfig pluggy pygments &&
    { "$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q --no-index --find-links .whl numpy; }
}
if has_phase build || ! "$PY" -c "import megamoe" 2>/dev/null; then
  step setup 300 setup || { echo "setup failed"; exit 1; }
  step build 600 "$PY" -m pip install -v --no-index --no-deps --no-build-isolation \
    --config-settings=build-dir=build-gpu-python . || { echo "build failed"; exit 1; }
  step import 60 bash -c "cd /tmp && '$PY' -c 'import megamoe, megamoe.torch; print(megamoe.__version__, megamoe.__file__)'"
fi

# 2. The pytest suite: CPU tests, then the GPU tests (one process, emulated ranks, torchrun 1 and 2).
if has_phase test; then
  step pytest 480 bash -c "cd python/tests && '$PY' -m pytest -v -rs -p no:cacheprovider --durations=15 --junitxml='$OUT/pytest.xml'"
fi

# 3. The quick start of docs/python.md, as written there, and the example, on 1 GPU and on 2.
if has_phase examples; then
  "$PY" - docs/python.md "$OUT/quick_start.py" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
section = text.split("## Quick start", 1)[1]
open(sys.argv[2], "w").write(re.search(r"```python\n(.*?)```", section, re.S).group(1))
PYEOF
  gpus=$(nvidia-smi -L | wc -l)
  for n in 1 2; do
    [ "$gpus" -ge "$n" ] || continue
    step "quick_start_${n}gpu" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$OUT/quick_start.py"
    step "example_${n}gpu" 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
      examples/torch_moe.py --tokens 128 --iters 20
  done
  step example_compile_1gpu 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    examples/torch_moe.py --tokens 128 --iters 20 --compile
  if [ "$gpus" -ge 2 ]; then
    step example_decode_2gpu 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
      examples/torch_moe.py --tokens 8 --iters 50
  fi
fi

echo "---- summary ($OUT)"
cat "$OUT/summary.txt"
if [ -f "$OUT/pytest.log" ]; then grep -h " passed\| failed" "$OUT/pytest.log" | tail -3; fi
grep -h "^rank\|^result\|^megamoe " "$OUT"/example_*.log 2>/dev/null
exit $status
