// The fp8_fp4 recipe's E2M1 -> E4M3 expansion (e2m1.cuh), on the CPU: every code under every shift
// against formats.h's own conversions, and the packed layout's column order.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "kernels/gemm/e2m1.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/policy.cuh"
#include "megamoe/formats.h"

namespace megamoe::gemm {
namespace {

uint8_t expected_e4m3(uint8_t code, uint32_t shift) {
  return float_to_e4m3(e2m1_to_float(code) * bits_float((127u - shift) << 23));
}

TEST(E2M1Expansion, EveryCodeUnderEveryShiftMatchesTheScalarConversion) {
  for (uint32_t shift = 0; shift <= kMaxE2M1Shift; ++shift) {
    const E2M1Table table = e2m1_table(shift);
    for (uint32_t a = 0; a < 16; ++a)
      for (uint32_t b = 0; b < 16; ++b) {
        // Codes a, b, b, a in column order: bytes (b << 4 | a) and (a << 4 | b).
        const uint32_t packed = (b << 4 | a) | (a << 4 | b) << 8;
        const uint32_t out = expand_e2m1x4(packed, table);
        const uint8_t want[4] = {expected_e4m3(a, shift), expected_e4m3(b, shift), expected_e4m3(b, shift),
                                 expected_e4m3(a, shift)};
        for (uint32_t i = 0; i < 4; ++i)
          ASSERT_EQ((out >> (8 * i)) & 0xFFu, want[i]) << "shift " << shift << " codes " << a << "," << b << " byte " << i;
      }
  }
}

TEST(E2M1Expansion, SmallShiftsAreExactAndLargeOnesFlushToZero) {
  for (uint32_t shift = 0; shift <= 8; ++shift)
    for (uint8_t code = 0; code < 16; ++code)
      EXPECT_EQ(e4m3_to_float(expected_e4m3(code, shift)), e2m1_to_float(code) * bits_float((127u - shift) << 23))
          << "shift " << shift << " code " << int{code};
  const E2M1Table flushed = e2m1_table(13);
  EXPECT_EQ(flushed.low, 0u);
  EXPECT_EQ(flushed.high, 0u);
}

TEST(E2M1Expansion, GroupOf32KeepsColumnOrder) {
  std::mt19937 rng(7);
  for (uint32_t trial = 0; trial < 100; ++trial) {
    const uint32_t shift = rng() % (kMaxE2M1Shift + 1);
    uint32_t packed[4];
    for (uint32_t& word : packed) word = rng();
    // As the converter does: each 16-bit half of a packed word gives one word of four E4M3 bytes.
    uint32_t out[8];
    for (uint32_t i = 0; i < 8; ++i) out[i] = expand_e2m1x4(packed[i / 2] >> (16 * (i % 2)) & 0xFFFFu, e2m1_table(shift));
    for (uint32_t column = 0; column < 32; ++column) {
      const uint8_t byte = static_cast<uint8_t>(packed[column / 8] >> (8 * (column % 8 / 2)));
      const uint8_t code = column % 2 == 0 ? byte & 0xF : byte >> 4;
      ASSERT_EQ((out[column / 4] >> (8 * (column % 4))) & 0xFFu, expected_e4m3(code, shift)) << "column " << column;
    }
  }
}

// Packed weights add a raw area per stage; the tiles still fit shared memory with a deep enough ring.
TEST(E2M1Expansion, PackedWeightConfigsFitSharedMemory) {
  using Prefill = GemmConfig<Fp8Fp4Policy, TileLayout::tokens_on_m, 128>;
  using Decode = GemmConfig<Fp8Fp4Policy, TileLayout::weights_on_m, 16>;
  EXPECT_GE(Prefill::kStages, 3u);
  EXPECT_GE(Decode::kStages, 4u);
  EXPECT_LE(Prefill::kSmemBytes, 227u * 1024);
  EXPECT_EQ(Prefill::kRawOffset % 16, 0u);  // TMA and bulk-copy destinations
  EXPECT_EQ(Prefill::kRawStride % 16, 0u);
  EXPECT_EQ(Prefill::kStageTxBytes, Prefill::kTokenBytes + Prefill::kScaleBytes);  // weights arrive via converters
  EXPECT_EQ(Prefill::kFullArrivals, 8u);  // the producer and seven converter warps
  EXPECT_EQ(Prefill::kThreads, 512u);
  EXPECT_EQ(Decode::kFullArrivals, 8u);
  EXPECT_EQ(Decode::kThreads, 512u);
}

}  // namespace
}  // namespace megamoe::gemm
