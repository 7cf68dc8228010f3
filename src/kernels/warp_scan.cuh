// Exclusive prefix sums by one warp, for the per-CTA tables the dispatch and the GEMM scheduler
// build from device-side counts.
#pragma once

#include <cstdint>

namespace megamoe::device {

// out[i] = count(0) + ... + count(i - 1) for i in [0, n], computed by the 32 lanes of one warp (all
// of them call it), 32 counts per step with a shuffle scan. count(i) may read out[i]: a step reads
// its 32 counts before it writes their sums. Fast when the counts are in shared memory; read from
// global memory, each step would wait one round trip.
template <class Count>
__device__ __forceinline__ void warp_exclusive_prefix(uint32_t n, uint32_t lane, uint32_t* out, const Count& count) {
  uint32_t running = 0;
  for (uint32_t base = 0; base < n; base += 32) {
    const uint32_t i = base + lane;
    const uint32_t value = i < n ? count(i) : 0;
    uint32_t inclusive = value;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const uint32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
      if (lane >= static_cast<uint32_t>(offset)) inclusive += other;
    }
    if (i < n) out[i] = running + inclusive - value;
    running += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
  }
  if (lane == 0) out[n] = running;
}

}  // namespace megamoe::device
