// Number formats shared by host and device: the CPU reference and the kernels quantize with the
// same functions, so both sides produce the same bits (tests/core/formats_test.cpp checks the
// values, tests/gpu/formats_gpu_test.cu checks the device's hardware conversions against them).
#pragma once

#include <cstdint>
#include <cstring>

#include "megamoe/config.h"

namespace megamoe {

MEGAMOE_HD uint32_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  return bits;
}

MEGAMOE_HD float bits_float(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
}

// Shifts `value` right by `shift` bits, rounding to nearest with ties to even.
MEGAMOE_HD uint32_t shift_right_rne(uint32_t value, int shift) {
  if (shift <= 0) return value;
  if (shift > 31) return 0;
  const uint32_t kept = value >> shift;
  const uint32_t dropped = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
}

// ---- BF16 -------------------------------------------------------------------------------------

// Round to nearest even; NaN becomes 0x7FFF, as the device's cvt.rn.bf16.f32 gives.
MEGAMOE_HD uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

MEGAMOE_HD float bf16_to_float(uint16_t value) { return bits_float(static_cast<uint32_t>(value) << 16); }

// ---- FP8 E4M3 (OCP "fn": no infinities, 0x7F/0xFF are NaN, largest finite 448) ----------------

inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3NaN = 0x7F;

// Round to nearest even with saturation to +-448 (infinities too); NaN becomes 0x7F.
// Matches cvt.rn.satfinite.e4m3x2.f32.
MEGAMOE_HD uint8_t float_to_e4m3(float value) {
  const uint32_t bits = float_bits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return kE4M3NaN;
  if (magnitude >= 0x43E00000u) return sign | 0x7E;  // |x| >= 448
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent < -126) return sign;  // FP32 subnormals are far below E4M3's smallest step (2^-9)
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;  // value = mantissa * 2^(exponent-23)
  if (exponent < -6) {
    // E4M3 subnormal: count of 2^-9 steps; a carry into 8 steps yields 0x08, the smallest normal.
    return sign | static_cast<uint8_t>(shift_right_rne(mantissa, 14 - exponent));
  }
  // Normal: keep 3 mantissa bits; a rounding carry into the hidden bit bumps the exponent field.
  const uint32_t rounded = shift_right_rne(mantissa, 20);  // in [8, 16]
  uint32_t code = (static_cast<uint32_t>(exponent + 7) << 3) + (rounded - 8u);
  if (code > 0x7Eu) code = 0x7E;  // rounding up past 448 saturates
  return sign | static_cast<uint8_t>(code);
}

MEGAMOE_HD float e4m3_to_float(uint8_t code) {
  const float sign = (code & 0x80u) ? -1.0f : 1.0f;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xF && mantissa == 0x7) return bits_float(0x7FC00000u);
  if (exponent == 0) return sign * static_cast<float>(mantissa) * (1.0f / 512.0f);
  // (8 + m) * 2^(e - 10), built exactly from bits.
  return sign * static_cast<float>(8u + mantissa) * bits_float((exponent - 10u + 127u) << 23);
}

// ---- FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN, no infinity) ------------------------

inline constexpr float kE2M1Max = 6.0f;

MEGAMOE_HD float e2m1_to_float(uint8_t code) {
  const float sign = (code & 0x8u) ? -1.0f : 1.0f;
  const uint32_t exponent = (code >> 1) & 0x3u;
  const uint32_t mantissa = code & 0x1u;
  if (exponent == 0) return sign * 0.5f * static_cast<float>(mantissa);
  return sign * static_cast<float>(2u + mantissa) * static_cast<float>(1u << exponent) * 0.25f;
}

// Round to nearest even with saturation to +-6. E2M1 has no NaN: a NaN input gives +0 here, and
// the weight quantizers reject NaN before they get this far.
MEGAMOE_HD uint8_t float_to_e2m1(float value) {
  const uint32_t bits = float_bits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0;
  if (magnitude >= 0x40C00000u) return sign | 0x7;  // |x| >= 6
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent < -3) return sign;  // below 0.125: rounds to zero
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  if (exponent < 0) {
    // Subnormal range [0, 1): count of 0.5 steps; 2 steps carry into code 2 (1.0).
    return sign | static_cast<uint8_t>(shift_right_rne(mantissa, 22 - exponent));
  }
  const uint32_t rounded = shift_right_rne(mantissa, 22);  // in [2, 4]
  uint32_t code = (static_cast<uint32_t>(exponent + 1) << 1) + (rounded - 2u);
  if (code > 0x7u) code = 0x7;
  return sign | static_cast<uint8_t>(code);
}

// ---- UE8M0 (an unsigned power of two, 2^(code - 127); 0xFF is NaN) ------------------------------

MEGAMOE_HD float ue8m0_to_float(uint8_t code) {
  if (code == 0xFF) return bits_float(0x7FC00000u);
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 is an FP32 subnormal
  return bits_float(static_cast<uint32_t>(code) << 23);
}

// The smallest power of two s with amax / s <= kE2M1Max, so no value of the block saturates.
// An all-zero block gets 2^0.
MEGAMOE_HD uint8_t mxfp4_scale_for_amax(float amax) {
  if (!(amax > 0.0f)) return 127;
  int code = static_cast<int>((float_bits(amax) >> 23) & 0xFFu) - 2;  // first guess: 2^(e-2) ~ amax / 6
  if (code < 1) code = 1;
  while (code > 1 && amax <= kE2M1Max * ue8m0_to_float(static_cast<uint8_t>(code - 1))) --code;
  while (code < 254 && amax > kE2M1Max * ue8m0_to_float(static_cast<uint8_t>(code))) ++code;
  return static_cast<uint8_t>(code);
}

// ---- FP8 activation blocks: one FP32 scale per 1x128 values -----------------------------------

// Blocks whose largest magnitude is below this use it instead, so the scale stays a normal float.
inline constexpr float kMinScaleAmax = 1.0e-12f;

struct Fp8BlockQuantizer {
  float inverse_scale;  // multiplies a value before rounding to E4M3
  float scale;          // what is stored: value ~ e4m3 * scale

  MEGAMOE_HD static Fp8BlockQuantizer from_amax(float amax) {
    const float clamped = amax > kMinScaleAmax ? amax : kMinScaleAmax;
    return {kE4M3Max / clamped, clamped / kE4M3Max};
  }
  MEGAMOE_HD uint8_t quantize(float value) const { return float_to_e4m3(value * inverse_scale); }
};

}  // namespace megamoe
