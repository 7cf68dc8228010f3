"""pytest for the megamoe package: CPU tests here, GPU tests in gpu/ (skipped without torch and a Hopper
GPU). Run from this directory, or anywhere with the package importable:

    python -m pytest            # after `pip install .`, or with PYTHONPATH=BUILD/python
"""

import os
import sys

import pytest

# torch before the extension, where torch is installed: a process keeps the first NCCL library it loads,
# and torch's CUDA library needs its own release, which need not be the one megamoe was built with.
try:
    import torch  # noqa: F401
except ImportError:
    pass

# Tests run against the installed package, or the build tree's copy when MEGAMOE_PYTHONPATH names it.
if os.environ.get("MEGAMOE_PYTHONPATH"):
    sys.path.insert(0, os.environ["MEGAMOE_PYTHONPATH"])


@pytest.fixture(scope="session")
def megamoe():
    import megamoe as module

    return module
