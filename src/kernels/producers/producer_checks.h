// The producers' argument checks, for a caller that must check every launch's arguments before the
// first of them (streamed_mega_moe: a producer that published while a later one was refused would
// leave the front ring's halves out of step).
#pragma once

#include <cstdint>

#include "megamoe/producers.h"

namespace megamoe::detail {

// route_tokens' checks of its router and logits (both forms); returns the token count.
int64_t check_route_arguments(const RouterConfig& config, const TensorView& logits, const TensorView& bias);
// router_logits' checks of its arguments.
void check_router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits);

}  // namespace megamoe::detail
