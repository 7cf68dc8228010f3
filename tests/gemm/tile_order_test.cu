// The order in which the grouped GEMM walks tiles and K blocks (no GPU needed): the group of a tile,
// the banded tile raster of a group, split K's work units, and the stage ring's bookkeeping with
// and without the unrolled ring passes.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/gemm/mainloop.cuh"

namespace megamoe::gemm {
namespace {

// A walker's cursor finds the same group as a search from scratch: the last group whose first tile is
// <= index, so empty groups (sharing their successor's start) are skipped, whether the walk visits
// every tile or strides over many groups at once.
TEST(TileOrder, GroupCursorFindsTheGroupOfEveryTile) {
  std::mt19937_64 rng(7);
  for (uint32_t num_groups : {1u, 2u, 5u, 32u, 257u}) {
    std::uniform_int_distribution<uint32_t> tiles_of(0, 6);
    std::vector<uint32_t> prefix(num_groups + 1, 0);
    for (uint32_t g = 0; g < num_groups; ++g) prefix[g + 1] = prefix[g] + (g % 3 == 1 ? 0 : tiles_of(rng));
    const uint32_t total = prefix[num_groups];
    for (uint32_t stride : {1u, 3u, 132u}) {
      for (uint32_t start = 0; start < std::min(stride, total); ++start) {
        uint32_t cursor = 0;
        for (uint32_t index = start; index < total; index += stride) {
          const uint32_t expected =
              static_cast<uint32_t>(std::upper_bound(prefix.begin(), prefix.begin() + num_groups, index) -
                                    prefix.begin()) - 1;
          ASSERT_EQ(group_of_tile(prefix.data(), num_groups, index, cursor), expected)
              << "index " << index << ", stride " << stride << ", groups " << num_groups;
          ASSERT_EQ(cursor, expected);
          ASSERT_LT(index - prefix[expected], prefix[expected + 1] - prefix[expected]) << "not a tile of its group";
        }
      }
    }
  }
}

TEST(TileOrder, BandsCoverEveryTileOnce) {
  for (uint32_t m_tiles : {1u, 2u, 16u, 28u}) {
    for (uint32_t n_tiles = 1; n_tiles <= 3 * kBandTokenTiles + 3; ++n_tiles) {
      std::set<std::pair<uint32_t, uint32_t>> seen;
      for (uint32_t local = 0; local < m_tiles * n_tiles; ++local) {
        const TileCoords coords = banded_tile(local, n_tiles, m_tiles);
        ASSERT_LT(coords.m_tile, m_tiles) << local;
        ASSERT_LT(coords.n_tile, n_tiles) << local;
        EXPECT_TRUE(seen.insert({coords.m_tile, coords.n_tile}).second)
            << "tile " << local << " repeats (" << coords.m_tile << ", " << coords.n_tile << "), n_tiles "
            << n_tiles << ", m_tiles " << m_tiles;
      }
      EXPECT_EQ(seen.size(), size_t{m_tiles} * n_tiles);
    }
  }
}

// Within a band, the token tiles of one weight tile are consecutive (they share it from L2), and a
// band's token tiles stay inside it until all its weight tiles are done.
TEST(TileOrder, BandsWalkWeightTilesOverAFewTokenTiles) {
  const uint32_t m_tiles = 16, n_tiles = 2 * kBandTokenTiles + 3;
  for (uint32_t local = 0; local < m_tiles * n_tiles; ++local) {
    const TileCoords coords = banded_tile(local, n_tiles, m_tiles);
    const uint32_t band = local / (m_tiles * kBandTokenTiles);
    EXPECT_EQ(coords.n_tile / kBandTokenTiles, band) << local;
    const uint32_t band_tiles = band < 2 ? kBandTokenTiles : 3;
    EXPECT_EQ(coords.m_tile, (local - band * m_tiles * kBandTokenTiles) / band_tiles) << local;
  }
}

using KBlockVisit = std::tuple<uint32_t, uint32_t, uint32_t>;  // stage, phase, kb

// A group's only token tile narrows its wgmmas to its rows; the tiles of a group of several (which
// stream one weight tile side by side) all keep the full width, the last, partial one included.
TEST(TileOrder, OnlyASingleTileGroupNarrowsItsWgmmas) {
  for (uint32_t block_n : {16u, 64u}) {
    for (uint32_t rows = 1; rows <= block_n; ++rows) EXPECT_EQ(wgmma_rows(rows, rows, block_n), rows) << rows;
    for (uint32_t rows = block_n + 1; rows <= 3 * block_n; ++rows) {
      const uint32_t last_tile_rows = rows - (rows - 1) / block_n * block_n;
      EXPECT_EQ(wgmma_rows(rows, last_tile_rows, block_n), block_n) << rows;
      EXPECT_EQ(wgmma_rows(rows, block_n, block_n), block_n) << rows;
    }
  }
}

// Split K: the splits of a tile partition its K blocks in order, none empty at the allowed counts.
TEST(SplitK, RangesPartitionTheKBlocks) {
  for (uint32_t k_blocks = kMinSplitKBlocks; k_blocks <= 64; ++k_blocks) {
    for (uint32_t splits = 1; splits <= kMaxSplits && splits * kMinSplitKBlocks <= k_blocks; ++splits) {
      uint32_t next = 0;
      for (uint32_t split = 0; split < splits; ++split) {
        const KRange range = split_k_range(k_blocks, split, splits);
        EXPECT_EQ(range.begin, next) << k_blocks << " " << splits << " " << split;
        EXPECT_GE(range.end - range.begin, kMinSplitKBlocks) << k_blocks << " " << splits;
        next = range.end;
      }
      EXPECT_EQ(next, k_blocks) << k_blocks << " " << splits;
    }
  }
}

// The split plan: none unless the last wave's tiles would leave more than half the grid idle (or
// without a workspace); otherwise those tiles split as many ways as one wave holds, within the
// K-block and capacity limits, after the whole waves' tiles.
TEST(SplitK, SplitsOnlyALastWaveThatLeavesMostOfTheGridIdle) {
  const auto expect_plan = [](uint32_t tiles, uint32_t k_blocks, uint32_t capacity, uint32_t whole, uint32_t splits) {
    const SplitPlan plan = plan_split_k(tiles, 132, k_blocks, capacity);
    EXPECT_EQ(plan.whole_tiles, whole) << tiles << " tiles, " << k_blocks << " K blocks, capacity " << capacity;
    EXPECT_EQ(plan.splits, splits) << tiles << " tiles, " << k_blocks << " K blocks, capacity " << capacity;
  };
  expect_plan(512, 56, 4096, 512, 1);  // last wave 116 of 132 tiles
  expect_plan(132, 56, 4096, 132, 1);  // one full wave
  expect_plan(112, 56, 4096, 112, 1);  // most SMs already stream
  expect_plan(252, 16, 4096, 252, 1);
  expect_plan(67, 56, 4096, 67, 1);
  expect_plan(66, 56, 4096, 0, 2);     // half the grid
  expect_plan(48, 23, 4096, 0, 2);
  expect_plan(32, 16, 4096, 0, 4);     // 4 splits of 4 K blocks
  expect_plan(10, 56, 4096, 0, 8);     // at most kMaxSplits
  expect_plan(144, 56, 4096, 132, 8);  // one whole wave, then 12 tiles 8 ways
  expect_plan(270, 56, 4096, 264, 8);  // two whole waves, then 6 tiles
  expect_plan(32, 16, 100, 0, 3);      // capacity: 32 x 3 units
  expect_plan(32, 16, 0, 32, 1);       // no workspace
  expect_plan(32, 4, 4096, 32, 1);     // K too short to split
  expect_plan(0, 56, 4096, 0, 1);
  for (uint32_t tiles = 1; tiles <= 600; ++tiles) {
    const SplitPlan plan = plan_split_k(tiles, 132, 16, 4096);
    ASSERT_GE(plan.splits, 1u);
    ASSERT_LE(plan.splits * kMinSplitKBlocks, 16u);
    if (plan.splits == 1) {
      EXPECT_EQ(plan.whole_tiles, tiles);
    } else {
      EXPECT_EQ(plan.whole_tiles % 132, 0u) << tiles;                    // whole waves first
      EXPECT_LE((tiles - plan.whole_tiles) * plan.splits, 132u) << tiles;  // then one wave of units
    }
  }
}

template <bool kUnroll>
std::vector<KBlockVisit> visits(RingPosition<4>& ring, uint32_t k_blocks) {
  std::vector<KBlockVisit> seen;
  for_each_k_block<kUnroll>(ring, KRange{0, k_blocks},
                            [&](uint32_t stage, uint32_t phase, uint32_t kb) { seen.emplace_back(stage, phase, kb); });
  return seen;
}

// The unrolled passes (taken when the ring is at stage 0 and K fills whole passes) visit the same
// stages, phases and K blocks as the plain loop and leave the ring where it does, so consecutive
// tiles of either kind agree with the producer, which always walks the ring one stage at a time.
TEST(RingPasses, UnrolledPassesMatchThePlainLoop) {
  for (uint32_t first_stage = 0; first_stage < 4; ++first_stage) {
    for (uint32_t first_phase = 0; first_phase < 2; ++first_phase) {
      for (uint32_t k_blocks = 1; k_blocks <= 13; ++k_blocks) {
        RingPosition<4> unrolled{first_stage, first_phase}, plain{first_stage, first_phase};
        const std::vector<KBlockVisit> seen = visits<true>(unrolled, k_blocks);
        EXPECT_EQ(seen, visits<false>(plain, k_blocks)) << first_stage << " " << first_phase << " " << k_blocks;
        EXPECT_EQ(unrolled.stage, plain.stage);
        EXPECT_EQ(unrolled.phase, plain.phase);
        // The producer's view: stage s of pass p is K block p * 4 + s - first_stage.
        RingPosition<4> producer{first_stage, first_phase};
        for (uint32_t kb = 0; kb < k_blocks; ++kb) {
          EXPECT_EQ(seen[kb], KBlockVisit(producer.stage, producer.phase, kb));
          producer.advance();
        }
      }
    }
  }
}

}  // namespace
}  // namespace megamoe::gemm
