// A layer output compared with the CPU reference (reference.h) token by token, two ways:
//   - each token's normalized error ||y_t - ref_t|| / ||ref_t|| against a bound above quantization
//     noise, so that a token far off fails even among thousands of correct ones (a bound over a
//     whole rank averages it away);
//   - with the reference's combine slots (ReferenceOptions::keep_slots), the difference projected on
//     each route's own contribution o: a route missing, repeated, or replaced by another expert's
//     moves y by about -o, +o or (other - o), a share of 1 of o, whatever the route's weight, while
//     noise has almost no share of any one route. A route of small weight hides under the norm
//     bound (top-8 beside a shared expert: under 3% of the token), never under this one.
// The GPU tests and `megamoe soak` check with it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "megamoe/types.h"

namespace megamoe {

// The largest per-token normalized error measured between the GPU and the CPU reference, by recipe:
// fp8 and fp8_fp4 flip about 0.5% of the re-quantized L1 outputs to a neighbouring E4M3 code (the
// FP8 wgmma accumulates with ~14 mantissa bits), a token's error is ~5e-3 and was seen at 4.03e-2 (a
// top-4 token of a 2-rank zipf case, 2026-12-02; top-1 tokens, one route each, reach 3.4e-2);
// bf16 differs by FP32 summation order and BF16 rounding only.
double token_noise(Recipe recipe);

// The bound on one token's normalized error, above token_noise.
double token_bound(Recipe recipe);

// The bound on |<y_t - ref_t, o>| / ||o||^2 for each route contribution o of a token: a wrong route
// gives about 1.
inline constexpr double kRouteShareBound = 0.5;

struct TokenCheck {
  int32_t compared = 0;      // tokens compared (skipped ones are not)
  int32_t failed = 0;        // tokens over their bound, or with an element not written or NaN
  int32_t worst_token = -1;  // the compared token with the largest normalized error
  double worst_error = 0.0;
  std::string first_failure;  // empty when none failed; else the first failing token, its error and bound
  bool ok() const { return failed == 0; }
};

// got and want: [tokens][hidden] BF16 bits. skip: empty, or [tokens], nonzero = not compared (a token
// whose inputs were made NaN on purpose). slots: empty, or the reference's [tokens][num_slots][hidden]
// (ReferenceResult::slots), for the per-route check. A token whose reference is all zero (every route
// masked, no shared expert) must be exactly zero.
TokenCheck check_tokens(std::span<const uint16_t> got, std::span<const uint16_t> want, int32_t hidden,
                        Recipe recipe, std::span<const uint8_t> skip = {}, std::span<const uint16_t> slots = {},
                        int32_t num_slots = 0);

}  // namespace megamoe
