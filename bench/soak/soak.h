// megamoe soak (`megamoe soak ARGS` runs this binary): many layer calls back to back on the GPUs,
// cycling token counts, masked routes and skewed routing, eager and replayed from CUDA graphs, in
// both schedules; every --check-every calls, every input set's latest output is compared with the
// CPU reference token by token (megamoe/token_check.h) and the receive statistics accumulated over
// all calls with the reference's counts. One JSON row per variant (bench/results/soak-*.json).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/problem.h"
#include "megamoe/types.h"

namespace megamoe::soak {

struct SoakOptions {
  std::vector<std::string> problems;  // "tiny" (the preset) and "mid" (a mid-size layer)
  std::vector<Recipe> recipes;
  std::vector<Schedule> schedules;
  int32_t ranks = 2;
  int64_t calls = 10000;  // over all variants
  int32_t check_every = 50;
  uint64_t seed = 1;
  std::string out;
  std::string command;
};

const char* soak_usage();

// Throws megamoe::Error naming the flag for anything the command line gets wrong.
SoakOptions parse_soak(const std::vector<std::string>& args);

// Runs every variant and writes the report; returns the number of variants with a failure.
int run_soak(const SoakOptions& options);

}  // namespace megamoe::soak
