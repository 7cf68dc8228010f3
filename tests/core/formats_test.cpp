// Number formats: hand-computed encodings, exhaustive round trips, and the block quantizers.
#include "megamoe/formats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace megamoe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

float pow2(int exponent) { return std::ldexp(1.0f, exponent); }

// ---- E4M3 --------------------------------------------------------------------------------------

TEST(E4M3, EncodesHandComputedValues) {
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);     // exponent field 7 (bias 7), mantissa 0
  EXPECT_EQ(float_to_e4m3(-1.0f), 0xB8);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);   // 1.75 * 2^8, the largest finite value
  EXPECT_EQ(float_to_e4m3(-448.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3(1.5f), 0x3C);
  EXPECT_EQ(float_to_e4m3(2.0f), 0x40);
  EXPECT_EQ(float_to_e4m3(pow2(-6)), 0x08);  // smallest normal
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(E4M3, SaturatesAndMapsNaN) {
  EXPECT_EQ(float_to_e4m3(500.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);  // halfway to the next (absent) step: still saturates
  EXPECT_EQ(float_to_e4m3(1.0e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(kInf), 0x7E);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xFE);
  EXPECT_EQ(float_to_e4m3(kNaN), 0x7F);
  EXPECT_EQ(float_to_e4m3(-kNaN), 0x7F);
}

TEST(E4M3, RoundsSubnormalsToNearestEven) {
  EXPECT_EQ(float_to_e4m3(pow2(-9)), 0x01);         // smallest subnormal
  EXPECT_EQ(float_to_e4m3(pow2(-10)), 0x00);        // halfway between 0 and 2^-9: ties to even 0
  EXPECT_EQ(float_to_e4m3(3.0f * pow2(-10)), 0x02); // halfway between 1 and 2 steps: ties to even 2
  EXPECT_EQ(float_to_e4m3(5.0f * pow2(-10)), 0x02); // halfway between 2 and 3 steps: ties to even 2
  EXPECT_EQ(float_to_e4m3(std::nextafter(pow2(-10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(7.0f * pow2(-9)), 0x07);  // largest subnormal
  // 0.015 is 7.68 steps of 2^-9: rounds to 8 steps, which is the smallest normal 2^-6 (0x08).
  EXPECT_EQ(float_to_e4m3(0.015f), 0x08);
  EXPECT_EQ(float_to_e4m3(7.5f * pow2(-9)), 0x08);  // tie between 7 (odd) and 8 steps
  EXPECT_EQ(float_to_e4m3(-3.0f * pow2(-10)), 0x82);
}

TEST(E4M3, FlushesTinyValuesToSignedZero) {
  EXPECT_EQ(float_to_e4m3(bits_float(0x00000001u)), 0x00);  // smallest FP32 subnormal
  EXPECT_EQ(float_to_e4m3(bits_float(0x007FFFFFu)), 0x00);  // largest FP32 subnormal
  EXPECT_EQ(float_to_e4m3(bits_float(0x80000001u)), 0x80);
  EXPECT_EQ(float_to_e4m3(pow2(-20)), 0x00);
}

TEST(E4M3, RoundsNormalsToNearestEven) {
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);  // 1 + 1/16: halfway between 1 and 1.125, even is 1
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);  // 1 + 3/16: halfway between 1.125 and 1.25, even is 1.25
  EXPECT_EQ(float_to_e4m3(1.07f), 0x39);    // above the tie rounds up
  EXPECT_EQ(float_to_e4m3(1.9375f), 0x40);  // 1.875 + 1/16: tie, even carries into the next binade (2.0)
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7E);   // halfway between 416 (odd) and 448: even is 448
  EXPECT_EQ(float_to_e4m3(400.0f), 0x7C);   // halfway between 384 (even) and 416: 384
}

TEST(E4M3, DecodesHandComputedValues) {
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), pow2(-9));
  EXPECT_EQ(e4m3_to_float(0x07), 7.0f * pow2(-9));
  EXPECT_EQ(e4m3_to_float(0x08), pow2(-6));
  EXPECT_EQ(e4m3_to_float(0x3A), 1.25f);
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(E4M3, EveryCodeRoundTrips) {
  int nan_codes = 0;
  for (int code = 0; code < 256; ++code) {
    const float value = e4m3_to_float(static_cast<uint8_t>(code));
    if (code == 0x7F || code == 0xFF) {
      ++nan_codes;
      EXPECT_TRUE(std::isnan(value)) << "code " << code;
      EXPECT_EQ(float_to_e4m3(value), kE4M3NaN) << "code " << code;
    } else {
      EXPECT_TRUE(std::isfinite(value)) << "code " << code;
      EXPECT_EQ(float_to_e4m3(value), code) << "code " << code << " value " << value;
    }
  }
  EXPECT_EQ(nan_codes, 2);
}

TEST(E4M3, DecodedValuesIncreaseWithTheCode) {
  for (int code = 1; code < 0x7F; ++code) {
    EXPECT_LT(e4m3_to_float(static_cast<uint8_t>(code - 1)), e4m3_to_float(static_cast<uint8_t>(code)));
  }
}

// Every float between two neighbouring codes goes to the nearer one (ties to the even code).
TEST(E4M3, RandomValuesRoundToTheNearestCode) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> magnitude(-12.0f, 9.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float value = std::exp2(magnitude(rng));
    const uint8_t code = float_to_e4m3(value);
    const float rounded = e4m3_to_float(code);
    const float below = code > 0 ? e4m3_to_float(static_cast<uint8_t>(code - 1)) : rounded;
    const float above = code < 0x7E ? e4m3_to_float(static_cast<uint8_t>(code + 1)) : rounded;
    const double error = std::fabs(static_cast<double>(rounded) - value);
    if (value <= kE4M3Max) {
      EXPECT_LE(error, std::fabs(static_cast<double>(below) - value)) << value;
      EXPECT_LE(error, std::fabs(static_cast<double>(above) - value)) << value;
    } else {
      EXPECT_EQ(code, 0x7E) << value;
    }
  }
}

