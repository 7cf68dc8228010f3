// Expert weights: the W1 row permutation, canonical <-> transformed layouts, quantization error
// bounds, validation messages, and concatenation of shared experts.
#include "megamoe/weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

constexpr Recipe kRecipes[] = {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16};

// A canonical expert of random bits with valid scales: transforms must move bits, not values.
StoredExpert random_canonical(Recipe recipe, int32_t hidden, int32_t intermediate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 4.0f);
  std::uniform_int_distribution<int> exponent(100, 140);
  const StoredExpertSizes sizes = canonical_sizes(recipe, hidden, intermediate);
  StoredExpert e;
  e.hidden = hidden;
  e.intermediate = intermediate;
  e.w1.resize(sizes.w1);
  e.w2.resize(sizes.w2);
  for (uint8_t& b : e.w1) b = static_cast<uint8_t>(byte(rng));
  for (uint8_t& b : e.w2) b = static_cast<uint8_t>(byte(rng));
  if (recipe == Recipe::fp8) {
    e.w1_scales.resize(sizes.w1_scales / sizeof(float));
    e.w2_scales.resize(sizes.w2_scales / sizeof(float));
    for (float& s : e.w1_scales) s = scale(rng);
    for (float& s : e.w2_scales) s = scale(rng);
  } else if (recipe == Recipe::fp8_fp4) {
    e.w1_mx_scales.resize(sizes.w1_scales);
    e.w2_mx_scales.resize(sizes.w2_scales);
    for (uint8_t& s : e.w1_mx_scales) s = static_cast<uint8_t>(exponent(rng));
    for (uint8_t& s : e.w2_mx_scales) s = static_cast<uint8_t>(exponent(rng));
  }
  return e;
}

// Random FP32 weights whose magnitudes span 2^-12..2^2, so every block mixes large values with
// values deep in E4M3's subnormal range relative to the block's amax.
DenseExpert random_dense(int32_t hidden, int32_t intermediate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 2);
  DenseExpert d;
  d.hidden = hidden;
  d.intermediate = intermediate;
  d.w1.resize(2ull * intermediate * hidden);
  d.w2.resize(1ull * hidden * intermediate);
  for (float& v : d.w1) v = std::ldexp(normal(rng), exponent(rng));
  for (float& v : d.w2) v = std::ldexp(normal(rng), exponent(rng));
  return d;
}

void expect_same_bits(const StoredExpert& a, const StoredExpert& b) {
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.intermediate, b.intermediate);
  EXPECT_TRUE(a.w1 == b.w1);
  EXPECT_TRUE(a.w2 == b.w2);
  EXPECT_TRUE(a.w1_mx_scales == b.w1_mx_scales);
  EXPECT_TRUE(a.w2_mx_scales == b.w2_mx_scales);
  ASSERT_EQ(a.w1_scales.size(), b.w1_scales.size());
  ASSERT_EQ(a.w2_scales.size(), b.w2_scales.size());
  for (size_t i = 0; i < a.w1_scales.size(); ++i) EXPECT_EQ(float_bits(a.w1_scales[i]), float_bits(b.w1_scales[i]));
  for (size_t i = 0; i < a.w2_scales.size(); ++i) EXPECT_EQ(float_bits(a.w2_scales[i]), float_bits(b.w2_scales[i]));
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

void expect_message(const std::string& message, const std::vector<std::string>& pieces) {
  ASSERT_FALSE(message.empty()) << "no error thrown";
  for (const std::string& piece : pieces) EXPECT_NE(message.find(piece), std::string::npos) << message;
}

// ---- The W1 row permutation -------------------------------------------------------------------

TEST(L1CanonicalRow, IsABijection) {
  for (int32_t intermediate : {128, 256, 384, 2048}) {
    std::vector<int> hits(2 * intermediate, 0);
    for (int32_t row = 0; row < 2 * intermediate; ++row) {
      const int32_t canonical = l1_canonical_row(row, intermediate);
      ASSERT_GE(canonical, 0);
      ASSERT_LT(canonical, 2 * intermediate);
      ++hits[canonical];
    }
    for (int32_t row = 0; row < 2 * intermediate; ++row) EXPECT_EQ(hits[row], 1) << "I " << intermediate << " row " << row;
  }
}

