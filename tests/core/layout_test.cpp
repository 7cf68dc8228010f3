// The symmetric buffer layout: region order and alignment, independence from the rank, hand-computed
// sizes for a DeepSeek-V3 layer, and the typed accessors.
#include "megamoe/layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/presets.h"

namespace megamoe {
namespace {

using RegionField = Region BufferLayout::*;

// Every region, in the order the layout places them.
const std::vector<std::pair<const char*, RegionField>>& regions_in_order() {
  static const std::vector<std::pair<const char*, RegionField>> regions = {
      {"control", &BufferLayout::control},
      {"recv_count", &BufferLayout::recv_count},
      {"expert_rows", &BufferLayout::expert_rows},
      {"x", &BufferLayout::x},
      {"x_scales", &BufferLayout::x_scales},
      {"topk_idx", &BufferLayout::topk_idx},
      {"topk_weights", &BufferLayout::topk_weights},
      {"src_index", &BufferLayout::src_index},
      {"pool_source", &BufferLayout::pool_source},
      {"pool_weight", &BufferLayout::pool_weight},
      {"l1_pool", &BufferLayout::l1_pool},
      {"l1_pool_scales", &BufferLayout::l1_pool_scales},
      {"l2_pool", &BufferLayout::l2_pool},
      {"l2_pool_scales", &BufferLayout::l2_pool_scales},
      {"shared_x_scales", &BufferLayout::shared_x_scales},
      {"shared_l2", &BufferLayout::shared_l2},
      {"shared_l2_scales", &BufferLayout::shared_l2_scales},
      {"combine", &BufferLayout::combine},
      {"front_ring", &BufferLayout::front_ring},
      {"gemm_split", &BufferLayout::gemm_split},
      {"fused_counters", &BufferLayout::fused_counters},
      {"expanded_weights", &BufferLayout::expanded_weights},
  };
  return regions;
}

Problem small_problem(Recipe recipe) {
  Problem p;
  p.num_ranks = 4;
  p.rank = 0;
  p.num_experts = 8;
  p.top_k = 4;
  p.hidden = 256;
  p.intermediate = 384;
  p.num_shared_experts = 2;
  p.max_tokens_per_rank = 37;
  p.recipe = recipe;
  return p;
}

// DeepSeek-V3's MoE layer split over 2 ranks.
Problem deepseek_v3() {
  Problem p;
  p.num_ranks = 2;
  p.rank = 0;
  p.num_experts = 256;
  p.top_k = 8;
  p.hidden = 7168;
  p.intermediate = 2048;
  p.num_shared_experts = 1;
  p.max_tokens_per_rank = 8192;
  p.recipe = Recipe::fp8;
  return p;
}

void expect_well_formed(const BufferLayout& l, const char* label) {
  uint64_t previous_end = 0;
  for (const auto& [name, field] : regions_in_order()) {
    const Region& region = l.*field;
    EXPECT_EQ(region.offset % kRegionAlign, 0u) << label << " " << name;
    EXPECT_GE(region.offset, previous_end) << label << " " << name << " overlaps the region before it";
    // Regions are packed: each starts at the first aligned offset after the previous one.
    EXPECT_EQ(region.offset, align_up(previous_end, kRegionAlign)) << label << " " << name;
    previous_end = region.end();
  }
  EXPECT_EQ(l.total_bytes, align_up(l.expanded_weights.end(), kRegionAlign)) << label;
}

TEST(BufferLayout, RegionsAreOrderedAlignedAndDisjoint) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    expect_well_formed(BufferLayout::make(small_problem(recipe)), "small");
  }
  expect_well_formed(BufferLayout::make(deepseek_v3()), "deepseek");
}

