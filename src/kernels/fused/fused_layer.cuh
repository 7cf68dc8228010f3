// The fused schedule: the whole layer in one persistent launch per call and rank (units.h says in
// which order its CTAs claim the work). Each CTA has the grouped GEMM's warp roles (grouped_gemm.cuh)
// and dispatch warps:
//   - the producer warp claims units in order. A GEMM unit's stages are loaded once what they read is
//     ready (the rows of its expert pulled, or the L1 tiles of its token tile done); send units, and
//     at decode pull units (units.h), go to the dispatch warps through a small queue; in prefill it
//     runs the pull units itself, with bulk copies through the ring's shared memory, which is free
//     until its first GEMM unit (pulls come before every GEMM unit in the claim order); the first
//     combine unit (or the end) ends its walk and is handed to the math warps with the ring's last
//     stage;
//   - the dispatch warps (the producer warpgroup's other three) run send units, and decode's pull
//     units, with the staged schedule's dispatch functions, while the math warps run GEMMs;
//   - the math warpgroups run GEMM units through the same mainloop and epilogues as the staged
//     schedule, then claim and run the combine units themselves;
//   - with packed weights in prefill tiles, the converter warpgroup expands the GEMM units' weight tiles,
//     and the dispatch warps join it once their units are done.
// The math warps' loop holds nothing but GEMMs: with dispatch code in it, values hoisted out of the
// loop held registers through the mainloop, which then spilled (a loop of pulls before it did too).
// The dispatch warps' 40 registers (prefill configs) keep about 6 KB per SM in flight: prefill rows
// moved at about 125 GB/s that way (docs/fused.md).
// Readiness counters (layout.h, FusedCounters) are released after the writes they cover and acquired
// before the TMA loads that read them (with proxy fences: the writes are generic, the loads async).
// The last CTA to finish resets every counter for the next call.
// Homes: scheduler.cuh (parameters, shared tables, the unit walk), producer.cuh (producer and
// converter warps), dispatch_units.cuh (dispatch warps), math.cuh (math warpgroups), tile_done.cuh
// (their tiles' counts); here the kernel and its end.
#pragma once

#include "kernels/fused/dispatch_units.cuh"
#include "kernels/fused/math.cuh"
#include "kernels/fused/producer.cuh"
#include "kernels/fused/scheduler.cuh"
#include "kernels/fused/tile_done.cuh"

