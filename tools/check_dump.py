#!/usr/bin/env python3
"""Recomputes the layer output of a `megamoe run --dump DIR` from its .npy files, independently of
the C++ code (NumPy only), and compares it with the y the run wrote.

    tools/check_dump.py DIR [--tolerance 0.01]

Prints, per rank, the largest |y - y_recomputed| divided by the largest |y_recomputed|, and checks
the receive counts against a recount of topk_idx. Exits 1 when a rank exceeds the tolerance or a
count differs, 2 when the dump cannot be read.
"""

import argparse
import json
import os
import sys

import numpy as np


# ---- Number formats --------------------------------------------------------------------------

def e4m3_table():
    """FP32 value of every E4M3 code (sign, 4 exponent bits with bias 7, 3 mantissa bits)."""
    codes = np.arange(256)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(exponent == 0xF) & ((codes & 0x7) == 0x7)] = np.nan
    return values.astype(np.float32)


E4M3 = e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def ue8m0_to_float(codes):
    return np.ldexp(np.float32(1.0), codes.astype(np.int32) - 127).astype(np.float32)


def bf16_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_bf16(values):
    """Round FP32 to the nearest BF16, ties to even."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return bf16_to_float(rounded)


def round_e4m3(values):
    """Round to the nearest E4M3 value, ties to even, saturating at +-448."""
    values = np.asarray(values, dtype=np.float64)
    magnitude = np.abs(values)
    exponent = np.clip(np.floor(np.log2(np.maximum(magnitude, 2.0 ** -40))), -6, 8)
    step = 2.0 ** (exponent - 3)  # 3 mantissa bits; exponent -6 also covers the subnormals
    rounded = np.minimum(np.round(magnitude / step) * step, 448.0)  # np.round: half to even
    return np.copysign(rounded, values).astype(np.float32)


def requantize_fp8(a):
    """E4M3 with one FP32 scale per 1x128 channels, back to FP32 (Fp8BlockQuantizer)."""
    rows, cols = a.shape
    blocks = a.reshape(rows, cols // 128, 128)
    amax = np.maximum(np.abs(blocks).max(axis=2, keepdims=True), np.float32(1e-12)).astype(np.float32)
    inverse = (np.float32(448.0) / amax).astype(np.float32)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    codes = round_e4m3((blocks * inverse).astype(np.float32))
    return (codes * scale).astype(np.float32).reshape(rows, cols)


# ---- The dump --------------------------------------------------------------------------------

class Dump:
    def __init__(self, directory):
        self.directory = directory
        with open(os.path.join(directory, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.problem = self.manifest["problem"]
        self.recipe = self.manifest["recipe"]
        self.files = {entry["name"] for entry in self.manifest["files"]}

    def load(self, name):
        if name not in self.files:
            raise FileNotFoundError(f"{name} is not listed in manifest.json")
        return np.load(os.path.join(self.directory, name))

    def x(self, rank):
        codes = self.load(f"rank{rank}_x.npy")
        if self.recipe == "bf16":
            return bf16_to_float(codes)
        scales = self.load(f"rank{rank}_x_scales.npy")
        return (E4M3[codes] * np.repeat(scales, 128, axis=1)).astype(np.float32)

    def matrix(self, prefix, name):
        codes = self.load(f"{prefix}_{name}.npy")
        if self.recipe == "bf16":
            return bf16_to_float(codes)
        scales = self.load(f"{prefix}_{name}_scales.npy")
        if self.recipe == "fp8":
            expanded = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)
            return (E4M3[codes] * expanded).astype(np.float32)
        values = np.empty((codes.shape[0], codes.shape[1] * 2), dtype=np.float32)
        values[:, 0::2] = E2M1[codes & 0xF]
        values[:, 1::2] = E2M1[codes >> 4]
        return (values * np.repeat(ue8m0_to_float(scales), 32, axis=1)).astype(np.float32)

    def expert(self, prefix):
        return self.matrix(prefix, "w1"), self.matrix(prefix, "w2")


def expert_l2(weights, x, route_weights, recipe):
    """W2 . a' before its BF16 rounding, accumulated in float64."""
    w1, w2 = weights
    inter = w1.shape[0] // 2
    h = x.astype(np.float64) @ w1.T.astype(np.float64)
    gate, up = h[:, :inter], h[:, inter:]
    a = (gate / (1.0 + np.exp(-gate)) * up * route_weights[:, None]).astype(np.float32)
    a = round_bf16(a) if recipe == "bf16" else requantize_fp8(a)
    return a.astype(np.float64) @ w2.T.astype(np.float64)


