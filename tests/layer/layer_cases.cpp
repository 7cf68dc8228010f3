#include "layer/layer_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include "comm/scoped_env.h"
#include "test_seed.h"

namespace megamoe::layer_test {
namespace {

std::vector<int32_t> tokens(int32_t ranks, std::vector<int32_t> pattern) {
  std::vector<int32_t> result(ranks);
  for (int32_t r = 0; r < ranks; ++r) result[r] = pattern[r % pattern.size()];
  return result;
}

// MEGAMOE_TEST_QUICK: the same cases with at most 64 tokens per rank and a few calls, for runs under
// compute-sanitizer (tools/gpu_check.sh sanitize); the SM holder's spin is left out.
constexpr int32_t kQuickTokens = 64;
void shrink(std::vector<LayerCase>& cases) {
  const auto cap = [](std::vector<int32_t>& counts) {
    for (int32_t& n : counts) n = std::min(n, kQuickTokens);
  };
  for (LayerCase& c : cases) {
    cap(c.tokens_per_rank);
    for (std::vector<int32_t>& variant : c.size_variants) cap(variant);
    c.repeats = std::min(c.repeats, 3);
    c.variant_calls = std::min(c.variant_calls, 8);
  }
  std::erase_if(cases, [](const LayerCase& c) { return c.hold_half_the_sms; });
}

// MEGAMOE_TEST_CASES: a comma-separated list; only the cases whose name contains one of its entries
// run (tools/gpu_check.sh sanitize runs a few cases of the process test, which forks per case and
// schedule). A list that matches no case is an error, so that a misspelt entry cannot pass as a run.
void select(std::vector<LayerCase>& cases) {
  const char* value = std::getenv("MEGAMOE_TEST_CASES");
  if (value == nullptr || value[0] == '\0') return;
  std::vector<std::string> wanted;
  std::stringstream list(value);
  for (std::string entry; std::getline(list, entry, ',');)
    if (!entry.empty()) wanted.push_back(entry);
  std::erase_if(cases, [&](const LayerCase& c) {
    return std::none_of(wanted.begin(), wanted.end(),
                        [&](const std::string& entry) { return c.name.find(entry) != std::string::npos; });
  });
  if (cases.empty())
    throw std::invalid_argument(std::string("MEGAMOE_TEST_CASES='") + value + "' matches no layer case name");
}

}  // namespace

std::vector<LayerCase> cases_for_ranks(int32_t ranks) {
  std::vector<LayerCase> cases;
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    const std::string suffix = "_" + std::string(to_string(recipe));
    LayerCase basic;
    basic.name = "basic_shared" + suffix;
    basic.recipe = recipe;
    basic.num_experts = 8 * ranks;
    basic.top_k = 2;
    basic.num_shared_experts = 1;
    basic.tokens_per_rank = tokens(ranks, {128, 7});
    cases.push_back(basic);

    LayerCase sweep = basic;
    sweep.name = "token_sweep" + suffix;
    sweep.num_shared_experts = 0;
    sweep.num_experts = 64;
    sweep.top_k = 6;
    sweep.tokens_per_rank = tokens(ranks, {4096, 0, 1000, 1, 128, 7});
    cases.push_back(sweep);

    // Decode tiles with K long enough to split (16 L1 and 8 L2 K blocks) and few tiles: the last
    // wave of each linear splits K in both schedules.
    LayerCase split = basic;
    split.name = "decode_tiles_split_k" + suffix;
    split.num_experts = 4 * ranks;
    split.hidden = 2048;
    split.intermediate = 1024;
    split.tokens_per_rank = tokens(ranks, {1, 7, 3});
    cases.push_back(split);

    LayerCase nonfinite = basic;
    nonfinite.name = "nonfinite_inputs_in_four_tokens" + suffix;
    nonfinite.top_k = 4;
    nonfinite.tokens_per_rank = tokens(ranks, {128, 7, 1});
    nonfinite.nonfinite_tokens = true;
    cases.push_back(nonfinite);
  }
  // fp8_fp4 prefill on weights expanded once (kExpandFp4Rows): 1100 tokens x top-4 over 4 experts per
  // rank expect 1100 rows per expert, and the shared expert has 1100; the rank of 64 tokens keeps the
  // converters (staged schedule; the fused one always converts).
  LayerCase expanded;
  expanded.name = "prefill_expanded_fp4_weights_fp8_fp4";
  expanded.recipe = Recipe::fp8_fp4;
  expanded.num_experts = 4 * ranks;
  expanded.top_k = 4;
  expanded.num_shared_experts = 1;
  expanded.tokens_per_rank = tokens(ranks, {1100, 64});
  cases.push_back(expanded);

  LayerCase repeat;
  repeat.name = "repeated_expert_within_a_token";
  repeat.num_experts = 8 * ranks;
  repeat.top_k = 4;
  repeat.num_shared_experts = 1;
  repeat.tokens_per_rank = tokens(ranks, {128, 7, 0});
  repeat.repeat_expert = true;
  cases.push_back(repeat);

  LayerCase top1;
  top1.name = "top1_every_route_on_one_expert";
  top1.num_experts = 8 * ranks;
  top1.top_k = 1;
  top1.routing = Routing::one_expert;
  top1.tokens_per_rank = tokens(ranks, {1000, 128});
  cases.push_back(top1);

