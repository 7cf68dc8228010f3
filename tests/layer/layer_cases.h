// The whole-layer cases of issue 5, for a given number of ranks.
#pragma once

#include <vector>

#include "layer/layer_scenarios.h"
#include "megamoe/comm.h"

namespace megamoe::layer_test {

// Token counts cycle through {0, 1, 7, 128, 1000, 4096} across ranks and cases, so every rank count
// sees uneven ranks and a rank with no tokens. MEGAMOE_TEST_QUICK=1 caps them at 64 and the calls of
// a case at a few (runs under compute-sanitizer); MEGAMOE_TEST_CASES=a,b keeps the cases whose
// name contains a or b.
std::vector<LayerCase> cases_for_ranks(int32_t ranks);

// A case for `ranks` >= 2 ranks in which the last rank never calls (run it with a short
// MEGAMOE_TIMEOUT_MS): not among cases_for_ranks, which every rank completes.
LayerCase absent_rank_case(int32_t ranks);

// A case for `ranks` >= 2 ranks in which the last rank calls only after the others' calls have
// timed out waiting for it (run it with a short MEGAMOE_TIMEOUT_MS).
LayerCase late_rank_case(int32_t ranks);

// Runs a case whose last rank calls late or never on `ranks` ranks, once per schedule, with
// MEGAMOE_TIMEOUT_MS at 1 s (set before the ranks start, so that process ranks inherit it); a
// gtest failure for a run in which some rank failed.
void expect_ranks_pass_with_short_timeout(int32_t ranks, LaunchMode mode, const LayerCase& c);

}  // namespace megamoe::layer_test
