// The producers on the device (megamoe/producers.h) against their CPU references on fresh random
// inputs (MEGAMOE_TEST_SEED replays one): the 1x128 quantization bit for bit, the router's logits to
// the rounding of their sums' order, its choices
// exactly wherever the reference's decision has a margin above 1e-6 (device and host exp may differ
// in the last bit), its weights to 1e-5, ties to the lower index, and argument errors by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.h"
#include "gpu_test_util.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/producers.h"
#include "megamoe/router.h"
#include "test_seed.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data, dtype, shape, Device::cuda);
}

TEST(QuantizeActivationsGpu, MatchesTheHostBitForBit) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  const int64_t tokens = 293, hidden = 7168;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<uint16_t> x(static_cast<size_t>(tokens * hidden));
  for (int64_t block = 0; block < tokens * hidden / 128; ++block) {
    const float magnitude = std::ldexp(1.0f, exponent(rng));  // blocks from tiny to huge
    for (int c = 0; c < 128; ++c) x[block * 128 + c] = float_to_bf16(normal(rng) * magnitude);
    if (block % 97 == 5) std::fill_n(x.begin() + block * 128, 128, uint16_t{0});  // an all-zero block
    if (block % 89 == 7) x[block * 128 + 3] = 0x7FC0;                              // a NaN among values
  }
  std::vector<uint8_t> want(x.size());
  std::vector<float> want_scales(x.size() / 128);
  quantize_activations_host(x.data(), tokens, hidden, want.data(), want_scales.data());

  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<uint8_t> d_out(x.size());
  DeviceBuffer<float> d_scales(want_scales.size());
  quantize_activations(view(d_x.get(), DType::bf16, {tokens, hidden}), view(d_out.get(), DType::e4m3, {tokens, hidden}),
                       view(d_scales.get(), DType::f32, {tokens, hidden / 128}), nullptr);
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = d_out.download();
  const std::vector<float> scales = d_scales.download();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "value " << i << ", seed " << seed;
  for (size_t i = 0; i < scales.size(); ++i)
    ASSERT_EQ(float_bits(scales[i]), float_bits(want_scales[i])) << "block " << i << ", seed " << seed;
}

void check_logits(int32_t tokens, int32_t hidden, int32_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(tokens) * hidden), weight(static_cast<size_t>(experts) * hidden);
  for (uint16_t& v : x) v = float_to_bf16(normal(rng));
  for (uint16_t& v : weight) v = float_to_bf16(normal(rng) * 0.02f);
  const std::vector<float> want = router_logits(x, weight, tokens, hidden, experts);
  DeviceBuffer<uint16_t> d_x(x), d_weight(weight);
  DeviceBuffer<float> d_logits(want.size());
  router_logits(view(d_x.get(), DType::bf16, {tokens, hidden}), view(d_weight.get(), DType::bf16, {experts, hidden}),
                view(d_logits.get(), DType::f32, {tokens, experts}), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = d_logits.download();
  for (int32_t t = 0; t < tokens; ++t)
    for (int32_t e = 0; e < experts; ++e) {
      // BF16 products are exact in FP32: only the sums' order and rounding differ.
      double magnitude = 0.0;
      for (int32_t h = 0; h < hidden; ++h)
        magnitude += std::fabs(double{bf16_to_float(x[static_cast<size_t>(t) * hidden + h])} *
                               bf16_to_float(weight[static_cast<size_t>(e) * hidden + h]));
      const size_t i = static_cast<size_t>(t) * experts + e;
      ASSERT_NEAR(got[i], want[i], 3e-5 * magnitude + 1e-7)
          << "token " << t << ", expert " << e << " of " << tokens << " x " << experts << ", hidden " << hidden
          << ", seed " << seed;
    }
}

TEST(RouterLogitsGpu, MatchesTheReference) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  check_logits(70, 7168, 256, seed);      // DeepSeek-V3's router, a partial token tile
  check_logits(129, 4096, 128, seed + 1);  // Qwen3
  check_logits(100, 4096, 8, seed + 2);    // Mixtral: a partial expert tile
  check_logits(1, 2944, 128, seed + 3);    // gpt-oss, one token
  check_logits(16, 7168, 256, seed + 4);   // the most tokens of the few-token kernel
  check_logits(17, 4096, 8, seed + 5);     // the fewest of the tiles
  check_logits(5, 4104, 3, seed + 6);      // K not a multiple of 64 nor of the block's pieces
  check_logits(33, 4104, 70, seed + 7);    // the same in the tiles, and a partial expert tile
}