  LayerCase top8;
  top8.name = "top8_256_experts_masked";
  top8.num_experts = 256;
  top8.top_k = 8;
  top8.hidden = 512;
  top8.intermediate = 256;
  top8.num_shared_experts = 1;
  top8.masked_fraction = 0.3f;
  top8.routing = Routing::zipf;
  top8.tokens_per_rank = tokens(ranks, {128, 1000, 0});
  cases.push_back(top8);

  LayerCase repeated;
  repeated.name = "hundred_calls";
  repeated.num_experts = 64;
  repeated.top_k = 8;
  repeated.tokens_per_rank = tokens(ranks, {7, 128});
  repeated.repeats = 100;
  cases.push_back(repeated);

  LayerCase graph;
  graph.name = "cuda_graph_replay";
  graph.num_experts = 64;
  graph.top_k = 2;
  graph.num_shared_experts = 1;
  graph.tokens_per_rank = tokens(ranks, {128, 1});
  graph.graph = true;
  cases.push_back(graph);

  LayerCase empty;
  empty.name = "zero_tokens_on_every_rank";
  empty.num_experts = 8 * ranks;
  empty.num_shared_experts = 1;
  empty.tokens_per_rank = tokens(ranks, {0});
  cases.push_back(empty);

  LayerCase held;
  held.name = "half_the_sms_held_by_another_kernel";
  held.num_experts = 64;
  held.top_k = 6;
  held.num_shared_experts = 1;
  held.tokens_per_rank = tokens(ranks, {1000, 128});
  held.hold_half_the_sms = true;
  cases.push_back(held);

  LayerCase sizes;
  sizes.name = "thousand_calls_changing_sizes";
  sizes.num_experts = 16 * ranks;
  sizes.top_k = 4;
  sizes.num_shared_experts = 1;
  sizes.masked_fraction = 0.1f;
  sizes.size_variants = {tokens(ranks, {1, 300}), tokens(ranks, {64, 0}), tokens(ranks, {500, 17}),
                         tokens(ranks, {0, 2})};
  sizes.tokens_per_rank = tokens(ranks, {500, 300});
  sizes.variant_calls = 1000;
  cases.push_back(sizes);

  // Waves of 128 tokens per rank: three for 300 tokens, the other ranks' shorter calls running
  // empty waves; both calls on the same buffer.
  LayerCase waves;
  waves.name = "waves_of_128_tokens";
  waves.num_experts = 8 * ranks;
  waves.top_k = 4;
  waves.num_shared_experts = 1;
  waves.masked_fraction = 0.1f;
  waves.tokens_per_rank = tokens(ranks, {300, 0, 129});
  waves.wave_tokens = 128;
  waves.repeats = 2;
  cases.push_back(waves);

  LayerCase bad;
  bad.name = "out_of_range_expert_id";
  bad.num_experts = 8 * ranks;
  bad.tokens_per_rank = tokens(ranks, {16});
  bad.bad_expert_rank = ranks - 1;
  cases.push_back(bad);
  if (testing::quick_run()) shrink(cases);
  // Receive capacity (Problem::recv_capacity) at, one above and one below the most routes a rank
  // receives: the first two are exact, the last is refused on every rank.
  for (int32_t margin : {0, 1, -1}) {
    LayerCase capacity;
    capacity.name = margin == 0 ? "capacity_at_the_routes" : margin > 0 ? "capacity_one_above" : "capacity_one_below";
    capacity.num_experts = 8 * ranks;
    capacity.top_k = 4;
    capacity.num_shared_experts = 1;
    capacity.routing = Routing::zipf;
    capacity.tokens_per_rank = tokens(ranks, {300, 64});
    capacity.capacity_margin = margin;
    cases.push_back(capacity);
  }
  select(cases);
  return cases;
}

LayerCase absent_rank_case(int32_t ranks) {
  LayerCase absent;
  absent.name = "last_rank_never_calls";
  absent.num_experts = 8 * ranks;
  absent.num_shared_experts = 1;
  absent.tokens_per_rank = tokens(ranks, {128, 7});
  absent.absent_rank = ranks - 1;
  return absent;
}

LayerCase late_rank_case(int32_t ranks) {
  LayerCase late = absent_rank_case(ranks);  // the same problem; the last rank calls, late
  late.name = "last_rank_calls_late";
  late.absent_rank = -1;
  late.late_rank = ranks - 1;
  return late;
}

void expect_ranks_pass_with_short_timeout(int32_t ranks, LaunchMode mode, const LayerCase& c) {
  const comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  const auto data = prepare(c);
  for (Schedule schedule : {Schedule::staged, Schedule::fused}) {
    std::printf("case %s, %s schedule\n", c.name.c_str(), std::string(to_string(schedule)).c_str());
    EXPECT_EQ(run_ranks(ranks, mode, [&](Communicator& comm) { run_rank(comm, *data, schedule); }), 0)
        << to_string(schedule) << " schedule: ranks failed; see stderr; replay: " << data->replay;
  }
}

}  // namespace megamoe::layer_test
