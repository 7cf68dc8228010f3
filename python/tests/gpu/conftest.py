"""GPU tests of megamoe.torch: skipped without torch, CUDA or a Hopper GPU (compute capability 9.x)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] != 9:
    pytest.skip("needs a Hopper GPU", allow_module_level=True)
