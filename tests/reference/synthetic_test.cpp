// Synthetic data: deterministic in the seed, element-wise pure, with the documented magnitudes and
// routing properties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "megamoe/error.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"
#include "reference/e4m3_table.h"

namespace megamoe {
namespace {

Problem synthetic_problem(Recipe recipe, int32_t shared = 1) {
  Problem p;
  p.num_ranks = 2;
  p.num_experts = 16;
  p.top_k = 4;
  p.hidden = 512;
  p.intermediate = 256;
  p.num_shared_experts = shared;
  p.max_tokens_per_rank = 64;
  p.recipe = recipe;
  return p;
}

bool same_expert(const StoredExpert& a, const StoredExpert& b) {
  auto float_bits_equal = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](float u, float v) {
             return float_bits(u) == float_bits(v);
           });
  };
  return a.hidden == b.hidden && a.intermediate == b.intermediate && a.w1 == b.w1 && a.w2 == b.w2 &&
         float_bits_equal(a.w1_scales, b.w1_scales) && float_bits_equal(a.w2_scales, b.w2_scales) &&
         a.w1_mx_scales == b.w1_mx_scales && a.w2_mx_scales == b.w2_mx_scales;
}

bool same_batch(const RankBatch& a, const RankBatch& b) {
  return a.num_tokens == b.num_tokens && a.x == b.x && a.x_scales == b.x_scales && a.topk_idx == b.topk_idx &&
         a.topk_weights == b.topk_weights;
}

class SyntheticRecipes : public ::testing::TestWithParam<Recipe> {};

TEST_P(SyntheticRecipes, SameSeedSameBitsDifferentSeedDifferent) {
  const Problem p = synthetic_problem(GetParam());
  const SyntheticWeights a(p, 42), b(p, 42), c(p, 43);
  EXPECT_TRUE(same_expert(a.routed_expert(5), b.routed_expert(5)));
  EXPECT_TRUE(same_expert(a.shared_expert(0), b.shared_expert(0)));
  EXPECT_FALSE(same_expert(a.routed_expert(5), c.routed_expert(5)));
  EXPECT_FALSE(same_expert(a.routed_expert(5), a.routed_expert(6)));
  EXPECT_FALSE(same_expert(a.routed_expert(0), a.shared_expert(0)));

  const auto batches_a = synthetic_batches(p, {9, 7}, Routing::zipf, 42, 0.25f);
  const auto batches_b = synthetic_batches(p, {9, 7}, Routing::zipf, 42, 0.25f);
  const auto batches_c = synthetic_batches(p, {9, 7}, Routing::zipf, 43, 0.25f);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(same_batch(batches_a[r], batches_b[r])) << "rank " << r;
    EXPECT_NE(batches_a[r].x, batches_c[r].x) << "rank " << r;
    EXPECT_NE(batches_a[r].topk_idx, batches_c[r].topk_idx) << "rank " << r;
  }
  EXPECT_NE(batches_a[0].x, batches_a[1].x);
}

TEST_P(SyntheticRecipes, WeightsAreCanonicalWithDeviationNearOneOverSqrtFanIn) {
  const Problem p = synthetic_problem(GetParam());
  const SyntheticWeights weights(p, 7);
  const StoredExpert stored = weights.routed_expert(3);
  EXPECT_NO_THROW(check_canonical(stored, p.recipe, "synthetic"));
  EXPECT_NO_THROW(check_canonical(weights.shared_expert(0), p.recipe, "synthetic"));
  const DenseExpert dense = dequantize(stored, p.recipe);
  auto rms = [](const std::vector<float>& values) {
    double sum = 0.0;
    for (float v : values) sum += static_cast<double>(v) * v;
    return std::sqrt(sum / static_cast<double>(values.size()));
  };
  // Within a factor of 2 of 1/sqrt(fan_in): fan_in is H for W1 and I for W2.
  EXPECT_GT(rms(dense.w1) * std::sqrt(512.0), 0.5);
  EXPECT_LT(rms(dense.w1) * std::sqrt(512.0), 2.0);
  EXPECT_GT(rms(dense.w2) * std::sqrt(256.0), 0.5);
  EXPECT_LT(rms(dense.w2) * std::sqrt(256.0), 2.0);
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, SyntheticRecipes, ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Synthetic, StoredWeightsAreThePerElementGenerators) {
  const uint64_t seed = 99;
  const int32_t expert = 11;
  // Visits elements in a scrambled order: each is a function of (seed, stream, index) alone.
  auto scrambled = [](size_t count, const auto& check) {
    for (size_t step = 0; step < count; ++step) check((step * 7919 + 13) % count);
  };
  {
    const Problem p = synthetic_problem(Recipe::fp8);
    const StoredExpert e = SyntheticWeights(p, seed).routed_expert(expert);
    const uint64_t w1 = routed_weight_stream(expert, WeightMatrix::w1);
    scrambled(e.w1.size(), [&](size_t i) { ASSERT_EQ(e.w1[i], synthetic_e4m3_code(seed, w1, i)) << i; });
    const uint64_t scales = routed_weight_stream(expert, WeightMatrix::w2_scales);
    const float range = synthetic_weight_range(p.intermediate);
    scrambled(e.w2_scales.size(), [&](size_t b) {
      ASSERT_EQ(float_bits(e.w2_scales[b]), float_bits(synthetic_fp8_block_scale(seed, scales, b, range))) << b;
    });
  }
  {
    const Problem p = synthetic_problem(Recipe::fp8_fp4);
    const StoredExpert e = SyntheticWeights(p, seed).shared_expert(0);
    const uint64_t w2 = shared_weight_stream(0, WeightMatrix::w2);
    scrambled(e.w2.size(), [&](size_t i) { ASSERT_EQ(e.w2[i], synthetic_e2m1_pair(seed, w2, i)) << i; });
    const uint64_t scales = shared_weight_stream(0, WeightMatrix::w1_scales);
    const float range = synthetic_weight_range(p.hidden);
    scrambled(e.w1_mx_scales.size(),
              [&](size_t g) { ASSERT_EQ(e.w1_mx_scales[g], synthetic_ue8m0_scale(seed, scales, g, range)) << g; });
  }
  {
    const Problem p = synthetic_problem(Recipe::bf16);
    const StoredExpert e = SyntheticWeights(p, seed).routed_expert(expert);
    const uint64_t w1 = routed_weight_stream(expert, WeightMatrix::w1);
    const float range = synthetic_weight_range(p.hidden);
    scrambled(e.w1.size() / 2, [&](size_t i) {
      const uint16_t stored = static_cast<uint16_t>(e.w1[2 * i] | (e.w1[2 * i + 1] << 8));
      ASSERT_EQ(stored, synthetic_bf16(seed, w1, i, range)) << i;
    });
  }
}