// The reference's choice values in double, for the margins of its decisions.
struct Margins {
  double groups = INFINITY;   // between the last kept group and the best dropped one
  double experts = INFINITY;  // between consecutive chosen experts and after the last
};

Margins decision_margins(const RouterConfig& c, const float* logits, const float* bias) {
  const int32_t e_count = c.num_experts, group_size = c.num_experts / c.num_groups;
  std::vector<double> choice(static_cast<size_t>(e_count));
  if (c.scoring == RouterScoring::softmax) {
    double top = -INFINITY, total = 0.0;
    for (int32_t e = 0; e < e_count; ++e) top = std::max(top, double{logits[e]});
    for (int32_t e = 0; e < e_count; ++e) total += std::exp(double{logits[e]} - top);
    for (int32_t e = 0; e < e_count; ++e) choice[e] = std::exp(double{logits[e]} - top) / total;
  } else {
    for (int32_t e = 0; e < e_count; ++e)
      choice[e] = 1.0 / (1.0 + std::exp(-double{logits[e]})) + (bias != nullptr ? double{bias[e]} : 0.0);
  }
  Margins m;
  if (c.num_groups > 1) {
    std::vector<double> group_score(static_cast<size_t>(c.num_groups));
    for (int32_t g = 0; g < c.num_groups; ++g) {
      std::vector<double> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
      std::sort(members.rbegin(), members.rend());
      group_score[g] = members[0] + members[1];
    }
    std::vector<double> sorted = group_score;
    std::sort(sorted.rbegin(), sorted.rend());
    if (c.topk_groups < c.num_groups) m.groups = sorted[c.topk_groups - 1] - sorted[c.topk_groups];
    const double cut = sorted[c.topk_groups - 1];
    for (int32_t e = 0; e < e_count; ++e)
      if (group_score[e / group_size] < cut) choice[e] = -INFINITY;
  }
  std::sort(choice.rbegin(), choice.rend());
  for (int32_t k = 0; k < c.top_k && k + 1 < e_count; ++k)
    if (std::isfinite(choice[k + 1])) m.experts = std::min(m.experts, choice[k] - choice[k + 1]);
  return m;
}

void check_router(const RouterConfig& config, int32_t tokens, bool with_bias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f);
  const size_t experts = static_cast<size_t>(config.num_experts);
  std::vector<float> logits(static_cast<size_t>(tokens) * experts), bias;
  for (float& v : logits) v = normal(rng);
  if (with_bias) {
    bias.resize(experts);
    for (float& v : bias) v = small(rng);
  }
  const size_t routes = static_cast<size_t>(tokens) * config.top_k;
  std::vector<int32_t> want_idx(routes);
  std::vector<float> want_weights(routes);
  route_tokens(config, logits, bias, tokens, want_idx, want_weights);

  DeviceBuffer<float> d_logits(logits), d_bias(bias), d_weights(routes);
  DeviceBuffer<int32_t> d_idx(routes);
  route_tokens(config, view(d_logits.get(), DType::f32, {tokens, config.num_experts}),
               with_bias ? view(d_bias.get(), DType::f32, {config.num_experts}) : TensorView{},
               view(d_idx.get(), DType::i32, {tokens, config.top_k}),
               view(d_weights.get(), DType::f32, {tokens, config.top_k}), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> idx = d_idx.download();
  const std::vector<float> weights = d_weights.download();
  int32_t near_ties = 0;
  for (int32_t t = 0; t < tokens; ++t) {
    const Margins m = decision_margins(config, logits.data() + t * experts, with_bias ? bias.data() : nullptr);
    if (std::min(m.groups, m.experts) < 1e-6) {  // within the last bits of exp: either choice is right
      ++near_ties;
      continue;
    }
    for (int32_t k = 0; k < config.top_k; ++k) {
      const size_t r = static_cast<size_t>(t) * config.top_k + k;
      ASSERT_EQ(idx[r], want_idx[r]) << "token " << t << ", choice " << k << ", seed " << seed;
      ASSERT_NEAR(weights[r], want_weights[r], 1e-5f * std::max(1.0f, std::fabs(want_weights[r])))
          << "token " << t << ", choice " << k << ", seed " << seed;
    }
  }
  EXPECT_LE(near_ties * 4, tokens + 3) << near_ties << " of " << tokens << " tokens unchecked (seed " << seed << ")";
}

TEST(RouteTokensGpu, DeepSeekV3GroupLimitedSigmoidMatchesTheReference) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  check_router(deepseek_v3_router(), 2000, true, testing::test_seed());
  check_router(deepseek_v3_router(), 3, false, testing::test_seed() + 1);
}

