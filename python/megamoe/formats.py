"""The library's number formats on NumPy arrays, bit for bit as ``megamoe/formats.h`` (and so the GPU).

E4M3 is OCP's "fn" variant (no infinities, 0x7F/0xFF NaN, largest finite 448); conversions to it round
to nearest even and saturate to +-448. BF16 rounds to nearest even, NaN becoming 0x7FFF. E2M1 holds
0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit. UE8M0 is 2^(code - 127), 0xFF NaN.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
SCALE_BLOCK = 128  # activation scales cover 1x128, fp8 weight scales 128x128
MX_BLOCK = 32  # one UE8M0 scale per 32 values (MXFP4 weights, MX activations)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    value = np.where(exponent == 0, mantissa / 512.0, (8 + mantissa) * np.exp2(exponent.astype(np.float64) - 10))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value


_E4M3 = _e4m3_table()  # float64, every code
_E4M3_POSITIVE = _E4M3[:127]  # codes 0x00..0x7E, ascending
_E2M1_POSITIVE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1 = np.concatenate([_E2M1_POSITIVE, -_E2M1_POSITIVE])


def _round_to_table(magnitude: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of ascending `table` to each magnitude, ties to the even index."""
    top = len(table) - 1
    low = np.clip(np.searchsorted(table, magnitude, side="right") - 1, 0, top)
    high = np.minimum(low + 1, top)
    below = magnitude - table[low]
    above = table[high] - magnitude
    pick_high = (above < below) | ((above == below) & (low % 2 == 1))
    return np.where(magnitude >= table[top], top, np.where(pick_high, high, low))


def float_to_e4m3(values) -> np.ndarray:
    """E4M3 codes (uint8) of float32 values: round to nearest even, saturate to +-448, NaN -> 0x7F."""
    with np.errstate(invalid="ignore"):
        v = np.asarray(values, dtype=np.float32).astype(np.float64)
    code = _round_to_table(np.abs(np.nan_to_num(v, nan=0.0, posinf=E4M3_MAX, neginf=-E4M3_MAX)), _E4M3_POSITIVE)
    code = code.astype(np.uint8) | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0x7F), code).astype(np.uint8)


def e4m3_to_float(codes) -> np.ndarray:
    return _E4M3[np.asarray(codes, dtype=np.uint8)].astype(np.float32)


