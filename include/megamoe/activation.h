// The activation clamp applied before SwiGLU (DeepSeek-V4 runs with c = 10; DeepGEMM's MegaMoE calls
// it activation_clamp). With a clamp c > 0:
//   gate = min(gate, c),   up = clamp(up, -c, c),   a = SiLU(gate) * up * route_weight
// c = +infinity leaves both unchanged, and so does "off": callers pass 0 (or +infinity) for no clamp.
// The CPU reference and the L1 epilogue use these same functions. NaN passes through unchanged (a NaN
// compares false), so a clamp never hides a NaN.
#pragma once

#include <cmath>
#include <limits>

#include "megamoe/config.h"

namespace megamoe {

MEGAMOE_HD float clamp_gate(float gate, float clamp) { return gate > clamp ? clamp : gate; }
MEGAMOE_HD float clamp_up(float up, float clamp) { return up > clamp ? clamp : (up < -clamp ? -clamp : up); }

// The clamp the kernels take: 0 (off) becomes +infinity. Throws megamoe::Error naming `argument` when
// the value is negative or NaN.
float kernel_activation_clamp(float activation_clamp, const char* argument);

}  // namespace megamoe