// for_each_region names every region once, in placement order, and nothing is left out: each region
// starts where the one before it ends (aligned up), and the last one ends the buffer.
TEST(BufferLayout, ForEachRegionTilesTheBuffer) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    for (const Problem& p : {small_problem(recipe), deepseek_v3()}) {
      const BufferLayout l = BufferLayout::make(p);
      std::vector<std::string> names;
      uint64_t cursor = 0;
      l.for_each_region([&](const char* name, const Region& region) {
        EXPECT_EQ(region.offset, cursor) << name;
        cursor = align_up(region.end(), kRegionAlign);
        names.emplace_back(name);
      });
      EXPECT_EQ(cursor, l.total_bytes);
      ASSERT_EQ(names.size(), regions_in_order().size());
      size_t i = 0;
      l.for_each_region([&](const char* name, const Region& region) {
        EXPECT_EQ(name, std::string(regions_in_order()[i].first));
        EXPECT_EQ(&region, &(l.*regions_in_order()[i].second)) << name;
        ++i;
      });
    }
  }
}

TEST(BufferLayout, DoesNotDependOnRank) {
  Problem p = small_problem(Recipe::fp8);
  const BufferLayout first = BufferLayout::make(p);
  for (int32_t rank = 1; rank < p.num_ranks; ++rank) {
    p.rank = rank;
    const BufferLayout other = BufferLayout::make(p);
    EXPECT_EQ(other.total_bytes, first.total_bytes);
    for (const auto& [name, field] : regions_in_order()) {
      EXPECT_EQ((other.*field).offset, (first.*field).offset) << name << " rank " << rank;
      EXPECT_EQ((other.*field).bytes, (first.*field).bytes) << name << " rank " << rank;
    }
  }
}

TEST(BufferLayout, GrowsMonotonicallyWithMaxTokens) {
  for (Recipe recipe : {Recipe::fp8, Recipe::bf16}) {
    Problem p = small_problem(recipe);
    p.max_tokens_per_rank = 1;
    const uint64_t smallest = BufferLayout::make(p).total_bytes;
    BufferLayout previous = BufferLayout::make(p);
    for (int32_t tokens = 2; tokens <= 600; ++tokens) {
      p.max_tokens_per_rank = tokens;
      const BufferLayout next = BufferLayout::make(p);
      EXPECT_GE(next.total_bytes, previous.total_bytes) << tokens;
      for (const auto& [name, field] : regions_in_order()) {
        EXPECT_GE((next.*field).bytes, (previous.*field).bytes) << name << " at " << tokens << " tokens";
      }
      previous = next;
    }
    EXPECT_GT(previous.total_bytes, smallest);
  }
}

TEST(BufferLayout, WorstCasePoolRows) {
  Problem p = small_problem(Recipe::fp8);
  // 8 experts on 4 ranks: 2 per rank. top_k 4 > 2, so a token sends at most 2 routes to one rank:
  // 4 source ranks * 37 tokens * 2 routes = 296 rows. The pool adds 255 rows of tile slack and
  // rounds up to kPoolRowAlign: 551 -> 768.
  EXPECT_EQ(p.max_routes_per_token_to_rank(), 2);
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), 296u);
  EXPECT_EQ(BufferLayout::make(p).pool_rows, 768u);

  // 1 rank, 8 experts, top-2, 100 tokens: every route lands here, 200 rows; 455 -> 512.
  p.num_ranks = 1;
  p.top_k = 2;
  p.max_tokens_per_rank = 100;
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), 200u);
  EXPECT_EQ(BufferLayout::make(p).pool_rows, 512u);

  // 64 experts on 8 ranks (8 each), top-6 < 8: 8 ranks * 1000 tokens * 6 routes = 48000 rows;
  // 48255 -> 48384 (189 * 256).
  p.num_ranks = 8;
  p.num_experts = 64;
  p.top_k = 6;
  p.max_tokens_per_rank = 1000;
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), 48000u);
  EXPECT_EQ(BufferLayout::make(p).pool_rows, 48384u);

  // One expert per rank: at most one route per token per rank, whatever top_k is.
  p.num_experts = 8;
  p.top_k = 8;
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), 8000u);
}

