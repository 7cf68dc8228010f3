"""Helpers of the GPU tests: reference data (megamoe.reference) moved into megamoe.torch's inputs."""

from __future__ import annotations

import numpy as np
import torch

import megamoe
import megamoe.torch as mt
from megamoe import reference as ref

# ||y - ref|| / ||ref|| bounds of README.md's accuracy table (E4M3: 4e-2 for single tokens).
BOUND = {"bf16": 5e-3, "fp8": 2e-2, "fp8_fp4": 2e-2}


def bound(recipe: str, tokens: int) -> float:
    return BOUND[recipe] * (2.0 if recipe != "bf16" and tokens < 4 else 1.0)


def to_device(array: np.ndarray, dtype=None, device="cuda") -> torch.Tensor:
    a = np.ascontiguousarray(array)
    if a.dtype == np.uint16:
        a = a.view(np.int16)
    t = torch.from_numpy(a).to(device)
    return t.view(dtype) if dtype is not None else t


def canonical_torch(recipe: str, weights: dict, first: int, count: int, device="cuda"):
    """Stacked canonical NumPy weights of experts [first, first + count) -> megamoe.torch's l1, l2."""
    pick = lambda key: weights[key][first:first + count]  # noqa: E731
    return canonical_pair(recipe, {k: pick(k) for k in ("w1", "w1_scales", "w2", "w2_scales") if k in weights}, device)


def canonical_pair(recipe: str, w: dict, device="cuda"):
    if recipe == "bf16":
        return to_device(w["w1"], torch.bfloat16, device), to_device(w["w2"], torch.bfloat16, device)
    codes = torch.float8_e4m3fn if recipe == "fp8" else torch.uint8
    return ((to_device(w["w1"], codes, device), to_device(w["w1_scales"], None, device)),
            (to_device(w["w2"], codes, device), to_device(w["w2_scales"], None, device)))


def transformed(problem, weights: dict, rank: int, device="cuda"):
    """This rank's transformed routed weights and, with shared experts, theirs: (l1, l2, sl1, sl2)."""
    e = problem.experts_per_rank
    l1, l2 = mt.transform_weights_for_mega_moe(*canonical_torch(problem.recipe, weights, rank * e, e, device))
    sl1 = sl2 = None
    if problem.num_shared_experts > 0:
        shared = ref.concat_shared_experts(problem.recipe, weights)
        sl1, sl2 = mt.transform_weights_for_mega_moe(*canonical_pair(problem.recipe, shared, device))
    return l1, l2, sl1, sl2


def write_inputs(buffer: mt.Buffer, batch: dict, mx: tuple | None = None) -> int:
    """Writes one rank's batch into the buffer's input tensors; returns its token count. With `mx`
    (codes, UE8M0 per 32), x and x_sf get those instead (activation_scales='mx')."""
    n = batch["topk_idx"].shape[0]
    if n == 0:
        return 0
    if buffer.recipe == "bf16":
        buffer.x[:n].copy_(to_device(batch["x"], torch.bfloat16, buffer.device))
    elif mx is not None:
        buffer.x[:n].copy_(to_device(mx[0], torch.float8_e4m3fn, buffer.device))
        buffer.x_sf[:n].copy_(to_device(np.ascontiguousarray(mx[1]).view(np.int32), None, buffer.device))
    else:
        buffer.x[:n].copy_(to_device(batch["x"], torch.float8_e4m3fn, buffer.device))
        buffer.x_sf[:n].copy_(to_device(batch["x_scales"], None, buffer.device))
    buffer.topk_idx[:n].copy_(to_device(batch["topk_idx"], None, buffer.device))
    buffer.topk_weights[:n].copy_(to_device(batch["topk_weights"], None, buffer.device))
    return n


def mx_batch(batch: dict, seed: int):
    """MX activations for a batch (E4M3 with a power-of-two scale per 32, as DeepGEMM's per-token cast
    with use_ue8m0 makes them), and the batch the reference takes for them (converted, megamoe/mx.h)."""
    tokens, hidden = batch["topk_idx"].shape[0], None
    rng = np.random.default_rng(seed)
    hidden = batch["x"].shape[1]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32) * np.exp2(rng.integers(-3, 4, (tokens, hidden // 32)))\
        .repeat(32, axis=1).astype(np.float32)
    groups = x.reshape(tokens, hidden // 32, 32)
    amax = np.maximum(np.abs(groups).max(axis=-1), 1e-4) / 448.0
    exponent = np.ceil(np.log2(amax)).astype(np.int64)
    sf = (exponent + 127).astype(np.uint8)
    codes = megamoe.formats.float_to_e4m3((groups / np.exp2(exponent)[..., None]).astype(np.float32)).reshape(tokens, hidden)
    converted = dict(batch)
    converted["x"], converted["x_scales"] = ref.mx_to_block_scales(codes, sf)
    return (codes, sf), converted


def y_bits(y: torch.Tensor) -> np.ndarray:
    return y.view(torch.int16).cpu().numpy().view(np.uint16)


CALLS = {"fp8": mt.fp8_mega_moe, "fp8_fp4": mt.fp8_fp4_mega_moe, "bf16": mt.bf16_mega_moe}
