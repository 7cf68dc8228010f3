// The grouped GEMM's tile heuristic and the shared-memory budgets of its configs (no GPU needed).
#include <gtest/gtest.h>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/grouped_gemm.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm {
namespace {

// Up to 3 rows: 16-token tiles. 4..16: 64-token tiles for launches of many groups (fewer weight
// passes for groups of several tiles, narrowed wgmmas for the rest), except with packed weights;
// launches of few groups keep 16-token tiles and with them split K. 17..39 (bf16: ..48): 64-token
// tiles, whose wgmmas narrow to a single-tile group's rows.
TEST(TileChoice, FewRowsStreamWeightsWith16Or64TokenTiles) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16})
    for (uint32_t groups : {1u, 31u, 32u, 256u}) {
      for (uint32_t rows : {0u, 1u, 3u}) {
        EXPECT_EQ(choose_tile(rows, groups, recipe).layout, TileLayout::weights_on_m) << rows;
        EXPECT_EQ(choose_tile(rows, groups, recipe).block_n, 16u) << rows << " " << groups;
      }
      for (uint32_t rows : {4u, 7u, 8u, 16u}) {
        const bool wide = groups >= kWideDecodeGroups && recipe != Recipe::fp8_fp4;
        EXPECT_EQ(choose_tile(rows, groups, recipe).layout, TileLayout::weights_on_m) << rows;
        EXPECT_EQ(choose_tile(rows, groups, recipe).block_n, wide ? 64u : 16u) << rows << " " << groups;
      }
      for (uint32_t rows : {17u, 32u, 39u}) {
        EXPECT_EQ(choose_tile(rows, groups, recipe).layout, TileLayout::weights_on_m) << rows;
        EXPECT_EQ(choose_tile(rows, groups, recipe).block_n, 64u) << rows << " " << groups;
      }
    }
  for (uint32_t rows : {40u, 48u}) {
    EXPECT_EQ(choose_tile(rows, 32, Recipe::bf16).layout, TileLayout::weights_on_m) << rows;
    EXPECT_EQ(choose_tile(rows, 32, Recipe::bf16).block_n, 64u) << rows;
  }
}

// From 40 rows (bf16: 49) a group of up to 128 rows is one token tile and reads each
// weight tile once.
TEST(TileChoice, ManyRowsPutTokensOnWgmmaM) {
  EXPECT_EQ(choose_tile(40, 32, Recipe::fp8).layout, TileLayout::tokens_on_m);
  EXPECT_EQ(choose_tile(49, 32, Recipe::bf16).layout, TileLayout::tokens_on_m);
  EXPECT_EQ(choose_tile(40, 32, Recipe::fp8_fp4).layout, TileLayout::tokens_on_m);
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16})
    for (uint32_t rows : {49u, 64u, 128u, 256u, 4096u, 1u << 20}) {
      EXPECT_EQ(choose_tile(rows, 32, recipe).layout, TileLayout::tokens_on_m) << rows;
      EXPECT_EQ(choose_tile(rows, 1, recipe).block_n, 128u) << rows;
    }
}

