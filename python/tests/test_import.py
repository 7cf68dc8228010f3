import os
import re
import subprocess
import sys

import pytest

import megamoe
from megamoe import _megamoe


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", megamoe.__version__)
    assert megamoe.__version__ == _megamoe.__version__


def test_import_needs_neither_torch_nor_a_gpu():
    code = ("import sys, megamoe, megamoe.reference, megamoe.formats; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(megamoe.__version__)")
    package_parent = os.path.dirname(os.path.dirname(megamoe.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_parent, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == megamoe.__version__


def test_presets_include_deepseek_v4():
    table = megamoe.presets()
    flash, pro = table["deepseek-v4-flash"], table["deepseek-v4-pro"]
    assert (flash["num_experts"], flash["top_k"], flash["hidden"], flash["intermediate"]) == (256, 6, 4096, 2048)
    assert (pro["num_experts"], pro["top_k"], pro["hidden"], pro["intermediate"]) == (384, 6, 7168, 3072)
    for p in (flash, pro):
        assert p["recipe"] == "fp8_fp4" and p["num_shared_experts"] == 1 and p["activation_clamp"] == 10.0
    v3 = megamoe.preset_problem("deepseek-v3", num_ranks=8, max_tokens_per_rank=64)
    assert (v3.num_experts, v3.top_k, v3.hidden, v3.intermediate, v3.recipe) == (256, 8, 7168, 2048, "fp8")
    assert v3.experts_per_rank == 32


def test_problem_round_trip():
    p = megamoe.make_problem(num_experts=8, top_k=2, hidden=256, intermediate=256, max_tokens_per_rank=16,
                             num_ranks=2, num_shared_experts=1, recipe="bf16")
    assert p.recipe == "bf16" and p.experts_per_rank == 4
    assert p.buffer_bytes > 0
    assert "hidden" in p.describe() or "256" in p.describe()
    q = megamoe.make_problem(num_experts=8, top_k=2, hidden=256, intermediate=256, max_tokens_per_rank=16,
                             num_ranks=2, num_shared_experts=1, recipe="fp8")
    assert p.fingerprint() != q.fingerprint()


def test_recv_capacity_bounds_the_buffer():
    worst = megamoe.preset_problem("deepseek-v3", num_ranks=8, max_tokens_per_rank=8192)
    worst.wave_tokens = 8192  # one wave
    assert worst.recv_capacity == 0 and worst.mean_recv_routes == 8192 * 8
    bounded = megamoe.make_problem(num_experts=256, top_k=8, hidden=7168, intermediate=2048,
                                   max_tokens_per_rank=8192, num_ranks=8, num_shared_experts=1,
                                   wave_tokens=8192, recv_capacity=2 * worst.mean_recv_routes)
    assert bounded.recv_capacity == 131072
    assert bounded.buffer_bytes < 0.4 * worst.buffer_bytes
    assert "recv_capacity=131072" in bounded.describe()
    assert bounded.fingerprint() != megamoe.make_problem(
        num_experts=256, top_k=8, hidden=7168, intermediate=2048, max_tokens_per_rank=8192, num_ranks=8,
        num_shared_experts=1, wave_tokens=8192).fingerprint()
    with pytest.raises(ValueError, match="recv_capacity"):
        megamoe.make_problem(num_experts=8, top_k=2, hidden=256, intermediate=256, max_tokens_per_rank=16,
                             recv_capacity=-1)


def test_wave_tokens_bound_the_buffer():
    shape = dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048, max_tokens_per_rank=8192, num_ranks=8,
                 num_shared_experts=1)
    whole = megamoe.make_problem(**shape, wave_tokens=8192)
    default = megamoe.make_problem(**shape)
    waves = megamoe.make_problem(**shape, wave_tokens=4096, recv_capacity=2 * 4096 * 8)
    assert (whole.waves_per_call, default.waves_per_call, waves.waves_per_call) == (1, 4, 2)
    assert default.tokens_per_wave == 2048 and default.buffer_bytes <= 1.5 * 2 ** 30 < whole.buffer_bytes
    assert waves.tokens_per_wave == 4096 and waves.mean_recv_routes == 4096 * 8
    assert waves.buffer_bytes <= 1.5 * 2 ** 30
    assert "wave_tokens=4096" in waves.describe()
    with pytest.raises(ValueError, match="wave_tokens"):
        megamoe.make_problem(**shape, wave_tokens=-1)


def test_megamoe_torch_imported_first_works_or_says_why():
    """`import megamoe.torch` loads megamoe's extension before torch. Where megamoe was built with another
    NCCL release than torch's, torch cannot then load its CUDA library: the error says what to do."""
    pytest.importorskip("torch")
    package_parent = os.path.dirname(os.path.dirname(megamoe.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_parent, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", "import megamoe, megamoe.torch"], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0 or "Import torch before megamoe" in out.stderr, out.stderr