// The table behind the weight generator's E4M3 codes equals float_to_e4m3 on every value the
// generator makes (all 2^24 of them), and on a sweep of every kind of float (NaN, infinities,
// subnormals, both signs).
TEST(Synthetic, E4m3TableIsFloatToE4m3) {
  const E4m3Table& table = E4m3Table::instance();
  for (uint32_t bits24 = 0; bits24 < (1u << 24); ++bits24) {
    const float value = uniform_from_24_bits(bits24) * kE4M3Max;
    if (table(value) != float_to_e4m3(value)) FAIL() << "24-bit input " << bits24;
  }
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 4099) {
    const float value = bits_float(static_cast<uint32_t>(bits));
    if (table(value) != float_to_e4m3(value)) FAIL() << "float bits " << bits;
  }
}

TEST(Synthetic, GeneratorsArePureFunctionsOfTheirArguments) {
  // Same arguments, same bits, whatever was called in between; any changed argument changes them.
  const uint64_t first = synthetic_bits(1, 2, 3);
  for (uint64_t i = 0; i < 1000; ++i) synthetic_bits(5, 6, i);
  EXPECT_EQ(synthetic_bits(1, 2, 3), first);
  EXPECT_NE(synthetic_bits(2, 2, 3), first);
  EXPECT_NE(synthetic_bits(1, 3, 3), first);
  EXPECT_NE(synthetic_bits(1, 2, 4), first);
  EXPECT_EQ(synthetic_e4m3_code(1, 2, 3), synthetic_e4m3_code(1, 2, 3));
  EXPECT_EQ(float_bits(synthetic_fp8_block_scale(1, 2, 3, 0.5f)), float_bits(synthetic_fp8_block_scale(1, 2, 3, 0.5f)));
  EXPECT_NE(routed_weight_stream(1, WeightMatrix::w1), shared_weight_stream(1, WeightMatrix::w1));
  EXPECT_NE(routed_weight_stream(1, WeightMatrix::w1), routed_weight_stream(1, WeightMatrix::w2));
  EXPECT_NE(routed_weight_stream(1, WeightMatrix::w1), routed_weight_stream(2, WeightMatrix::w1));
}

