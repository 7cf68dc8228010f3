"""megamoe.torch in 1 and 2 processes (one GPU each) through torchrun; 2 only where two GPUs are present."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("processes", [1, 2])
def test_torchrun(processes):
    if torch.cuda.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs")
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", f"--nproc-per-node={processes}", os.path.join(HERE, "torchrun_worker.py")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("all passed") == processes
