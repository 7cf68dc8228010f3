"""The CPU reference of the whole layer, on NumPy arrays: for tests, and for checking your own data.

Two implementations of the same steps (``megamoe/reference.h``):

- :func:`mega_moe` is written in NumPy here (FP64 products of FP32-rounded operands, the library's
  rounding steps bit for bit: E4M3 1x128 re-quantization or BF16 after SwiGLU, BF16 per slot, BF16 sum);
- :func:`cpp_mega_moe` runs the library's C++ reference (FP32 accumulation in a fixed order), the oracle
  of every GPU test.

They agree to within accumulation-order effects (a few E4M3 codes of the re-quantized activations may
round the other way). Arrays, per rank (a ``batches`` entry is a dict):

- ``x``: [tokens, hidden] E4M3 codes (uint8) for fp8 and fp8_fp4, BF16 bits (uint16) for bf16;
- ``x_scales``: [tokens, hidden / 128] float32 (fp8, fp8_fp4);
- ``topk_idx``: [tokens, top_k] int32, -1 = masked route; ``topk_weights``: [tokens, top_k] float32.

Weights (a dict of stacked canonical arrays, ``megamoe/weights.h``), E experts (all ranks' experts):

- fp8: ``w1`` uint8 [E, 2I, H] (gate rows then up rows), ``w1_scales`` float32 [E, 2I/128, H/128],
  ``w2`` uint8 [E, H, I], ``w2_scales`` float32 [E, H/128, I/128];
- fp8_fp4: ``w1`` uint8 [E, 2I, H/2] (E2M1 pairs, low nibble = even column), ``w1_scales`` uint8 UE8M0
  [E, 2I, H/32], ``w2`` uint8 [E, H, I/2], ``w2_scales`` uint8 [E, H, I/32];
- bf16: ``w1`` uint16 [E, 2I, H], ``w2`` uint16 [E, H, I];
- with shared experts, ``shared_w1`` ... ``shared_w2_scales`` the same with S = num_shared_experts.

``y`` comes back as BF16 bits (uint16) [tokens, hidden] per rank; :func:`megamoe.formats.bf16_to_float`
turns them into float32.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from . import _megamoe
from .formats import (
    MX_BLOCK,
    SCALE_BLOCK,
    bf16_to_float,
    dequantize_blocks_e4m3,
    e2m1_to_float,
    e4m3_to_float,
    float_to_bf16,
    mx_to_block_scales,
    quantize_blocks_e4m3,
    ue8m0_to_float,
    unpack_e2m1,
)

Problem = _megamoe.Problem

__all__ = [
    "mega_moe",
    "cpp_mega_moe",
    "dequantize_weights",
    "transform_weights",
    "cpp_transform_weights",
    "concat_shared_experts",
    "quantize_weights",
    "quantize_activations",
    "mx_to_block_scales",
    "cpp_mx_to_block_scales",
    "random_layer",
    "normalized_error",
    "activation_clamp_value",
]


def activation_clamp_value(activation_clamp: Optional[float]) -> float:
    """None, 0 or +inf mean no clamp (returns +inf); a negative or NaN clamp raises ValueError."""
    if activation_clamp is None:
        return float("inf")
    return float(_megamoe.kernel_activation_clamp(float(activation_clamp)))


def _validated(problem):
    """Validates the problem as rank 0 (the reference computes every rank)."""
    copy = Problem()
    for field in ("num_ranks", "num_experts", "top_k", "hidden", "intermediate", "num_shared_experts",
                  "max_tokens_per_rank", "recipe"):
        setattr(copy, field, getattr(problem, field))
    copy.validate()


def _dequantize_matrix(recipe: str, codes, scales) -> np.ndarray:
    if recipe == "bf16":
        return bf16_to_float(codes)
    if recipe == "fp8":
        values = e4m3_to_float(codes)
        rows, cols = values.shape
        expanded = np.repeat(np.repeat(np.asarray(scales, dtype=np.float32), SCALE_BLOCK, 0), SCALE_BLOCK, 1)
        return (values * expanded[:rows, :cols]).astype(np.float32)
    values = e2m1_to_float(unpack_e2m1(codes))
    return (values * np.repeat(ue8m0_to_float(scales), MX_BLOCK, axis=1)).astype(np.float32)


def dequantize_weights(recipe: str, weights: Dict[str, np.ndarray], expert: int, prefix: str = ""):
    """FP32 canonical (w1 [2I, H], w2 [H, I]) of one stacked expert."""
    w1 = _dequantize_matrix(recipe, weights[prefix + "w1"][expert], weights.get(prefix + "w1_scales", [None] * (expert + 1))[expert])
    w2 = _dequantize_matrix(recipe, weights[prefix + "w2"][expert], weights.get(prefix + "w2_scales", [None] * (expert + 1))[expert])
    return w1, w2


def _requantize(recipe: str, values: np.ndarray) -> np.ndarray:
    if recipe == "bf16":
        return bf16_to_float(float_to_bf16(values))
    codes, scales = quantize_blocks_e4m3(values)
    return dequantize_blocks_e4m3(codes, scales)


def _dequantize_x(recipe: str, batch: Dict[str, np.ndarray]) -> np.ndarray:
    if recipe == "bf16":
        return bf16_to_float(batch["x"])
    return dequantize_blocks_e4m3(batch["x"], batch["x_scales"])


def _expert_mlp(recipe, x, w1, w2, route_weights, clamp):
    """BF16 bits of one expert's output for the rows of x (FP32 operands, FP64 products)."""
    inter = w2.shape[1]
    h = (x.astype(np.float64) @ w1.astype(np.float64).T).astype(np.float32)
    gate, up = h[:, :inter], h[:, inter:]
    gate = np.where(gate > clamp, np.float32(clamp), gate)
    up = np.where(up > clamp, np.float32(clamp), np.where(up < -clamp, np.float32(-clamp), up))
    silu = gate / (np.float32(1) + np.exp(-gate.astype(np.float64)).astype(np.float32))
    act = (silu * up * route_weights[:, None].astype(np.float32)).astype(np.float32)
    act = _requantize(recipe, act)
    out = (act.astype(np.float64) @ w2.astype(np.float64).T).astype(np.float32)
    return float_to_bf16(out)