TEST(L1CanonicalRow, HandTable) {
  // I = 128: one tile [gate 0..63][up 0..63][gate 64..127][up 64..127]; up channel c is row 128 + c.
  const int32_t table_128[][2] = {{0, 0},     {63, 63},   {64, 128},  {127, 191},
                                  {128, 64},  {129, 65},  {191, 127}, {192, 192}, {255, 255}};
  for (const auto& [row, canonical] : table_128) EXPECT_EQ(l1_canonical_row(row, 128), canonical) << row;
  // I = 256: two tiles; the second covers channels 128..255, up rows start at 256.
  const int32_t table_256[][2] = {{0, 0},     {64, 256},  {128, 64},  {192, 320}, {256, 128},
                                  {320, 384}, {384, 192}, {448, 448}, {511, 511}, {300, 172}, {330, 394}};
  for (const auto& [row, canonical] : table_256) EXPECT_EQ(l1_canonical_row(row, 256), canonical) << row;
}

// ---- Sizes ------------------------------------------------------------------------------------

TEST(Sizes, HandComputed) {
  // H = 256, I = 384: w1 is [768][256], w2 is [256][384].
  StoredExpertSizes s = canonical_sizes(Recipe::fp8, 256, 384);
  EXPECT_EQ(s.w1, 196608u);
  EXPECT_EQ(s.w2, 98304u);
  EXPECT_EQ(s.w1_scales, 4u * 6u * 2u);  // [768/128][256/128] f32
  EXPECT_EQ(s.w2_scales, 4u * 2u * 3u);  // [256/128][384/128]
  s = transformed_sizes(Recipe::fp8, 256, 384);
  EXPECT_EQ(s.w1, 196608u);
  EXPECT_EQ(s.w2, 98304u);
  EXPECT_EQ(s.w1_scales, 4u * 12u * 2u);  // [768/64][256/128]
  EXPECT_EQ(s.w2_scales, 4u * 4u * 3u);   // [256/64][384/128]
  for (bool transformed : {false, true}) {
    s = transformed ? transformed_sizes(Recipe::fp8_fp4, 256, 384) : canonical_sizes(Recipe::fp8_fp4, 256, 384);
    EXPECT_EQ(s.w1, 768u * 128u);
    EXPECT_EQ(s.w2, 256u * 192u);
    EXPECT_EQ(s.w1_scales, 768u * 8u);   // one UE8M0 per 32 columns
    EXPECT_EQ(s.w2_scales, 256u * 12u);
    s = transformed ? transformed_sizes(Recipe::bf16, 256, 384) : canonical_sizes(Recipe::bf16, 256, 384);
    EXPECT_EQ(s.w1, 768u * 256u * 2u);
    EXPECT_EQ(s.w2, 256u * 384u * 2u);
    EXPECT_EQ(s.w1_scales, 0u);
    EXPECT_EQ(s.w2_scales, 0u);
  }
  expect_message(error_of([] { canonical_sizes(Recipe::fp8, 200, 128); }), {"hidden", "multiple of 128", "200"});
  expect_message(error_of([] { transformed_sizes(Recipe::bf16, 128, 64); }),
                 {"intermediate", "multiple of 128", "64"});
}

// ---- Canonical <-> transformed ----------------------------------------------------------------