def recompute_rank(dump, rank, cache):
    p = dump.problem
    x = dump.x(rank)
    topk_idx = dump.load(f"rank{rank}_topk_idx.npy")
    topk_weights = dump.load(f"rank{rank}_topk_weights.npy")
    total = np.zeros((x.shape[0], p["hidden"]), dtype=np.float32)
    for k in range(p["top_k"]):  # slots in order 0..top_k-1, then the shared slot
        for expert in np.unique(topk_idx[:, k]):
            if expert < 0:
                continue
            rows = np.nonzero(topk_idx[:, k] == expert)[0]
            prefix = f"expert{expert}"
            if prefix not in cache:
                cache[prefix] = dump.expert(prefix)
            out = expert_l2(cache[prefix], x[rows], topk_weights[rows, k], dump.recipe)
            total[rows] += round_bf16(out.astype(np.float32))
    if p["num_shared_experts"] > 0 and x.shape[0] > 0:
        shared = np.zeros((x.shape[0], p["hidden"]), dtype=np.float64)
        ones = np.ones(x.shape[0], dtype=np.float32)
        for s in range(p["num_shared_experts"]):
            prefix = f"shared{s}"
            if prefix not in cache:
                cache[prefix] = dump.expert(prefix)
            shared += expert_l2(cache[prefix], x, ones, dump.recipe)
        total += round_bf16(shared.astype(np.float32))
    return round_bf16(total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="largest allowed max|y - y_recomputed| / max|y_recomputed| per rank")
    args = parser.parse_args()
    try:
        dump = Dump(args.directory)
    except (OSError, KeyError, ValueError) as error:
        print(f"check_dump: cannot read {args.directory}: {error}", file=sys.stderr)
        return 2
    p = dump.problem
    print(f"{args.directory}: preset {dump.manifest['preset']}, recipe {dump.recipe}, "
          f"routing {dump.manifest['routing']}, seed {dump.manifest['seed']}")

    counts = np.zeros(p["num_experts"], dtype=np.int64)
    for rank in range(p["num_ranks"]):
        ids = dump.load(f"rank{rank}_topk_idx.npy").ravel()
        counts += np.bincount(ids[ids >= 0], minlength=p["num_experts"])
    failed = False
    cache = {}
    for rank in range(p["num_ranks"]):
        per_rank = p["experts_per_rank"]
        dumped_counts = dump.load(f"rank{rank}_recv_counts.npy").astype(np.int64)
        if not np.array_equal(dumped_counts, counts[rank * per_rank:(rank + 1) * per_rank]):
            print(f"rank {rank}: receive counts differ from a recount of topk_idx")
            failed = True
        y = bf16_to_float(dump.load(f"rank{rank}_y.npy")).astype(np.float64)
        want = recompute_rank(dump, rank, cache).astype(np.float64)
        scale = np.abs(want).max() if want.size else 0.0
        error = np.abs(y - want).max() if want.size else 0.0
        normalized = error / scale if scale > 0 else error
        verdict = "ok" if normalized <= args.tolerance else "EXCEEDS TOLERANCE"
        print(f"rank {rank}: {y.shape[0]} tokens, max normalized error {normalized:.3e} "
              f"(max |y| {scale:.4g}) {verdict}")
        failed = failed or normalized > args.tolerance
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