// Expert offsets in the pool are prefix sums, so an expert's last GEMM tile (up to kPoolRowAlign
// rows) may start at any row below the worst case; it must still end inside the pool.
TEST(BufferLayout, PoolHasRoomForTheLastTile) {
  Problem p = small_problem(Recipe::fp8);
  p.num_ranks = 1;
  p.num_experts = 8;
  for (int32_t top_k : {1, 2, 8}) {
    for (int32_t tokens : {1, 32, 37, 128, 255, 256, 1000}) {
      p.top_k = top_k;
      p.max_tokens_per_rank = tokens;
      const uint64_t worst = BufferLayout::worst_case_pool_rows(p);
      const uint64_t rows = BufferLayout::make(p).pool_rows;
      EXPECT_EQ(rows % kPoolRowAlign, 0u);
      EXPECT_GE(rows, worst - 1 + kPoolRowAlign) << "top_k " << top_k << " tokens " << tokens;
      EXPECT_LT(rows, worst + 2 * kPoolRowAlign) << "no more slack than needed";
    }
  }
}

// A receive capacity bounds the expert pools: their rows are the capacity plus a tile's overhang,
// the worst case caps it, and the total shrinks by the pools' bytes per row saved.
TEST(BufferLayout, RecvCapacityBoundsThePools) {
  Problem p = deepseek_v3();
  p.num_ranks = 8;
  p.wave_tokens = p.max_tokens_per_rank;  // one wave
  const BufferLayout worst = BufferLayout::make(p);
  EXPECT_EQ(worst.recv_capacity, 8u * 8192 * 8);
  p.recv_capacity = 2 * mean_recv_routes(p);  // 131072 routes: twice the uniform routing's
  const BufferLayout bounded = BufferLayout::make(p);
  EXPECT_EQ(bounded.recv_capacity, 131072u);
  EXPECT_EQ(bounded.pool_rows, 131072u + 256);
  expect_well_formed(bounded, "bounded");
  // Per pool row: hidden + intermediate activation bytes, their scales, the source and the weight;
  // and the fused schedule's counter per (at most) kFusedMinTokenTile rows.
  const uint64_t row_bytes = 7168 + 2048 + 4 * (56 + 16) + sizeof(PoolSource) + 4;
  const uint64_t saved_rows = uint64_t{worst.pool_rows} - bounded.pool_rows;
  const uint64_t saved = saved_rows * row_bytes + saved_rows / kFusedMinTokenTile * 4;
  EXPECT_GE(worst.total_bytes - bounded.total_bytes, saved - 16 * kRegionAlign);
  EXPECT_LE(worst.total_bytes - bounded.total_bytes, saved + 16 * kRegionAlign);
  std::printf("deepseek-v3, 8 ranks x 8192 tokens: %.2f GiB worst case, %.2f GiB at capacity 2x the mean\n",
              worst.total_bytes / double(1ull << 30), bounded.total_bytes / double(1ull << 30));
  // Larger than the worst case changes nothing.
  p.recv_capacity = int64_t{1} << 30;
  EXPECT_EQ(BufferLayout::make(p).total_bytes, worst.total_bytes);
}

// Waves shrink every token-sized region and the pools' worst case by the wave's share of the call.
// DeepSeek-V3 at 8 ranks x 8192 tokens in waves of 4096 with twice the mean routes fits 1.5 GiB.
TEST(BufferLayout, WavesBoundTheBuffer) {
  Problem p = deepseek_v3();
  p.num_ranks = 8;
  p.wave_tokens = p.max_tokens_per_rank;  // one wave
  const BufferLayout whole = BufferLayout::make(p);
  EXPECT_GT(whole.total_bytes, 5ull << 30);
  p.wave_tokens = 4096;
  const BufferLayout half = BufferLayout::make(p);
  expect_well_formed(half, "waves");
  EXPECT_EQ(half.wave_tokens, 4096u);
  EXPECT_EQ(half.recv_capacity, 8u * 4096 * 8);
  EXPECT_EQ(half.combine.bytes * 2, whole.combine.bytes);
  EXPECT_EQ(half.x.bytes * 2, whole.x.bytes);
  EXPECT_EQ(half.src_index.bytes * 2, whole.src_index.bytes);
  p.recv_capacity = 2 * mean_recv_routes(p);  // 65536 routes: twice a wave's uniform routing
  const BufferLayout bounded = BufferLayout::make(p);
  EXPECT_EQ(bounded.recv_capacity, 65536u);
  EXPECT_LE(bounded.total_bytes, 3ull << 29);  // 1.5 GiB
  std::printf("deepseek-v3, 8 ranks x 8192 tokens in waves of 4096: %.2f GiB worst case, %.2f GiB at capacity "
              "2x the mean\n",
              half.total_bytes / double(1ull << 30), bounded.total_bytes / double(1ull << 30));
}

