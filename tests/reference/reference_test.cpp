// Properties of the CPU reference on synthetic layers: agreement with an independent recomputation,
// masked routes, empty ranks, skewed routing, shared experts, receive counts, thread-count
// independence, token subsets and progress reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>

#include "megamoe/reference.h"
#include "megamoe/synthetic.h"
#include "reference_test_util.h"

namespace megamoe {
namespace {

using testing::token_row;

Problem small_problem(Recipe recipe, int32_t shared = 1, int32_t top_k = 3) {
  Problem p;
  p.num_ranks = 2;
  p.num_experts = 8;
  p.top_k = top_k;
  p.hidden = 256;
  p.intermediate = 256;
  p.num_shared_experts = shared;
  p.max_tokens_per_rank = 24;
  p.recipe = recipe;
  return p;
}

ReferenceResult run(const Problem& p, const std::vector<RankBatch>& batches, const WeightSource& weights,
                    int threads = 0) {
  ReferenceOptions options;
  options.threads = threads;
  return reference_moe(p, batches, weights, options);
}

void expect_matches_naive(const Problem& p, const std::vector<RankBatch>& batches, const WeightSource& weights,
                          const ReferenceResult& result) {
  testing::NaiveLayer naive(p, weights);
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    for (int32_t t = 0; t < batches[static_cast<size_t>(r)].num_tokens; ++t) {
      const std::vector<float> want = naive.token_output(batches[static_cast<size_t>(r)], t);
      EXPECT_LT(testing::normalized_error(token_row(result, r, t, p.hidden), want), 0.01)
          << "rank " << r << ", token " << t;
    }
  }
}

class ReferenceRecipes : public ::testing::TestWithParam<Recipe> {};

TEST_P(ReferenceRecipes, MatchesAnIndependentRecomputation) {
  const Problem p = small_problem(GetParam(), 2);
  const SyntheticWeights weights(p, 7);
  const auto batches = synthetic_batches(p, {5, 4}, Routing::uniform, 7, 0.2f);
  const ReferenceResult result = run(p, batches, weights);
  expect_matches_naive(p, batches, weights, result);
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, ReferenceRecipes,
                         ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Reference, MaskedRoutesAddNothing) {
  const Problem p = small_problem(Recipe::fp8);
  const SyntheticWeights weights(p, 3);
  const auto masked = synthetic_batches(p, {8, 8}, Routing::uniform, 3, 0.4f);
  // The same batches with every masked route sent, with weight 0, to an expert the token does not
  // use: that slot is written with zeros, so y must not change by a single bit.
  auto zero_weight = masked;
  int masked_routes = 0;
  for (RankBatch& batch : zero_weight) {
    for (int32_t t = 0; t < batch.num_tokens; ++t) {
      int32_t* ids = batch.topk_idx.data() + t * p.top_k;
      for (int32_t k = 0; k < p.top_k; ++k) {
        if (ids[k] >= 0) continue;
        ++masked_routes;
        int32_t unused = 0;
        while (std::find(ids, ids + p.top_k, unused) != ids + p.top_k) ++unused;
        ids[k] = unused;
        batch.topk_weights[static_cast<size_t>(t * p.top_k + k)] = 0.0f;
      }
    }
  }
  ASSERT_GT(masked_routes, 5);
  EXPECT_EQ(run(p, masked, weights).y, run(p, zero_weight, weights).y);
}

// An expert named in both slots of a token runs once per slot, with that slot's weight, and the token
// sums both: y of [e, e] with weights (a, b) is the BF16 sum of the outputs of [e, -1] with (a, 0)
// and [-1, e] with (0, b), bit for bit, for three tokens with the same x.
TEST(Reference, RepeatedExpertRunsOncePerSlot) {
  const Problem p = small_problem(Recipe::fp8, 0, 2);
  const SyntheticWeights weights(p, 5);
  auto batches = synthetic_batches(p, {3, 1}, Routing::uniform, 5);
  RankBatch& batch = batches[0];
  const size_t row = static_cast<size_t>(p.hidden), scales = row / 128;
  for (size_t t = 1; t < 3; ++t) {
    std::copy_n(batch.x.begin(), row, batch.x.begin() + t * row);
    std::copy_n(batch.x_scales.begin(), scales, batch.x_scales.begin() + t * scales);
  }
  const int32_t e = 3;
  const float a = 0.7f, b = 0.3f;
  batch.topk_idx = {e, e, e, -1, -1, e};
  batch.topk_weights = {a, b, a, 0.0f, 0.0f, b};
  const ReferenceResult result = run(p, batches, weights);
  const std::vector<uint16_t>& y = result.y[0];
  for (size_t h = 0; h < row; ++h) {
    const float both = bf16_to_float(y[row + h]) + bf16_to_float(y[2 * row + h]);
    ASSERT_EQ(y[h], float_to_bf16(both)) << "element " << h;
  }
  EXPECT_NE(std::vector<uint16_t>(y.begin(), y.begin() + row), std::vector<uint16_t>(y.begin() + row, y.begin() + 2 * row))
      << "the second slot added nothing";
  uint32_t routes_to_e = 4;  // rank 0's four, plus rank 1's
  for (int32_t id : batches[1].topk_idx) routes_to_e += id == e ? 1 : 0;
  EXPECT_EQ(result.recv_counts[p.owner_rank(e)][p.local_expert(e)], routes_to_e);
}

TEST(Reference, AllRoutesMaskedAndNoSharedExpertsGiveZero) {
  const Problem p = small_problem(Recipe::bf16, 0);
  const SyntheticWeights weights(p, 3);
  const auto batches = synthetic_batches(p, {4, 3}, Routing::uniform, 3, 1.0f);
  const ReferenceResult result = run(p, batches, weights);
  for (const auto& y : result.y) {
    for (uint16_t value : y) EXPECT_EQ(bf16_to_float(value), 0.0f);
  }
  for (const auto& counts : result.recv_counts) EXPECT_EQ(counts, std::vector<uint32_t>(4, 0));
}

TEST(Reference, RankWithZeroTokens) {
  const Problem p = small_problem(Recipe::fp8);
  const SyntheticWeights weights(p, 5);
  const auto batches = synthetic_batches(p, {6, 0}, Routing::uniform, 5);
  const ReferenceResult result = run(p, batches, weights);
  ASSERT_EQ(result.y.size(), 2u);
  EXPECT_EQ(result.y[0].size(), 6u * 256u);
  EXPECT_TRUE(result.y[1].empty());
  uint32_t received = 0;
  for (const auto& counts : result.recv_counts) {
    EXPECT_EQ(counts.size(), 4u);
    for (uint32_t n : counts) received += n;
  }
  EXPECT_EQ(received, 6u * 3u);
  expect_matches_naive(p, batches, weights, result);
}

TEST(Reference, SkewedRoutingMatchesTokensRunAlone) {
  // Every route on expert 0; 20 tokens span more than one tile of routes.
  const Problem p = small_problem(Recipe::fp8, 0, 1);
  const SyntheticWeights weights(p, 9);
  const auto batches = synthetic_batches(p, {20, 20}, Routing::one_expert, 9);
  const ReferenceResult result = run(p, batches, weights);
  EXPECT_EQ(result.recv_counts[0][0], 40u);
  for (int32_t r = 0; r < 2; ++r) {
    for (int32_t t = 0; t < 20; t += 7) {
      // The token alone on its rank, the other rank empty.
      std::vector<RankBatch> alone(2);
      const RankBatch& source = batches[static_cast<size_t>(r)];
      RankBatch& single = alone[static_cast<size_t>(r)];
      single.num_tokens = 1;
      single.x.assign(source.x.begin() + t * 256, source.x.begin() + (t + 1) * 256);
      single.x_scales.assign(source.x_scales.begin() + t * 2, source.x_scales.begin() + (t + 1) * 2);
      single.topk_idx = {source.topk_idx[static_cast<size_t>(t)]};
      single.topk_weights = {source.topk_weights[static_cast<size_t>(t)]};
      const ReferenceResult one = run(p, alone, weights);
      EXPECT_EQ(token_row(one, r, 0, 256), token_row(result, r, t, 256)) << "rank " << r << ", token " << t;
    }
  }
}

TEST(Reference, SharedExpertsAddTheirMlpToEveryToken) {
  const Problem with_shared = small_problem(Recipe::fp8, 2);
  const Problem without_shared = small_problem(Recipe::fp8, 0);
  // Routed and shared weights depend only on the seed, the expert and the shapes.
  const SyntheticWeights weights(with_shared, 11);
  const auto batches = synthetic_batches(with_shared, {5, 5}, Routing::uniform, 11);
  auto all_masked = batches;
  for (RankBatch& batch : all_masked) std::fill(batch.topk_idx.begin(), batch.topk_idx.end(), -1);

  const ReferenceResult shared_only = run(with_shared, all_masked, weights);
  const ReferenceResult routed_only = run(without_shared, batches, weights);
  const ReferenceResult both = run(with_shared, batches, weights);
  expect_matches_naive(with_shared, all_masked, weights, shared_only);
  for (int32_t r = 0; r < 2; ++r) {
    for (int32_t t = 0; t < 5; ++t) {
      const std::vector<float> shared = token_row(shared_only, r, t, 256);
      const std::vector<float> routed = token_row(routed_only, r, t, 256);
      std::vector<float> sum(256);
      for (size_t c = 0; c < 256; ++c) sum[c] = shared[c] + routed[c];
      EXPECT_GT(testing::normalized_error(shared, std::vector<float>(256, 0.0f)), 0.0) << "shared output is zero";
      EXPECT_LT(testing::normalized_error(token_row(both, r, t, 256), sum), 0.02) << "rank " << r << ", token " << t;
    }
  }
}

TEST(Reference, ReceiveCountsEqualADirectCount) {
  const Problem p = small_problem(Recipe::bf16);
  const SyntheticWeights weights(p, 13);
  const auto batches = synthetic_batches(p, {17, 9}, Routing::zipf, 13, 0.1f);
  std::vector<std::vector<uint32_t>> expected(2, std::vector<uint32_t>(4, 0));
  for (const RankBatch& batch : batches) {
    for (int32_t id : batch.topk_idx) {
      if (id >= 0) ++expected[static_cast<size_t>(id / 4)][static_cast<size_t>(id % 4)];
    }
  }
  EXPECT_EQ(run(p, batches, weights).recv_counts, expected);
}

TEST(Reference, ThreadCountDoesNotChangeAnyBit) {
  const Problem p = small_problem(Recipe::fp8_fp4, 1);
  const SyntheticWeights weights(p, 17);
  const auto batches = synthetic_batches(p, {19, 11}, Routing::zipf, 17, 0.1f);
  const ReferenceResult one = run(p, batches, weights, 1);
  for (int threads : {2, 5}) {
    const ReferenceResult many = run(p, batches, weights, threads);
    EXPECT_EQ(many.y, one.y) << threads << " threads";
    EXPECT_EQ(many.recv_counts, one.recv_counts) << threads << " threads";
  }
}

TEST(Reference, TokenSubsetComputesOnlyThoseTokens) {
  const Problem p = small_problem(Recipe::fp8);
  const SyntheticWeights weights(p, 19);
  const auto batches = synthetic_batches(p, {7, 5}, Routing::uniform, 19);
  const ReferenceResult full = run(p, batches, weights);
  const std::vector<std::vector<int32_t>> subset = {{4, 1, 4}, {}};
  ReferenceOptions options;
  options.token_subset = &subset;
  const ReferenceResult sampled = reference_moe(p, batches, weights, options);
  EXPECT_EQ(sampled.recv_counts, full.recv_counts);
  for (int32_t t = 0; t < 7; ++t) {
    const bool in_subset = t == 1 || t == 4;
    EXPECT_EQ(token_row(sampled, 0, t, 256), in_subset ? token_row(full, 0, t, 256) : std::vector<float>(256, 0.0f))
        << "token " << t;
  }
  EXPECT_EQ(sampled.y[1], std::vector<uint16_t>(5 * 256, 0));
}

TEST(Reference, TokenSubsetOutOfRangeIsRejected) {
  const Problem p = small_problem(Recipe::fp8);
  const SyntheticWeights weights(p, 19);
  const auto batches = synthetic_batches(p, {7, 5}, Routing::uniform, 19);
  const std::vector<std::vector<int32_t>> subset = {{1}, {5}};
  ReferenceOptions options;
  options.token_subset = &subset;
  testing::expect_error([&] { reference_moe(p, batches, weights, options); },
                        {"options.token_subset[1]", "token 5 is outside [0, num_tokens = 5)"});
  const std::vector<std::vector<int32_t>> one_list = {{1}};
  options.token_subset = &one_list;
  testing::expect_error([&] { reference_moe(p, batches, weights, options); },
                        {"options.token_subset", "one list per rank (2), got 1"});
}

TEST(Reference, ProgressCountsEveryExpertOnce) {
  const Problem p = small_problem(Recipe::bf16, 1);
  const SyntheticWeights weights(p, 23);
  const auto batches = synthetic_batches(p, {12, 12}, Routing::uniform, 23);
  std::vector<std::pair<int64_t, int64_t>> calls;
  ReferenceOptions options;
  options.threads = 2;
  options.progress = [&calls](int64_t done, int64_t total) { calls.emplace_back(done, total); };
  const ReferenceResult result = reference_moe(p, batches, weights, options);
  int64_t used_experts = 0;
  for (const auto& counts : result.recv_counts) {
    for (uint32_t n : counts) used_experts += n > 0 ? 1 : 0;
  }
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls.back(), std::make_pair(used_experts + 1, used_experts + 1));  // + the shared experts
  for (size_t i = 1; i < calls.size(); ++i) EXPECT_GT(calls[i].first, calls[i - 1].first);
}