// ---- E2M1 --------------------------------------------------------------------------------------

TEST(E2M1, AllCodesDecode) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 8; ++code) {
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(code)), expected[code]) << code;
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(code | 0x8)), -expected[code]) << code;
    EXPECT_EQ(float_to_e2m1(expected[code]), code);
    EXPECT_EQ(float_to_e2m1(-expected[code]), code | 0x8);
  }
  EXPECT_TRUE(std::signbit(e2m1_to_float(0x8)));
}

TEST(E2M1, RoundsTiesToEven) {
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.25f)), 0.0f);  // between 0 and 0.5
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.75f)), 1.0f);  // between 0.5 (odd) and 1
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.25f)), 1.0f);  // between 1 and 1.5 (odd)
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.75f)), 2.0f);  // between 1.5 and 2
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(2.5f)), 2.0f);   // between 2 and 3 (odd)
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(3.5f)), 4.0f);   // between 3 and 4
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(5.0f)), 4.0f);   // between 4 and 6 (odd)
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(-5.0f)), -4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.26f)), 0.5f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(5.01f)), 6.0f);
  EXPECT_EQ(float_to_e2m1(0.1f), 0x0);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);
}

TEST(E2M1, Saturates) {
  EXPECT_EQ(float_to_e2m1(7.0f), 0x7);
  EXPECT_EQ(float_to_e2m1(6.5f), 0x7);
  EXPECT_EQ(float_to_e2m1(1.0e20f), 0x7);
  EXPECT_EQ(float_to_e2m1(kInf), 0x7);
  EXPECT_EQ(float_to_e2m1(-kInf), 0xF);
  EXPECT_EQ(float_to_e2m1(-7.0f), 0xF);
}

// ---- UE8M0 and the MXFP4 scale choice ------------------------------------------------------------

TEST(UE8M0, Decodes) {
  EXPECT_EQ(ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(ue8m0_to_float(128), 2.0f);
  EXPECT_EQ(ue8m0_to_float(126), 0.5f);
  EXPECT_EQ(ue8m0_to_float(1), pow2(-126));
  EXPECT_EQ(ue8m0_to_float(0), pow2(-127));  // an FP32 subnormal
  EXPECT_GT(ue8m0_to_float(0), 0.0f);
  EXPECT_EQ(ue8m0_to_float(254), pow2(127));
  EXPECT_TRUE(std::isnan(ue8m0_to_float(0xFF)));
}

TEST(Mxfp4Scale, HandComputedValues) {
  EXPECT_EQ(mxfp4_scale_for_amax(6.0f), 127);       // 6 / 1 = 6 fits exactly
  EXPECT_EQ(mxfp4_scale_for_amax(6.0001f), 128);    // needs 2
  EXPECT_EQ(mxfp4_scale_for_amax(3.0f), 126);       // 3 / 0.5 = 6
  EXPECT_EQ(mxfp4_scale_for_amax(0.0f), 127);       // all-zero block: 2^0
  EXPECT_EQ(mxfp4_scale_for_amax(4.0f), 127);       // 4 / 1 = 4; 4 / 0.5 = 8 would saturate
  EXPECT_EQ(mxfp4_scale_for_amax(8.0f), 128);       // 8 / 2 = 4
  EXPECT_EQ(mxfp4_scale_for_amax(12.0f), 128);      // 12 / 2 = 6
  EXPECT_EQ(mxfp4_scale_for_amax(std::nextafter(12.0f, kInf)), 129);
  EXPECT_EQ(mxfp4_scale_for_amax(0.75f), 124);      // 0.75 / 2^-3 = 6
  EXPECT_EQ(mxfp4_scale_for_amax(std::nextafter(0.75f, kInf)), 125);
  EXPECT_EQ(mxfp4_scale_for_amax(std::nextafter(4.0f, kInf)), 127);  // just above a power of two
  EXPECT_EQ(mxfp4_scale_for_amax(std::nextafter(2.0f, kInf)), 126);
  EXPECT_EQ(mxfp4_scale_for_amax(6.0f * pow2(126)), 253);                    // 2^126
  EXPECT_EQ(mxfp4_scale_for_amax(std::numeric_limits<float>::max()), 253);  // ~2^128 / 2^126 = 4
}

// For any amax the scale is the smallest power of two that keeps amax / scale within 6.
TEST(Mxfp4Scale, IsTheSmallestNonSaturatingPowerOfTwo) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exponent(-100.0f, 100.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float amax = std::exp2(exponent(rng));
    const uint8_t code = mxfp4_scale_for_amax(amax);
    ASSERT_GT(code, 1);
    ASSERT_LT(code, 254);
    EXPECT_LE(amax / ue8m0_to_float(code), kE2M1Max) << amax;
    EXPECT_GT(amax / ue8m0_to_float(static_cast<uint8_t>(code - 1)), kE2M1Max) << amax;
  }
}

