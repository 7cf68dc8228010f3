// The fused schedule's work units (kernels/fused/units.h): how many of each kind, the order CTAs
// claim them in, and the token and row ranges units cover.
#include "kernels/fused/units.h"

#include <gtest/gtest.h>

#include <vector>

namespace megamoe::fused {
namespace {

TEST(FusedUnits, ClassifyWalksTheKindsInClaimOrder) {
  UnitPlan plan;
  plan.send_units = 3;
  plan.shared_l1_units = 2;
  plan.pull_units = 4;
  plan.shared_l2_units = 1;
  plan.combine_units = 2;
  const RoutedUnits routed{5, 6};
  const std::vector<UnitKind> kinds = {UnitKind::send, UnitKind::pull, UnitKind::shared_l1, UnitKind::routed_l1,
                                       UnitKind::routed_l2, UnitKind::shared_l2, UnitKind::combine};
  const std::vector<uint32_t> counts = {3, 4, 2, 5, 6, 1, 2};
  uint32_t unit = 0;
  for (size_t k = 0; k < kinds.size(); ++k) {
    for (uint32_t i = 0; i < counts[k]; ++i, ++unit) {
      const UnitRef ref = classify(plan, routed, unit);
      EXPECT_EQ(ref.kind, kinds[k]) << "unit " << unit;
      EXPECT_EQ(ref.index, i) << "unit " << unit;
    }
  }
  EXPECT_EQ(unit, total_units(plan, routed));
  EXPECT_EQ(first_routed_unit(plan), 9u);
  EXPECT_EQ(classify(plan, routed, unit).kind, UnitKind::none);
  EXPECT_EQ(classify(plan, routed, unit + 100).kind, UnitKind::none);
}

TEST(FusedUnits, EmptyKindsAreSkipped) {
  UnitPlan plan;  // one send and one pull unit, nothing else
  const RoutedUnits none{};
  EXPECT_EQ(classify(plan, none, 0).kind, UnitKind::send);
  EXPECT_EQ(classify(plan, none, 1).kind, UnitKind::pull);
  EXPECT_EQ(classify(plan, none, 2).kind, UnitKind::none);
  // Routed units sit between the pulls and the shared L2 tiles.
  plan.shared_l2_units = 2;
  const UnitRef after = classify(plan, RoutedUnits{0, 3}, 2);
  EXPECT_EQ(after.kind, UnitKind::routed_l2);
  EXPECT_EQ(classify(plan, RoutedUnits{0, 3}, 5).kind, UnitKind::shared_l2);
}

TEST(FusedUnits, TokenAndRowRangesCoverEverythingOnce) {
  for (uint32_t tokens : {0u, 1u, 7u, 128u, 1000u, 8192u}) {
    for (uint32_t per_unit : {1u, 3u, 64u}) {
      std::vector<int> seen(tokens, 0);
      const uint32_t units = (tokens + per_unit - 1) / per_unit;
      for (uint32_t u = 0; u < units + 1; ++u) {  // one past the last is empty
        const TokenRange r = unit_tokens(u, per_unit, tokens);
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
        const TokenRange r = pull_rows(u, units, rows);
        ASSERT_EQ(r.begin, next) << rows << " rows, unit " << u;  // contiguous, in order
        ASSERT_LE(r.begin, r.end);
        next = r.end;
      }
      EXPECT_EQ(next, rows);
    }
  }
}

TEST(FusedUnits, PlanSizesUnitsFromTheCall) {
  // DeepSeek-V3's shape at 8192 tokens, 132 CTAs, 128-token tiles, one shared expert.
  const UnitPlan big = make_unit_plan({8192, 8, 132, 128, 2048 * 2 / 256, 7168 / 256});
  EXPECT_EQ(big.tokens_per_send, 63u);  // ceil(8192 / 132)
  EXPECT_EQ(big.send_units, 131u);
  EXPECT_EQ(big.shared_l1_units, 64u * 16u);
  EXPECT_EQ(big.shared_l2_units, 64u * 28u);
  EXPECT_EQ(big.pull_units, 512u);  // 65536 routes / 128 rows (under the cap of 4 per CTA)
  EXPECT_EQ(make_unit_plan({16384, 8, 132, 128, 0, 0}).pull_units, 4u * 132u);  // capped
  EXPECT_EQ(big.tokens_per_combine, 32u);  // ceil(8192 / 264)
  EXPECT_EQ(big.combine_units, 256u);
  // One token: one of each, and the shared experts' tiles.
  const UnitPlan one = make_unit_plan({1, 8, 132, 16, 16, 28});
  EXPECT_EQ(one.send_units, 1u);
  EXPECT_EQ(one.pull_units, 1u);
  EXPECT_EQ(one.shared_l1_units, 16u);
  EXPECT_EQ(one.combine_units, 1u);
  // No tokens: still one send unit (it publishes the counts) and one pull unit (rows may arrive).
  const UnitPlan none = make_unit_plan({0, 8, 132, 16, 0, 0});
  EXPECT_EQ(none.send_units, 1u);
  EXPECT_EQ(none.pull_units, 1u);
  EXPECT_EQ(none.combine_units, 0u);
  EXPECT_EQ(none.shared_l1_units, 0u);
}

}  // namespace
}  // namespace megamoe::fused