TEST(Transform, RoundTripsBitExactly) {
  for (Recipe recipe : kRecipes) {
    for (int32_t intermediate : {128, 384}) {
      SCOPED_TRACE(std::string(to_string(recipe)) + " I=" + std::to_string(intermediate));
      const StoredExpert canonical = random_canonical(recipe, 256, intermediate, 17u + intermediate);
      const StoredExpert transformed = transform_weights(canonical, recipe);
      const StoredExpertSizes sizes = transformed_sizes(recipe, 256, intermediate);
      EXPECT_EQ(transformed.w1.size(), sizes.w1);
      EXPECT_EQ(transformed.w2.size(), sizes.w2);
      if (recipe == Recipe::fp8) {
        EXPECT_EQ(transformed.w1_scales.size() * sizeof(float), sizes.w1_scales);
        EXPECT_EQ(transformed.w2_scales.size() * sizeof(float), sizes.w2_scales);
      }
      expect_same_bits(untransform_weights(transformed, recipe), canonical);
    }
  }
}

// Transformed row r holds canonical row l1_canonical_row(r) (and for fp8_fp4 its scale row too);
// w2 is untouched.
TEST(Transform, MovesW1RowsAndKeepsW2) {
  const int32_t hidden = 256, intermediate = 384;
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(to_string(recipe));
    const StoredExpert canonical = random_canonical(recipe, hidden, intermediate, 5);
    const StoredExpert transformed = transform_weights(canonical, recipe);
    const size_t row_bytes = canonical.w1.size() / (2 * intermediate);
    for (int32_t row = 0; row < 2 * intermediate; ++row) {
      const size_t source = static_cast<size_t>(l1_canonical_row(row, intermediate));
      ASSERT_EQ(0, memcmp(transformed.w1.data() + row * row_bytes, canonical.w1.data() + source * row_bytes,
                          row_bytes))
          << "row " << row;
      if (recipe == Recipe::fp8_fp4) {
        const size_t scales_per_row = hidden / kMxBlock;
        ASSERT_EQ(0, memcmp(transformed.w1_mx_scales.data() + row * scales_per_row,
                            canonical.w1_mx_scales.data() + source * scales_per_row, scales_per_row))
            << "scale row " << row;
      }
    }
    EXPECT_TRUE(transformed.w2 == canonical.w2);
    EXPECT_TRUE(transformed.w2_mx_scales == canonical.w2_mx_scales);
  }
}

TEST(Transform, Fp8ScalesFollowTheirRuns) {
  // I = 128, H = 256: canonical w1 blocks are [gate][up] x 2 column blocks. The transformed runs are
  // gate 0..63, up 0..63, gate 64..127, up 64..127, so their scale rows are blocks 0, 1, 0, 1.
  const StoredExpert small = random_canonical(Recipe::fp8, 256, 128, 3);
  const StoredExpert small_t = transform_weights(small, Recipe::fp8);
  const int expected_block[4] = {0, 1, 0, 1};
  for (int run = 0; run < 4; ++run) {
    for (int kb = 0; kb < 2; ++kb) {
      EXPECT_EQ(small_t.w1_scales[run * 2 + kb], small.w1_scales[expected_block[run] * 2 + kb]) << run;
    }
  }

  // In general every transformed row's scale is the scale of the canonical block holding its row.
  const int32_t hidden = 384, intermediate = 512;
  const int32_t h_blocks = hidden / 128, i_blocks = intermediate / 128;
  const StoredExpert canonical = random_canonical(Recipe::fp8, hidden, intermediate, 9);
  const StoredExpert transformed = transform_weights(canonical, Recipe::fp8);
  for (int32_t row = 0; row < 2 * intermediate; ++row) {
    const int32_t block_row = l1_canonical_row(row, intermediate) / 128;
    for (int32_t kb = 0; kb < h_blocks; ++kb) {
      ASSERT_EQ(transformed.w1_scales[(row / 64) * h_blocks + kb], canonical.w1_scales[block_row * h_blocks + kb])
          << "row " << row << " kb " << kb;
    }
  }
  // w2 scales: each canonical 128-row block's scale serves both of its 64-row halves.
  for (int32_t row = 0; row < hidden; ++row) {
    for (int32_t kb = 0; kb < i_blocks; ++kb) {
      ASSERT_EQ(transformed.w2_scales[(row / 64) * i_blocks + kb], canonical.w2_scales[(row / 128) * i_blocks + kb])
          << "row " << row << " kb " << kb;
    }
  }
}

