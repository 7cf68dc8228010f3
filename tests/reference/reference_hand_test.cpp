// The reference on layers small enough to follow by hand: every expected value below is derived in
// the comments and is exact in FP32, so the checks are equalities.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <string>

#include "megamoe/error.h"
#include "megamoe/reference.h"
#include "reference_test_util.h"

namespace megamoe {
namespace {

using testing::MemoryWeights;
using testing::w1_at;
using testing::w2_at;
using testing::y_at;

constexpr int kHidden = 128;
constexpr int kInter = 128;

// SiLU(g) = g / (1 + exp(-g)) in FP32 is exactly g for g >= 32 (exp(-32) ~ 1.3e-14 vanishes next to
// 1), exactly -0 for g = -128 (exp(128) overflows to infinity) and 0 for g = 0. So a gate row reading
// a "switch" input that is 0 or 1 either closes a channel or passes 32 or 64 times it.
//
// x[t] = [x0, x1, x2, 0, ...]: x0 and x2 are switches, x1 carries the value.
//
// Expert 0:  channel 0: gate row 0 = 32 at column 0, up row I+0 = 0.25 at column 1 -> SiLU(32 x0) * x1/4
//            channel 3: gate row 3 = 32 at column 2, up row I+3 = 0.25 at column 1 -> SiLU(32 x2) * x1/4
//            W2[0][0] = 0.5, W2[1][0] = -1, W2[3][3] = 0.765625 (49/64)
// Expert 1:  channel 1: gate row 1 = -128 at column 0, up row I+1 = 1 at column 1  -> SiLU(-128 x0) * x1
//            channel 2: gate row 2 = 64 at column 0, up row I+2 = 0.125 at column 1 -> SiLU(64 x0) * x1/8
//            channel 4: gate row 4 = 32 at column 2, up row I+4 = 0.25 at column 1  -> SiLU(32 x2) * x1/4
//            W2[0][1] = 100 (reads the closed channel 1), W2[0][2] = 1, W2[2][2] = 0.25, W2[3][4] = -0.25
// Every other weight is 0.
MemoryWeights hand_bf16_weights() {
  DenseExpert e0 = testing::zero_dense(kHidden, kInter);
  w1_at(e0, 0, 0) = 32.0f;
  w1_at(e0, kInter + 0, 1) = 0.25f;
  w1_at(e0, 3, 2) = 32.0f;
  w1_at(e0, kInter + 3, 1) = 0.25f;
  w2_at(e0, 0, 0) = 0.5f;
  w2_at(e0, 1, 0) = -1.0f;
  w2_at(e0, 3, 3) = 0.765625f;
  DenseExpert e1 = testing::zero_dense(kHidden, kInter);
  w1_at(e1, 1, 0) = -128.0f;
  w1_at(e1, kInter + 1, 1) = 1.0f;
  w1_at(e1, 2, 0) = 64.0f;
  w1_at(e1, kInter + 2, 1) = 0.125f;
  w1_at(e1, 4, 2) = 32.0f;
  w1_at(e1, kInter + 4, 1) = 0.25f;
  w2_at(e1, 0, 1) = 100.0f;
  w2_at(e1, 0, 2) = 1.0f;
  w2_at(e1, 2, 2) = 0.25f;
  w2_at(e1, 3, 4) = -0.25f;
  MemoryWeights weights;
  weights.routed = {quantize(e0, Recipe::bf16), quantize(e1, Recipe::bf16)};
  return weights;
}

Problem hand_problem(int top_k, Recipe recipe) {
  Problem p;
  p.num_ranks = 1;
  p.num_experts = 2;
  p.top_k = top_k;
  p.hidden = kHidden;
  p.intermediate = kInter;
  p.max_tokens_per_rank = 4;
  p.recipe = recipe;
  return p;
}

// Tokens with x = [x0, x1, x2, 0, ...].
std::vector<float> hand_x(const std::vector<std::array<float, 3>>& tokens) {
  std::vector<float> x(tokens.size() * kHidden, 0.0f);
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int c = 0; c < 3; ++c) x[t * kHidden + static_cast<size_t>(c)] = tokens[t][static_cast<size_t>(c)];
  }
  return x;
}

// Expects y[token] to be `expected` in its first columns and 0 everywhere else.
void expect_row(const ReferenceResult& result, int token, const std::vector<float>& expected) {
  for (int c = 0; c < kHidden; ++c) {
    const float want = c < static_cast<int>(expected.size()) ? expected[static_cast<size_t>(c)] : 0.0f;
    EXPECT_EQ(y_at(result, 0, token, kHidden, c), want) << "token " << token << ", column " << c;
  }
}

