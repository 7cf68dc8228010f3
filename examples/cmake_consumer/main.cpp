// Uses the installed library: a preset layer, its symmetric-buffer size, and the CPU reference on
// synthetic data (no GPU needed). Exits non-zero on any failure.
#include <cstdio>
#include <exception>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/layout.h"
#include "megamoe/presets.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"

int main() {
  try {
    megamoe::Problem problem = megamoe::preset_problem(megamoe::find_preset("tiny"), 2, 16);
    megamoe::validate(problem);
    const uint64_t bytes = megamoe::BufferLayout::make(problem).total_bytes;
    const std::vector<megamoe::RankBatch> batches =
        megamoe::synthetic_batches(problem, {16, 5}, megamoe::Routing::uniform, 1);
    const megamoe::SyntheticWeights weights(problem, 1);
    const megamoe::ReferenceResult result = megamoe::reference_moe(problem, batches, weights);
    double sum = 0;
    for (uint16_t bits : result.y[0]) sum += megamoe::bf16_to_float(bits);
    std::printf("consumer: %s, buffer %llu bytes, y[0] sum %.6f\n", megamoe::describe(problem).c_str(),
                static_cast<unsigned long long>(bytes), sum);
    bool caught = false;
    try {
      problem.hidden = 100;
      megamoe::validate(problem);
    } catch (const megamoe::Error& e) {
      caught = true;
      std::printf("consumer: invalid problem rejected: %s\n", e.what());
    }
    return caught && result.y.size() == 2 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