TEST(Transform, UntransformRejectsDisagreeingScaleRuns) {
  const StoredExpert canonical = random_canonical(Recipe::fp8, 128, 128, 21);
  StoredExpert transformed = transform_weights(canonical, Recipe::fp8);
  transformed.w1_scales[2] *= 2.0f;  // run 2 (gate 64..127) no longer matches run 0 (gate 0..63)
  expect_message(error_of([&] { untransform_weights(transformed, Recipe::fp8); }),
                 {"transformed.w1_scales", "[0][0]", "disagree"});
  transformed = transform_weights(canonical, Recipe::fp8);
  transformed.w2_scales[1] = 5.0f;  // second 64-row half of block 0
  expect_message(error_of([&] { untransform_weights(transformed, Recipe::fp8); }),
                 {"transformed.w2_scales", "[0][0]", "disagree"});
}

TEST(Transform, RejectsWrongSizes) {
  StoredExpert canonical = random_canonical(Recipe::bf16, 128, 128, 1);
  canonical.w1.pop_back();
  expect_message(error_of([&] { transform_weights(canonical, Recipe::bf16); }), {"canonical.w1", "65536", "65535"});
  // A canonical fp8 expert is not a transformed one: its scales are too few.
  const StoredExpert fp8 = random_canonical(Recipe::fp8, 128, 128, 1);
  expect_message(error_of([&] { untransform_weights(fp8, Recipe::fp8); }),
                 {"transformed.w1_scales", "must hold 16 bytes, got 8"});
}

// ---- Quantization -----------------------------------------------------------------------------

TEST(Quantize, HandComputedEncodings) {
  DenseExpert d;
  d.hidden = 128;
  d.intermediate = 128;
  d.w1.assign(256 * 128, 0.0f);
  d.w2.assign(128 * 128, 0.0f);
  d.w1[0] = 1.0f;
  d.w1[1] = -6.0f;

  // fp8: block (0, 0) has amax 6, so scale 6/448; 1.0 becomes 448/6 = 74.67, whose nearest E4M3 value
  // is 72 = 1.125 * 2^6 (exponent field 13, mantissa 1: 0x69), and -6 becomes -448 (0xFE).
  StoredExpert fp8 = quantize(d, Recipe::fp8);
  EXPECT_EQ(fp8.w1_scales[0], 6.0f / 448.0f);
  EXPECT_EQ(fp8.w1[0], 0x69);
  EXPECT_EQ(fp8.w1[1], 0xFE);
  EXPECT_EQ(fp8.w1[2], 0x00);
  EXPECT_EQ(fp8.w1_scales[1], Fp8BlockQuantizer::from_amax(0.0f).scale);  // all-zero block

  // fp8_fp4: the first 32 columns of row 0 have amax 6 -> scale 2^0 (code 127); codes 1.0 -> 0x2 and
  // -6 -> 0xF share byte 0, the even column in the low nibble.
  StoredExpert fp4 = quantize(d, Recipe::fp8_fp4);
  EXPECT_EQ(fp4.w1[0], 0xF2);
  EXPECT_EQ(fp4.w1[1], 0x00);
  EXPECT_EQ(fp4.w1_mx_scales[0], 127);
  EXPECT_EQ(fp4.w1_mx_scales[1], 127);  // all-zero group

  // bf16: 1.0 is 0x3F80, stored little endian; -6 is 0xC0C0.
  StoredExpert bf16 = quantize(d, Recipe::bf16);
  EXPECT_EQ(bf16.w1[0], 0x80);
  EXPECT_EQ(bf16.w1[1], 0x3F);
  EXPECT_EQ(bf16.w1[2], 0xC0);
  EXPECT_EQ(bf16.w1[3], 0xC0);
}

