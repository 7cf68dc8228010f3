#include "megamoe/token_check.h"

#include <cmath>
#include <cstdint>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe {

double token_noise(Recipe recipe) { return recipe == Recipe::bf16 ? 5e-3 : 4.1e-2; }

double token_bound(Recipe recipe) { return recipe == Recipe::bf16 ? 1e-2 : 6e-2; }

TokenCheck check_tokens(std::span<const uint16_t> got, std::span<const uint16_t> want, int32_t hidden,
                        Recipe recipe, std::span<const uint8_t> skip, std::span<const uint16_t> slots,
                        int32_t num_slots) {
  require(hidden > 0 && want.size() % static_cast<size_t>(hidden) == 0, "hidden",
          "must divide the reference's ", want.size(), " values, got ", hidden);
  require(got.size() == want.size(), "y", "must hold ", want.size(), " values like the reference, got ", got.size());
  const size_t tokens = want.size() / static_cast<size_t>(hidden);
  require(skip.empty() || skip.size() == tokens, "skip", "must be empty or hold one flag per token (", tokens,
          "), got ", skip.size());
  require(slots.empty() || (num_slots > 0 && slots.size() == tokens * static_cast<size_t>(num_slots) * hidden),
          "slots", "must be empty or hold [tokens][num_slots][hidden] = ", tokens, " x ", num_slots, " x ", hidden,
          " values, got ", slots.size());
  const double bound = token_bound(recipe);
  TokenCheck check;
  const auto fail = [&check](size_t token, std::string why) {
    if (check.failed++ == 0) check.first_failure = detail::concat("token ", token, ": ", why);
  };
  for (size_t t = 0; t < tokens; ++t) {
    if (!skip.empty() && skip[t] != 0) continue;
    ++check.compared;
    const uint16_t* g = got.data() + t * hidden;
    const uint16_t* w = want.data() + t * hidden;
    double diff = 0.0, norm = 0.0, largest = -1.0;
    size_t unwritten = SIZE_MAX, largest_at = 0;
    for (size_t h = 0; h < static_cast<size_t>(hidden); ++h) {
      const double a = bf16_to_float(g[h]), b = bf16_to_float(w[h]);
      if (std::isnan(a) && unwritten == SIZE_MAX) unwritten = h;
      diff += (a - b) * (a - b);
      norm += b * b;
      if (std::fabs(a - b) > largest) {
        largest = std::fabs(a - b);
        largest_at = h;
      }
    }
    if (unwritten != SIZE_MAX) {
      fail(t, detail::concat("element ", unwritten, " was not written or is NaN"));
      continue;
    }
    // No route and no shared expert: the sum of nothing is exactly zero.
    const double error = norm > 0.0 ? std::sqrt(diff / norm) : (diff > 0.0 ? INFINITY : 0.0);
    if (check.worst_token < 0 || error > check.worst_error) {
      check.worst_token = static_cast<int32_t>(t);
      check.worst_error = error;
    }
    if (error > bound) {
      fail(t, detail::concat("normalized error ", error, " > ", bound, " (norm of the reference ", std::sqrt(norm),
                             "); largest difference at element ", largest_at, ": got ", bf16_to_float(g[largest_at]),
                             " want ", bf16_to_float(w[largest_at])));
      continue;
    }
    for (int32_t k = 0; k < (slots.empty() ? 0 : num_slots); ++k) {
      const uint16_t* o = slots.data() + (t * num_slots + k) * hidden;
      double along = 0.0, own = 0.0;
      for (size_t h = 0; h < static_cast<size_t>(hidden); ++h) {
        const double value = bf16_to_float(o[h]);
        along += (bf16_to_float(g[h]) - bf16_to_float(w[h])) * value;
        own += value * value;
      }
      if (own > 0.0 && std::fabs(along) > kRouteShareBound * own) {
        fail(t, detail::concat("combine slot ", k, " (its norm ", std::sqrt(own) / std::sqrt(norm),
                               " of the token's) is off by ", along / own,
                               " times itself: a route missing, repeated or sent to another expert"));
        break;
      }
    }
  }
  return check;
}

}  // namespace megamoe
