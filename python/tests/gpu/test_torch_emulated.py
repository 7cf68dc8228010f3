"""megamoe.torch with 2 and 4 ranks emulated on one GPU (threads in one process), in a subprocess that
starts CUDA with the environment emulated ranks need."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("ranks", [2, 4])
def test_emulated_ranks(ranks):
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER", CUDA_DEVICE_MAX_CONNECTIONS="32")
    out = subprocess.run([sys.executable, os.path.join(HERE, "emulated_worker.py"), str(ranks)], env=env,
                         capture_output=True, text=True, timeout=900)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("-> ok") >= 3 * 3 * ranks
