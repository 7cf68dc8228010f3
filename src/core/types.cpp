#include "megamoe/types.h"

namespace megamoe {

bool parse_recipe(std::string_view text, Recipe& recipe) {
  for (Recipe candidate : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    if (text == to_string(candidate)) {
      recipe = candidate;
      return true;
    }
  }
  return false;
}

bool parse_schedule(std::string_view text, Schedule& schedule) {
  for (Schedule candidate : {Schedule::staged, Schedule::fused}) {
    if (text == to_string(candidate)) {
      schedule = candidate;
      return true;
    }
  }
  return false;
}

}  // namespace megamoe
