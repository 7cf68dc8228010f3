// validate_batch: one test per rule, each checking that the message names the field and the rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "megamoe/reference.h"
#include "megamoe/synthetic.h"
#include "reference_test_util.h"

namespace megamoe {
namespace {

using testing::expect_error;

Problem batch_problem(Recipe recipe = Recipe::fp8) {
  Problem p;
  p.num_ranks = 2;
  p.num_experts = 8;
  p.top_k = 3;
  p.hidden = 256;
  p.intermediate = 128;
  p.max_tokens_per_rank = 4;
  p.recipe = recipe;
  return p;
}

RankBatch good_batch(const Problem& p) { return synthetic_batches(p, {4, 4}, Routing::uniform, 1)[1]; }

TEST(ValidateBatch, AcceptsAValidBatch) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    const Problem p = batch_problem(recipe);
    EXPECT_NO_THROW(validate_batch(p, good_batch(p), 1)) << to_string(recipe);
  }
}

TEST(ValidateBatch, SeveralMaskedRoutesInOneTokenAreFine) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_idx[0] = -1;
  batch.topk_idx[1] = -1;
  EXPECT_NO_THROW(validate_batch(p, batch, 0));
}

TEST(ValidateBatch, RankOutOfRange) {
  const Problem p = batch_problem();
  expect_error([&] { validate_batch(p, good_batch(p), 2); }, {"rank", "must be in [0, num_ranks = 2), got 2"});
}

TEST(ValidateBatch, TooManyTokens) {
  const Problem p = batch_problem();
  Problem bigger = p;
  bigger.max_tokens_per_rank = 5;
  const RankBatch batch = synthetic_batches(bigger, {5, 5}, Routing::uniform, 1)[0];
  expect_error([&] { validate_batch(p, batch, 1); },
               {"batches[1].num_tokens", "must be at most max_tokens_per_rank (4), got 5"});
}

TEST(ValidateBatch, NegativeTokenCount) {
  const Problem p = batch_problem();
  RankBatch batch;
  batch.num_tokens = -1;
  expect_error([&] { validate_batch(p, batch, 0); }, {"batches[0].num_tokens", "must not be negative, got -1"});
}

TEST(ValidateBatch, SizeOfX) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.x.pop_back();
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].x", "must hold num_tokens * hidden * 1 = 1024 bytes, got 1023"});
  const Problem bf16 = batch_problem(Recipe::bf16);
  RankBatch bf16_batch = good_batch(bf16);
  bf16_batch.x.resize(1024);
  expect_error([&] { validate_batch(bf16, bf16_batch, 0); },
               {"batches[0].x", "must hold num_tokens * hidden * 2 = 2048 bytes, got 1024"});
}

TEST(ValidateBatch, SizeOfScales) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.x_scales.push_back(1.0f);
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].x_scales", "must hold num_tokens * hidden / 128 = 8 scales, got 9"});
}

TEST(ValidateBatch, ScalesMustBeEmptyForBf16) {
  const Problem p = batch_problem(Recipe::bf16);
  RankBatch batch = good_batch(p);
  batch.x_scales.assign(8, 1.0f);
  expect_error([&] { validate_batch(p, batch, 0); }, {"batches[0].x_scales", "must be empty for recipe bf16, got 8"});
}

TEST(ValidateBatch, SizeOfTopkIdx) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_idx.resize(11);
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].topk_idx", "must hold num_tokens * top_k = 12 ids, got 11"});
}

TEST(ValidateBatch, SizeOfTopkWeights) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_weights.resize(13);
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].topk_weights", "must hold num_tokens * top_k = 12 weights, got 13"});
}

TEST(ValidateBatch, ExpertIdOutOfRange) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_idx[2 * 3 + 1] = 8;
  expect_error([&] { validate_batch(p, batch, 1); },
               {"batches[1].topk_idx", "expert id 8 at token 2, slot 1 is outside [-1, num_experts = 8)"});
  batch = good_batch(p);
  batch.topk_idx[3 * 3 + 2] = -2;
  expect_error([&] { validate_batch(p, batch, 1); }, {"batches[1].topk_idx", "expert id -2 at token 3, slot 2"});
}

// A repeated expert is valid: each slot is its own route (reference_test checks what it computes).
TEST(ValidateBatch, RepeatedExpertWithinATokenIsValid) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_idx[3] = 5;
  batch.topk_idx[4] = 6;
  batch.topk_idx[5] = 5;
  EXPECT_NO_THROW(validate_batch(p, batch, 0));
}

// Repeats can send one expert more routes from one rank than there are tokens: the buffer has room
// for max_tokens_per_rank (4) of them.
TEST(ValidateBatch, MoreRoutesToOneExpertThanTheBufferHolds) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  std::fill(batch.topk_idx.begin(), batch.topk_idx.end(), -1);
  for (size_t route = 0; route < 6; ++route) batch.topk_idx[route] = 5;
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].topk_idx", "expert 5 gets more than max_tokens_per_rank = 4 routes from this rank",
                "at token 1, slot 1", "repeated"});
  batch.topk_idx[4] = 6;  // exactly four routes to expert 5
  batch.topk_idx[5] = 7;
  EXPECT_NO_THROW(validate_batch(p, batch, 0));
}

TEST(ValidateBatch, NonFiniteWeight) {
  const Problem p = batch_problem();
  RankBatch batch = good_batch(p);
  batch.topk_weights[1] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].topk_weights", "weight at token 0, slot 1", "must be finite", "nan"});
  batch = good_batch(p);
  batch.topk_weights[5] = -std::numeric_limits<float>::infinity();
  expect_error([&] { validate_batch(p, batch, 0); },
               {"batches[0].topk_weights", "weight at token 1, slot 2", "must be finite", "inf"});
}

TEST(ValidateBatch, BadActivationScale) {
  const Problem p = batch_problem();
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    RankBatch batch = good_batch(p);
    batch.x_scales[3] = bad;
    expect_error([&] { validate_batch(p, batch, 1); },
                 {"batches[1].x_scales", "scale at token 1, block 1 must be positive and finite"});
  }
}

}  // namespace
}  // namespace megamoe