// The default wave (Problem::wave_tokens = 0): DeepSeek-V3 at 8 ranks x 8192 tokens per rank runs in
// four waves of 2048 tokens (512 expected rows per expert each), in at most 1.5 GiB.
TEST(BufferLayout, DefaultWaveFitsDeepSeekV3AtEightRanks) {
  Problem p = deepseek_v3();
  p.num_ranks = 8;
  EXPECT_EQ(default_wave_floor(p), 2048);
  EXPECT_EQ(tokens_per_wave(p), 2048);
  EXPECT_EQ(waves_per_call(p), 4);
  const BufferLayout l = BufferLayout::make(p);
  EXPECT_LE(l.total_bytes, kDefaultBufferBytes);
  EXPECT_EQ(l.total_bytes, BufferLayout::make(p, 2048).total_bytes);
  std::printf("deepseek-v3, 8 ranks x 8192 tokens, default waves: %d of %d tokens, %.2f GiB\n", waves_per_call(p),
              tokens_per_wave(p), l.total_bytes / double(1ull << 30));
  // A receive capacity shrinks the pools but leaves the wave as it is.
  p.recv_capacity = 2 * mean_recv_routes(p);
  EXPECT_EQ(tokens_per_wave(p), 2048);
  EXPECT_LT(BufferLayout::make(p).total_bytes, l.total_bytes);
}

// For every preset, rank count and token count: the default is one wave when that fits the budget,
// else the fewest equal waves that fit it, and never waves under the floor (where the fewest allowed
// may exceed the budget). An explicit wave is kept as it is.
TEST(BufferLayout, DefaultWaveIsTheFewestThatFit) {
  for (const Preset& preset : all_presets()) {
    for (int32_t ranks : {1, 2, 4, 8}) {
      if (preset.num_experts % ranks != 0) continue;
      for (int32_t tokens : {1, 100, 2048, 8192, 20000, 65536}) {
        Problem p = preset_problem(preset, ranks, tokens);
        validate(p);
        const std::string label = std::string(preset.name) + " ranks " + std::to_string(ranks) + " tokens " +
                                  std::to_string(tokens);
        const int32_t wave = tokens_per_wave(p), waves = waves_per_call(p), floor = default_wave_floor(p);
        const auto bytes = [&](int32_t w) { return BufferLayout::make(p, w).total_bytes; };
        ASSERT_GE(wave, 1) << label;
        ASSERT_LE(wave, tokens) << label;
        EXPECT_EQ(waves, (tokens + wave - 1) / wave) << label;
        EXPECT_EQ(wave, (tokens + waves - 1) / waves) << label << ": equal waves";
        EXPECT_EQ(BufferLayout::make(p).total_bytes, bytes(wave)) << label;
        if (waves > 1) {
          EXPECT_GE(wave, floor) << label;
          const int32_t fewer = (tokens + waves - 2) / (waves - 1);
          EXPECT_GT(bytes(fewer), kDefaultBufferBytes) << label << ": one wave fewer fits too";
        }
        if (bytes(wave) > kDefaultBufferBytes) {
          const int32_t more = (tokens + waves) / (waves + 1);
          EXPECT_LT(more, floor) << label << ": one wave more was allowed";
        }
        Problem explicit_wave = p;
        explicit_wave.wave_tokens = tokens;
        EXPECT_EQ(waves_per_call(explicit_wave), 1) << label;
        explicit_wave.wave_tokens = 1000;
        EXPECT_EQ(tokens_per_wave(explicit_wave), std::min(tokens, 1000)) << label;
      }
    }
  }
}

