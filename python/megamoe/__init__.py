"""megamoe: a whole expert-parallel MoE layer (dispatch, expert GEMMs with SwiGLU, combine) on NVIDIA
Hopper GPUs, from Python.

- ``megamoe`` (this module): problems, presets, the version. Importing it needs neither torch nor a GPU.
- ``megamoe.reference``: the CPU reference on NumPy arrays.
- ``megamoe.torch``: the layer on torch tensors with a ``torch.distributed`` group, in calls shaped like
  DeepGEMM's MegaMoE (``get_symm_buffer_for_mega_moe``, ``transform_weights_for_mega_moe``,
  ``fp8_fp4_mega_moe`` ...). See docs/python.md.

Argument errors raise ValueError naming the argument; failures of the device or its runtime (a CUDA or
NCCL call, an error the kernels recorded) raise RuntimeError.
"""

from __future__ import annotations

from typing import Dict, Optional

from . import _megamoe
from ._megamoe import Problem, RouterConfig, __version__, deepseek_v3_router, softmax_router

RECIPES = ("fp8", "fp8_fp4", "bf16")

__all__ = ["__version__", "Problem", "RECIPES", "RouterConfig", "deepseek_v3_router", "make_problem", "presets",
           "preset_problem", "softmax_router"]


def make_problem(*, num_experts: int, top_k: int, hidden: int, intermediate: int, max_tokens_per_rank: int,
                 num_ranks: int = 1, rank: int = 0, num_shared_experts: int = 0, recipe: str = "fp8",
                 recv_capacity: int = 0, wave_tokens: int = 0, validate: bool = True) -> Problem:
    """A Problem from keywords; validated unless validate=False (ValueError names the field and rule).
    ``recv_capacity``: the routes one rank's expert pools hold per wave (0: the worst case); a wave past
    it is refused on every rank and ``check_device_error`` raises (e.g. ``2 * problem.mean_recv_routes``).
    ``wave_tokens``: tokens per rank of one wave; the buffer holds one wave (0: the whole call when
    its buffer fits 1.5 GiB, else the fewest equal waves that fit, none under 512 expected rows per
    expert; ``max_tokens_per_rank``: always one wave)."""
    problem = Problem()
    problem.num_ranks = num_ranks
    problem.rank = rank
    problem.num_experts = num_experts
    problem.top_k = top_k
    problem.hidden = hidden
    problem.intermediate = intermediate
    problem.num_shared_experts = num_shared_experts
    problem.max_tokens_per_rank = max_tokens_per_rank
    problem.recipe = recipe
    problem.recv_capacity = recv_capacity
    problem.wave_tokens = wave_tokens
    if validate:
        problem.validate()
    return problem


def presets() -> Dict[str, dict]:
    """The named model shapes of ``megamoe run --preset`` (DeepSeek-V3 and V4, Qwen3, gpt-oss, Mixtral):
    name -> dict(num_experts, top_k, hidden, intermediate, num_shared_experts, recipe, activation_clamp,
    note, ...)."""
    return {p["name"]: p for p in _megamoe.presets()}


def preset_problem(name: str, *, num_ranks: int = 1, rank: int = 0, max_tokens_per_rank: int = 128,
                   recipe: Optional[str] = None) -> Problem:
    """The preset's layer on num_ranks ranks (ValueError lists the valid names for an unknown one)."""
    table = presets()
    if name not in table:
        raise ValueError(f"name: unknown preset '{name}'; valid names are {', '.join(table)}")
    p = table[name]
    return make_problem(num_experts=p["num_experts"], top_k=p["top_k"], hidden=p["hidden"],
                        intermediate=p["intermediate"], num_shared_experts=p["num_shared_experts"],
                        max_tokens_per_rank=max_tokens_per_rank, num_ranks=num_ranks, rank=rank,
                        recipe=recipe or p["recipe"])