def float_to_bf16(values) -> np.ndarray:
    """BF16 bits (uint16) of float32 values: round to nearest even, NaN -> 0x7FFF."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, np.uint16(0x7FFF), rounded).astype(np.uint16)


def bf16_to_float(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_e2m1(values) -> np.ndarray:
    """E2M1 codes (uint8, one per value) of float32 values: nearest even, saturate to +-6, NaN -> 0."""
    with np.errstate(invalid="ignore"):
        v = np.asarray(values, dtype=np.float32).astype(np.float64)
    code = _round_to_table(np.abs(np.nan_to_num(v, nan=0.0, posinf=E2M1_MAX, neginf=-E2M1_MAX)), _E2M1_POSITIVE)
    code = code.astype(np.uint8) | np.where(np.signbit(v), 0x8, 0).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0), code).astype(np.uint8)


def e2m1_to_float(codes) -> np.ndarray:
    return _E2M1[np.asarray(codes, dtype=np.uint8) & 0xF].astype(np.float32)


def ue8m0_to_float(codes) -> np.ndarray:
    c = np.asarray(codes, dtype=np.uint8).astype(np.float64)
    return np.where(c == 255, np.nan, np.exp2(c - 127)).astype(np.float32)


def unpack_e2m1(packed) -> np.ndarray:
    """Packed E2M1 pairs (low nibble = even column) -> one code per value, last dimension doubled."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def pack_e2m1(codes) -> np.ndarray:
    c = np.asarray(codes, dtype=np.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def mxfp4_scale_for_amax(amax) -> np.ndarray:
    """The smallest UE8M0 code s with amax / 2^(s - 127) <= 6 (an all-zero group gets 127)."""
    a = np.asarray(amax, dtype=np.float32).astype(np.float64)
    with np.errstate(divide="ignore"):
        code = np.ceil(np.log2(np.where(a > 0, a, 1.0) / E2M1_MAX)) + 127
    code = np.clip(code, 1, 254)
    # log2 can land one off at exact powers of two: settle it exactly.
    code = np.where((code > 1) & (a <= E2M1_MAX * np.exp2(code - 1 - 127)), code - 1, code)
    code = np.where((code < 254) & (a > E2M1_MAX * np.exp2(code - 127)), code + 1, code)
    return np.where(a > 0, code, 127).astype(np.uint8)


def quantize_blocks_e4m3(values) -> tuple[np.ndarray, np.ndarray]:
    """Rows of float32 values -> E4M3 codes and one FP32 scale per 1x128 (scale = amax / 448), the
    library's Fp8BlockQuantizer: what the L1 epilogue and the activations of the fp8 recipes use."""
    v = np.asarray(values, dtype=np.float32)
    blocks = v.reshape(v.shape[:-1] + (v.shape[-1] // SCALE_BLOCK, SCALE_BLOCK))
    amax = np.max(np.abs(blocks), axis=-1)
    amax = np.maximum(amax, np.float32(1.0e-12))
    inverse = (np.float32(E4M3_MAX) / amax).astype(np.float32)
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    codes = float_to_e4m3((blocks * inverse[..., None]).astype(np.float32))
    return codes.reshape(v.shape), scale


def dequantize_blocks_e4m3(codes, scales) -> np.ndarray:
    c = e4m3_to_float(codes)
    blocks = c.reshape(c.shape[:-1] + (c.shape[-1] // SCALE_BLOCK, SCALE_BLOCK))
    return (blocks * np.asarray(scales, dtype=np.float32)[..., None]).reshape(c.shape).astype(np.float32)


# ---- MX activations (E4M3 + UE8M0 per 32) -> 1x128 blocks, as megamoe/mx.h ------------------------------


def _magnitude_key(codes: np.ndarray, scale_codes: np.ndarray) -> np.ndarray:
    """16 p + q with |value| = q 2^p, q in [8, 15]; -2^30 for zeros, NaN codes and NaN scales."""
    magnitude = codes.astype(np.int64) & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 7
    q = np.where(exponent > 0, 8 + mantissa, mantissa)
    p = np.where(exponent > 0, exponent - 10, -9)
    for _ in range(3):  # normalize subnormals into [8, 15]
        small = (q > 0) & (q < 8)
        q = np.where(small, q * 2, q)
        p = np.where(small, p - 1, p)
    key = 16 * (p + scale_codes.astype(np.int64) - 127) + q
    none = (magnitude == 0) | (magnitude == 0x7F) | (scale_codes == 0xFF)
    return np.where(none, -(1 << 30), key)


def mx_to_block_scales(x, x_sf) -> tuple[np.ndarray, np.ndarray]:
    """MX activations -> the library's 1x128 blocks (megamoe/mx.h has the rule and its exactness).

    x: [tokens, hidden] E4M3 codes (uint8); x_sf: [tokens, hidden / 32] UE8M0 codes (uint8), or
    [tokens, hidden / 128] int32 with four codes packed per word (DeepGEMM's packed UE8M0, first group in
    the low byte). Returns (codes [tokens, hidden] uint8, scales [tokens, hidden / 128] float32).
    """
    x = np.ascontiguousarray(x, dtype=np.uint8)
    sf = np.ascontiguousarray(x_sf)
    if sf.dtype == np.int32 or sf.dtype == np.uint32:
        sf = sf.view(np.uint8)
    sf = sf.astype(np.uint8)
    tokens, hidden = x.shape
    groups = np.repeat(sf.reshape(tokens, hidden // MX_BLOCK), MX_BLOCK, axis=1)
    keys = _magnitude_key(x, groups).reshape(tokens, hidden // SCALE_BLOCK, SCALE_BLOCK)
    max_key = keys.max(axis=-1)
    q = np.mod(max_key, 16)
    p = (max_key - q) // 16
    k = np.where(q <= 14, p - 5, p - 4)
    k = np.where(max_key == -(1 << 30), 0, np.clip(k, -126, 127))
    shift = groups.astype(np.int64).reshape(tokens, hidden // SCALE_BLOCK, SCALE_BLOCK) - 127 - k[..., None]
    values = e4m3_to_float(x).astype(np.float64).reshape(shift.shape) * np.exp2(np.minimum(shift, 20).astype(np.float64))
    codes = float_to_e4m3(values.astype(np.float32)).reshape(tokens, hidden)
    sign = (x & 0x80).astype(np.uint8)
    codes = np.where((shift.reshape(tokens, hidden) < -40), sign, codes)
    nan = ((x & 0x7F) == 0x7F) | (groups == 0xFF)
    codes = np.where(nan, np.uint8(0x7F), codes).astype(np.uint8)
    return codes, np.exp2(k.astype(np.float64)).astype(np.float32)