// fp8_fp4 tiles expand their weights once into E4M3 scratch from kExpandFp4Rows expected rows, and
// no other recipe's or size's tiles do.
TEST(TileChoice, Fp4PrefillExpandsWeightsFromItsThreshold) {
  const uint32_t threshold = static_cast<uint32_t>(kExpandFp4Rows);
  for (uint32_t rows : {1u, 16u, 40u, 512u, threshold - 1})
    EXPECT_FALSE(choose_tile(rows, 32, Recipe::fp8_fp4).expand_weights) << rows;
  for (uint32_t rows : {threshold, 4096u, 1u << 20}) {
    EXPECT_TRUE(choose_tile(rows, 32, Recipe::fp8_fp4).expand_weights) << rows;
    EXPECT_EQ(choose_tile(rows, 32, Recipe::fp8_fp4).layout, TileLayout::tokens_on_m) << rows;
    EXPECT_FALSE(choose_tile(rows, 32, Recipe::fp8).expand_weights) << rows;
    EXPECT_FALSE(choose_tile(rows, 32, Recipe::bf16).expand_weights) << rows;
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

// With store warps the L2 prefill tile stages whole 512-byte rows (128 tokens, 16 bytes of padding
// each): three stages fit beside them, and the two warpgroups' staged-tile records.
TEST(TileConfig, StoreWarpTilesStageWholeRowsBesideThreeStages) {
  using Fp8Stores = GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128, true>;
  using Bf16Stores = GemmConfig<Bf16Policy, TileLayout::tokens_on_m, 128, true>;
  EXPECT_EQ(Fp8Stores::kL2StagingStride, 528u);
  EXPECT_EQ(Fp8Stores::kStagingBytes, 128u * 528);
  EXPECT_EQ(Fp8Stores::kStages, 3u);
  EXPECT_EQ(Bf16Stores::kStages, 3u);
  EXPECT_EQ(Fp8Stores::kStagedTileBytes, 32u);
  EXPECT_EQ((GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128>::kStagedTileBytes), 0u);
  EXPECT_LE(Fp8Stores::kSmemBytes, 227u * 1024);
  EXPECT_LE(Bf16Stores::kSmemBytes, 227u * 1024);
  EXPECT_EQ(Fp8Stores::kStagingOffset % 128, 0u);
  EXPECT_TRUE(kRegistersFit<Fp8Stores>);
}

// setmaxnreg's split of the CTA's registers at launch (a request past them would hang the math
// warps): 232 math registers in prefill, 216 beside fp8_fp4's prefill converter warpgroup; fp8 and
// bf16 decode tiles give the producer warpgroup 56 (it stages the weight scales) and get 224;
// fp8_fp4's decode tiles have no converters (their math warps expand the weights in registers) and
// get 232.
TEST(TileConfig, MathRegistersFitTheLaunchAllocation) {
  using Fp8Prefill = GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128>;
  using Fp8Decode = GemmConfig<Fp8Policy, TileLayout::weights_on_m, 16>;
  using Bf16Decode = GemmConfig<Bf16Policy, TileLayout::weights_on_m, 64>;
  using Fp4Decode = GemmConfig<Fp8Fp4Policy, TileLayout::weights_on_m, 16>;
  using Fp4Prefill = GemmConfig<Fp8Fp4Policy, TileLayout::tokens_on_m, 128>;
  EXPECT_EQ(kLaunchRegisters<Fp8Prefill>, 168);
  EXPECT_EQ(kLaunchRegisters<Fp4Prefill>, 128);
  EXPECT_EQ(kMathRegisters<Fp8Prefill>, 232);
  EXPECT_EQ(kProducerRegisters<Fp8Decode>, 56);
  EXPECT_EQ(kMathRegisters<Fp8Decode>, 224);
  EXPECT_EQ(kMathRegisters<Bf16Decode>, 224);
  EXPECT_EQ(kLaunchRegisters<Fp4Decode>, 168);
  EXPECT_EQ(Fp4Decode::kConverterWarps, 0u);
  EXPECT_EQ(kMathRegisters<Fp4Decode>, 232);
  EXPECT_EQ(Fp4Prefill::kConverterWarps, 7u);
  // The fused schedule's prefill config: its dispatch warps join the converter warpgroup.
  using Fp4FusedPrefill = GemmConfig<Fp8Fp4Policy, TileLayout::tokens_on_m, 128, false, true>;
  EXPECT_EQ(Fp4FusedPrefill::kConverterWarps, 7u);
  EXPECT_EQ(Fp4FusedPrefill::kFullArrivals, 8u);
  EXPECT_EQ(kMathRegisters<Fp4FusedPrefill>, 216);
  EXPECT_EQ(kMathRegisters<Fp4Prefill>, 216);
  EXPECT_TRUE(kRegistersFit<Fp8Prefill>);
  EXPECT_TRUE(kRegistersFit<Fp8Decode>);
  EXPECT_TRUE(kRegistersFit<Bf16Decode>);
  EXPECT_TRUE(kRegistersFit<Fp4Decode>);
  EXPECT_TRUE(kRegistersFit<Fp4Prefill>);
}

// The scale warp (kScaleWarp) stages fp8's weight-block scales in tokens_on_m tiles, staged or fused, and
// arrives on full[s] beside the producer; decode tiles (the producer stages them stages ahead), bf16
// (no scales) and fp8_fp4's prefill tiles (warp 3 is a converter) keep one arrival per producer.
TEST(TileConfig, ScaleWarpServesFp8PrefillTiles) {
  using Fp8Prefill = GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128>;
  using Fp8PrefillStores = GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128, true>;
  using Fp8FusedPrefill = GemmConfig<Fp8Policy, TileLayout::tokens_on_m, 128, false, true>;
  EXPECT_TRUE(Fp8Prefill::kScaleWarp);
  EXPECT_TRUE(Fp8PrefillStores::kScaleWarp);
  EXPECT_TRUE(Fp8FusedPrefill::kScaleWarp);
  EXPECT_EQ(Fp8Prefill::kFullArrivals, 2u);
  EXPECT_EQ(Fp8FusedPrefill::kFullArrivals, 2u);
  EXPECT_FALSE((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 16>::kScaleWarp));
  EXPECT_EQ((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 16>::kFullArrivals), 1u);
  EXPECT_FALSE((GemmConfig<Bf16Policy, TileLayout::tokens_on_m, 128, true>::kScaleWarp));
  EXPECT_FALSE((GemmConfig<Fp8Fp4Policy, TileLayout::tokens_on_m, 128>::kScaleWarp));
  EXPECT_FALSE((GemmConfig<Fp8Fp4Policy, TileLayout::tokens_on_m, 128, false, true>::kScaleWarp));
}

TEST(TileConfig, DecodeTilesKeepAtLeastFourStages) {
  EXPECT_GE((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 16>::kStages), 4u);
  EXPECT_GE((GemmConfig<Fp8Policy, TileLayout::weights_on_m, 64>::kStages), 4u);
  EXPECT_GE((GemmConfig<Bf16Policy, TileLayout::weights_on_m, 64>::kStages), 3u);
}

}  // namespace
}  // namespace megamoe::gemm