TEST(ReferenceHand, Bf16TopOne) {
  const Problem p = hand_problem(1, Recipe::bf16);
  const MemoryWeights weights = hand_bf16_weights();
  RankBatch batch;
  batch.num_tokens = 2;
  batch.x = testing::bf16_bytes(hand_x({{1, 2, 0}, {1, -3, 0}}));
  batch.topk_idx = {0, 1};
  batch.topk_weights = {1.0f, 0.5f};
  const ReferenceResult result = reference_moe(p, {batch}, weights);

  // Token 0 -> expert 0, w = 1, x = [1, 2, 0]:
  //   channel 0: a = SiLU(32) * (2 / 4) * 1 = 16 (exact in BF16); channel 3: SiLU(0) * ... = 0
  //   o[0] = 0.5 * 16 = 8, o[1] = -1 * 16 = -16; y = o
  expect_row(result, 0, {8, -16});
  // Token 1 -> expert 1, w = 0.5, x = [1, -3, 0]:
  //   channel 1: SiLU(-128) * -3 * 0.5 = 0 (closed); channel 2: SiLU(64) * (-3 / 8) * 0.5 = -12
  //   o[0] = 100 * 0 + 1 * -12 = -12, o[2] = 0.25 * -12 = -3
  expect_row(result, 1, {-12, 0, -3});
  EXPECT_EQ(result.recv_counts, (std::vector<std::vector<uint32_t>>{{1, 1}}));
}

TEST(ReferenceHand, Bf16TopTwoRoundsEachStep) {
  const Problem p = hand_problem(2, Recipe::bf16);
  const MemoryWeights weights = hand_bf16_weights();
  RankBatch batch;
  batch.num_tokens = 3;
  batch.x = testing::bf16_bytes(hand_x({{1, 2, 0}, {1, 64, 0}, {0, 2, 1}}));
  batch.topk_idx = {0, 1, 1, 0, 0, 1};
  batch.topk_weights = {257.0f / 512.0f, 0.25f, 1.0f, 1.0f / 128.0f, 21.0f / 256.0f, 0.25f};
  const ReferenceResult result = reference_moe(p, {batch}, weights);

  // Token 0, x = [1, 2, 0]: the L1 output is rounded to BF16.
  //   slot 0, expert 0, w = 257/512: a0 = 32 * 0.5 * 257/512 = 8.03125 = 257/32, which needs 9
  //     significant bits; BF16 keeps 8, the tie goes to the even 256/32 = 8, so a0' = 8:
  //     o[0] = 4, o[1] = -8 (without the rounding: 4.015625 and -8.03125)
  //   slot 1, expert 1, w = 0.25: a2 = 64 * (2/8) * 0.25 = 4: o[0] = 100 * 0 + 4 = 4, o[2] = 1
  //   y = [4 + 4, -8, 1]
  expect_row(result, 0, {8, -8, 1});
  // Token 1, x = [1, 64, 0]: the final sum is rounded to BF16.
  //   slot 0, expert 1, w = 1: a2 = 64 * 8 = 512: o[0] = 512, o[2] = 128
  //   slot 1, expert 0, w = 1/128: a0 = 32 * 16 / 128 = 4: o[0] = 2, o[1] = -4
  //   y[0] = BF16(512 + 2): BF16's step at 512 is 4, 514 is a tie, the even 512 wins
  expect_row(result, 1, {512, -4, 128});
  // Token 2, x = [0, 2, 1]: each slot is rounded to BF16 before the sum. Channels 0-2 are closed
  // (their gates read x0 = 0); channels 3 and 4 are open.
  //   slot 0, expert 0, w = 21/256: a3 = 32 * 0.5 * 21/256 = 1.3125 (21/16, exact)
  //     o[3] = 1.3125 * 49/64 = 1029/1024; BF16's step in [1, 2) is 8/1024, so the slot holds 1032/1024
  //   slot 1, expert 1, w = 0.25: a4 = 32 * 0.5 * 0.25 = 4: o[3] = -0.25 * 4 = -1
  //   y[3] = 1032/1024 - 1 = 0.0078125 (summing unrounded slots would give 5/1024 = 0.0048828125)
  expect_row(result, 2, {0, 0, 0, 0.0078125f});
  EXPECT_EQ(result.recv_counts, (std::vector<std::vector<uint32_t>>{{3, 3}}));
}