TEST(Reference, BatchCountMustMatchRanks) {
  const Problem p = small_problem(Recipe::fp8);
  const SyntheticWeights weights(p, 1);
  auto batches = synthetic_batches(p, {2, 2}, Routing::uniform, 1);
  batches.pop_back();
  testing::expect_error([&] { run(p, batches, weights); }, {"batches", "one batch per rank (2), got 1"});
}

TEST(Reference, WeightsOfTheWrongShapeAreRejected) {
  const Problem p = small_problem(Recipe::fp8, 0);
  Problem smaller = p;
  smaller.intermediate = 128;
  const SyntheticWeights wrong(smaller, 1);
  const auto batches = synthetic_batches(p, {2, 2}, Routing::uniform, 1);
  testing::expect_error([&] { run(p, batches, wrong); }, {"weights.routed_expert(", ").intermediate", "must be 256"});
}

TEST(Reference, WeightSourceErrorsReachTheCaller) {
  class FailingWeights : public WeightSource {
   public:
    StoredExpert routed_expert(int32_t) const override { throw Error("routed_expert: disk on fire"); }
    StoredExpert shared_expert(int32_t) const override { throw Error("shared_expert: disk on fire"); }
  };
  const Problem p = small_problem(Recipe::fp8, 1);
  const auto batches = synthetic_batches(p, {3, 3}, Routing::uniform, 1);
  testing::expect_error([&] { run(p, batches, FailingWeights(), 2); }, {"disk on fire"});
}

}  // namespace
}  // namespace megamoe