TEST(BufferLayout, DeepSeekV3HandComputedSizes) {
  const Problem p = deepseek_v3();
  const BufferLayout l = BufferLayout::make(p);
  constexpr uint64_t kPage = kRegionAlign;  // 4096

  // 128 experts per rank; a token sends min(8, 128) = 8 routes to one rank at most.
  EXPECT_EQ(l.experts_per_rank, 128u);
  EXPECT_EQ(l.wave_tokens, 8192u);
  // Worst case 2 ranks * 8192 tokens * 8 routes = 131072 rows; plus 255 rows of tile slack, rounded
  // up to 256: 131328 pool rows.
  EXPECT_EQ(BufferLayout::worst_case_pool_rows(p), 131072u);
  EXPECT_EQ(l.pool_rows, 131328u);
  EXPECT_EQ(l.hidden_blocks, 56u);        // 7168 / 128
  EXPECT_EQ(l.intermediate_blocks, 16u);  // 2048 / 128
  EXPECT_EQ(l.shared_intermediate, 2048u);
  EXPECT_EQ(l.activation_bytes, 1u);

  // control: the counters plus one u64 send count per global expert (256 * 8 = 2048 bytes); it
  // fits one page as long as ControlBlock stays under 2 KiB.
  EXPECT_EQ(l.control.bytes, sizeof(ControlBlock) + 2048);
  ASSERT_LE(l.control.bytes, kPage);
  EXPECT_EQ(l.control.offset, 0u);
  // recv_count: 128 experts * 2 ranks * 4 bytes = 1024.
  EXPECT_EQ(l.recv_count.offset, 1 * kPage);
  EXPECT_EQ(l.recv_count.bytes, 1024u);
  // expert_rows: 129 * 4 = 516.
  EXPECT_EQ(l.expert_rows.offset, 2 * kPage);
  EXPECT_EQ(l.expert_rows.bytes, 516u);
  // x: 8192 tokens * 7168 bytes = 58720256 = 14336 pages.
  EXPECT_EQ(l.x.offset, 3 * kPage);
  EXPECT_EQ(l.x.bytes, 58720256u);
  // x_scales: 8192 * 56 * 4 = 1835008 = 448 pages.
  EXPECT_EQ(l.x_scales.offset, (3 + 14336) * kPage);
  EXPECT_EQ(l.x_scales.bytes, 1835008u);
  // topk_idx and topk_weights: 8192 * 8 * 4 = 262144 = 64 pages each.
  EXPECT_EQ(l.topk_idx.offset, 14787 * kPage);
  EXPECT_EQ(l.topk_idx.bytes, 262144u);
  EXPECT_EQ(l.topk_weights.offset, 14851 * kPage);
  EXPECT_EQ(l.topk_weights.bytes, 262144u);
  // src_index: 128 experts * 2 ranks * 8192 tokens * 4 = 8388608 = 2048 pages.
  EXPECT_EQ(l.src_index.offset, 14915 * kPage);
  EXPECT_EQ(l.src_index.bytes, 8388608u);
  // pool_source: 131328 rows * 8 = 1050624 bytes = 256.5 pages, so the next region starts 257 pages on.
  EXPECT_EQ(l.pool_source.offset, 16963 * kPage);
  EXPECT_EQ(l.pool_source.bytes, 1050624u);
  // pool_weight: 131328 * 4 = 525312 = 128.25 pages -> 129.
  EXPECT_EQ(l.pool_weight.offset, 17220 * kPage);
  EXPECT_EQ(l.pool_weight.bytes, 525312u);
  // l1_pool: 131328 rows * 7168 bytes = 941359104 = 229824 pages.
  EXPECT_EQ(l.l1_pool.offset, 17349 * kPage);
  EXPECT_EQ(l.l1_pool.bytes, 941359104u);
  // l1_pool_scales: 131328 * 56 * 4 = 29417472 = 7182 pages.
  EXPECT_EQ(l.l1_pool_scales.offset, 247173 * kPage);
  EXPECT_EQ(l.l1_pool_scales.bytes, 29417472u);
  // l2_pool: 131328 * 2048 = 268959744 = 65664 pages.
  EXPECT_EQ(l.l2_pool.offset, 254355 * kPage);
  EXPECT_EQ(l.l2_pool.bytes, 268959744u);
  // l2_pool_scales: 131328 * 16 * 4 = 8404992 = 2052 pages.
  EXPECT_EQ(l.l2_pool_scales.offset, 320019 * kPage);
  EXPECT_EQ(l.l2_pool_scales.bytes, 8404992u);
  // shared_x_scales: 56 * 8192 * 4 = 1835008 = 448 pages.
  EXPECT_EQ(l.shared_x_scales.offset, 322071 * kPage);
  EXPECT_EQ(l.shared_x_scales.bytes, 1835008u);
  // shared_l2: 8192 * 2048 = 16777216 = 4096 pages; its scales 16 * 8192 * 4 = 524288 = 128 pages.
  EXPECT_EQ(l.shared_l2.offset, 322519 * kPage);
  EXPECT_EQ(l.shared_l2.bytes, 16777216u);
  EXPECT_EQ(l.shared_l2_scales.offset, 326615 * kPage);
  EXPECT_EQ(l.shared_l2_scales.bytes, 524288u);
  // combine: 8192 tokens * 9 slots * 7168 * 2 bytes = 1056964608 = 258048 pages.
  EXPECT_EQ(l.combine.offset, 326743 * kPage);
  EXPECT_EQ(l.combine.bytes, 1056964608u);
  // No front ring.
  EXPECT_EQ(l.front_ring.offset, 584791 * kPage);
  EXPECT_EQ(l.front_ring.bytes, 0u);
  // The GEMM's split-K workspace: 1024 counters + 132 x 16 KiB = 529 pages.
  EXPECT_EQ(l.gemm_split.offset, 584791 * kPage);
  EXPECT_EQ(l.gemm_split.bytes, 4096u + 132u * 16384u);
  // fused_counters: 128 experts + (131328 / 16 + 128) routed token tiles + 8192 / 16 shared token
  // tiles + the streamed route counters (1 + 2 ranks x 2, to word 8981, then 2 ranks x 128 experts
  // from word 8992, the next multiple of 32) = 9248 u32 = 36992 bytes = 9.03 pages.
  EXPECT_EQ(l.max_routed_token_tiles, 8336u);
  EXPECT_EQ(l.max_shared_token_tiles, 512u);
  EXPECT_EQ(l.fused_counters.offset, 585320 * kPage);
  EXPECT_EQ(l.fused_counters.bytes, 36992u);
  EXPECT_EQ(l.total_bytes, 585330 * kPage);  // 2397511680 bytes, about 2.23 GiB
}

