// Combine: y[token] = BF16(sum over the token's written combine slots, in FP32, in slot order).
// Route weights were applied in L1, so slots add as they are. A masked route (-1) wrote no slot and
// adds nothing; the shared experts' slot (top_k) adds when there are shared experts.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/sync.cuh"
#include "megamoe/layout.h"
#include "megamoe/problem.h"

namespace megamoe::combine {

struct CombineArgs {
  ControlBlock* control;  // this rank's: a timeout or a refused call (call_refused) stops combine
  int32_t rank;
  const uint16_t* slots;    // this rank's combine region: [wave tokens][top_k + 1][hidden] bf16
  const int32_t* topk_idx;  // [num_tokens][top_k]
  uint16_t* y;              // [num_tokens][hidden] bf16
  int32_t num_tokens;
  int32_t top_k;
  int32_t num_experts;
  int32_t hidden;
  bool shared;
};

__device__ __forceinline__ void add_bf16x8(float (&sum)[8], const uint4& packed) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sum[2 * i] += __uint_as_float(words[i] << 16);
    sum[2 * i + 1] += __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// One thread per 16-byte output vector (8 features of a token's row), so that even a single token
// spreads over the threads. A thread loads a round of slots together with the route ids that say which
// of them were written (a round holds DeepSeek-V3's eight routed slots and its shared one), so that a
// vector waits for one round trip to memory, where loading the ids first and then the slots four at a
// time took four. Combines output vectors [vector_begin, vector_end), numbered token-major
// (token * hidden / 8 + vector), as thread `thread` of `threads`, kVectorsInFlight vectors at a time
// (vectors thread, thread + threads, ...): the fused kernel's math warps, half as many threads per SM
// as the staged combine kernel's, keep as many bytes in flight with two. `dry`: only the first round,
// its loads made and nothing stored, so that a later call's code is warm (an SM's first run of a step
// costs about 2 µs more than its second; docs/fused.md).
template <uint32_t kVectorsInFlight = 1>
__device__ inline void combine_vectors(const CombineArgs& a, uint64_t vector_begin, uint64_t vector_end,
                                       uint64_t thread, uint64_t threads, bool dry = false) {
  constexpr uint32_t kSlotsInFlight = 9;
  const uint32_t top_k = static_cast<uint32_t>(a.top_k);
  const uint32_t slots_per_token = top_k + 1;
  const uint32_t vectors = static_cast<uint32_t>(a.hidden) / 8;
  const uint4* slots = reinterpret_cast<const uint4*>(a.slots);
  uint4* y = reinterpret_cast<uint4*>(a.y);
  for (uint64_t item = vector_begin + thread; item < vector_end; item += kVectorsInFlight * threads) {
    const uint4* token_slots[kVectorsInFlight];
    const int32_t* token_experts[kVectorsInFlight];
    bool present[kVectorsInFlight];
#pragma unroll
    for (uint32_t v = 0; v < kVectorsInFlight; ++v) {
      const uint64_t mine = item + v * threads;
      present[v] = mine < vector_end;
      const uint32_t token = static_cast<uint32_t>((present[v] ? mine : item) / vectors);
      const uint32_t vector = static_cast<uint32_t>((present[v] ? mine : item) % vectors);
      token_slots[v] = slots + uint64_t{token} * slots_per_token * vectors + vector;
      token_experts[v] = a.topk_idx + uint64_t{token} * top_k;
    }
    float sum[kVectorsInFlight][8] = {};
    for (uint32_t first = 0; first < slots_per_token; first += kSlotsInFlight) {
      uint4 parts[kVectorsInFlight][kSlotsInFlight];
      int32_t experts[kVectorsInFlight][kSlotsInFlight];
#pragma unroll
      for (uint32_t v = 0; v < kVectorsInFlight; ++v) {
#pragma unroll
        for (uint32_t j = 0; j < kSlotsInFlight; ++j) {
          const uint32_t s = first + j;
          const bool load = present[v] && s < slots_per_token;
          parts[v][j] = load ? token_slots[v][uint64_t{s} * vectors] : make_uint4(0, 0, 0, 0);
          experts[v][j] = present[v] && s < top_k ? __ldg(token_experts[v] + s) : -1;
        }
      }
#pragma unroll
      for (uint32_t v = 0; v < kVectorsInFlight; ++v) {
#pragma unroll
        for (uint32_t j = 0; j < kSlotsInFlight; ++j) {
          // Slot s holds a result if its route was not masked (-1), or if it is the shared slot.
          const uint32_t s = first + j;
          const bool written =
              s < top_k ? experts[v][j] >= 0 && experts[v][j] < a.num_experts : s == top_k && a.shared;
          add_bf16x8(sum[v], written ? parts[v][j] : make_uint4(0, 0, 0, 0));
        }
      }
    }
#pragma unroll
    for (uint32_t v = 0; v < kVectorsInFlight; ++v) {
      if (!present[v] || dry) continue;
      uint32_t words[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(sum[v][2 * i], sum[v][2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      y[item + v * threads] = make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (dry) return;
  }
}

}  // namespace megamoe::combine
