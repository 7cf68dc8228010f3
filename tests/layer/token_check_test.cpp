// The per-token check of megamoe/token_check.h, on the CPU: it accepts the reference plus quantization
// noise of the size measured on the GPU, and rejects an output in which one token lacks one route's
// contribution or has another expert's in its place, for every route of the token, even the weakest.
#include "megamoe/token_check.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "megamoe/formats.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"
#include "test_seed.h"

namespace megamoe {
namespace {

// The weakest single route the layer cases have: top-8 (the smallest share of a token's weight)
// beside a shared expert (weight 1, which dilutes every routed contribution). Hidden 1024: at 256 a
// wrong expert whose output happened to lean on the small route it replaced (0.59 of it along it)
// left its token at 0.998 of the norm bound and 0.41 of the route bound (seed 3160878332634525522,
// about one run in several hundred): two random outputs' cosine spreads as 1 / sqrt(hidden), so
// the check's blind spot for a wrong expert narrows as hidden grows, while a missing route is a
// share of -1 at any size.
Problem checker_problem(Recipe recipe) {
  Problem p;
  p.num_ranks = 1;
  p.num_experts = 16;
  p.top_k = 8;
  p.hidden = 1024;
  p.intermediate = 256;
  p.num_shared_experts = 1;
  p.max_tokens_per_rank = 32;
  p.recipe = recipe;
  return p;
}

constexpr int32_t kTokens = 32;
constexpr int32_t kPerturbedTokens = 6;  // each with every one of its routes perturbed in turn

class TokenCheckTest : public ::testing::TestWithParam<Recipe> {
 protected:
  void SetUp() override {
    seed_ = testing::announced_test_seed("token_check_test");
    p_ = checker_problem(GetParam());
    weights_ = std::make_unique<SyntheticWeights>(p_, seed_);
    batches_ = synthetic_batches(p_, {kTokens}, Routing::uniform, seed_ + 1);
    ReferenceOptions options;
    options.keep_slots = true;
    ReferenceResult result = reference_moe(p_, batches_, *weights_, options);
    reference_ = std::move(result.y[0]);
    slots_ = std::move(result.slots[0]);
  }

  TokenCheck check(const std::vector<uint16_t>& y, std::span<const uint8_t> skip = {}) const {
    return check_tokens(y, reference_, p_.hidden, p_.recipe, skip, slots_, p_.combine_slots());
  }

  // The reference output with token `token` computed from `batch` instead (one token only).
  std::vector<uint16_t> with_token_from(const RankBatch& batch, int32_t token) const {
    const std::vector<std::vector<int32_t>> subset = {{token}};
    ReferenceOptions options;
    options.token_subset = &subset;
    const std::vector<uint16_t> one = reference_moe(p_, {batch}, *weights_, options).y[0];
    std::vector<uint16_t> y = reference_;
    std::copy_n(one.begin() + size_t(token) * p_.hidden, p_.hidden, y.begin() + size_t(token) * p_.hidden);
    return y;
  }

  // Rejected, and the failure names `token` and no other.
  void expect_rejected(const std::vector<uint16_t>& y, int32_t token, const std::string& what) const {
    const TokenCheck result = check(y);
    EXPECT_EQ(result.failed, 1) << what << " (replay: " << testing::replay_command(seed_) << ")";
    EXPECT_EQ(result.first_failure.rfind("token " + std::to_string(token) + ":", 0), 0u) << result.first_failure;
    EXPECT_EQ(result.worst_token, token) << what;
    smallest_error_ = std::min(smallest_error_, result.worst_error);
  }

