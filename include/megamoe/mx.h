// MX activations: E4M3 values with one UE8M0 scale (a power of two) per 32, as DeepGEMM's MegaMoE
// takes them in its fp8_fp4 recipe (1, 1, 32), converted to this library's 1x128 blocks (E4M3 values
// with one FP32 scale per 128).
//
// Per 1x128 block (4 MX groups g with UE8M0 codes u_g and values v = e4m3(code) * 2^(u_g - 127)):
//   - the block scale S = 2^k is the smallest power of two with |v| / S <= 448 for every value of the
//     block (so the largest lands in (224, 448]), k clamped to [-126, 127] so that S is a normal FP32;
//     a block of zeros and NaNs gets S = 1;
//   - each code becomes E4M3(v / S), rounded to nearest even.
// v / S is exact whenever it is an E4M3 value: always for values at least 2^-13 times the block's largest
// magnitude (E4M3 normals start at 2^-6 and the codes carry 3 mantissa bits), and for smaller ones as
// far as E4M3's subnormals (steps of 2^-9) hold their bits; the rest round to nearest even, as
// fp8_fp4's expansion of MXFP4 weights does (below 2^-10 * S, to zero). Zeros keep their sign, NaN
// codes stay NaN, and a NaN scale (code 0xFF) makes its group's codes NaN. The host and the device
// use the functions below and give the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/config.h"
#include "megamoe/formats.h"
#include "megamoe/tensor.h"

namespace megamoe {

inline constexpr uint8_t kUe8m0NaN = 0xFF;

// An ordering key of |value| of one E4M3 code under UE8M0 scale `scale_code`: |value| = q * 2^p with q
// in [8, 15]; the key is 16 p + q (monotonic in |value|). Zeros, NaN codes and NaN scales give kMxNoKey.
inline constexpr int32_t kMxNoKey = -(1 << 30);
MEGAMOE_HD int32_t mx_magnitude_key(uint8_t code, uint8_t scale_code) {
  const uint32_t magnitude = code & 0x7Fu;
  if (magnitude == 0 || magnitude == kE4M3NaN || scale_code == kUe8m0NaN) return kMxNoKey;
  const int32_t exponent = static_cast<int32_t>(magnitude >> 3);
  int32_t q = static_cast<int32_t>(magnitude & 7u);
  int32_t p = -9;  // subnormal: q * 2^-9
  if (exponent > 0) {
    q += 8;
    p = exponent - 10;  // (8 + m) * 2^(e - 10)
  } else {
    while (q < 8) {
      q *= 2;
      --p;
    }
  }
  return 16 * (p + static_cast<int32_t>(scale_code) - 127) + q;
}

// The block exponent k (S = 2^k) for the largest key of a block (kMxNoKey: none, k = 0).
MEGAMOE_HD int32_t mx_block_exponent(int32_t max_key) {
  if (max_key == kMxNoKey) return 0;
  // max_key = 16 p + q with q in [8, 15]: q * 2^(p - k) <= 448 = 14 * 2^5 needs k >= p - 5 (q <= 14) or p - 4.
  const int32_t q = ((max_key % 16) + 16) % 16;
  const int32_t p = (max_key - q) / 16;
  int32_t k = q <= 14 ? p - 5 : p - 4;
  if (k < -126) k = -126;
  if (k > 127) k = 127;
  return k;
}

MEGAMOE_HD float mx_block_scale(int32_t block_exponent) {
  return bits_float(static_cast<uint32_t>(block_exponent + 127) << 23);
}

// One code of a group with UE8M0 scale `scale_code`, re-expressed under the block scale 2^k.
MEGAMOE_HD uint8_t mx_rescale_e4m3(uint8_t code, uint8_t scale_code, int32_t block_exponent) {
  if (scale_code == kUe8m0NaN || (code & 0x7Fu) == kE4M3NaN) return kE4M3NaN;
  const int32_t shift = static_cast<int32_t>(scale_code) - 127 - block_exponent;  // value / S = e4m3 * 2^shift
  const uint8_t sign = code & 0x80u;
  if (shift < -40) return sign;      // below 2^-31: rounds to zero
  const int32_t up = shift > 20 ? 20 : shift;  // only a clamped k lets a shift pass 5; 448 * 2^20 saturates
  return float_to_e4m3(e4m3_to_float(code) * bits_float(static_cast<uint32_t>(up + 127) << 23));
}

// Host conversion of `tokens` rows of `hidden` values (hidden a multiple of 128): x [tokens][hidden]
// E4M3 codes, scales [tokens][hidden / 32] UE8M0 codes -> x_out (may equal x) and x_scales
// [tokens][hidden / 128] FP32.
void convert_mx_activations_host(const uint8_t* x, const uint8_t* scales, int64_t tokens, int64_t hidden,
                                 uint8_t* x_out, float* x_scales);

// The same on the device, asynchronously on `stream` (no allocation, capturable in a CUDA graph):
//   x [T, H] e4m3 (or u8), scales [T, H / 32] ue8m0 (or u8), x_out [T, H] e4m3 (may alias x),
//   x_scales [T, H / 128] f32, all CUDA tensors, contiguous. Argument errors throw megamoe::Error
//   naming the argument. Writing x_out and x_scales into SymmBuffer's input regions
//   (buffer_input_views, layer.h) feeds the layer with no further copy.
void convert_mx_activations(const TensorView& x, const TensorView& scales, const TensorView& x_out,
                            const TensorView& x_scales, cudaStream_t stream);

}  // namespace megamoe