// fp8: per 128x128 block, scale s = amax / 448 and q = v / s lies in [-448, 448]. E4M3 has 3 mantissa
// bits, so rounding a normal q (|q| >= 2^-6) moves it by at most half a step, 2^-4 of its binade's
// start, hence <= 2^-4 |q|; in the subnormal range the step is 2^-9, so the error is <= 2^-10. Scaled
// back: |dequantized - v| <= 2^-4 * max(|v|, 2^-6 s), which is also <= 2^-4 amax. FP32 rounding of
// v * (448 / amax) and of code * s adds a few ulps, covered by a 2^-16 relative allowance.
TEST(Quantize, Fp8ErrorBound) {
  const int32_t hidden = 256, intermediate = 256;
  const DenseExpert dense = random_dense(hidden, intermediate, 31);
  const StoredExpert stored = quantize(dense, Recipe::fp8);
  ASSERT_NO_THROW(check_canonical(stored, Recipe::fp8, "quantized"));
  const DenseExpert back = dequantize(stored, Recipe::fp8);
  auto check = [](const std::vector<float>& original, const std::vector<float>& restored,
                  const std::vector<float>& scales, int64_t rows, int64_t cols, const char* name) {
    const int64_t col_blocks = cols / 128;
    for (int64_t rb = 0; rb < rows / 128; ++rb) {
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        float amax = 0.0f;
        int64_t amax_index = 0;
        for (int64_t r = rb * 128; r < rb * 128 + 128; ++r) {
          for (int64_t c = cb * 128; c < cb * 128 + 128; ++c) {
            if (std::fabs(original[r * cols + c]) > amax) {
              amax = std::fabs(original[r * cols + c]);
              amax_index = r * cols + c;
            }
          }
        }
        const float scale = scales[rb * col_blocks + cb];
        ASSERT_EQ(scale, Fp8BlockQuantizer::from_amax(amax).scale) << name << " block " << rb << "," << cb;
        for (int64_t r = rb * 128; r < rb * 128 + 128; ++r) {
          for (int64_t c = cb * 128; c < cb * 128 + 128; ++c) {
            const double v = original[r * cols + c];
            const double error = std::fabs(restored[r * cols + c] - v);
            const double bound = std::ldexp(std::max(std::fabs(v), std::ldexp(double{scale}, -6)), -4) *
                                 (1.0 + 1.0 / 65536);
            ASSERT_LE(error, bound) << name << " [" << r << "][" << c << "] v=" << v;
            ASSERT_LE(error, amax / 16.0) << name << " [" << r << "][" << c << "]";
          }
        }
        // The block's largest value maps to 448 and comes back up to FP32 rounding.
        EXPECT_NEAR(restored[amax_index], original[amax_index], 1e-6 * amax) << name;
      }
    }
  };
  check(dense.w1, back.w1, stored.w1_scales, 2 * intermediate, hidden, "w1");
  check(dense.w2, back.w2, stored.w2_scales, hidden, intermediate, "w2");
}

// fp8_fp4: per 32 values, s is the smallest power of two with amax / s <= 6, and q = v / s is exact.
// E2M1 steps are 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so rounding moves q by at most
// max(|q|, 1) / 4. Multiplying by s is exact too: |dequantized - v| <= max(|v|, s) / 4, with no
// allowance.
TEST(Quantize, Fp4ErrorBound) {
  const int32_t hidden = 256, intermediate = 128;
  const DenseExpert dense = random_dense(hidden, intermediate, 37);
  const StoredExpert stored = quantize(dense, Recipe::fp8_fp4);
  ASSERT_NO_THROW(check_canonical(stored, Recipe::fp8_fp4, "quantized"));
  const DenseExpert back = dequantize(stored, Recipe::fp8_fp4);
  auto check = [](const std::vector<float>& original, const std::vector<float>& restored,
                  const std::vector<uint8_t>& scales, const char* name) {
    for (size_t group = 0; group < original.size() / 32; ++group) {
      float amax = 0.0f;
      for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(original[group * 32 + j]));
      ASSERT_EQ(scales[group], mxfp4_scale_for_amax(amax)) << name << " group " << group;
      const float scale = ue8m0_to_float(scales[group]);
      for (size_t j = 0; j < 32; ++j) {
        const size_t index = group * 32 + j;
        const float error = std::fabs(restored[index] - original[index]);
        ASSERT_LE(error, std::max(std::fabs(original[index]), scale) / 4.0f) << name << " index " << index;
      }
    }
  };
  check(dense.w1, back.w1, stored.w1_mx_scales, "w1");
  check(dense.w2, back.w2, stored.w2_mx_scales, "w2");
}