TEST(RouteTokensGpu, SoftmaxTopKMatchesTheReference) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  check_router(softmax_router(128, 8, true), 1500, false, testing::test_seed());   // Qwen3
  check_router(softmax_router(128, 4, false), 700, false, testing::test_seed() + 2);
  check_router(softmax_router(8, 2, true), 999, false, testing::test_seed() + 3);   // Mixtral
  check_router(softmax_router(1000, 16, true), 64, false, testing::test_seed() + 4);  // padded lanes
}

TEST(RouteTokensGpu, UnevenGroupsMatchTheReference) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  RouterConfig config = deepseek_v3_router();
  config.num_experts = 40;  // groups of 5, the last lane-row half empty
  config.num_groups = 8;
  config.topk_groups = 3;
  config.top_k = 6;
  config.normalize = false;
  config.routed_scaling = 1.0f;
  check_router(config, 777, true, testing::test_seed());
}

TEST(RouteTokensGpu, TiesGoToTheLowerIndex) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (const RouterConfig& config : {deepseek_v3_router(), softmax_router(64, 8, true)}) {
    const int32_t tokens = 5;
    const std::vector<float> logits(static_cast<size_t>(tokens) * config.num_experts, 0.25f);  // all equal
    const size_t routes = static_cast<size_t>(tokens) * config.top_k;
    std::vector<int32_t> want_idx(routes);
    std::vector<float> want_weights(routes);
    route_tokens(config, logits, {}, tokens, want_idx, want_weights);
    DeviceBuffer<float> d_logits(logits), d_weights(routes);
    DeviceBuffer<int32_t> d_idx(routes);
    route_tokens(config, view(d_logits.get(), DType::f32, {tokens, config.num_experts}), TensorView{},
                 view(d_idx.get(), DType::i32, {tokens, config.top_k}),
                 view(d_weights.get(), DType::f32, {tokens, config.top_k}), nullptr);
    MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(d_idx.download(), want_idx);
    // With groups, the first topk_groups groups' first experts: 0..7 for DeepSeek-V3 (group 0 alone).
    for (int32_t k = 0; k < config.top_k; ++k) EXPECT_EQ(want_idx[k], k);
  }
}

TEST(RouteTokensGpu, ArgumentErrorsNameTheArgument) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const RouterConfig config = softmax_router(64, 4, true);
  DeviceBuffer<float> d_logits(2 * 64), d_weights(2 * 4), d_bias(64);
  DeviceBuffer<int32_t> d_idx(2 * 4);
  const TensorView logits = view(d_logits.get(), DType::f32, {2, 64});
  const TensorView idx = view(d_idx.get(), DType::i32, {2, 4});
  const TensorView weights = view(d_weights.get(), DType::f32, {2, 4});
  EXPECT_NE(testing::error_message([&] {
              route_tokens(config, logits, view(d_bias.get(), DType::f32, {64}), idx, weights, nullptr);
            }).find("bias:"),
            std::string::npos);
  EXPECT_NE(testing::error_message([&] {
              route_tokens(config, logits, {}, view(d_idx.get(), DType::f32, {2, 4}), weights, nullptr);
            }).find("topk_idx:"),
            std::string::npos);
  EXPECT_NE(testing::error_message([&] {
              route_tokens(config, view(d_logits.get(), DType::f32, {4, 32}), {}, idx, weights, nullptr);
            }).find("logits:"),
            std::string::npos);
  RouterConfig wide = softmax_router(2048, 4, true);
  EXPECT_NE(testing::error_message([&] { route_tokens(wide, logits, {}, idx, weights, nullptr); }).find("num_experts:"),
            std::string::npos);
  EXPECT_NE(testing::error_message([&] {
              quantize_activations(view(d_logits.get(), DType::bf16, {2, 100}), logits, weights, nullptr);
            }).find("x: hidden"),
            std::string::npos);
  EXPECT_NE(testing::error_message([&] {
              router_logits(view(d_logits.get(), DType::bf16, {2, 64}), view(d_logits.get(), DType::bf16, {4, 32}),
                            logits, nullptr);
            }).find("weight:"),
            std::string::npos);
  // Zero tokens: nothing to do, no error.
  route_tokens(config, view(d_logits.get(), DType::f32, {0, 64}), {}, view(d_idx.get(), DType::i32, {0, 4}),
               view(d_weights.get(), DType::f32, {0, 4}), nullptr);
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace megamoe
