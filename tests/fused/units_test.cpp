// The fused schedule's work units (kernels/fused/units.h): how many of each kind, the order CTAs
// claim them in, and the token and row ranges units cover.
#include "kernels/fused/units.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace megamoe::fused {
namespace {

TEST(FusedUnits, ClassifyWalksTheKindsInClaimOrder) {
  UnitPlan plan;
  plan.send_units = 3;
  const uint32_t route_units = 2;
  plan.shared_l1_units = 2;
  plan.pull_units = 4;
  plan.shared_l2_units = 1;
  plan.combine_units = 2;
  const RoutedUnits routed{5, 6};
  const std::vector<UnitKind> kinds = {UnitKind::send,      UnitKind::route,     UnitKind::pull,
                                       UnitKind::shared_l1, UnitKind::routed_l1, UnitKind::shared_l2,
                                       UnitKind::routed_l2, UnitKind::combine};
  const std::vector<uint32_t> counts = {3, 2, 4, 2, 5, 1, 6, 2};
  uint32_t unit = 0;
  for (size_t k = 0; k < kinds.size(); ++k) {
    for (uint32_t i = 0; i < counts[k]; ++i, ++unit) {
      const UnitRef ref = classify<true>(plan, routed, unit, route_units);
      EXPECT_EQ(ref.kind, kinds[k]) << "unit " << unit;
      EXPECT_EQ(ref.index, i) << "unit " << unit;
    }
  }
  EXPECT_EQ(unit, total_units<true>(plan, routed, route_units));
  EXPECT_EQ(first_routed_unit<true>(plan, route_units), 11u);
  EXPECT_EQ(first_pull_unit<true>(plan, route_units), 5u);
  EXPECT_EQ(classify<true>(plan, routed, first_pull_unit<true>(plan, route_units), route_units).kind, UnitKind::pull);
  EXPECT_EQ(classify<true>(plan, routed, unit, route_units).kind, UnitKind::none);
  EXPECT_EQ(classify<true>(plan, routed, unit + 100, route_units).kind, UnitKind::none);
  // A batch call's kernel has no route units.
  EXPECT_EQ(first_routed_unit(plan), 9u);
  EXPECT_EQ(classify(plan, routed, 3).kind, UnitKind::pull);
  EXPECT_EQ(first_pull_unit(plan), 3u);
}

// A streamed call's route parts: one per kRoutesPerRoutePart routes begun, at most kMaxRouteParts;
// every route falls to exactly one part, none is empty, and a call never takes more
// parts than a launch for a larger call has units (the launch's come from the buffer's most routes).
TEST(FusedUnits, RoutePartsCoverEachCallOnce) {
  EXPECT_EQ(route_parts(0).parts, 1u);
  EXPECT_EQ(route_parts(8).parts, 1u);  // one token, top-8
  EXPECT_EQ(route_parts(160).parts, 2u);
  EXPECT_EQ(route_parts(128 * 8).parts, 8u);  // 128 tokens, top-8: eight CTAs, whatever the buffer
  EXPECT_EQ(route_parts(8192 * 8).parts, kMaxRouteParts);
  uint32_t previous_parts = 1;
  for (uint32_t routes = 0; routes <= 70000; routes += routes < 600 ? 1 : 97) {
    const RouteParts plan = route_parts(routes);
    ASSERT_GE(plan.parts, previous_parts) << routes << " routes take fewer parts than fewer routes";
    previous_parts = plan.parts;
    ASSERT_LE(plan.parts, kMaxRouteParts);
    ASSERT_LE(plan.parts, (routes + kRoutesPerRoutePart - 1) / kRoutesPerRoutePart + (routes == 0)) << routes;
    std::vector<uint32_t> covered(routes, 0);
    for (uint32_t part = 0; part < plan.parts; ++part) {
      const UnitRange mine = unit_range(part, plan.routes_per_part, routes);
      ASSERT_TRUE(part == 0 || mine.begin < mine.end) << "part " << part << " of " << routes << " routes is empty";
      for (uint32_t r = mine.begin; r < mine.end; ++r) ++covered[r];
    }
    for (uint32_t r = 0; r < routes; ++r) ASSERT_EQ(covered[r], 1u) << routes << " routes, route " << r;
  }
}

// A call in chunks: every route falls to exactly one (part, chunk) share, every chunk with routes is
// read by some part, and no part waits for a chunk it takes nothing from.
TEST(FusedUnits, RoutePartsCoverEachChunkOfACallOnce) {
  for (const uint32_t top_k : {1u, 4u, 8u}) {
    for (const uint32_t max_tokens : {1u, 40u, 300u, 8192u}) {
      const uint32_t launched = route_parts(max_tokens * top_k).parts;
      for (const uint32_t chunk_tokens : {1u, 7u, 16u, 256u, max_tokens}) {
        const uint32_t chunk_routes = chunk_tokens * top_k;
        for (const uint32_t tokens : {0u, 1u, max_tokens / 3, max_tokens}) {
          const uint32_t routes = tokens * top_k;
          const RouteParts plan = route_parts(routes);
          ASSERT_LE(plan.parts, launched) << tokens << " of " << max_tokens << " tokens";
          const uint32_t chunks = (routes + chunk_routes - 1) / chunk_routes;
          std::vector<uint32_t> covered(routes, 0), chunk_readers(chunks, 0);
          for (uint32_t part = 0; part < plan.parts; ++part) {
            const UnitRange mine = unit_range(part, plan.routes_per_part, routes);
            const UnitRange held = chunks_holding(mine, chunk_routes);
            for (uint32_t c = held.begin; c < held.end; ++c) {
              ASSERT_LT(c, chunks);
              ++chunk_readers[c];
              const UnitRange share = routes_in_chunk(mine, c, chunk_routes);
              ASSERT_LT(share.begin, share.end) << "part " << part << " waits for chunk " << c << " for nothing";
              for (uint32_t r = share.begin; r < share.end; ++r) {
                ASSERT_EQ(r / chunk_routes, c);
                ++covered[r];
              }
            }
          }
          const std::string where = "top-" + std::to_string(top_k) + ", " + std::to_string(tokens) + " of " +
                                    std::to_string(max_tokens) + " tokens in chunks of " + std::to_string(chunk_tokens);
          for (uint32_t r = 0; r < routes; ++r) ASSERT_EQ(covered[r], 1u) << where << ", route " << r;
          for (uint32_t c = 0; c < chunks; ++c) ASSERT_GE(chunk_readers[c], 1u) << where << ", chunk " << c;
        }
      }
    }
  }
}

TEST(FusedUnits, EmptyKindsAreSkipped) {
  UnitPlan plan;  // one send and one pull unit, nothing else
  const RoutedUnits none{};
  EXPECT_EQ(classify(plan, none, 0).kind, UnitKind::send);
  EXPECT_EQ(classify(plan, none, 1).kind, UnitKind::pull);
  EXPECT_EQ(classify(plan, none, 2).kind, UnitKind::none);
  // The shared L2 tiles sit between the pulls and the routed L2 tiles when there are no L1 units.
  plan.shared_l2_units = 2;
  EXPECT_EQ(classify(plan, RoutedUnits{0, 3}, 2).kind, UnitKind::shared_l2);
  const UnitRef after = classify(plan, RoutedUnits{0, 3}, 4);
  EXPECT_EQ(after.kind, UnitKind::routed_l2);
  EXPECT_EQ(after.index, 0u);
  EXPECT_EQ(classify(plan, RoutedUnits{0, 3}, 7).kind, UnitKind::none);
}

TEST(FusedUnits, TokenAndRowRangesCoverEverythingOnce) {
  for (uint32_t tokens : {0u, 1u, 7u, 128u, 1000u, 8192u}) {
    for (uint32_t per_unit : {1u, 3u, 64u}) {
      std::vector<int> seen(tokens, 0);
      const uint32_t units = (tokens + per_unit - 1) / per_unit;
      for (uint32_t u = 0; u < units + 1; ++u) {  // one past the last is empty
        const UnitRange r = unit_range(u, per_unit, tokens);
        ASSERT_LE(r.begin, r.end);
        for (uint32_t t = r.begin; t < r.end; ++t) ++seen[t];
      }
      for (uint32_t t = 0; t < tokens; ++t) ASSERT_EQ(seen[t], 1) << tokens << " tokens, token " << t;
    }
  }
  for (uint32_t rows : {0u, 1u, 5u, 1000u, 65536u}) {
    for (uint32_t units : {1u, 3u, 528u}) {
      uint32_t next = 0;
      for (uint32_t u = 0; u < units; ++u) {
        const UnitRange r = pull_rows(u, units, rows);
        ASSERT_EQ(r.begin, next) << rows << " rows, unit " << u;  // contiguous, in order
        ASSERT_LE(r.begin, r.end);
        next = r.end;
      }
      EXPECT_EQ(next, rows);
    }
  }
}

TEST(FusedUnits, StreamedKernelsPutARouteUnitPerSourceRankAfterTheSendUnits) {
  const UnitPlan plan = make_unit_plan({1, 8, 132, 16, 16, 28, false, 7168 / 8});
  const uint32_t ranks = 8;
  EXPECT_EQ(first_routed_unit<true>(plan, ranks), first_routed_unit(plan) + ranks);
  EXPECT_EQ(classify<true>(plan, RoutedUnits{}, plan.send_units, ranks).kind, UnitKind::route);
  EXPECT_EQ(classify<true>(plan, RoutedUnits{}, plan.send_units + 7, ranks).index, 7u);
  const UnitRef first_pull = classify<true>(plan, RoutedUnits{}, plan.send_units + 8, ranks);
  EXPECT_EQ(first_pull.kind, UnitKind::pull);
  EXPECT_EQ(first_pull.index, 0u);
  // Everything past the route units as in the batch kernel.
  const RoutedUnits routed{5, 6};
  for (uint32_t unit = plan.send_units; unit < total_units(plan, routed); ++unit) {
    const UnitRef batch = classify(plan, routed, unit);
    const UnitRef streamed = classify<true>(plan, routed, unit + ranks, ranks);
    EXPECT_EQ(streamed.kind, batch.kind) << "unit " << unit;
    EXPECT_EQ(streamed.index, batch.index) << "unit " << unit;
  }
}

TEST(FusedUnits, PlanSizesUnitsFromTheCall) {
  // DeepSeek-V3's shape at 8192 tokens, 132 CTAs, 128-token tiles, one shared expert.
  const UnitPlan big = make_unit_plan({8192, 8, 132, 128, 2048 * 2 / 256, 7168 / 256, true, 7168 / 8});
  EXPECT_EQ(big.tokens_per_send, 63u);  // ceil(8192 / 132)
  EXPECT_EQ(big.send_units, 131u);
  EXPECT_EQ(big.shared_l1_units, 64u * 16u);
  EXPECT_EQ(big.shared_l2_units, 64u * 28u);
  // Past 256 rows per CTA with shared experts the dispatch warps pull beside their L1 tiles: up to
  // four units per CTA of 128 rows.
  EXPECT_FALSE(big.bulk_pulls);
  EXPECT_EQ(big.pull_units, 512u);
  // Bulk pulls by the producers: one unit per CTA, from 32 rows per CTA on (up to 256 with shared
  // experts, without a bound without them).
  const UnitPlan prefill = make_unit_plan({2048, 8, 132, 128, 16, 28, true});  // 124 rows per CTA
  EXPECT_TRUE(prefill.bulk_pulls);
  EXPECT_EQ(prefill.pull_units, 132u);
  const UnitPlan no_shared = make_unit_plan({16384, 8, 132, 128, 0, 0, true});
  EXPECT_TRUE(no_shared.bulk_pulls);
  EXPECT_EQ(no_shared.pull_units, 132u);
  EXPECT_TRUE(make_unit_plan({528, 8, 132, 128, 16, 28, true}).bulk_pulls);    // 32 rows per CTA
  EXPECT_FALSE(make_unit_plan({527, 8, 132, 128, 16, 28, true}).bulk_pulls);   // 31
  EXPECT_TRUE(make_unit_plan({4240, 8, 132, 128, 16, 28, true}).bulk_pulls);   // 256
  EXPECT_TRUE(make_unit_plan({8192, 8, 132, 128, 0, 0, true}).bulk_pulls);     // 496, no shared experts
  EXPECT_FALSE(make_unit_plan({4257, 8, 132, 128, 16, 28, true}).bulk_pulls);  // 258
  EXPECT_EQ(make_unit_plan({2048, 8, 1, 128, 16, 28, true}).pull_units, 4u);  // a grid of one CTA: 16384 rows
  // Decode tiles' kernels have no bulk pulls, whatever the rows.
  EXPECT_FALSE(make_unit_plan({16384, 8, 132, 64, 0, 0, false}).bulk_pulls);
  EXPECT_EQ(make_unit_plan({16384, 8, 132, 64, 0, 0, false}).pull_units, 4u * 132u);
  // The dispatch warps' pulls: one per CTA or 128 rows each, at least a row each, up to four per CTA.
  EXPECT_FALSE(make_unit_plan({8, 8, 132, 16, 16, 28}).bulk_pulls);
  EXPECT_EQ(make_unit_plan({8, 8, 132, 16, 0, 0}).pull_units, 64u);      // a row each
  EXPECT_EQ(make_unit_plan({128, 8, 132, 64, 0, 0}).pull_units, 132u);   // one per CTA, 8 rows each
  EXPECT_EQ(make_unit_plan({128, 8, 132, 64, 16, 28}).pull_units, 132u);
  EXPECT_EQ(big.vectors_per_combine, 32u * 896u);  // whole tokens: ceil(8192 / 264)
  EXPECT_EQ(big.combine_units, 256u);
  // One token: one send unit, a pull unit per row, the shared experts' tiles, and its 896 output
  // vectors as four combine units of at most one vector per math thread.
  const UnitPlan one = make_unit_plan({1, 8, 132, 16, 16, 28, false, 7168 / 8});
  EXPECT_EQ(one.send_units, 1u);
  EXPECT_EQ(one.pull_units, 8u);  // a row each, on eight CTAs
  EXPECT_FALSE(one.bulk_pulls);
  EXPECT_EQ(one.shared_l1_units, 16u);
  EXPECT_EQ(one.vectors_per_combine, kCombineUnitVectors);
  EXPECT_EQ(one.combine_units, 4u);
  EXPECT_EQ(make_unit_plan({8, 8, 132, 16, 16, 28, false, 7168 / 8}).combine_units, 28u);
  EXPECT_EQ(make_unit_plan({128, 8, 132, 64, 16, 28, false, 7168 / 8}).combine_units, 132u);  // 869 vectors each
  EXPECT_EQ(make_unit_plan({300, 8, 132, 128, 16, 28, true, 7168 / 8}).vectors_per_combine, 2u * 896u);
  // No tokens: still one send unit (it publishes the counts) and one pull unit (rows may arrive).
  const UnitPlan none = make_unit_plan({0, 8, 132, 16, 0, 0, false, 7168 / 8});
  EXPECT_EQ(none.send_units, 1u);
  EXPECT_EQ(none.pull_units, 1u);
  EXPECT_EQ(none.combine_units, 0u);
  EXPECT_EQ(none.shared_l1_units, 0u);
}

TEST(FusedUnits, OneRankDecodeCallsPlaceTheirRoutesWithoutPulls) {
  // One rank's batch call with decode tiles and at most a token per CTA: a send unit per token places
  // its routes, and there are no pull units.
  PlanShape shape{1, 8, 132, 16, 16, 28, false, 7168 / 8, true};
  const UnitPlan one = make_unit_plan(shape);
  EXPECT_TRUE(one.local_routes);
  EXPECT_EQ(pull_units_of(one), 0u);
  EXPECT_EQ(one.pull_units, 8u);  // what a kernel without the one-rank path runs instead
  EXPECT_EQ(one.send_units, 1u);
  EXPECT_EQ(one.tokens_per_send, 1u);
  EXPECT_EQ(first_routed_unit(one), 1u + 16u);  // the send unit, then the shared experts' L1 tiles
  EXPECT_EQ(classify(one, RoutedUnits{16, 28}, 1).kind, UnitKind::shared_l1);
  shape.num_tokens = 132;
  EXPECT_TRUE(make_unit_plan(shape).local_routes);
  EXPECT_EQ(make_unit_plan(shape).send_units, 132u);
  shape.num_tokens = 0;  // its one send unit has no token; nothing is pulled
  EXPECT_TRUE(make_unit_plan(shape).local_routes);
  EXPECT_EQ(pull_units_of(make_unit_plan(shape)), 0u);
  // Two tokens per send unit, prefill tiles, several ranks or a streamed call: the pulls as before.
  shape.num_tokens = 133;
  EXPECT_FALSE(make_unit_plan(shape).local_routes);
  EXPECT_GT(pull_units_of(make_unit_plan(shape)), 0u);
  EXPECT_FALSE(make_unit_plan({64, 8, 132, 128, 16, 28, true, 7168 / 8, true}).local_routes);
  EXPECT_FALSE(make_unit_plan({1, 8, 132, 16, 16, 28, false, 7168 / 8, false}).local_routes);
  EXPECT_EQ(pull_units_of(make_unit_plan({1, 8, 132, 16, 16, 28, false, 7168 / 8, false})), 8u);
  // A kernel without the one-rank path clears the flag: the pulls come back.
  UnitPlan cleared = one;
  cleared.local_routes = false;
  EXPECT_EQ(first_routed_unit(cleared), 1u + 8u + 16u);
}

TEST(FusedUnits, CombineUnitsCoverEveryOutputVectorOnce) {
  for (uint32_t hidden_vectors : {360u, 896u}) {  // gpt-oss-120b's and DeepSeek-V3's rows
    for (uint32_t tokens : {0u, 1u, 3u, 8u, 300u, 8192u}) {
      const UnitPlan plan = make_unit_plan({tokens, 4, 132, 16, 0, 0, false, hidden_vectors});
      const uint32_t vectors = tokens * hidden_vectors;
      ASSERT_LE(plan.combine_units, 2u * 132u + 1u) << tokens << " tokens";
      std::vector<int> seen(vectors, 0);
      for (uint32_t u = 0; u < plan.combine_units; ++u) {
        const UnitRange r = unit_range(u, plan.vectors_per_combine, vectors);
        ASSERT_LT(r.begin, r.end) << "combine unit " << u << " of " << plan.combine_units << " is empty";
        for (uint32_t v = r.begin; v < r.end; ++v) ++seen[v];
      }
      for (uint32_t v = 0; v < vectors; ++v) ASSERT_EQ(seen[v], 1) << tokens << " tokens, vector " << v;
    }
  }
}

TEST(FusedUnits, RoutedTailSplitsInItsLinearsLastWave) {
  // DeepSeek-V3 at one token on one GPU: 16 shared and 128 routed L1 tiles (56 K blocks), 28 shared and
  // 224 routed L2 tiles (16 K blocks), 132 CTAs, 132 partial slots.
  const RoutedSplits one = plan_routed_splits(16, 128, 56, 28, 224, 16, 132, 132);
  EXPECT_EQ(one.l1.whole_tiles, 116u);  // 144 tiles: the last 12 split
  EXPECT_EQ(one.l1.splits, 8u);         // 132 / 12, at most kMaxSplits
  EXPECT_EQ(gemm::split_units(128, one.l1), 116u + 96u);
  EXPECT_EQ(one.l2_split_base, 12u);
  EXPECT_EQ(one.l2_slot_base, 96u);
  EXPECT_EQ(one.l2.splits, 1u);  // 252 tiles: a last wave of 120 keeps most of the grid busy
  EXPECT_EQ(one.l2.whole_tiles, 224u);
  // A tail longer than the routed tiles splits only the routed ones.
  const gemm::SplitPlan routed_only = plan_routed_tail(60, 4, 132, 56, 132);
  EXPECT_EQ(routed_only.whole_tiles, 0u);
  EXPECT_EQ(routed_only.splits, 2u);  // 132 / 64
  // No capacity, no split; a full last wave, no split.
  EXPECT_EQ(plan_routed_splits(16, 128, 56, 28, 224, 16, 132, 0).l1.splits, 1u);
  EXPECT_EQ(plan_routed_tail(4, 128, 132, 56, 132).splits, 1u);
  // L2 splits with what L1 left of the capacity: 20 L1 tiles take 6 x 20 = 120 slots, 12 remain.
  const RoutedSplits both = plan_routed_splits(0, 20, 56, 0, 6, 16, 132, 132);
  EXPECT_EQ(both.l1.splits, 6u);
  EXPECT_EQ(both.l2_slot_base, 120u);
  EXPECT_EQ(both.l2.splits, 2u);  // 12 slots / 6 tiles
  EXPECT_LE(both.l2_slot_base + (6 - both.l2.whole_tiles) * both.l2.splits, 132u);
}

// Every split unit of both linears, with its linear's place in the workspace (split_space, as the
// kernel's split_args applies it), stays inside the workspace's capacity, and no two split tiles
// share a counter or a slot. (The first version numbered L2's split tiles after L1's and also moved
// L2's slots past L1's: at DeepSeek-V3-like decode shapes on 66 CTAs its slots reached 144 of 132.)
TEST(FusedUnits, SplitUnitsOfBothLinearsFitTheWorkspaceApart) {
  const uint32_t capacity = 132;
  for (uint32_t grid : {66u, 132u}) {
    for (uint32_t shared : {0u, 8u, 16u}) {
      for (uint32_t routed_tiles = 1; routed_tiles <= 300; ++routed_tiles) {
        const RoutedSplits splits = plan_routed_splits(shared, routed_tiles * 8, 16, shared, routed_tiles * 8, 8, grid,
                                                       capacity);
        std::vector<int> counters(capacity, 0), slots(capacity, 0);
        for (bool first : {true, false}) {
          const gemm::SplitPlan& plan = first ? splits.l1 : splits.l2;
          const SplitSpace space = split_space(splits, first);
          for (uint32_t u = 0; u < gemm::split_units(routed_tiles * 8, plan); ++u) {
            const gemm::SplitUnit part = gemm::split_unit(u, plan);
            if (part.splits < 2) continue;
            const uint32_t counter = space.counter_base + part.split_tile;
            const uint32_t slot = space.slot_base + part.split_tile * part.splits + part.split;
            ASSERT_LT(counter, capacity) << routed_tiles << " tiles, grid " << grid;
            ASSERT_LT(slot, capacity) << routed_tiles << " tiles, grid " << grid << (first ? ", L1" : ", L2");
            if (part.split == 0) ++counters[counter];
            ++slots[slot];
          }
        }
        for (uint32_t i = 0; i < capacity; ++i) {
          ASSERT_LE(counters[i], 1) << "counter " << i << ", " << routed_tiles << " tiles";
          ASSERT_LE(slots[i], 1) << "slot " << i << ", " << routed_tiles << " tiles";
        }
      }
    }
  }
}

TEST(FusedUnits, SplitUnitsCoverEachTileAndItsKRangeOnce) {
  for (const gemm::SplitPlan plan : {gemm::SplitPlan{5, 1}, gemm::SplitPlan{3, 4}, gemm::SplitPlan{0, 8}}) {
    const uint32_t tiles = 5, k_blocks = 56;
    std::vector<uint32_t> covered(tiles * k_blocks, 0);
    uint32_t last_tile = 0;
    for (uint32_t u = 0; u < gemm::split_units(tiles, plan); ++u) {
      const gemm::SplitUnit part = gemm::split_unit(u, plan);
      ASSERT_LT(part.tile, tiles);
      ASSERT_GE(part.tile, last_tile);  // tiles in order, so the walkers' group cursors only move on
      last_tile = part.tile;
      EXPECT_EQ(part.splits, part.tile < plan.whole_tiles ? 1u : plan.splits);
      if (part.splits > 1) EXPECT_EQ(part.split_tile, part.tile - plan.whole_tiles);
      const gemm::KRange range = gemm::split_k_range(k_blocks, part.split, part.splits);
      for (uint32_t kb = range.begin; kb < range.end; ++kb) ++covered[part.tile * k_blocks + kb];
    }
    for (uint32_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1u) << "tile " << i / k_blocks;
  }
}

}  // namespace
}  // namespace megamoe::fused