// bf16: 8 significant bits, so round-to-nearest moves a value by at most 2^-8 of its binade's start.
TEST(Quantize, Bf16ErrorBound) {
  const DenseExpert dense = random_dense(128, 256, 41);
  const DenseExpert back = dequantize(quantize(dense, Recipe::bf16), Recipe::bf16);
  for (size_t i = 0; i < dense.w1.size(); ++i) {
    ASSERT_LE(std::fabs(back.w1[i] - dense.w1[i]), std::ldexp(std::fabs(dense.w1[i]), -8)) << i;
  }
  for (size_t i = 0; i < dense.w2.size(); ++i) {
    ASSERT_LE(std::fabs(back.w2[i] - dense.w2[i]), std::ldexp(std::fabs(dense.w2[i]), -8)) << i;
  }
}

// fp8_fp4 and bf16 dequantize to values they represent exactly (a power-of-two scale), so a second
// round trip returns the same values. (The fp4 scale may halve: a group whose amax rounded down to 3s
// now fits 3s / (s/2) = 6.)
TEST(Quantize, RoundTripIsIdempotentOnItsOwnOutput) {
  const DenseExpert dense = random_dense(128, 128, 43);
  for (Recipe recipe : {Recipe::fp8_fp4, Recipe::bf16}) {
    const DenseExpert once = dequantize(quantize(dense, recipe), recipe);
    const DenseExpert twice = dequantize(quantize(once, recipe), recipe);
    EXPECT_TRUE(twice.w1 == once.w1) << to_string(recipe);
    EXPECT_TRUE(twice.w2 == once.w2) << to_string(recipe);
  }
}

TEST(Quantize, RejectsNonFiniteWeights) {
  for (Recipe recipe : kRecipes) {
    DenseExpert dense = random_dense(128, 128, 47);
    dense.w1[3 * 128 + 17] = std::numeric_limits<float>::quiet_NaN();
    expect_message(error_of([&] { quantize(dense, recipe); }), {"dense.w1", "[3][17]", "finite"});
    dense = random_dense(128, 128, 47);
    dense.w2[127 * 128 + 5] = -std::numeric_limits<float>::infinity();
    expect_message(error_of([&] { quantize(dense, recipe); }), {"dense.w2", "[127][5]", "finite"});
  }
}

TEST(Quantize, RejectsWrongShapes) {
  DenseExpert dense = random_dense(128, 128, 1);
  dense.w2.resize(100);
  expect_message(error_of([&] { quantize(dense, Recipe::fp8); }), {"dense.w2", "65536", "400"});
  dense = random_dense(128, 128, 1);
  dense.hidden = 130;
  expect_message(error_of([&] { quantize(dense, Recipe::fp8); }), {"dense.hidden", "multiple of 128"});
}

// ---- check_canonical ----------------------------------------------------------------------------

TEST(CheckCanonical, AcceptsValidExperts) {
  for (Recipe recipe : kRecipes) {
    EXPECT_NO_THROW(check_canonical(random_canonical(recipe, 256, 128, 2), recipe, "expert")) << to_string(recipe);
  }
}

