// The CPU reference router: hand-computed softmax and group-limited sigmoid choices, ties, the
// weights' normalization and scaling, BF16 logits, and the configuration rules.
#include "megamoe/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

struct Routed {
  std::vector<int32_t> idx;
  std::vector<float> weights;
};

Routed route(const RouterConfig& config, const std::vector<float>& logits, const std::vector<float>& bias = {}) {
  const int32_t tokens = static_cast<int32_t>(logits.size() / config.num_experts);
  Routed out{std::vector<int32_t>(static_cast<size_t>(tokens) * config.top_k),
             std::vector<float>(static_cast<size_t>(tokens) * config.top_k)};
  route_tokens(config, logits, bias, tokens, out.idx, out.weights);
  return out;
}

void expect_rejected(const RouterConfig& config, const std::string& field, const std::string& words) {
  try {
    validate(config);
    FAIL() << "accepted a config with a bad " << field;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(field), std::string::npos) << message;
    EXPECT_NE(message.find(words), std::string::npos) << message;
  }
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Eight experts in four groups of two, top-2 among the best two groups, and logits for them: expert
// 6 alone scores highest, but its group (6, 7) sums lower than groups (0, 1) and (2, 3).
RouterConfig four_groups_of_two() {
  RouterConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  config.scoring = RouterScoring::sigmoid;
  config.num_groups = 4;
  config.topk_groups = 2;
  return config;
}
const std::vector<float> kGroupLogits = {1.0f, 1.0f, 1.5f, 0.8f, -3.0f, -3.0f, 4.0f, -4.0f};

TEST(Router, SoftmaxTopKNormalizedAndNot) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f};
  const Routed normalized = route(softmax_router(4, 2, true), logits);
  EXPECT_EQ(normalized.idx, (std::vector<int32_t>{1, 2}));
  const float e3 = std::exp(3.0f), e2 = std::exp(2.0f);
  EXPECT_NEAR(normalized.weights[0], e3 / (e3 + e2), 1e-6);
  EXPECT_NEAR(normalized.weights[1], e2 / (e3 + e2), 1e-6);
  const Routed plain = route(softmax_router(4, 2, false), logits);
  const float total = std::exp(1.0f) + e3 + e2 + 1.0f;
  EXPECT_NEAR(plain.weights[0], e3 / total, 1e-6);
  EXPECT_NEAR(plain.weights[1], e2 / total, 1e-6);
}

TEST(Router, TiesGoToTheLowerIndex) {
  const Routed routed = route(softmax_router(4, 2, true), {0.5f, 2.0f, 0.5f, 2.0f});
  EXPECT_EQ(routed.idx, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(routed.weights[0], 0.5f);
  const Routed lower = route(softmax_router(4, 3, true), {0.5f, 2.0f, 0.5f, 2.0f});
  EXPECT_EQ(lower.idx, (std::vector<int32_t>{1, 3, 0}));
}

// Expert 6 is not chosen: its group is not among the best two.
TEST(Router, SigmoidChoosesAmongTheBestGroupsOnly) {
  RouterConfig config = four_groups_of_two();
  config.routed_scaling = 2.0f;
  const Routed routed = route(config, kGroupLogits);
  EXPECT_EQ(routed.idx, (std::vector<int32_t>{2, 0}));
  const float s2 = sigmoid(1.5f), s0 = sigmoid(1.0f);
  EXPECT_NEAR(routed.weights[0], 2.0f * s2 / (s2 + s0), 1e-6);
  EXPECT_NEAR(routed.weights[1], 2.0f * s0 / (s2 + s0), 1e-6);
  // With one group, expert 6 wins.
  config.num_groups = 1;
  config.topk_groups = 1;
  EXPECT_EQ(route(config, kGroupLogits).idx[0], 6);
}

// The bias moves the choice (of groups and experts), never the weights.
TEST(Router, SigmoidBiasChoosesButDoesNotWeigh) {
  RouterConfig config = four_groups_of_two();
  config.normalize = false;
  std::vector<float> bias(8, 0.0f);
  bias[4] = bias[5] = 2.0f;  // group (4, 5) now sums highest, and its experts lead
  const Routed routed = route(config, kGroupLogits, bias);
  EXPECT_EQ(routed.idx, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(routed.weights[0], sigmoid(-3.0f), 1e-7);
  EXPECT_NEAR(routed.weights[1], sigmoid(-3.0f), 1e-7);
}

TEST(Router, DeepSeekV3ChoosesEightFromFourGroups) {
  const RouterConfig config = deepseek_v3_router();
  ASSERT_NO_THROW(validate(config));
  std::vector<float> logits(256);
  for (int32_t e = 0; e < 256; ++e) logits[e] = std::sin(0.37f * static_cast<float>(e * e % 97));
  const Routed routed = route(config, logits);
  std::vector<int32_t> groups;
  float sum = 0.0f;
  for (int32_t k = 0; k < 8; ++k) {
    const int32_t group = routed.idx[k] / 32;
    if (std::find(groups.begin(), groups.end(), group) == groups.end()) groups.push_back(group);
    sum += routed.weights[k];
    if (k > 0) EXPECT_GE(logits[routed.idx[k - 1]], logits[routed.idx[k]]) << "choices in decreasing order";
  }
  EXPECT_LE(groups.size(), 4u);
  EXPECT_NEAR(sum, 2.5f, 1e-5) << "normalized weights times the routed scaling";
}

TEST(Router, LogitsFromBf16) {
  const std::vector<uint16_t> x = {float_to_bf16(1.0f), float_to_bf16(-2.0f), float_to_bf16(0.5f),
                                   float_to_bf16(0.25f), float_to_bf16(3.0f), float_to_bf16(-1.0f)};
  const std::vector<uint16_t> w = {float_to_bf16(2.0f), float_to_bf16(1.0f), float_to_bf16(4.0f),
                                   float_to_bf16(0.0f), float_to_bf16(1.0f), float_to_bf16(-1.0f)};
  const std::vector<float> logits = router_logits(x, w, 2, 3, 2);
  EXPECT_EQ(logits, (std::vector<float>{2.0f, -2.5f, -0.5f, 4.0f}));
  EXPECT_THROW(router_logits(x, w, 2, 3, 3), Error);
}

TEST(Router, RejectsBadConfigsAndInputs) {
  RouterConfig config = softmax_router(8, 2, true);
  config.top_k = 9;
  expect_rejected(config, "top_k", "[1, 8]");
  config = deepseek_v3_router();
  config.num_groups = 7;
  expect_rejected(config, "num_groups", "must divide num_experts");
  config.num_groups = 8;
  config.topk_groups = 9;
  expect_rejected(config, "topk_groups", "[1, num_groups = 8]");
  config.topk_groups = 1;
  config.top_k = 33;
  expect_rejected(config, "top_k", "[1, 16]");
  config.top_k = 8;
  config.num_experts = 16;  // groups of two: top-8 needs four of them
  expect_rejected(config, "top_k", "at most the experts of the chosen groups (2)");
  config = softmax_router(8, 2, true);
  config.num_groups = 2;
  expect_rejected(config, "num_groups", "softmax");
  config = softmax_router(4, 2, true);
  EXPECT_THROW(route(config, {0.0f, 1.0f, NAN, 2.0f}), Error);
  EXPECT_THROW(route(config, {0.0f, 1.0f, 2.0f, 3.0f}, {0.0f, 0.0f, 0.0f, 0.0f}), Error);  // bias: sigmoid only
}

}  // namespace
}  // namespace megamoe
