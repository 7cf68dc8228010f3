// The whole-layer cases of issue 5, for a given number of ranks.
#pragma once

#include <vector>

#include "layer/layer_scenarios.h"

namespace megamoe::layer_test {

// Token counts cycle through {0, 1, 7, 128, 1000, 4096} across ranks and cases, so every rank count
// sees uneven ranks and a rank with no tokens.
std::vector<LayerCase> cases_for_ranks(int32_t ranks);

}  // namespace megamoe::layer_test