TEST(CheckCanonical, NamesTheWrongSize) {
  StoredExpert e = random_canonical(Recipe::fp8, 256, 128, 2);
  e.w1.resize(e.w1.size() + 1);
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }),
                 {"expert.w1:", "65536 bytes", "got 65537"});
  e = random_canonical(Recipe::fp8, 256, 128, 2);
  e.w2.clear();
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }), {"expert.w2:", "32768", "got 0"});
  e = random_canonical(Recipe::fp8, 256, 128, 2);
  e.w2_scales.push_back(1.0f);
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }),
                 {"expert.w2_scales:", "8 bytes", "got 12"});
  e = random_canonical(Recipe::fp8_fp4, 256, 128, 2);
  e.w1_mx_scales.pop_back();
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8_fp4, "expert"); }),
                 {"expert.w1_mx_scales:", "2048", "got 2047"});
  // Scales of another recipe are a mistake, not something to ignore.
  e = random_canonical(Recipe::bf16, 256, 128, 2);
  e.w1_scales = {1.0f};
  expect_message(error_of([&] { check_canonical(e, Recipe::bf16, "expert"); }), {"expert.w1_scales:", "got 4"});
  e = random_canonical(Recipe::fp8, 256, 128, 2);
  e.intermediate = 192;
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }),
                 {"expert.intermediate:", "multiple of 128", "192"});
}

TEST(CheckCanonical, NamesTheBadScale) {
  // H = 256, I = 128: w1_scales is [2][2], w2_scales is [2][1].
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 0.0f, -1.0f}) {
    StoredExpert e = random_canonical(Recipe::fp8, 256, 128, 2);
    e.w1_scales[3] = bad;
    expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }),
                   {"expert.w1_scales:", "[1][1]", "index 3", "finite and positive"});
    e = random_canonical(Recipe::fp8, 256, 128, 2);
    e.w2_scales[1] = bad;
    expect_message(error_of([&] { check_canonical(e, Recipe::fp8, "expert"); }),
                   {"expert.w2_scales:", "[1][0]", "index 1"});
  }
  StoredExpert e = random_canonical(Recipe::fp8_fp4, 256, 128, 2);
  e.w1_mx_scales[8 * 5 + 2] = 0xFF;  // row 5, group 2 (8 groups of 32 per 256-wide row)
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8_fp4, "expert"); }),
                 {"expert.w1_mx_scales:", "[5][2]", "index 42", "0xFF"});
  e = random_canonical(Recipe::fp8_fp4, 256, 128, 2);
  e.w2_mx_scales[4 * 7 + 3] = 0xFF;  // row 7, group 3 (4 groups per 128-wide row)
  expect_message(error_of([&] { check_canonical(e, Recipe::fp8_fp4, "expert"); }),
                 {"expert.w2_mx_scales:", "[7][3]"});
  // UE8M0 code 0 (2^-127) is a valid scale.
  e = random_canonical(Recipe::fp8_fp4, 256, 128, 2);
  e.w2_mx_scales[0] = 0;
  EXPECT_NO_THROW(check_canonical(e, Recipe::fp8_fp4, "expert"));
}

// ---- Shared experts -------------------------------------------------------------------------------

// y = W2 (SiLU(W1_gate x) * W1_up x), in double so only the weights' order of summation differs.
std::vector<double> mlp(const DenseExpert& e, const std::vector<float>& x) {
  const int64_t hidden = e.hidden, intermediate = e.intermediate;
  std::vector<double> h(2 * intermediate, 0.0);
  for (int64_t r = 0; r < 2 * intermediate; ++r) {
    for (int64_t c = 0; c < hidden; ++c) h[r] += static_cast<double>(e.w1[r * hidden + c]) * x[c];
  }
  std::vector<double> a(intermediate);
  for (int64_t c = 0; c < intermediate; ++c) a[c] = h[c] / (1.0 + std::exp(-h[c])) * h[intermediate + c];
  std::vector<double> y(hidden, 0.0);
  for (int64_t r = 0; r < hidden; ++r) {
    for (int64_t c = 0; c < intermediate; ++c) y[r] += static_cast<double>(e.w2[r * intermediate + c]) * a[c];
  }
  return y;
}

