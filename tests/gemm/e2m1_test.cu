// The fp8_fp4 recipe's E2M1 -> E4M3 expansion (e2m1.cuh), on the CPU: every code under every shift
// against formats.h's own conversions, the sign interleaving, and the packed layout's column order.
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
        // Codes a, b, b, a, b, a, a, b in column order.
        const uint32_t codes[8] = {a, b, b, a, b, a, a, b};
        uint32_t packed = 0;
        for (uint32_t i = 0; i < 8; ++i) packed |= codes[i] << (4 * i);
        const uint32_t word = interleave_e2m1_signs(packed);
        const uint32_t out[2] = {expand_e2m1_low(word, table), expand_e2m1_high(word, table)};
        for (uint32_t i = 0; i < 8; ++i)
          ASSERT_EQ((out[i / 4] >> (8 * (i % 4))) & 0xFFu, expected_e4m3(static_cast<uint8_t>(codes[i]), shift))
              << "shift " << shift << " codes " << a << "," << b << " column " << i;
      }
  }
}

TEST(E2M1Expansion, InterleavingKeepsMagnitudesAndMovesOnlySigns) {
  EXPECT_EQ(interleave_e2m1_signs(0x77777777u), 0x77777777u);
  EXPECT_EQ(interleave_e2m1_signs(0x00000008u), 0x00000080u);  // code 0's sign: bit 3 -> bit 7
  EXPECT_EQ(interleave_e2m1_signs(0x00000080u), 0x00008000u);  // code 1's: bit 7 -> bit 15
  EXPECT_EQ(interleave_e2m1_signs(0x00080000u), 0x00000008u);  // code 4's: bit 19 -> bit 3
  EXPECT_EQ(interleave_e2m1_signs(0x80000000u), 0x08000000u);  // code 7's: bit 31 -> bit 27
  EXPECT_EQ(interleave_e2m1_signs(0x88888888u), 0x88888888u);
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

TEST(E2M1Expansion, WordsOfRandomCodesKeepColumnOrder) {
  std::mt19937 rng(7);
  for (uint32_t trial = 0; trial < 1000; ++trial) {
    const uint32_t shift = rng() % (kMaxE2M1Shift + 1);
    const uint32_t packed = rng();  // the plain packing: byte j holds columns 2j (low) and 2j + 1
    const uint32_t word = interleave_e2m1_signs(packed);
    const uint32_t out[2] = {expand_e2m1_low(word, e2m1_table(shift)), expand_e2m1_high(word, e2m1_table(shift))};
    for (uint32_t column = 0; column < 8; ++column) {
      const uint8_t byte = static_cast<uint8_t>(packed >> (8 * (column / 2)));
      const uint8_t code = column % 2 == 0 ? byte & 0xF : byte >> 4;
      ASSERT_EQ((out[column / 4] >> (8 * (column % 4))) & 0xFFu, expected_e4m3(code, shift)) << "column " << column;
    }
  }
}

// The kernels' group order: word c of a packed group expands, low half then high half, into the
// columns that lane c of a quad holds in wgmma's A fragment, 4c..4c+3 and 16+4c..16+4c+3 (so the
// converters' chunks, every word's low half and then every high half, hold the columns in order).
TEST(E2M1Expansion, PackedGroupsFollowTheAFragmentColumns) {
  std::mt19937 rng(11);
  for (uint32_t trial = 0; trial < 1000; ++trial) {
    const uint32_t shift = rng() % (kMaxE2M1Shift + 1);
    const E2M1Table table = e2m1_table(shift);
    uint32_t plain[4], packed[4];
    for (uint32_t& word : plain) word = rng();
    pack_e2m1_group(plain, packed);
    for (uint32_t c = 0; c < 4; ++c) {
      const uint32_t halves[2] = {expand_e2m1_low(packed[c], table), expand_e2m1_high(packed[c], table)};
      for (uint32_t h = 0; h < 2; ++h)
        for (uint32_t i = 0; i < 4; ++i) {
          const uint32_t column = 16 * h + 4 * c + i;
          const uint8_t code = static_cast<uint8_t>((plain[column / 8] >> (4 * (column % 8))) & 0xFu);
          const uint8_t byte = static_cast<uint8_t>(halves[h] >> (8 * i));
          ASSERT_EQ(byte, expected_e4m3(code, shift)) << "word " << c << " half " << h << " byte " << i;
          ASSERT_EQ(e2m1_group_column(c, 4 * h + i), column);
        }
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
  // TMA's 64-byte swizzle pattern starts at 1024-byte boundaries of shared memory.
  EXPECT_EQ(Prefill::kRawOffset % 1024, 0u);
  EXPECT_EQ(Prefill::kRawStride % 1024, 0u);
  EXPECT_EQ(Decode::kRawOffset % 1024, 0u);
  EXPECT_EQ(Prefill::kStageTxBytes, Prefill::kTokenBytes + Prefill::kScaleBytes);  // weights arrive via converters
  EXPECT_EQ(Prefill::kFullArrivals, 8u);  // the producer and seven converter warps
  EXPECT_EQ(Prefill::kThreads, 512u);
  // Decode tiles expand in the math warps' registers: no converters, no E4M3 tile, raw bytes on full[s].
  EXPECT_EQ(Decode::kFullArrivals, 1u);
  EXPECT_EQ(Decode::kThreads, 384u);
  EXPECT_EQ(Decode::kWeightBytes, 0u);
  EXPECT_GE(Decode::kStages, 8u);
}

}  // namespace
}  // namespace megamoe::gemm