def mega_moe(problem, batches: Sequence[Dict[str, np.ndarray]], weights: Dict[str, np.ndarray],
             activation_clamp: Optional[float] = None) -> List[np.ndarray]:
    """The layer for every rank, in NumPy. Returns y (BF16 bits, uint16 [tokens, hidden]) per rank."""
    _validated(problem)
    recipe = problem.recipe
    clamp = activation_clamp_value(activation_clamp)
    if len(batches) != problem.num_ranks:
        raise ValueError(f"batches: must hold one batch per rank ({problem.num_ranks}), got {len(batches)}")
    hidden, top_k = problem.hidden, problem.top_k
    slots = [np.zeros((b["topk_idx"].shape[0], top_k + 1, hidden), dtype=np.uint16) for b in batches]
    written = [np.zeros((b["topk_idx"].shape[0], top_k + 1), dtype=bool) for b in batches]
    xs = [_dequantize_x(recipe, b) for b in batches]
    for expert in range(problem.num_experts):
        rows = [np.nonzero(np.asarray(b["topk_idx"]) == expert) for b in batches]
        if sum(len(r[0]) for r in rows) == 0:
            continue
        w1, w2 = dequantize_weights(recipe, weights, expert)
        for rank, (tokens, ks) in enumerate(rows):
            if len(tokens) == 0:
                continue
            route_weights = np.asarray(batches[rank]["topk_weights"], dtype=np.float32)[tokens, ks]
            slots[rank][tokens, ks] = _expert_mlp(recipe, xs[rank][tokens], w1, w2, route_weights, clamp)
            written[rank][tokens, ks] = True
    if problem.num_shared_experts > 0:
        parts = [dequantize_weights(recipe, weights, s, "shared_") for s in range(problem.num_shared_experts)]
        inter = problem.intermediate
        w1 = np.concatenate([p[0][:inter] for p in parts] + [p[0][inter:] for p in parts], axis=0)
        w2 = np.concatenate([p[1] for p in parts], axis=1)
        for rank, x in enumerate(xs):
            if x.shape[0] == 0:
                continue
            slots[rank][:, top_k] = _expert_mlp(recipe, x, w1, w2, np.ones(x.shape[0], np.float32), clamp)
            written[rank][:, top_k] = True
    ys = []
    for rank in range(problem.num_ranks):
        values = bf16_to_float(slots[rank]) * written[rank][..., None]
        total = np.zeros((values.shape[0], hidden), dtype=np.float32)
        for slot in range(top_k + 1):  # FP32 sum in slot order
            total = (total + values[:, slot]).astype(np.float32)
        ys.append(float_to_bf16(total))
    return ys