TEST(ConcatSharedExperts, DequantizesToTheConcatenatedWeights) {
  const int32_t hidden = 256;
  for (Recipe recipe : kRecipes) {
    for (int32_t second_intermediate : {256, 128}) {
      SCOPED_TRACE(std::string(to_string(recipe)) + " I1=" + std::to_string(second_intermediate));
      const std::vector<StoredExpert> experts = {quantize(random_dense(hidden, 256, 51), recipe),
                                                 quantize(random_dense(hidden, second_intermediate, 53), recipe)};
      const StoredExpert joined = concat_shared_experts(experts, recipe);
      ASSERT_EQ(joined.intermediate, 256 + second_intermediate);
      ASSERT_EQ(joined.hidden, hidden);
      ASSERT_NO_THROW(check_canonical(joined, recipe, "joined"));

      const DenseExpert parts[2] = {dequantize(experts[0], recipe), dequantize(experts[1], recipe)};
      const DenseExpert whole = dequantize(joined, recipe);
      // w1: gate rows of expert 0, gate rows of expert 1, then their up rows in the same order.
      std::vector<float> w1;
      for (int half = 0; half < 2; ++half) {
        for (const DenseExpert& part : parts) {
          const size_t rows = part.intermediate;
          w1.insert(w1.end(), part.w1.begin() + half * rows * hidden, part.w1.begin() + (half + 1) * rows * hidden);
        }
      }
      // w2: each row is expert 0's columns, then expert 1's.
      std::vector<float> w2;
      for (int32_t r = 0; r < hidden; ++r) {
        for (const DenseExpert& part : parts) {
          const size_t cols = part.intermediate;
          w2.insert(w2.end(), part.w2.begin() + r * cols, part.w2.begin() + (r + 1) * cols);
        }
      }
      EXPECT_TRUE(whole.w1 == w1);
      EXPECT_TRUE(whole.w2 == w2);
    }
  }
}

TEST(ConcatSharedExperts, ComputesTheSumOfTheMlps) {
  const int32_t hidden = 256, intermediate = 128;
  std::mt19937 rng(59);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(hidden);
  for (float& v : x) v = normal(rng);
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(to_string(recipe));
    std::vector<StoredExpert> experts;
    for (uint32_t s = 0; s < 3; ++s) experts.push_back(quantize(random_dense(hidden, intermediate, 61 + s), recipe));
    const std::vector<double> joined = mlp(dequantize(concat_shared_experts(experts, recipe), recipe), x);
    std::vector<double> sum(hidden, 0.0);
    double norm = 0.0;
    for (const StoredExpert& e : experts) {
      const std::vector<double> y = mlp(dequantize(e, recipe), x);
      for (int32_t r = 0; r < hidden; ++r) sum[r] += y[r];
    }
    for (double v : sum) norm = std::max(norm, std::fabs(v));
    ASSERT_GT(norm, 0.0);
    for (int32_t r = 0; r < hidden; ++r) EXPECT_NEAR(joined[r], sum[r], 1e-9 * norm) << r;
  }
}

TEST(ConcatSharedExperts, OneExpertIsItself) {
  const StoredExpert e = random_canonical(Recipe::fp8, 128, 256, 67);
  expect_same_bits(concat_shared_experts({e}, Recipe::fp8), e);
}

TEST(ConcatSharedExperts, RejectsBadInputs) {
  expect_message(error_of([] { concat_shared_experts({}, Recipe::fp8); }), {"shared_experts", "at least one"});
  const StoredExpert a = random_canonical(Recipe::bf16, 128, 128, 1);
  const StoredExpert b = random_canonical(Recipe::bf16, 256, 128, 2);
  expect_message(error_of([&] { concat_shared_experts({a, b}, Recipe::bf16); }),
                 {"shared_experts[1].hidden", "128", "256"});
  StoredExpert c = a;
  c.w2.pop_back();
  expect_message(error_of([&] { concat_shared_experts({a, c}, Recipe::bf16); }), {"shared_experts[1].w2"});
}

}  // namespace
}  // namespace megamoe
