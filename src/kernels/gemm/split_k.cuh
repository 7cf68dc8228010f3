// Split K's reduction (scheduler.cuh picks the splits): each work unit publishes its FP32 partial
// sums to a workspace slot; the tile's last unit to arrive adds all of them in split order, so the
// result does not depend on which unit finished last, and runs the epilogue.
//
// The workspace is one caller-owned buffer, zeroed once: an arrival counter per tile, then the
// partial slots. The last unit of a tile resets its counter, so every launch finds them at zero
// (after a recorded device error, SymmBuffer::check_device_error zeroes them again).
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "megamoe/config.h"
#include "megamoe/layout.h"

namespace megamoe::gemm {

// The workspace: kGemmSplitCounters arrival counters (layout.h), then the partial slots.
inline constexpr uint64_t kSplitPartialsOffset = kGemmSplitCounters * sizeof(uint32_t);

// Which configs split: 16-token decode tiles only. tokens_on_m's staggered warpgroups assume whole
// tiles; with 64 tokens a unit's partials are 64 KiB, and their round trip costs more than the
// idle SMs gain.
inline constexpr uint32_t kMaxSplitTokenTile = 16;
template <class Config>
inline constexpr bool kSplitsK = Config::kLayout == TileLayout::weights_on_m && Config::kBlockN <= kMaxSplitTokenTile;

// Partial bytes of one work unit: every math thread's accumulators.
template <class Config>
inline constexpr uint64_t kSplitUnitBytes = uint64_t{Config::kMathThreads} * 2 * Config::kAccRegs * sizeof(float);

// Work-unit slots a workspace of `bytes` holds for units of `unit_bytes` (0: no split K); the split
// tiles' counters stay below the unit counter.
MEGAMOE_HD constexpr uint32_t split_capacity_units(uint64_t bytes, uint64_t unit_bytes) {
  if (bytes <= kSplitPartialsOffset) return 0;
  const uint64_t units = (bytes - kSplitPartialsOffset) / unit_bytes;
  return units < kGemmUnitCounter ? static_cast<uint32_t>(units) : kGemmUnitCounter;
}

struct SplitArgs {
  uint32_t* counters = nullptr;  // [kGemmSplitCounters]
  float* partials = nullptr;     // [capacity_units] unit slots
  uint32_t capacity_units = 0;   // 0: tiles stay whole
};

// Stores this unit's accumulators in its slot and counts its arrival. Returns true, with acc holding
// the sum over all splits, on the tile's last unit; the others return false and skip the epilogue.
// All math threads of the CTA call it (both math warpgroups work on the same unit).
template <class Config>
__device__ bool gather_splits(const SplitArgs& split, const WorkUnit& unit, uint32_t* flag, uint32_t math_thread,
                              float (&acc)[2][Config::kAccRegs]) {
  constexpr uint32_t kVectors = 2 * Config::kAccRegs / 4;
  constexpr uint32_t kThreads = Config::kMathThreads;
  const uint32_t splits = unit.splits;
  float4* tile_slots = reinterpret_cast<float4*>(split.partials) + uint64_t{unit.split_tile} * splits * kVectors * kThreads;
  float4* own = tile_slots + uint64_t{unit.split} * kVectors * kThreads;
#pragma unroll
  for (uint32_t v = 0; v < kVectors; ++v) {
    const uint32_t i = 4 * v % Config::kAccRegs, j = 4 * v / Config::kAccRegs;
    __stcg(own + v * kThreads + math_thread, make_float4(acc[j][i], acc[j][i + 1], acc[j][i + 2], acc[j][i + 3]));
  }
  // The barrier orders every thread's stores before thread 0's arrival, whose release covers them
  // (cumulativity), and its acquire before every thread's loads below after the second barrier: no
  // per-thread fences (sequentially consistent ones, MEMBAR.SC, each a round trip).
  math_barrier<Config>();
  if (math_thread == 0) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device> counter(split.counters[unit.split_tile]);
    const bool last = counter.fetch_add(1, cuda::memory_order_acq_rel) == splits - 1;
    if (last) counter.store(0, cuda::memory_order_relaxed);
    *flag = last;
  }
  math_barrier<Config>();
  if (*flag == 0) return false;
  // Every split's part is loaded before any is added: predicated loads, all in flight at once. (A
  // loop that broke out past the last split waited one round trip to L2 per split: the one-expert
  // fp8 L1 launch took 24-25 us against 20-21 us now.) Then the parts are added in split order; the
  // missing ones add zero.
  float4 parts[kVectors][kMaxSplits];
#pragma unroll
  for (uint32_t v = 0; v < kVectors; ++v)
#pragma unroll
    for (uint32_t s = 0; s < kMaxSplits; ++s)
      parts[v][s] = s < splits ? __ldcg(tile_slots + (uint64_t{s} * kVectors + v) * kThreads + math_thread)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (uint32_t v = 0; v < kVectors; ++v) {
    const uint32_t i = 4 * v % Config::kAccRegs, j = 4 * v / Config::kAccRegs;
    float4 sum = parts[v][0];
#pragma unroll
    for (uint32_t s = 1; s < kMaxSplits; ++s) {
      sum.x += parts[v][s].x;
      sum.y += parts[v][s].y;
      sum.z += parts[v][s].z;
      sum.w += parts[v][s].w;
    }
    acc[j][i] = sum.x;
    acc[j][i + 1] = sum.y;
    acc[j][i + 2] = sum.z;
    acc[j][i + 3] = sum.w;
  }
  return true;
}

}  // namespace megamoe::gemm