def cpp_mega_moe(problem, batches: Sequence[Dict[str, np.ndarray]], weights: Dict[str, np.ndarray],
                 activation_clamp: Optional[float] = None, threads: int = 0):
    """The library's C++ reference on the same arrays. Returns (y per rank as BF16 bits, receive counts
    per rank [experts_per_rank] uint32)."""
    clamp = activation_clamp_value(activation_clamp)
    ys, counts = _megamoe.reference_moe(problem, [dict(b) for b in batches], dict(weights), clamp, threads)
    return list(ys), list(counts)


def quantize_activations(x: np.ndarray, recipe: str):
    """float32 [tokens, hidden] -> (x codes, x_scales or None) in the recipe's activation format."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if recipe == "bf16":
        return float_to_bf16(x), None
    return quantize_blocks_e4m3(x)


def quantize_weights(recipe: str, w1: np.ndarray, w2: np.ndarray) -> Dict[str, np.ndarray]:
    """FP32 canonical w1 [2I, H], w2 [H, I] of one expert -> its stored arrays (the library's quantize():
    128x128 amax blocks for fp8, MXFP4 for fp8_fp4, BF16)."""
    return dict(_megamoe.quantize_weights_host(recipe, np.ascontiguousarray(w1, np.float32),
                                               np.ascontiguousarray(w2, np.float32)))


def transform_weights(recipe: str, expert: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """One canonical expert (w1, w1_scales, w2, w2_scales as above, without the expert dimension) into
    the layout the kernels read (weights.h), in NumPy; megamoe.torch does the same on the GPU."""
    w1 = np.asarray(expert["w1"])
    inter = w1.shape[0] // 2
    rows = _megamoe.l1_canonical_rows(inter)
    out = {"w1": w1[rows], "w2": np.asarray(expert["w2"])}
    if recipe == "fp8":
        runs = rows[::64] // SCALE_BLOCK  # each 64-row run lies in one canonical 128-row block
        out["w1_scales"] = np.asarray(expert["w1_scales"])[runs]
        out["w2_scales"] = np.repeat(np.asarray(expert["w2_scales"]), 2, axis=0)
    elif recipe == "fp8_fp4":
        out["w1_scales"] = np.asarray(expert["w1_scales"])[rows]
        out["w2_scales"] = np.asarray(expert["w2_scales"])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def concat_shared_experts(recipe: str, weights: Dict[str, np.ndarray], prefix: str = "shared_") -> Dict[str, np.ndarray]:
    """S stacked canonical experts (``shared_w1`` [S, 2I, H] ...) as one expert of intermediate S*I: all
    gate rows, then all up rows; W2's columns side by side (the sum of S SwiGLU MLPs is one MLP over
    their concatenated channels). Returns w1 [2SI, H], w2 [H, SI] and their scales, without the expert
    dimension: what megamoe.torch takes as the shared experts' weights."""
    w1 = np.asarray(weights[prefix + "w1"])
    count, half = w1.shape[0], w1.shape[1] // 2
    out = {"w1": np.concatenate([w1[:, :half].reshape(-1, w1.shape[2]), w1[:, half:].reshape(-1, w1.shape[2])]),
           "w2": np.concatenate(list(np.asarray(weights[prefix + "w2"])), axis=1)}
    if recipe != "bf16":
        s1 = np.asarray(weights[prefix + "w1_scales"])
        h = s1.shape[1] // 2
        out["w1_scales"] = np.concatenate([s1[:, :h].reshape(-1, s1.shape[2]), s1[:, h:].reshape(-1, s1.shape[2])])
        out["w2_scales"] = np.concatenate(list(np.asarray(weights[prefix + "w2_scales"])), axis=1)
    assert out["w1"].shape[0] == 2 * count * half
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def cpp_transform_weights(recipe: str, expert: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The library's C++ transform_weights on the same arrays."""
    w1 = np.asarray(expert["w1"])
    hidden = w1.shape[1] * (2 if recipe == "fp8_fp4" else 1)
    inter = w1.shape[0] // 2
    stacked = {k: np.ascontiguousarray(v)[None] for k, v in expert.items()}
    if recipe == "bf16":
        stacked = {k: v.view(np.uint16) for k, v in stacked.items()}
    out = dict(_megamoe.transform_weights_host(recipe, hidden, inter, stacked))
    if recipe == "bf16":
        out = {k: v.view(np.uint16) for k, v in out.items()}
    return out


def cpp_mx_to_block_scales(x, x_sf):
    """The library's C++ MX conversion (megamoe/mx.h) on the CPU, the same bits as the GPU's."""
    sf = np.ascontiguousarray(x_sf)
    if sf.dtype in (np.int32, np.uint32):
        sf = sf.view(np.uint8)
    return _megamoe.convert_mx_activations_host(np.ascontiguousarray(x), sf)


def normalized_error(got, want) -> float:
    """||got - want|| / ||want|| of two BF16-bit or float arrays."""
    g = bf16_to_float(got) if np.asarray(got).dtype == np.uint16 else np.asarray(got, np.float64)
    w = bf16_to_float(want) if np.asarray(want).dtype == np.uint16 else np.asarray(want, np.float64)
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    norm = np.linalg.norm(w)
    return float(np.linalg.norm(g - w) / norm) if norm > 0 else float(np.linalg.norm(g - w))


def random_layer(problem, tokens_per_rank: Sequence[int], seed: int = 0, masked: float = 0.0):
    """Random weights (quantized in the problem's recipe) and batches for every rank: (batches, weights).

    Weights are uniform in +-1/sqrt(fan in), tokens standard normal; each token picks top_k distinct
    experts with softmax-like positive weights; a fraction `masked` of routes is -1.
    """
    rng = np.random.default_rng(seed)
    recipe, h, i = problem.recipe, problem.hidden, problem.intermediate

    def stack(count):
        experts = []
        for _ in range(count):
            w1 = rng.uniform(-1, 1, (2 * i, h)).astype(np.float32) / np.sqrt(h)
            w2 = rng.uniform(-1, 1, (h, i)).astype(np.float32) / np.sqrt(i)
            experts.append(quantize_weights(recipe, w1, w2))
        return {k: np.stack([e[k] for e in experts]) for k in experts[0]}

    weights = stack(problem.num_experts)
    if problem.num_shared_experts > 0:
        weights.update({"shared_" + k: v for k, v in stack(problem.num_shared_experts).items()})
    batches = []
    for tokens in tokens_per_rank:
        x = rng.standard_normal((tokens, h)).astype(np.float32)
        codes, scales = quantize_activations(x, recipe)
        scores = rng.standard_normal((tokens, problem.num_experts))
        idx = np.argsort(-scores, axis=1)[:, : problem.top_k].astype(np.int32)
        w = np.exp(-np.sort(-scores, axis=1)[:, : problem.top_k] / 2).astype(np.float32)
        w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32) if tokens else w
        if masked > 0:
            idx = np.where(rng.random(idx.shape) < masked, np.int32(-1), idx).astype(np.int32)
        batch = {"x": codes, "topk_idx": np.ascontiguousarray(idx), "topk_weights": np.ascontiguousarray(w)}
        if scales is not None:
            batch["x_scales"] = scales
        batches.append(batch)
    return batches, weights
