// The wgmma shared-memory descriptor (no GPU needed): its fields as the PTX ISA lays them out for a
// K-major operand with 128-byte swizzle, and stepping through K slices and stages in its low word.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/ptx/wgmma.cuh"

namespace megamoe::ptx {
namespace {

uint64_t field(uint64_t desc, int first_bit, int bits) { return (desc >> first_bit) & ((uint64_t{1} << bits) - 1); }

TEST(SmemDescriptor, FieldsOfA128ByteSwizzledKMajorTile) {
  for (uint32_t address : {0u, 1024u, 0x1e000u, 227u * 1024 - 1024}) {
    const uint64_t desc = SmemDescSw128::at(address).value();
    EXPECT_EQ(field(desc, 0, 14), address >> 4) << "start address, in 16-byte units";
    EXPECT_EQ(field(desc, 14, 2), 0u);
    EXPECT_EQ(field(desc, 16, 14), 1u) << "leading byte offset (unused with swizzling)";
    EXPECT_EQ(field(desc, 32, 14), 1024u >> 4) << "stride byte offset: one 8-row atom of 1024 bytes";
    EXPECT_EQ(field(desc, 49, 3), 0u) << "base offset: the tile starts on an atom";
    EXPECT_EQ(field(desc, 62, 2), 1u) << "layout: 128-byte swizzle";
  }
}

// A K block's wgmmas step 32 bytes of K each, and stages lie whole tiles apart: both only move the
// start address, whatever the base, for every shared-memory address a CTA can have.
TEST(SmemDescriptor, StepsMoveOnlyTheStartAddress) {
  for (uint32_t base = 0; base < 227u * 1024; base += 1024) {
    const SmemDescSw128 desc = SmemDescSw128::at(base);
    for (uint32_t step : {32u, 64u, 96u, 8192u, 32768u}) {
      if (base + step >= 227u * 1024) continue;
      EXPECT_EQ(desc.plus(step).value(), SmemDescSw128::at(base + step).value()) << base << " + " << step;
    }
  }
}

}  // namespace
}  // namespace megamoe::ptx
