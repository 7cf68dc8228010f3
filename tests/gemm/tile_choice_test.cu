// The grouped GEMM's tile heuristic and the shared-memory budgets of its configs (no GPU needed).
#include <gtest/gtest.h>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm {
namespace {

// Up to 16 rows: 16-token tiles. 17..64: 64-token tiles, whose wgmmas narrow to a single-tile
// group's rows (measured faster than 32-token tiles for skewed routing at 32 rows per expert).
TEST(TileChoice, FewRowsStreamWeightsWith16Or64TokenTiles) {
  for (uint32_t rows : {0u, 1u, 16u}) {
    EXPECT_EQ(choose_tile(rows).layout, TileLayout::weights_on_m) << rows;
    EXPECT_EQ(choose_tile(rows).block_n, 16u) << rows;
  }
  for (uint32_t rows : {17u, 32u, 33u, 64u}) {
    EXPECT_EQ(choose_tile(rows).layout, TileLayout::weights_on_m) << rows;
    EXPECT_EQ(choose_tile(rows).block_n, 64u) << rows;
  }
}

TEST(TileChoice, ManyRowsPutTokensOnWgmmaM) {
  for (uint32_t rows : {65u, 128u, 256u, 4096u, 1u << 20}) {
    EXPECT_EQ(choose_tile(rows).layout, TileLayout::tokens_on_m) << rows;
    EXPECT_EQ(choose_tile(rows).block_n, 128u) << rows;
  }
}

// The prefill tile keeps four stages in flight for both recipes: the epilogue stages 128-byte row
// passes instead of whole rows to make room for them.
TEST(TileConfig, PrefillTilesKeepFourStages) {
  EXPECT_EQ((GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128>::kStages), 4u);
  EXPECT_EQ((GemmConfig<Bf16Policy, TileLayout::tokens_on_m, 128>::kStages), 4u);
  EXPECT_LE((GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128>::kSmemBytes), 227u * 1024);
  EXPECT_LE((GemmConfig<Bf16Policy, TileLayout::tokens_on_m, 128>::kSmemBytes), 227u * 1024);
}

TEST(TileConfig, DecodeTilesKeepAtLeastFourStages) {
  EXPECT_GE((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 16>::kStages), 4u);
  EXPECT_GE((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 64>::kStages), 4u);
  EXPECT_GE((GemmConfig<Bf16Policy, TileLayout::weights_on_m, 64>::kStages), 3u);
}

}  // namespace
}  // namespace megamoe::gemm
