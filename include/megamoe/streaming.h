// Streaming chunk-ready front ring (docs/streaming.md): layout of the ring and the protocol
// functions that producers and the MoE layer share. Filled in by the streaming work (issue 6).
#pragma once

#include <cstdint>

#include "megamoe/config.h"
#include "megamoe/problem.h"

namespace megamoe {

struct FrontRingLayout {
  uint64_t total_bytes = 0;

  MEGAMOE_HD static FrontRingLayout make(const Problem& p) {
    FrontRingLayout l;
    (void)p;
    return l;
  }
};

}  // namespace megamoe