namespace megamoe::fused {

// The last CTA to finish: every counter back to zero, the barrier's epoch past this call's three, and
// this rank's arrival at the third (the call's end), which the peers' next batch calls wait for before
// writing into its route tables and counts (peers_previous_call_ended). A CTA that never built the
// call's tables (it started after an error) clears every routed tile's count.
template <class Config>
__device__ void reset_counters(const FusedScheduler<Config>& s, uint32_t thread) {
  const FusedCounters counters = s.counters();
  const uint32_t routed_tiles =
      s.built() ? s.routed_token_tiles() : s.params.dispatch.layout.max_routed_token_tiles;
  const uint32_t shared_tiles = s.shared_token_tiles();
  for (uint32_t i = thread; i < s.num_groups(); i += Config::kThreads) counters.rows_pulled[i] = 0;
  for (uint32_t i = thread; i < routed_tiles; i += Config::kThreads) counters.l1_done[i] = 0;
  for (uint32_t i = thread; i < shared_tiles; i += Config::kThreads) counters.shared_l1_done[i] = 0;
  // A streamed call: every source's chunks handed back, now that every CTA's reads of them are done,
  // and this rank's consumer cursors past them. After an error (a source whose first chunk was never
  // read counts none; a later chunk may be handed back unread) the host resets the ring.
  if constexpr (Config::kStreamed) {
    const dispatch::DispatchArgs& a = s.params.dispatch;
    const StreamedRouteCounters routes = s.streamed_routes();
    const uint32_t pairs = a.layout.experts_per_rank * static_cast<uint32_t>(a.view.num_ranks);
    if (thread == 0) *routes.sources_done = 0;
    for (uint32_t i = thread; i < pairs; i += Config::kThreads) routes.cursors[i] = 0;
    void* own_ring = a.view.local() + a.layout.front_ring.offset;
    for (uint32_t source = thread; source < static_cast<uint32_t>(a.view.num_ranks); source += Config::kThreads) {
      uint64_t* cursor = a.ring.consumer_cursor(own_ring, source);
      const uint64_t first_seq = *cursor;
      const uint32_t chunks = routes.chunks[source];
      void* source_ring = device::front_ring_of(a.view, a.layout, static_cast<int32_t>(source));
      for (uint32_t chunk = 0; chunk < chunks; ++chunk)
        front_acknowledge<device::FrontRingAtomics>(a.ring, source_ring, a.view.rank, first_seq + chunk);
      *cursor = first_seq + chunks;
      routes.parts_done[source] = 0;
      routes.chunks[source] = 0;
    }
  }
  if (thread == 0) {
    ControlBlock* control = s.control();
    const uint64_t next_epoch = s.epoch(3);
    control->fused_claims = 0;
    control->fused_sends_done = 0;
    control->fused_l2_done = 0;
    control->finished_blocks = 0;
    device::GpuRef<uint64_t>(control->barrier_epoch).store(next_epoch, cuda::memory_order_relaxed);
    // Every CTA's reads of the tables and counts came before (finished_blocks): a CTA that started
    // late builds its tables only at its first claim, possibly after this rank's L2 tiles. A broken
    // call does not arrive: the arrival would also pass the peers' waits for its first two epochs.
    if (!device::rank_call_failed(control)) device::rank_arrive(s.view(), control, next_epoch);
  }
}

// Every thread of the CTA, at its end: the last CTA to finish resets the counters (every other CTA's
// writes seen: fence, then acq_rel).
template <class Config>
__device__ __forceinline__ void finish_cta(const FusedScheduler<Config>& s, uint32_t thread) {
  uint32_t* last = s.words(FusedTables::kLastFlag);
  __threadfence();
  ptx::cta_barrier_from_any_site();
  if (thread == 0)
    *last = device::GpuRef<uint32_t>(s.control()->finished_blocks).fetch_add(1, cuda::memory_order_acq_rel) + 1 ==
            gridDim.x;
  ptx::cta_barrier_from_any_site();
  if (*last != 0) reset_counters(s, thread);
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    fused_layer_kernel(const __grid_constant__ FusedParams<Config> params) {
  static_assert(gemm::kRegistersFit<Config>, "setmaxnreg split exceeds the CTA's registers at launch");
  static_assert(!Config::kStoreWarps && Config::kDispatchWarps, "the fused schedule's warps: see GemmConfig");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const gemm::SharedStorage<Config> smem(smem_raw);
  const uint32_t thread = threadIdx.x;
  const uint32_t warpgroup = thread / 128;
  const uint32_t warp = (thread % 128) / 32;
  const uint32_t lane = thread % 32;
  gemm::init_pipeline<Config>(smem, thread);
  FusedScheduler<Config> s{params, smem};
  if (thread == 0) {
    *s.built_flag() = 0;
    for (uint32_t role = 0; role < 3; ++role) s.words(FusedTables::kTraceCounts)[role] = 0;
    const FusedCounters counters = s.counters();
    *s.signal_targets() =
        SignalTargets{s.control(), counters.l1_done, counters.shared_l1_done, 0, s.view().one_device ? 1u : 0u};
    for (uint32_t slot = 0; slot < kQueueSlots; ++slot) {
      cuda::ptx::mbarrier_init(s.queue_full(slot), 1);
      cuda::ptx::mbarrier_init(s.queue_empty(slot), 1);
    }
    for (uint32_t half = 0; half < 2; ++half) cuda::ptx::mbarrier_init(s.pull_loaded() + half, 1);
    for (uint32_t w = 0; w < Config::kMathWarpgroups; ++w) {
      *s.tile_done_mode(w) = kCountsOwn;
      *s.tile_done_written(w) = 0;
      *s.tile_done_made(w) = 0;
    }
    for (uint32_t half = 0; half < 2; ++half) cuda::ptx::mbarrier_init(s.stage_loaded() + half, 1);
    cuda::ptx::mbarrier_init(s.scale_hand_over(), 1);
    *s.scale_warp_free() = 0;
    *s.pull_phases() = 0;
    *s.stage_phases() = 0;
    *s.pull_segments_built() = 0;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // the pulls' barriers complete on TMA's bytes
  }
  if constexpr (Config::kStreamed) {
    if (!params.ring_synchronized) wait_for_prior_kernels();
  } else {
    wait_for_prior_kernels();
  }
  allow_next_kernel();
  // The first hand-overs' deadlines (gemm::SharedDeadline): the walkers read them after the CTA's
  // barrier in cta_call_failed.
  if (thread == 0) {
    const uint64_t now = gemm::global_timer_ns();
    gemm::set_hand_over_deadline(smem.hand_over_deadline(), now, params.l1[0].args.watch);
    gemm::set_hand_over_deadline(s.queue_deadline(), now, params.l1[0].args.watch);
  }
  // A CTA that starts after an error runs nothing, but still counts itself finished: the last CTA
  // to finish then resets the counters and the barrier's epoch as after any call, so the next call
  // (after check_device_error) starts from them.
  if (device::cta_call_failed(s.control())) {
    finish_cta(s, thread);
    return;
  }

  // Each role ends in its own copy of finish_cta: no code after the roles joins their register budgets.
  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<gemm::kProducerRegisters<Config>>();
    if (warp == 0) {
      produce_fused(s, lane);
    } else {
      dispatch_fused(s, thread - 32, lane);
      // With converters the dispatch warps then expand weight tiles, and each math warpgroup makes its
      // own tile-done counts. Without, warps 1 and 2 make the math warpgroups' counts, and warp 3 stages
      // the weight scales where there are any.
      if constexpr (Config::kConverters) {
        convert_fused(s, thread - 32, lane);
      } else {
        if (warp <= Config::kMathWarpgroups && lane == 0) make_handed_counts(s, warp - 1);
        if constexpr (Config::kScaleWarp) {
          if (warp == 3) stage_scales_fused(s, lane);
        }
      }
    }
    finish_cta(s, thread);
  } else if (warpgroup > Config::kMathWarpgroups) {  // converters; none without them (kThreads)
    ptx::setmaxnreg_decrease<gemm::kProducerRegisters<Config>>();
    convert_fused(s, kDispatchThreads + 128 * (warpgroup - 1 - Config::kMathWarpgroups) + thread % 128, lane);
    finish_cta(s, thread);
  } else {
    ptx::setmaxnreg_increase<gemm::kMathRegisters<Config>>();
    const uint32_t math_warpgroup = __shfl_sync(0xFFFFFFFFu, warpgroup - 1, 0);
    math_fused(s, math_warpgroup, warp, lane, thread - 128);
    finish_cta(s, thread);
  }
}

}  // namespace megamoe::fused