// ---- BF16 --------------------------------------------------------------------------------------

TEST(BF16, RoundsTiesToEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(1.0f + pow2(-8)), 0x3F80);         // halfway between 1 and 1 + 2^-7: even is 1
  EXPECT_EQ(float_to_bf16(1.0f + 3.0f * pow2(-8)), 0x3F82);  // halfway between 1 + 2^-7 (odd) and 1 + 2^-6
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + pow2(-8), 2.0f)), 0x3F81);
  EXPECT_EQ(float_to_bf16(-1.0f - pow2(-8)), 0xBF80);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
}

TEST(BF16, SpecialValues) {
  EXPECT_EQ(float_to_bf16(kNaN), 0x7FFF);
  EXPECT_EQ(float_to_bf16(-kNaN), 0x7FFF);
  EXPECT_EQ(float_to_bf16(bits_float(0x7F800001u)), 0x7FFF);  // a NaN whose payload would round away
  EXPECT_EQ(float_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xFF80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to infinity
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7FFF)));
  EXPECT_EQ(bf16_to_float(0x7F80), kInf);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
}

TEST(BF16, EveryNonNaNCodeRoundTrips) {
  for (uint32_t code = 0; code < 0x10000u; ++code) {
    const uint16_t bits = static_cast<uint16_t>(code);
    if ((bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu) != 0) continue;  // NaN
    ASSERT_EQ(float_to_bf16(bf16_to_float(bits)), bits) << "code " << code;
  }
}

// ---- FP8 block quantizer -------------------------------------------------------------------------

TEST(Fp8BlockQuantizer, AllZeroBlockGivesZerosAndAFiniteScale) {
  const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(0.0f);
  EXPECT_TRUE(std::isfinite(quantizer.scale));
  EXPECT_GT(quantizer.scale, 0.0f);
  EXPECT_TRUE(std::isnormal(quantizer.scale));
  EXPECT_TRUE(std::isfinite(quantizer.inverse_scale));
  EXPECT_EQ(quantizer.quantize(0.0f), 0x00);
  EXPECT_EQ(quantizer.quantize(-0.0f), 0x80);
}

TEST(Fp8BlockQuantizer, ExactlyRepresentableBlockRoundTrips) {
  for (const float scale : {0.125f, 3.0f, 0.01171875f}) {
    const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(kE4M3Max * scale);
    EXPECT_EQ(quantizer.scale, scale);
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) == 0x7F) continue;
      const float value = e4m3_to_float(static_cast<uint8_t>(code)) * scale;
      EXPECT_EQ(quantizer.quantize(value), code) << "scale " << scale << " code " << code;
    }
  }
}

TEST(Fp8BlockQuantizer, ScaleIsAmaxOver448) {
  const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(3.5f);
  EXPECT_FLOAT_EQ(quantizer.scale, 3.5f / 448.0f);
  EXPECT_EQ(quantizer.quantize(3.5f), 0x7E);
  EXPECT_EQ(quantizer.quantize(-3.5f), 0xFE);
}

TEST(Fp8BlockQuantizer, NaNPropagatesToANaNCode) {
  const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(2.0f);
  EXPECT_EQ(quantizer.quantize(kNaN), kE4M3NaN);
  EXPECT_TRUE(std::isnan(e4m3_to_float(quantizer.quantize(kNaN))));
}

}  // namespace
}  // namespace megamoe
