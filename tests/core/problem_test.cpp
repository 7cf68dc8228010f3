// Problem validation (one test per rule) and the cross-rank fingerprint.
#include "megamoe/problem.h"

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/layout.h"

namespace megamoe {
namespace {

Problem valid_problem() {
  Problem p;
  p.num_ranks = 4;
  p.rank = 1;
  p.num_experts = 16;
  p.top_k = 4;
  p.hidden = 512;
  p.intermediate = 256;
  p.num_shared_experts = 1;
  p.max_tokens_per_rank = 128;
  p.recipe = Recipe::fp8;
  return p;
}

// The message validate throws for `p`, or "" when it accepts it.
std::string validation_error(const Problem& p) {
  try {
    validate(p);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// Expects validate to reject `p` with a message that names `field` and contains every piece of `rule`.
void expect_rejected(const Problem& p, const std::string& field, const std::vector<std::string>& rule) {
  const std::string message = validation_error(p);
  ASSERT_FALSE(message.empty()) << "accepted a problem that breaks the rule on " << field;
  EXPECT_EQ(message.rfind(field + ":", 0), 0u) << message;
  for (const std::string& piece : rule) EXPECT_NE(message.find(piece), std::string::npos) << message;
}

TEST(Validate, AcceptsAValidProblem) {
  EXPECT_NO_THROW(validate(valid_problem()));
  Problem p = valid_problem();
  p.num_ranks = 1;
  p.rank = 0;
  p.num_experts = 1;
  p.top_k = 1;
  p.num_shared_experts = 0;
  p.max_tokens_per_rank = 1;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validate, NumRanksRange) {
  Problem p = valid_problem();
  p.num_ranks = 0;
  p.rank = 0;
  expect_rejected(p, "num_ranks", {"[1, 64]", "got 0"});
  p.num_ranks = 65;
  p.num_experts = 65 * 2;
  expect_rejected(p, "num_ranks", {"[1, 64]", "got 65"});
  p.num_ranks = 64;
  p.num_experts = 64 * 2;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validate, RankRange) {
  Problem p = valid_problem();
  p.rank = 4;
  expect_rejected(p, "rank", {"[0, num_ranks = 4)", "got 4"});
  p.rank = -1;
  expect_rejected(p, "rank", {"[0, num_ranks = 4)", "got -1"});
  p.rank = 3;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validate, NumExpertsPositive) {
  Problem p = valid_problem();
  p.num_experts = 0;
  expect_rejected(p, "num_experts", {"at least 1"});
}

TEST(Validate, NumExpertsDivisibleByRanks) {
  Problem p = valid_problem();
  p.num_experts = 18;
  expect_rejected(p, "num_experts", {"divisible by num_ranks", "(4)", "got 18"});
}

TEST(Validate, TopKRange) {
  Problem p = valid_problem();
  p.top_k = 0;
  expect_rejected(p, "top_k", {"[1, 16]", "got 0"});
  p.top_k = 17;
  expect_rejected(p, "top_k", {"[1, 16]", "got 17"});
  // With fewer experts than kMaxTopK the limit is the expert count.
  p.num_experts = 8;
  p.top_k = 9;
  expect_rejected(p, "top_k", {"[1, 8]", "num_experts", "got 9"});
  p.top_k = 8;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validate, HiddenMultipleOf128) {
  Problem p = valid_problem();
  p.hidden = 200;
  expect_rejected(p, "hidden", {"multiple of 128", "got 200"});
  p.hidden = 0;
  expect_rejected(p, "hidden", {"positive multiple of 128", "got 0"});
  p.hidden = -128;
  expect_rejected(p, "hidden", {"positive multiple of 128"});
  p.hidden = 65536 + 128;
  expect_rejected(p, "hidden", {"at most 65536"});
}

TEST(Validate, IntermediateMultipleOf128) {
  Problem p = valid_problem();
  p.intermediate = 192;
  expect_rejected(p, "intermediate", {"multiple of 128", "got 192"});
  p.intermediate = 0;
  expect_rejected(p, "intermediate", {"positive multiple of 128", "got 0"});
  // Large enough that num_shared_experts * intermediate would overflow int32 in the layout.
  p.intermediate = 1 << 28;
  expect_rejected(p, "intermediate", {"at most 65536"});
}

TEST(Validate, SharedExpertsRange) {
  Problem p = valid_problem();
  p.num_shared_experts = -1;
  expect_rejected(p, "num_shared_experts", {"[0, 8]", "got -1"});
  p.num_shared_experts = 9;
  expect_rejected(p, "num_shared_experts", {"[0, 8]", "got 9"});
  p.num_shared_experts = 8;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validate, MaxTokensRange) {
  Problem p = valid_problem();
  p.max_tokens_per_rank = 0;
  expect_rejected(p, "max_tokens_per_rank", {"[1, 1048576]", "got 0"});
  p.max_tokens_per_rank = (1 << 20) + 1;
  expect_rejected(p, "max_tokens_per_rank", {"[1, 1048576]", "got 1048577"});
}

// token * top_k + k is stored in 32 bits. The token limit (2^20) and kMaxTopK (16) keep it below
// 2^31 for every valid problem (problem.cpp static_asserts it), so validate has no separate rule:
// the largest accepted problem must still index pool rows and routes in 32 bits.
TEST(Validate, LargestProblemKeepsRouteIndicesIn32Bits) {
  Problem p = valid_problem();
  p.num_ranks = kMaxRanks;
  p.rank = kMaxRanks - 1;
  p.num_experts = kMaxRanks * kMaxTopK;
  p.top_k = kMaxTopK;
  p.max_tokens_per_rank = 1 << 20;
  p.wave_tokens = p.max_tokens_per_rank;  // one wave
  ASSERT_NO_THROW(validate(p));
  const int64_t largest_route = int64_t{p.max_tokens_per_rank - 1} * p.top_k + (p.top_k - 1);
  EXPECT_LT(largest_route, int64_t{1} << 31);
  // 64 ranks * 2^20 tokens * 16 routes = 2^30 rows, plus one tile of slack: fits pool_rows (u32).
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), uint64_t{1} << 30);
  EXPECT_EQ(BufferLayout::make(p).pool_rows, (uint32_t{1} << 30) + 256u);
  p.max_tokens_per_rank += 1;
  expect_rejected(p, "max_tokens_per_rank", {"[1, 1048576]"});
}

// A wave's output vectors (tokens x hidden / 8) are counted in 32 bits by the fused combine.
TEST(Validate, WaveOutputVectorsIn32Bits) {
  Problem p = valid_problem();
  p.hidden = 1 << 16;
  p.max_tokens_per_rank = 1 << 19;  // 2^19 x 2^13 vectors = 2^32
  p.wave_tokens = 0;
  expect_rejected(p, "wave_tokens", {"below 2^32", "max_tokens_per_rank (524288)", "hidden 65536"});
  p.wave_tokens = (1 << 19) - 1;
  EXPECT_NO_THROW(validate(p));
  p.wave_tokens = 1 << 19;
  expect_rejected(p, "wave_tokens", {"below 2^32"});
}

TEST(Validate, RecvCapacityRange) {
  Problem p = valid_problem();
  p.recv_capacity = -1;
  expect_rejected(p, "recv_capacity", {"[0, 2147483648]", "the worst case", "got -1"});
  p.recv_capacity = (int64_t{1} << 31) + 1;
  expect_rejected(p, "recv_capacity", {"got 2147483649"});
  p.recv_capacity = 1;
  EXPECT_NO_THROW(validate(p));
}

// A wave of at least max_tokens_per_rank is the whole call, a smaller one splits it, and 0 chooses
// (layout_test checks the choice; this small problem fits the budget in one wave).
TEST(Validate, WaveTokens) {
  Problem p = valid_problem();  // 128 tokens per rank
  p.wave_tokens = -1;
  expect_rejected(p, "wave_tokens", {"[0, 1048576]", "one wave per call", "got -1"});
  p.wave_tokens = (1 << 20) + 1;
  expect_rejected(p, "wave_tokens", {"got 1048577"});
  for (int32_t wave : {0, 128, 1000}) {
    p.wave_tokens = wave;
    EXPECT_NO_THROW(validate(p));
    EXPECT_EQ(tokens_per_wave(p), 128) << wave;
    EXPECT_EQ(waves_per_call(p), 1) << wave;
  }
  p.wave_tokens = 50;
  EXPECT_EQ(tokens_per_wave(p), 50);
  EXPECT_EQ(waves_per_call(p), 3);
  EXPECT_EQ(mean_recv_routes(p), 50 * 4);
  p.wave_tokens = 64;
  EXPECT_EQ(waves_per_call(p), 2);
  EXPECT_NE(describe(p).find("wave_tokens=64"), std::string::npos) << describe(p);
}

TEST(Validate, FrontRingFields) {
  Problem p = valid_problem();
  p.front_num_slots = -1;
  expect_rejected(p, "front_num_slots", {"negative", "got -1"});
  p.front_num_slots = 4;
  p.front_tokens_per_slot = 0;
  expect_rejected(p, "front_tokens_per_slot", {"at least 1 when front_num_slots > 0", "got 0"});
  p.front_tokens_per_slot = 31;  // 4 x 31 = 124 < 128 tokens: a call would wrap the ring
  expect_rejected(p, "front_num_slots", {"must hold max_tokens_per_rank (128)", "never wraps", "got 4 x 31"});
  p.front_tokens_per_slot = 32;
  EXPECT_NO_THROW(validate(p));
  // Without a ring the per-slot size is not looked at.
  p.front_num_slots = 0;
  p.front_tokens_per_slot = 0;
  EXPECT_NO_THROW(validate(p));
}

TEST(Fingerprint, EqualAcrossRanks) {
  Problem a = valid_problem();
  Problem b = a;
  a.rank = 0;
  b.rank = 3;
  EXPECT_EQ(fingerprint(a), fingerprint(b));
  EXPECT_EQ(fingerprint(a), fingerprint(a));
}

TEST(Fingerprint, ChangesWithEveryOtherField) {
  const Problem base = valid_problem();
  const uint64_t base_print = fingerprint(base);
  const std::vector<std::pair<const char*, std::function<void(Problem&)>>> changes = {
      {"num_ranks", [](Problem& p) { p.num_ranks = 2; }},
      {"num_experts", [](Problem& p) { p.num_experts = 32; }},
      {"top_k", [](Problem& p) { p.top_k = 2; }},
      {"hidden", [](Problem& p) { p.hidden = 640; }},
      {"intermediate", [](Problem& p) { p.intermediate = 384; }},
      {"num_shared_experts", [](Problem& p) { p.num_shared_experts = 0; }},
      {"max_tokens_per_rank", [](Problem& p) { p.max_tokens_per_rank = 129; }},
      {"recipe fp8_fp4", [](Problem& p) { p.recipe = Recipe::fp8_fp4; }},
      {"recipe bf16", [](Problem& p) { p.recipe = Recipe::bf16; }},
      {"front_num_slots", [](Problem& p) {
         p.front_num_slots = 2;
         p.front_tokens_per_slot = 64;
       }},
      {"front_tokens_per_slot", [](Problem& p) { p.front_tokens_per_slot = 64; }},
      {"recv_capacity", [](Problem& p) { p.recv_capacity = 100; }},
      {"wave_tokens", [](Problem& p) { p.wave_tokens = 64; }},
  };
  std::set<uint64_t> prints = {base_print};
  for (const auto& [field, change] : changes) {
    Problem changed = base;
    change(changed);
    ASSERT_NO_THROW(validate(changed)) << field;
    EXPECT_TRUE(prints.insert(fingerprint(changed)).second) << field << " did not give a new fingerprint";
  }
}

TEST(Describe, NamesTheFields) {
  Problem p = valid_problem();
  const std::string text = describe(p);
  EXPECT_NE(text.find("ranks=4"), std::string::npos) << text;
  EXPECT_NE(text.find("hidden=512"), std::string::npos) << text;
  EXPECT_NE(text.find("recipe=fp8"), std::string::npos) << text;
  EXPECT_EQ(text.find("front_slots"), std::string::npos) << text;
  p.front_num_slots = 2;
  p.front_tokens_per_slot = 16;
  EXPECT_NE(describe(p).find("front_slots=2x16"), std::string::npos) << describe(p);
}

}  // namespace
}  // namespace megamoe
