// MX activations (E4M3 + UE8M0 per 32) converted to 1x128 blocks (megamoe/mx.h): the block scale is
// the smallest power of two that holds the block, codes are exact wherever the values are
// representable, and the edge cases keep their documented meaning.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/mx.h"

namespace megamoe {
namespace {

constexpr int kHidden = 256;  // two 1x128 blocks, eight MX groups

struct Converted {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

Converted convert(const std::vector<uint8_t>& x, const std::vector<uint8_t>& sf, int64_t tokens = 1) {
  Converted out{std::vector<uint8_t>(x.size()), std::vector<float>(static_cast<size_t>(tokens * kHidden / 128))};
  convert_mx_activations_host(x.data(), sf.data(), tokens, kHidden, out.codes.data(), out.scales.data());
  return out;
}

double mx_value(uint8_t code, uint8_t scale) { return double(e4m3_to_float(code)) * std::ldexp(1.0, int(scale) - 127); }

TEST(MxActivations, OneScaleAtTheTopKeepsEveryCode) {
  // All groups at 2^0 and a 448 in each block: the block scale is 1 and nothing moves.
  std::vector<uint8_t> x(kHidden), sf(kHidden / 32, 127);
  for (int c = 0; c < kHidden; ++c) x[c] = static_cast<uint8_t>(c % 255 == 0x7F ? 0x10 : c % 255);
  x[0] = 0x7E;
  x[128] = 0xFE;  // -448
  const Converted out = convert(x, sf);
  EXPECT_EQ(out.codes, x);
  EXPECT_EQ(out.scales, (std::vector<float>{1.0f, 1.0f}));
}

TEST(MxActivations, GroupsBelowTheLargestShiftDownExactly) {
  // Block 0: group 0 at 2^3 holds 448 (3584); groups 1-3 at 2^0. The block scale is 2^3; group 0's
  // codes stay, the others' values are divided by 8.
  std::vector<uint8_t> x(kHidden, 0), sf(kHidden / 32, 127);
  sf[0] = 130;
  x[0] = 0x7E;             // 448 * 8
  x[32] = 0x40;            // 2.0 -> 0.25 = 0x28
  x[33] = 0xC0;            // -2.0 -> -0.25 = 0xA8
  x[34] = 0x7E;            // 448 -> 56 = 0x5E (E=11: 14 * 2^(11-10)... (8+6) * 2^2 = 56)
  x[35] = 0x0C;            // 12 * 2^-9 -> 1.5 * 2^-9, a tie between subnormals 1 and 2: the even 2
  x[36] = 0x04;            // 2^-7 -> 2^-10, a tie between 0 and 2^-9: the even 0
  x[37] = 0x01;            // 2^-9 -> 2^-12: rounds to 0
  x[38] = 0x81;            // -2^-9 -> -0 (the sign stays)
  const Converted out = convert(x, sf);
  EXPECT_EQ(out.scales[0], 8.0f);
  EXPECT_EQ(out.codes[0], 0x7E);
  EXPECT_EQ(out.codes[32], 0x28);
  EXPECT_EQ(out.codes[33], 0xA8);
  EXPECT_EQ(e4m3_to_float(out.codes[34]), 56.0f);
  EXPECT_EQ(out.codes[35], 0x02);
  EXPECT_EQ(out.codes[36], 0x00);
  EXPECT_EQ(out.codes[37], 0x00);
  EXPECT_EQ(out.codes[38], 0x80);
  // Block 1 is all zeros: scale 1, codes unchanged.
  EXPECT_EQ(out.scales[1], 1.0f);
  for (int c = 128; c < kHidden; ++c) EXPECT_EQ(out.codes[c], 0) << c;
}

TEST(MxActivations, ALargestMantissaOfFifteenEighthsTakesTheNextScale) {
  // 240 (0x77, mantissa 15/8) at 2^1 is 480 > 448: the block scale must be 2, not 1.
  std::vector<uint8_t> x(kHidden, 0), sf(kHidden / 32, 127);
  sf[1] = 128;
  x[40] = 0x77;
  x[0] = 0x7E;  // 448 at 2^0 in group 0 stays below 480
  const Converted out = convert(x, sf);
  EXPECT_EQ(out.scales[0], 2.0f);
  EXPECT_EQ(out.codes[40], 0x77);                   // 480 / 2 = 240
  EXPECT_EQ(e4m3_to_float(out.codes[0]), 224.0f);  // 448 / 2
}

TEST(MxActivations, SmallBlocksScaleUpInsteadOfLosingBits) {
  // Every group at 2^-20 with values up to 1.0: the block scale is 2^-28 (1.0 * 2^-20 lands on 256),
  // so even the smallest subnormal code 2^-9 becomes 2^-1 and stays exact.
  std::vector<uint8_t> x(kHidden, 0), sf(kHidden / 32, 107);
  x[0] = 0x38;  // 1.0
  x[1] = 0x01;  // 2^-9
  x[2] = 0x85;  // -5 * 2^-9
  const Converted out = convert(x, sf);
  EXPECT_EQ(out.scales[0], std::ldexp(1.0f, -28));
  for (int c = 0; c < 3; ++c)
    EXPECT_EQ(double(e4m3_to_float(out.codes[c])) * std::ldexp(1.0, -28), mx_value(x[c], 107)) << c;
}

TEST(MxActivations, NaNsAndExtremeScales) {
  std::vector<uint8_t> x(kHidden, 0x38), sf(kHidden / 32, 127);
  x[5] = 0x7F;    // a NaN code stays NaN and does not set the scale
  x[6] = 0xFF;
  sf[1] = 0xFF;   // a NaN scale makes its group NaN
  sf[4] = 0;      // block 1: group 4 at 2^-127, the rest of the block zero
  for (int c = 128; c < kHidden; ++c) x[c] = c < 160 ? 0x7E : 0;
  const Converted out = convert(x, sf);
  EXPECT_EQ(out.scales[0], std::ldexp(1.0f, -8));  // the largest value, 1.0, lands on 256
  EXPECT_EQ(out.codes[5] & 0x7F, 0x7F);
  EXPECT_EQ(out.codes[6] & 0x7F, 0x7F);
  for (int c = 32; c < 64; ++c) EXPECT_EQ(out.codes[c], 0x7F) << c;
  // 448 * 2^-127 needs 2^-127: the scale stops at the smallest normal 2^-126 and the codes halve, exactly.
  EXPECT_EQ(out.scales[1], std::ldexp(1.0f, -126));
  EXPECT_EQ(e4m3_to_float(out.codes[128]), 224.0f);
}

// Random blocks with group scales spread over 12 binades: the scale is the smallest power of two
// that holds the block, and every value that is an E4M3 value under it converts exactly.
TEST(MxActivations, RandomBlocksAreExactWhereRepresentable) {
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> code(0, 255), spread(0, 12);
  const int tokens = 64;
  std::vector<uint8_t> x(tokens * kHidden), sf(tokens * kHidden / 32);
  for (auto& c : x) {
    c = static_cast<uint8_t>(code(rng));
    if ((c & 0x7F) == 0x7F) c = 0x3C;
  }
  for (auto& s : sf) s = static_cast<uint8_t>(120 + spread(rng));
  const Converted out = convert(x, sf, tokens);
  int exact = 0, rounded = 0;
  for (int t = 0; t < tokens; ++t) {
    for (int b = 0; b < kHidden / 128; ++b) {
      const double scale = out.scales[t * 2 + b];
      double largest = 0;
      for (int c = 0; c < 128; ++c) {
        const size_t i = size_t(t) * kHidden + b * 128 + c;
        largest = std::max(largest, std::fabs(mx_value(x[i], sf[i / 32])));
      }
      ASSERT_LE(largest / scale, 448.0);
      ASSERT_GT(largest / scale, 224.0) << "the scale is not the smallest";
      for (int c = 0; c < 128; ++c) {
        const size_t i = size_t(t) * kHidden + b * 128 + c;
        const double want = mx_value(x[i], sf[i / 32]) / scale;
        const double got = e4m3_to_float(out.codes[i]);
        const bool representable = double(e4m3_to_float(float_to_e4m3(float(want)))) == want;
        if (representable) {
          ASSERT_EQ(got, want) << "token " << t << ", column " << b * 128 + c;
          ++exact;
        } else {
          ASSERT_EQ(out.codes[i], float_to_e4m3(float(want)));  // nearest even
          ASSERT_LT(std::fabs(want), 0.015625) << "only values below E4M3's normals may round";
          ++rounded;
        }
      }
    }
  }
  EXPECT_GT(exact, 0);
  EXPECT_GT(rounded, 0);
}

TEST(MxActivations, ArgumentErrorsNameTheArgument) {
  std::vector<uint8_t> x(100), sf(4);
  std::vector<float> scales(1);
  try {
    convert_mx_activations_host(x.data(), sf.data(), 1, 100, x.data(), scales.data());
    FAIL() << "expected megamoe::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megamoe