TEST(Synthetic, UniformIsInRangeAndCentered) {
  double sum = 0.0, square = 0.0;
  const int count = 100000;
  for (int i = 0; i < count; ++i) {
    const float u = synthetic_uniform(8, 9, static_cast<uint64_t>(i));
    ASSERT_GE(u, -1.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    square += static_cast<double>(u) * u;
  }
  EXPECT_NEAR(sum / count, 0.0, 0.01);
  EXPECT_NEAR(square / count, 1.0 / 3.0, 0.01);
  EXPECT_EQ(uniform_from_24_bits(0), -1.0f);
  EXPECT_EQ(uniform_from_24_bits(1u << 23), 0.0f);
  EXPECT_EQ(uniform_from_24_bits(0xFFFFFF), 1.0f - 0x1p-23f);
}

TEST(Synthetic, WeightRangeIsSqrtThreeOverFanIn) {
  EXPECT_EQ(isqrt64(0), 0u);
  EXPECT_EQ(isqrt64(15), 3u);
  EXPECT_EQ(isqrt64(16), 4u);
  EXPECT_EQ(isqrt64((1ull << 62) - 1), (1ull << 31) - 1);
  for (int32_t fan_in : {128, 256, 1536, 2048, 2944, 7168, 14336}) {
    EXPECT_NEAR(synthetic_weight_range(fan_in), std::sqrt(3.0 / fan_in), 1e-5 * std::sqrt(3.0 / fan_in)) << fan_in;
  }
}

TEST(Synthetic, BatchesHaveTheDocumentedRoutes) {
  for (Routing routing : {Routing::uniform, Routing::zipf, Routing::one_expert}) {
    const Problem p = synthetic_problem(Recipe::fp8);
    const auto batches = synthetic_batches(p, {64, 33}, routing, 5, 0.25f);
    int64_t masked = 0, routes = 0;
    for (int32_t r = 0; r < 2; ++r) {
      const RankBatch& batch = batches[static_cast<size_t>(r)];
      EXPECT_NO_THROW(validate_batch(p, batch, r));
      for (int32_t t = 0; t < batch.num_tokens; ++t) {
        float sum = 0.0f;
        bool any = false;
        for (int32_t k = 0; k < p.top_k; ++k) {
          const size_t route = static_cast<size_t>(t * p.top_k + k);
          ++routes;
          if (batch.topk_idx[route] < 0) {
            ++masked;
            continue;
          }
          EXPECT_GT(batch.topk_weights[route], 0.0f);
          sum += batch.topk_weights[route];
          any = true;
        }
        if (any) {
          EXPECT_NEAR(sum, 1.0f, 1e-6f) << to_string(routing) << " rank " << r << " token " << t;
        }
      }
    }
    EXPECT_NEAR(static_cast<double>(masked) / routes, 0.25, 0.05) << to_string(routing);
  }
}

TEST(Synthetic, RoutingShapes) {
  const Problem p = synthetic_problem(Recipe::bf16);
  auto counts = [&p](Routing routing) {
    std::vector<int> count(static_cast<size_t>(p.num_experts), 0);
    for (const RankBatch& batch : synthetic_batches(p, {64, 64}, routing, 3)) {
      for (int32_t t = 0; t < batch.num_tokens; ++t) {
        std::set<int32_t> distinct;
        for (int32_t k = 0; k < p.top_k; ++k) {
          const int32_t id = batch.topk_idx[static_cast<size_t>(t * p.top_k + k)];
          if (routing == Routing::one_expert && k == 0) {
            EXPECT_EQ(id, 0);
          }
          distinct.insert(id);
          ++count[static_cast<size_t>(id)];
        }
        EXPECT_EQ(distinct.size(), static_cast<size_t>(p.top_k));
      }
    }
    return count;
  };
  const std::vector<int> uniform = counts(Routing::uniform);
  const std::vector<int> zipf = counts(Routing::zipf);
  const std::vector<int> one = counts(Routing::one_expert);
  // 128 tokens x 4 routes over 16 experts: 32 each on average.
  EXPECT_LT(*std::max_element(uniform.begin(), uniform.end()), 60);
  EXPECT_GT(*std::max_element(zipf.begin(), zipf.end()), 80);
  EXPECT_EQ(one[0], 128);
}

TEST(Synthetic, Bf16BatchesHaveNoScales) {
  const Problem p = synthetic_problem(Recipe::bf16);
  const auto batches = synthetic_batches(p, {3, 0}, Routing::uniform, 1);
  EXPECT_EQ(batches[0].x.size(), 3u * 512u * 2u);
  EXPECT_TRUE(batches[0].x_scales.empty());
  EXPECT_EQ(batches[1].num_tokens, 0);
  EXPECT_TRUE(batches[1].x.empty());
}

TEST(Synthetic, RejectsBadArguments) {
  const Problem p = synthetic_problem(Recipe::fp8);
  EXPECT_THROW(synthetic_batches(p, {1}, Routing::uniform, 1), Error);
  EXPECT_THROW(synthetic_batches(p, {65, 1}, Routing::uniform, 1), Error);
  EXPECT_THROW(synthetic_batches(p, {1, 1}, Routing::uniform, 1, 1.5f), Error);
  const SyntheticWeights weights(p, 1);
  EXPECT_THROW(weights.routed_expert(16), Error);
  EXPECT_THROW(weights.shared_expert(1), Error);
}

TEST(Synthetic, RoutingNames) {
  for (Routing routing : {Routing::uniform, Routing::zipf, Routing::one_expert}) {
    Routing parsed = Routing::uniform;
    EXPECT_TRUE(parse_routing(to_string(routing), parsed));
    EXPECT_EQ(parsed, routing);
  }
  Routing parsed = Routing::uniform;
  EXPECT_FALSE(parse_routing("random", parsed));
}

}  // namespace
}  // namespace megamoe