TEST(BufferLayout, Bf16HasNoScaleRegions) {
  const BufferLayout l = BufferLayout::make(small_problem(Recipe::bf16));
  EXPECT_EQ(l.activation_bytes, 2u);
  EXPECT_EQ(l.x_scales.bytes, 0u);
  EXPECT_EQ(l.l1_pool_scales.bytes, 0u);
  EXPECT_EQ(l.l2_pool_scales.bytes, 0u);
  EXPECT_EQ(l.shared_x_scales.bytes, 0u);
  EXPECT_EQ(l.shared_l2_scales.bytes, 0u);
  // Activations take two bytes: x is 40 tokens (37 rounded up to 4) * 256 * 2.
  EXPECT_EQ(l.x.bytes, 40u * 256u * 2u);

  const BufferLayout fp8 = BufferLayout::make(small_problem(Recipe::fp8));
  EXPECT_EQ(fp8.x.bytes, 40u * 256u);
  EXPECT_EQ(fp8.x_scales.bytes, 40u * 2u * 4u);
  EXPECT_EQ(fp8.pool_rows, 768u);
  EXPECT_EQ(fp8.l1_pool_scales.bytes, 768u * 2u * 4u);
  EXPECT_EQ(fp8.l2_pool_scales.bytes, 768u * 3u * 4u);
  EXPECT_EQ(fp8.shared_x_scales.bytes, 40u * 2u * 4u);
  EXPECT_EQ(fp8.shared_l2_scales.bytes, 40u * 6u * 4u);  // 2 shared experts * 384 = 768 channels = 6 blocks
  // The fp8_fp4 recipe has fp8 activations, so the same activation regions.
  const BufferLayout fp4 = BufferLayout::make(small_problem(Recipe::fp8_fp4));
  EXPECT_EQ(fp4.total_bytes, fp8.total_bytes);
}