// The activation clamp c (activation.h): gate = min(gate, c), up = clamp(up, -c, c) before SwiGLU.
// With c = 40 every value stays exact: SiLU(g) = g for g >= 32, and SiLU(40) = 40 in FP32 too.
TEST(ReferenceHand, ActivationClampLimitsGateAndUp) {
  const Problem p = hand_problem(1, Recipe::bf16);
  const MemoryWeights weights = hand_bf16_weights();
  RankBatch batch;
  batch.num_tokens = 3;
  batch.x = testing::bf16_bytes(hand_x({{1, 200, 0}, {1, -200, 0}, {1, -3, 0}}));
  batch.topk_idx = {0, 0, 1};
  batch.topk_weights = {1.0f, 1.0f, 0.5f};
  ReferenceOptions options;
  options.activation_clamp = 40.0f;
  const ReferenceResult clamped = reference_moe(p, {batch}, weights, options);

  // Token 0 -> expert 0, x = [1, 200, 0]: channel 0 has gate 32 (below c, unchanged) and up
  //   0.25 * 200 = 50, clamped to 40: a0 = 32 * 40 = 1280 (1600 without the clamp).
  //   o[0] = 0.5 * 1280 = 640, o[1] = -1280
  expect_row(clamped, 0, {640, -1280});
  // Token 1 -> expert 0, x = [1, -200, 0]: up = -50 is clamped from below to -40: a0 = -1280.
  expect_row(clamped, 1, {-640, 1280});
  // Token 2 -> expert 1, w = 0.5, x = [1, -3, 0]: channel 2 has gate 64, clamped to 40, and up
  //   0.125 * -3 = -0.375 (inside [-40, 40]): a2 = 40 * -0.375 * 0.5 = -7.5 (-12 without the clamp);
  //   channel 1's gate -128 stays -128 (the clamp only limits gates from above): closed.
  //   o[0] = 1 * -7.5, o[2] = 0.25 * -7.5 = -1.875
  expect_row(clamped, 2, {-7.5f, 0, -1.875f});

  // 0 and +infinity mean no clamp.
  for (float off : {0.0f, INFINITY}) {
    options.activation_clamp = off;
    const ReferenceResult unclamped = reference_moe(p, {batch}, weights, options);
    expect_row(unclamped, 0, {800, -1600});
    expect_row(unclamped, 1, {-800, 1600});
    expect_row(unclamped, 2, {-12, 0, -3});
  }
  // A negative or NaN clamp is an argument error naming it.
  for (float bad : {-1.0f, NAN}) {
    options.activation_clamp = bad;
    try {
      reference_moe(p, {batch}, weights, options);
      FAIL() << "expected megamoe::Error for clamp " << bad;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("options.activation_clamp"), std::string::npos) << error.what();
    }
  }
}

// fp8: x is E4M3 with one FP32 scale per 1x128, W1 and W2 are E4M3 with 128x128 block scales, and the
// L1 output is re-quantized to E4M3 per 1x128 before L2.
//
// x = [1, 2, 0, 1, 0, ...] stored as codes of [2, 4, 0, 2] with scale 0.5.
// Expert 0 (W1 gate blocks scale 2, up blocks scale 2^-7, W2 scale 0.25; every value exact):
//   channel 0: gate row 0 = 32 at column 0                    -> g0 = 32
//              up row I+0 = 7/64 at column 1                  -> u0 = 7/32
//   channel 1: gate row 1 = 80 at column 0, 3 at column 3     -> g1 = 83
//              up row I+1 = 1/128 at column 1                 -> u1 = 1/64
//   W2[0][1] = 1, W2[1][0] = 0.5
// Expert 1 is all zeros.
TEST(ReferenceHand, Fp8RequantizesTheL1Output) {
  const Problem p = hand_problem(1, Recipe::fp8);
  DenseExpert e0 = testing::zero_dense(kHidden, kInter);
  w1_at(e0, 0, 0) = 32.0f;
  w1_at(e0, kInter + 0, 1) = 7.0f / 64.0f;
  w1_at(e0, 1, 0) = 80.0f;
  w1_at(e0, 1, 3) = 3.0f;
  w1_at(e0, kInter + 1, 1) = 1.0f / 128.0f;
  w2_at(e0, 0, 1) = 1.0f;
  w2_at(e0, 1, 0) = 0.5f;
  MemoryWeights weights;
  weights.routed = {testing::fp8_expert(e0, 2.0f, 1.0f / 128.0f, 0.25f),
                    testing::fp8_expert(testing::zero_dense(kHidden, kInter), 1.0f, 1.0f, 1.0f)};

  RankBatch batch;
  batch.num_tokens = 2;
  std::vector<float> x(2 * kHidden, 0.0f);
  for (int t = 0; t < 2; ++t) {
    x[static_cast<size_t>(t) * kHidden + 0] = 1.0f;
    x[static_cast<size_t>(t) * kHidden + 1] = 2.0f;
    x[static_cast<size_t>(t) * kHidden + 3] = 1.0f;
  }
  batch.x = testing::e4m3_codes(x, 0.5f);
  batch.x_scales = {0.5f, 0.5f};
  batch.topk_idx = {0, 0};
  batch.topk_weights = {1.0f, 0.5f};
  const ReferenceResult result = reference_moe(p, {batch}, weights);

  // Token 0, w = 1: a0 = SiLU(32) * 7/32 = 7, a1 = SiLU(83) * 1/64 = 83/64 = 1.296875.
  //   Re-quantization: amax = 7, scale = 7/448 = 1/64, a * 64 = [448, 83] -> E4M3 [448, 80]
  //   (E4M3 steps by 8 in [64, 128): 83 rounds to 80), so a' = [7, 1.25].
  //   o[0] = 1 * a1' = 1.25 (1.296875 without re-quantization), o[1] = 0.5 * a0' = 3.5
  expect_row(result, 0, {1.25f, 3.5f});
  // Token 1, w = 0.5: a = [3.5, 83/128]; amax = 3.5, scale = 3.5/448 = 1/128, a * 128 = [448, 83]
  //   -> [448, 80], a' = [3.5, 0.625]: o[0] = 0.625, o[1] = 1.75
  expect_row(result, 1, {0.625f, 1.75f});
}

}  // namespace
}  // namespace megamoe