  uint64_t seed_ = 0;
  Problem p_;
  std::unique_ptr<SyntheticWeights> weights_;
  std::vector<RankBatch> batches_;
  std::vector<uint16_t> reference_;
  std::vector<uint16_t> slots_;  // the reference's combine slots
  // The smallest normalized error among rejected outputs: below token_bound, only the per-route
  // projection caught it.
  mutable double smallest_error_ = std::numeric_limits<double>::infinity();
};

TEST_P(TokenCheckTest, AcceptsTheReferenceWithQuantizationNoise) {
  const TokenCheck exact = check(reference_);
  EXPECT_TRUE(exact.ok()) << exact.first_failure;
  EXPECT_EQ(exact.compared, kTokens);
  EXPECT_EQ(exact.worst_error, 0.0);

  // Every token off by the largest per-token error measured on the GPU, in a random direction.
  std::mt19937_64 rng(seed_ + 2);
  std::normal_distribution<double> normal;
  std::vector<uint16_t> noisy(reference_.size());
  for (int32_t t = 0; t < kTokens; ++t) {
    std::vector<double> direction(p_.hidden);
    double direction_norm = 0.0, token_norm = 0.0;
    for (int32_t h = 0; h < p_.hidden; ++h) {
      direction[h] = normal(rng);
      direction_norm += direction[h] * direction[h];
      const double value = bf16_to_float(reference_[size_t(t) * p_.hidden + h]);
      token_norm += value * value;
    }
    const double scale = token_noise(p_.recipe) * std::sqrt(token_norm / direction_norm);
    for (int32_t h = 0; h < p_.hidden; ++h) {
      const size_t i = size_t(t) * p_.hidden + h;
      noisy[i] = float_to_bf16(static_cast<float>(bf16_to_float(reference_[i]) + scale * direction[h]));
    }
  }
  const TokenCheck result = check(noisy);
  EXPECT_TRUE(result.ok()) << result.first_failure << " (replay: " << testing::replay_command(seed_) << ")";
  EXPECT_GT(result.worst_error, 0.9 * token_noise(p_.recipe)) << "the noise was not applied";
}

TEST_P(TokenCheckTest, RejectsOneMissingOrWrongRouteOfOneToken) {
  for (int32_t t = 0; t < kPerturbedTokens; ++t) {
    const int32_t token = t * (kTokens / kPerturbedTokens);
    for (int32_t k = 0; k < p_.top_k; ++k) {
      const size_t route = size_t(token) * p_.top_k + k;
      RankBatch missing = batches_[0];
      missing.topk_idx[route] = -1;
      expect_rejected(with_token_from(missing, token), token,
                      "token " + std::to_string(token) + " without route " + std::to_string(k));
      // Another expert, one the token does not use, in the route's place.
      RankBatch wrong = batches_[0];
      const int32_t* ids = wrong.topk_idx.data() + size_t(token) * p_.top_k;
      int32_t other = 0;
      while (std::find(ids, ids + p_.top_k, other) != ids + p_.top_k) ++other;
      wrong.topk_idx[route] = other;
      expect_rejected(with_token_from(wrong, token), token,
                      "token " + std::to_string(token) + " with expert " + std::to_string(other) + " in route " +
                          std::to_string(k));
    }
  }
  std::printf("smallest normalized error rejected %.3g (the norm bound alone: %.1e)\n", smallest_error_,
              token_bound(p_.recipe));
}

TEST_P(TokenCheckTest, UnwrittenElementsAndZeroTokens) {
  std::vector<uint16_t> y = reference_;
  y[size_t(5) * p_.hidden + 17] = 0xFFFF;  // the tests' poison: a NaN
  TokenCheck result = check(y);
  EXPECT_EQ(result.failed, 1);
  EXPECT_EQ(result.first_failure, "token 5: element 17 was not written or is NaN");
  std::vector<uint8_t> skip(kTokens, 0);
  skip[5] = 1;
  result = check(y, skip);
  EXPECT_TRUE(result.ok()) << result.first_failure;
  EXPECT_EQ(result.compared, kTokens - 1);

  // A token with no route and no shared expert sums nothing: exactly zero, however small the rest.
  std::vector<uint16_t> zeros(reference_.size(), 0), tiny = zeros;
  tiny[size_t(3) * p_.hidden] = float_to_bf16(1e-30f);
  EXPECT_TRUE(check_tokens(zeros, zeros, p_.hidden, p_.recipe).ok());
  result = check_tokens(tiny, zeros, p_.hidden, p_.recipe);
  EXPECT_EQ(result.failed, 1);
  EXPECT_EQ(result.first_failure.rfind("token 3:", 0), 0u) << result.first_failure;
}

INSTANTIATE_TEST_SUITE_P(Recipes, TokenCheckTest, ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace megamoe
