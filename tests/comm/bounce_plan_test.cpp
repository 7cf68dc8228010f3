// The bulk pull's batches (kernels/comm/bounce_plan.h): every byte of every row passes through the
// bounce area exactly once, in batches that fit half the area.
#include "kernels/comm/bounce_plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace megamoe::comm {
namespace {

void expect_covers(uint32_t area_bytes, uint32_t row_bytes, uint32_t rows) {
  const BouncePlan plan = BouncePlan::make(area_bytes, row_bytes, rows);
  const std::string what = std::to_string(area_bytes) + " B area, " + std::to_string(row_bytes) + " B rows, " +
                           std::to_string(rows) + " rows";
  ASSERT_GT(plan.half, 0u) << what;
  ASSERT_EQ(plan.half % 16, 0u) << what;
  ASSERT_LE(2 * plan.half, area_bytes) << what;
  // bytes of each row seen so far, in order; a row completes with its last batch only
  std::vector<uint32_t> seen(rows, 0);
  std::vector<bool> completed(rows, false);
  for (uint32_t b = 0; b < plan.batches(); ++b) {
    const BounceBatch batch = plan.batch(b);
    ASSERT_GE(batch.rows, 1u) << what << ", batch " << b;
    ASSERT_LE(batch.rows, 32u) << what << ", batch " << b;
    ASSERT_LE(batch.first + batch.rows, rows) << what << ", batch " << b;
    ASSERT_LE(batch.rows * batch.bytes, plan.half) << what << ", batch " << b;
    ASSERT_EQ(batch.offset % 16, 0u) << what << ", batch " << b;
    ASSERT_EQ(batch.bytes % 16, 0u) << what << ", batch " << b;
    ASSERT_GT(batch.bytes, 0u) << what << ", batch " << b;
    for (uint32_t r = batch.first; r < batch.first + batch.rows; ++r) {
      ASSERT_EQ(seen[r], batch.offset) << what << ", batch " << b << ", row " << r;
      seen[r] += batch.bytes;
      ASSERT_EQ(batch.completes_rows, seen[r] == row_bytes) << what << ", batch " << b << ", row " << r;
      completed[r] = batch.completes_rows;
    }
  }
  for (uint32_t r = 0; r < rows; ++r) {
    EXPECT_EQ(seen[r], row_bytes) << what << ", row " << r;
    EXPECT_TRUE(completed[r]) << what << ", row " << r;
  }
}

TEST(BouncePlan, EveryByteOfEveryRowOnceInBatchesThatFitHalfTheArea) {
  // The fused kernel's areas: the fp8 prefill ring (about 195 KiB less the segments), the fp8_fp4
  // decode ring (13 KiB), and odd sizes; rows of DeepSeek-V3 (7168 B), gpt-oss (2880), bf16 8192,
  // the largest hidden size (64 KiB of E4M3, 128 KiB of BF16) and the smallest.
  for (uint32_t area : {195840u, 13312u, 8192u, 1000u, 48u})
    for (uint32_t row_bytes : {16u, 128u, 2880u, 7168u, 8192u, 65536u, 131072u})
      for (uint32_t rows : {0u, 1u, 2u, 3u, 31u, 32u, 33u, 128u, 129u}) expect_covers(area, row_bytes, rows);
}

TEST(BouncePlan, WholeRowsPerBatchWhenTheyFit) {
  const BouncePlan dsv3 = BouncePlan::make(195840, 7168, 128);
  EXPECT_EQ(dsv3.pieces, 1u);
  EXPECT_EQ(dsv3.rows_per_batch, 13u);  // 97920 B halves
  EXPECT_EQ(dsv3.batches(), 10u);
  const BouncePlan small = BouncePlan::make(195840, 128, 1000);
  EXPECT_EQ(small.rows_per_batch, 32u);  // a lane per row
  const BouncePlan large = BouncePlan::make(13312, 7168, 3);
  EXPECT_EQ(large.pieces, 2u);  // 6656 B halves
  EXPECT_EQ(large.rows_per_batch, 1u);
  EXPECT_EQ(large.batches(), 6u);
}

}  // namespace
}  // namespace megamoe::comm
