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

}  // namespace megamoe
