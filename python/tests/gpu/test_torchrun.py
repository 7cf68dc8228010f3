"""megamoe.torch in 1 and 2 processes (one GPU each) through torchrun; 2 only where two GPUs are present."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("processes", [1, 2])
def test_torchrun(processes):
    if torch.cuda.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs")
    # torchrun as a module of this interpreter, so that the workers import the same megamoe.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               os.path.join(HERE, "torchrun_worker.py")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("all passed") == processes