// The fp8_fp4 scratch for expanded weights (kExpandFp4Rows): the routed part only when a wave can
// expect that many rows per local expert, the shared part when the shared experts' wave can reach it
// too, nothing for the other recipes.
TEST(BufferLayout, ExpandedFp4WeightsOnlyWhereAWaveCanReachTheThreshold) {
  Problem p = deepseek_v3();
  p.num_ranks = 8;
  p.recipe = Recipe::fp8_fp4;
  p.wave_tokens = p.max_tokens_per_rank;  // one wave
  const uint64_t l1_expert = 2ull * 2048 * 7168;  // one expert's L1 weights as E4M3
  // 8192 tokens x 8 ranks x top-8 over 256 experts: 2048 rows per expert.
  const BufferLayout both = BufferLayout::make(p);
  EXPECT_EQ(both.expanded_shared_offset, 32 * l1_expert);
  EXPECT_EQ(both.expanded_weights.bytes, 33 * l1_expert);
  expect_well_formed(both, "expanded");
  // One rank: 256 rows per expert keep the converters; the shared expert's 8192 rows expand.
  p.num_ranks = 1;
  const BufferLayout shared_only = BufferLayout::make(p);
  EXPECT_EQ(shared_only.expanded_shared_offset, 0u);
  EXPECT_EQ(shared_only.expanded_weights.bytes, l1_expert);
  // Below the threshold everywhere: no scratch.
  p.max_tokens_per_rank = static_cast<int32_t>(kExpandFp4Rows) - 4;
  EXPECT_EQ(BufferLayout::make(p).expanded_weights.bytes, 0u);
  p.max_tokens_per_rank = 8192;
  p.num_ranks = 8;
  for (Recipe recipe : {Recipe::fp8, Recipe::bf16}) {
    p.recipe = recipe;
    EXPECT_EQ(BufferLayout::make(p).expanded_weights.bytes, 0u) << to_string(recipe);
  }
}

TEST(BufferLayout, NoSharedExpertsMeansNoSharedRegions) {
  Problem p = small_problem(Recipe::fp8);
  p.num_shared_experts = 0;
  const BufferLayout l = BufferLayout::make(p);
  EXPECT_EQ(l.shared_intermediate, 0u);
  EXPECT_EQ(l.shared_x_scales.bytes, 0u);
  EXPECT_EQ(l.shared_l2.bytes, 0u);
  EXPECT_EQ(l.shared_l2_scales.bytes, 0u);
}

