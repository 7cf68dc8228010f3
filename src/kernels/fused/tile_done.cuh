// The fused kernel's tile-done counts: what a math warpgroup's finished tile releases (the L2 tiles
// of its token tile, or this rank's L2 arrival), made by the warpgroup or handed to a dispatch warp.
#pragma once

#include "kernels/fused/scheduler.cuh"

namespace megamoe::fused {

// Tile-done counts. Each fence before a count holds the thread that makes it for microseconds, and a
// math warpgroup's next wgmmas wait for all of its threads; so once the dispatch warps are done with
// their units, a dispatch warp makes the counts a math warpgroup hands it (make_handed_counts), and
// the warpgroup makes its own only until then (always, where the dispatch warps go on to expand
// weights: packed prefill tiles). A warpgroup's mode says which: its own counts, handed over, or
// finished without handing over (the dispatch warp then waits for nothing from it).
enum : uint32_t { kCountsOwn = 0, kCountsHanded = 1, kCountsFinished = 2 };
// A count to make: 2 bits of kind, the token tile.
enum : uint32_t { kCountRoutedL1 = 0, kCountSharedL1 = 1, kCountL2 = 2 };

// Makes the count `entry` says, after the writes of the warpgroup that finished the tile (ordered
// before this thread by the warpgroup's barrier and, when handed over, the ring's fences). True for
// this rank's last L2 tile.
template <class Config>
__device__ bool count_tile_done(const FusedScheduler<Config>& s, uint32_t entry) {
  const uint32_t kind = entry >> 30;
  const SignalTargets& targets = *s.signal_targets();
  if (kind != kCountL2) {
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the L2 tiles read these rows with TMA
    uint32_t* counter = kind == kCountRoutedL1 ? targets.l1_done : targets.shared_l1_done;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(counter[entry & 0x3FFFFFFFu])
        .fetch_add(1, cuda::memory_order_release);
    return false;
  }
  // The results may be in peers' combine slots, which combine reads with generic loads: the count's
  // release (system scope across GPUs) orders them, and the last count's acquire orders every tile's
  // before the rank arrival. (A sequentially consistent system fence before it was redundant.)
  return device::atomic_add_acq_rel_ranks(targets.one_device != 0, &targets.control->fused_l2_done, 1u) + 1 ==
         targets.l2_tiles;
}

// A math warpgroup's thread 0: hands `entry` to the dispatch warp that makes the counts, unless its
// ring is full (then false: the thread makes the count itself, and never waits here).
template <class Config>
__device__ bool hand_over_tile_done(const FusedScheduler<Config>& s, uint32_t math_warpgroup, uint32_t entry) {
  const uint32_t written = *s.tile_done_written(math_warpgroup);
  if (written - *static_cast<volatile uint32_t*>(s.tile_done_made(math_warpgroup)) >= kTileDoneSlots) return false;
  // The count of entries made before the slot's new entry: the maker read the slot's old entry before
  // it counted it made (its fence), and this fence pairs with that one.
  __threadfence_block();
  *s.tile_done_entry(math_warpgroup, written) = entry;
  __threadfence_block();  // the entry before the count of entries written
  *static_cast<volatile uint32_t*>(s.tile_done_written(math_warpgroup)) = written + 1;
  return true;
}

// After a math warpgroup's epilogue of a GEMM unit: counts the tile done for what waits on it, or
// hands the count over. True if this thread counted this rank's last L2 tile.
template <class Config>
__device__ bool signal_tile_done(const FusedScheduler<Config>& s, bool first_linear, const gemm::Tile& tile,
                                 uint32_t math_warpgroup, uint32_t math_thread) {
  // The warpgroup's stores are ordered before one thread's count (or hand-over) by the barrier: the
  // other threads go on (a fence in every thread stalled each of them until its own stores had landed).
  gemm::warpgroup_barrier(math_warpgroup);
  if (math_thread % 128 != 0) return false;
  const uint32_t entry =
      first_linear ? (tile.job == 0 ? kCountRoutedL1 : kCountSharedL1) << 30 | s.token_tile(tile) : kCountL2 << 30;
  if (*static_cast<volatile uint32_t*>(s.tile_done_mode(math_warpgroup)) == kCountsHanded &&
      hand_over_tile_done(s, math_warpgroup, entry))
    return false;
  return count_tile_done(s, entry);
}

// A math warpgroup's thread 0 after its last GEMM unit. Out of line: two instructions inlined after
// the GEMM loop moved the math warps' register allocation into spills in the K loop (ptxas).
inline __device__ __noinline__ void finish_counts(uint32_t* mode) {
  __threadfence_block();  // after the entries written
  *static_cast<volatile uint32_t*>(mode) = kCountsFinished;
}

// Lane 0 of dispatch warp 1 + `math_warpgroup`, once the dispatch units are done: takes over the
// warpgroup's counts unless it has finished, and makes its handed counts in order until it has
// finished and every entry it wrote is made. One maker per warpgroup, so that the two warpgroups'
// fences run side by side, as when each makes its own. Gives up, with a timeout recorded, after twice
// the layer's timeout without an entry (the math warps' own waits, one timeout each, fire first and
// name the cause).
template <class Config>
__device__ void make_handed_counts(const FusedScheduler<Config>& s, uint32_t math_warpgroup) {
  if (atomicCAS(s.tile_done_mode(math_warpgroup), kCountsOwn, kCountsHanded) != kCountsOwn) return;
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  bool last_l2_tile = false;
  uint32_t made = 0;
  uint64_t idle_since = gemm::global_timer_ns();
  for (;;) {
    // The mode before the entries' count: a warpgroup that has finished wrote its last entry before.
    const bool finished = *static_cast<volatile uint32_t*>(s.tile_done_mode(math_warpgroup)) == kCountsFinished;
    __threadfence_block();
    if (made != *static_cast<volatile uint32_t*>(s.tile_done_written(math_warpgroup))) {
      __threadfence_block();  // the entry after its count of entries written
      const uint32_t entry = *s.tile_done_entry(math_warpgroup, made);
      __threadfence_block();  // the entry read before its slot is freed
      *static_cast<volatile uint32_t*>(s.tile_done_made(math_warpgroup)) = ++made;
      last_l2_tile |= count_tile_done(s, entry);
      idle_since = gemm::global_timer_ns();
      continue;
    }
    if (finished) break;
    // A short sleep between polls leaves the scheduler's issue slots to the math warps beside it.
    __nanosleep(128);
    if (gemm::global_timer_ns() - idle_since > 2 * watch.timeout_ns) {
      DeviceError error{};
      error.code = kDeviceTimeout;
      error.site = kWaitFusedTileDone;
      error.rank = watch.rank;
      error.block = blockIdx.x;
      error.thread = ptx::thread_index();
      error.peer = watch.rank;
      error.detail = math_warpgroup;
      error.expected = made + 1;
      error.seen = made;
      device::record_error(watch.control, error);
      break;
    }
  }
  if (last_l2_tile) device::rank_arrive(s.view(), s.control(), s.epoch(2));
}

}  // namespace megamoe::fused
