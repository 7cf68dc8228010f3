#include "megamoe/types.h"

#include <initializer_list>

namespace megamoe {
namespace {

// The candidate whose to_string is `text`, into `value`; false (value unchanged) when none is.
template <typename T>
bool parse_name(std::string_view text, std::initializer_list<T> candidates, T& value) {
  for (const T candidate : candidates) {
    if (text == to_string(candidate)) {
      value = candidate;
      return true;
    }
  }
  return false;
}

}  // namespace

bool parse_recipe(std::string_view text, Recipe& recipe) {
  return parse_name(text, {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}, recipe);
}

bool parse_schedule(std::string_view text, Schedule& schedule) {
  return parse_name(text, {Schedule::staged, Schedule::fused}, schedule);
}

bool parse_call_form(std::string_view text, CallForm& form) {
  return parse_name(text, {CallForm::automatic, CallForm::streamed, CallForm::batch}, form);
}

}  // namespace megamoe
