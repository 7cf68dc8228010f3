// Named MoE layer shapes of well-known models, for the command-line tool and benchmarks.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "megamoe/problem.h"
#include "megamoe/types.h"

namespace megamoe {

struct Preset {
  std::string_view name;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t num_shared_experts = 0;
  int32_t default_ranks = 1;
  int32_t default_tokens = 1;  // per rank
  Recipe recipe = Recipe::fp8;
  std::string_view note;  // where the shape departs from the model, or what it leaves out
  float activation_clamp = 0.0f;  // the model's clamp before SwiGLU (activation.h); 0: none
};

const std::vector<Preset>& all_presets();

// Throws megamoe::Error listing the valid names when `name` is not one of them.
const Preset& find_preset(std::string_view name);

// The preset's layer on `num_ranks` ranks with room for `max_tokens_per_rank` tokens, in the
// preset's recipe (callers may change `recipe` afterwards). Not validated: call validate().
Problem preset_problem(const Preset& preset, int32_t num_ranks, int32_t max_tokens_per_rank);

}  // namespace megamoe