// Pointers into a real allocation: the extreme indices land inside their regions.
TEST(BufferLayout, AccessorsStayInsideTheirRegions) {
  for (Recipe recipe : {Recipe::fp8, Recipe::bf16}) {
    const Problem p = small_problem(recipe);
    const BufferLayout l = BufferLayout::make(p);
    std::vector<uint8_t> buffer(l.total_bytes + kRegionAlign);
    // Align the base like a device allocation.
    uint8_t* base = buffer.data() + (kRegionAlign - reinterpret_cast<uintptr_t>(buffer.data()) % kRegionAlign);
    auto offset_of = [base](const void* pointer) {
      return static_cast<uint64_t>(static_cast<const uint8_t*>(pointer) - base);
    };
    const uint32_t ranks = static_cast<uint32_t>(p.num_ranks);
    const uint32_t slots = static_cast<uint32_t>(p.combine_slots());
    const uint32_t hidden = static_cast<uint32_t>(p.hidden);

    EXPECT_EQ(offset_of(l.control_block(base)), l.control.offset);
    EXPECT_EQ(offset_of(l.send_count(base)), l.control.offset + sizeof(ControlBlock));
    EXPECT_EQ(offset_of(l.send_count(base) + p.num_experts), l.control.end());

    EXPECT_EQ(offset_of(l.recv_count_ptr(base, 0, 0, ranks)), l.recv_count.offset);
    EXPECT_EQ(offset_of(l.recv_count_ptr(base, l.experts_per_rank - 1, ranks - 1, ranks) + 1), l.recv_count.end());

    EXPECT_EQ(offset_of(l.src_index_ptr(base, 0, 0, ranks)), l.src_index.offset);
    EXPECT_EQ(offset_of(l.src_index_ptr(base, l.experts_per_rank - 1, ranks - 1, ranks) + l.wave_tokens),
              l.src_index.end());
    // Neighbouring (expert, rank) lists do not overlap.
    EXPECT_EQ(l.src_index_ptr(base, 0, 1, ranks) - l.src_index_ptr(base, 0, 0, ranks), l.wave_tokens);
    EXPECT_EQ(l.src_index_ptr(base, 1, 0, ranks) - l.src_index_ptr(base, 0, 0, ranks), ranks * l.wave_tokens);

    EXPECT_EQ(offset_of(l.combine_slot(base, 0, 0, slots, hidden)), l.combine.offset);
    EXPECT_EQ(offset_of(l.combine_slot(base, l.wave_tokens - 1, slots - 1, slots, hidden) + hidden), l.combine.end());
    EXPECT_EQ(l.combine_slot(base, 0, 1, slots, hidden) - l.combine_slot(base, 0, 0, slots, hidden), hidden);

    // Every region's start is aligned in memory, not just as an offset.
    for (const auto& [name, field] : regions_in_order()) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(BufferLayout::at<uint8_t>(base, l.*field)) % kRegionAlign, 0u) << name;
    }
    const FusedCounters fused = l.fused(base);
    EXPECT_EQ(offset_of(fused.rows_pulled), l.fused_counters.offset);
    EXPECT_EQ(fused.l1_done - fused.rows_pulled, l.experts_per_rank);
    EXPECT_EQ(fused.shared_l1_done - fused.l1_done, l.max_routed_token_tiles);
    const StreamedRouteCounters routes = l.streamed_routes(base, ranks);
    EXPECT_EQ(routes.sources_done - fused.shared_l1_done, l.max_shared_token_tiles);
    EXPECT_EQ(routes.parts_done - routes.sources_done, 1);
    EXPECT_EQ(routes.chunks - routes.parts_done, ranks);
    // The table slots on lines of their own: past the chunks, from a 128-byte boundary.
    EXPECT_GE(routes.cursors - routes.chunks, ranks);
    EXPECT_LT(routes.cursors - routes.chunks, ranks + 32);
    EXPECT_EQ(offset_of(routes.cursors) % 128, 0u);
    EXPECT_EQ(offset_of(routes.cursors + l.experts_per_rank * ranks), l.fused_counters.end());

    // The regions cover the whole allocation once: their ends never pass total_bytes.
    EXPECT_LE(l.fused_counters.end(), l.total_bytes);
  }
}

}  // namespace
}  // namespace megamoe
