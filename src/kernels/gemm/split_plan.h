// Split K's plan (host and device; CPU-tested): which tiles of a run of tiles split, how many ways,
// and which tile, split and K range a work unit is. The grouped GEMM's scheduler (scheduler.cuh) and
// the fused schedule's units (kernels/fused/units.h) both plan through it; split_k.cuh gathers the
// partial sums.
#pragma once

#include <cstdint>

#include "megamoe/config.h"

namespace megamoe::gemm {

inline constexpr uint32_t kMaxSplits = 8;
inline constexpr uint32_t kMinSplitKBlocks = 4;  // K blocks per unit, so a unit still streams its stages

// Which tiles split, and how many ways: the last wave's tiles (tiles mod grid; all of them with
// fewer tiles than CTAs), when they would leave more than half the grid idle, each into as many
// units as that wave holds. Decode is weight streaming: once half the SMs stream, splitting
// measured slower (the partials' round trips cost more than the idle SMs). Bounded by the
// workspace's units and by K blocks per unit.
struct SplitPlan {
  uint32_t whole_tiles;  // tiles [0, whole_tiles) run whole; the rest split
  uint32_t splits;       // units per split tile (1: nothing splits)
};
MEGAMOE_HD constexpr SplitPlan plan_split_k(uint32_t tiles, uint32_t grid, uint32_t k_blocks, uint32_t capacity_units) {
  const SplitPlan whole{tiles, 1};
  if (grid == 0) return whole;
  const uint32_t tail = tiles % grid;
  if (tail == 0 || 2 * tail > grid) return whole;
  uint32_t splits = grid / tail;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits > k_blocks / kMinSplitKBlocks) splits = k_blocks / kMinSplitKBlocks;
  if (splits > capacity_units / tail) splits = capacity_units / tail;
  return splits > 1 ? SplitPlan{tiles - tail, splits} : whole;
}

// K blocks [begin, end) of split `split` of `splits` over k_blocks.
struct KRange {
  uint32_t begin;
  uint32_t end;
};
MEGAMOE_HD constexpr KRange split_k_range(uint32_t k_blocks, uint32_t split, uint32_t splits) {
  return {split * k_blocks / splits, (split + 1) * k_blocks / splits};
}

// Work units of `tiles` tiles under `plan`.
MEGAMOE_HD constexpr uint32_t split_units(uint32_t tiles, const SplitPlan& plan) {
  return plan.whole_tiles + (tiles - plan.whole_tiles) * plan.splits;
}

// Which tile work unit `index` is, and which split of it: split tiles are numbered from 0 (their
// counter and partial slots), their units follow the whole tiles' in tile order.
struct SplitUnit {
  uint32_t tile;
  uint32_t split_tile;
  uint32_t split;
  uint32_t splits;  // 1 for a whole tile
};
MEGAMOE_HD constexpr SplitUnit split_unit(uint32_t index, const SplitPlan& plan) {
  if (index < plan.whole_tiles) return {index, 0, 0, 1};
  const uint32_t past = index - plan.whole_tiles;
  const uint32_t split_tile = past / plan.splits;
  return {plan.whole_tiles + split_tile, split_tile, past - split_tile * plan.splits, plan.splits};
}

}  // namespace megamoe::gemm
