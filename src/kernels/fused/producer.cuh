// The fused kernel's producer warp (claims units, loads their stages once their operands are ready,
// runs the bulk pulls, hands send, route and pull units to the dispatch warps) and its converter
// warps (packed weights' tiles expanded for the wgmmas).
#pragma once

#include "kernels/fused/dispatch_units.cuh"
#include "kernels/fused/scheduler.cuh"

namespace megamoe::fused {

// What GEMM unit `unit`'s stages read waits for: a readiness counter reaching `expected`. One wait
// site for every kind: one inlined spin-wait per kind made each fused kernel about 200 instructions
// longer.
struct OperandWait {
  const uint32_t* counter;
  uint32_t expected;
  WaitSite site;
  uint32_t choice;
  uint32_t timeouts = 1;  // WaitSiteInfo::timeouts
};
template <class Config>
__device__ OperandWait operand_wait(const FusedScheduler<Config>& s, const UnitRef& unit, const gemm::Tile& tile) {
  const FusedCounters counters = s.counters();
  // A streamed call's send units wait for the ring (one timeout): their wait, not this one, names
  // unpublished inputs.
  if (unit.kind == UnitKind::shared_l1)
    return {&s.control()->fused_sends_done, s.plan().send_units, kWaitFusedInputs, 0, Config::kStreamed ? 2u : 1u};
  if (unit.kind == UnitKind::routed_l1)
    return {counters.rows_pulled + tile.group,
            pull_counts_per_row<Config>(s.plan()) * (s.group_begin()[tile.group + 1] - s.group_begin()[tile.group]),
            kWaitFusedRows, tile.group};
  const uint32_t token_tile = s.token_tile(tile);
  if (unit.kind == UnitKind::routed_l2)
    return {counters.l1_done + token_tile, 2 * s.l1_m_tiles(), kWaitFusedL1Tile, token_tile};
  return {counters.shared_l1_done + token_tile, 2 * s.shared_l1_m_tiles(), kWaitFusedSharedL1Tile, token_tile};
}

// Waits (one thread) until what a GEMM unit's stages read is ready; false after a timeout.
template <class Config>
__device__ bool wait_for_operands(const FusedScheduler<Config>& s, const OperandWait& wait) {
  const bool ready =
      device::wait_at_least_gpu(s.view(), s.control(), wait.counter, wait.expected, wait.site, wait.choice,
                                wait.timeouts);
  // The rows were written by generic stores; the stages read them through the async proxy. Global
  // memory only: the fence over every state space also waits for this thread's memory operations
  // (a MEMBAR.GPU in SASS), the global one does not.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  return ready;
}

// Hands `value` (a send, route or pull unit, or kNoUnit: no more) to the dispatch warps (one thread).
// False after a timeout (recorded), or past the hand-over's deadline: the dispatch warps stopped
// taking units (their own wait for the queue gave up), so nothing more may be handed to them.
template <class Config>
__device__ bool push_dispatch(const FusedScheduler<Config>& s, gemm::RingPosition<kQueueSlots>& queue, uint32_t value) {
  if (!gemm::wait_barrier<Config, true>(s.queue_empty(queue.stage), queue.phase ^ 1, s.params.l1[0].args.watch,
                                        queue.stage))
    return false;
  *s.queue_slot(queue.stage) = value;
  if (!gemm::hand_over_in_time(s.queue_deadline(), s.params.l1[0].args.watch)) return false;
  cuda::ptx::mbarrier_arrive(s.queue_full(queue.stage));
  queue.advance();
  return true;
}

// A pull unit (bulk_pulls), by the producer warp (all lanes): the bytes of its share of the received
// rows into the pool, each row counted for its expert once it is there, while the dispatch warps copy
// the rows' scales, route weights and sources (run_pull_metadata). The pool's segments are built at
// the CTA's first pull unit, once every rank's counts are in. False after a timeout.
template <class Config>
__device__ bool run_pull(const FusedScheduler<Config>& s, uint32_t index, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  uint32_t* segment_begin = s.pull_segments();
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  const dispatch::PoolSegments segments{segment_begin, a.layout.experts_per_rank * num_ranks, num_ranks};
  if (*s.pull_segments_built() == 0) {
    const bool routes_in = lane == 0 ? counts_in(s) : true;
    if (!__shfl_sync(0xFFFFFFFFu, routes_in, 0)) return false;
    dispatch::build_segments(a, segment_begin, lane, 32, [] { __syncwarp(); }, index == 0);
    __syncwarp();
    if (lane == 0) *s.pull_segments_built() = 1;
    __syncwarp();
  }
  const UnitRange rows = pull_rows(index, s.plan().pull_units, segment_begin[segments.num_segments]);
  uint32_t* rows_pulled = s.counters().rows_pulled;
  static_assert(kPullAreaBytes<Config> >= kPullSegmentBytes + 2 * 1024, "the pulls' bounce area");
  dispatch::BounceArea bounce{s.smem.base + kPullSegmentBytes, kPullAreaBytes<Config> - kPullSegmentBytes,
                              s.pull_loaded(), *s.pull_phases()};
  dispatch::pull_rows_bulk<Config::kStreamed>(
      a, segments, rows.begin, rows.end, bounce, lane,
      [&](uint32_t first, uint32_t count) { count_pulled_rows(rows_pulled, segments, first, count); });
  if (lane == 0) *s.pull_phases() = bounce.phases;  // lane 0 waited on the halves
  __syncwarp();
  return true;
}

// The scale warp's hand-over (GemmConfig::kScaleWarp): warp 3 of the producer warpgroup is a dispatch
// warp until the dispatch units are done, and meanwhile the producer stages the weight scales and
// arrives for it. Once free, the warp says so (scale_warp_free); at its next GEMM unit the producer
// writes where in the ring that unit starts (its stage and phase, and the walkers' unit_ready parities)
// and completes the hand-over barrier; the warp walks on from there. A producer that ends first
// completes it with kNoScaleStart.
inline constexpr uint32_t kNoScaleStart = ~0u;
template <class Config>
__device__ __forceinline__ void hand_over_scales(const FusedScheduler<Config>& s, uint32_t start) {
  *s.scale_start() = start;
  cuda::ptx::mbarrier_arrive(s.scale_hand_over());
}
template <uint32_t kStages>
__device__ __forceinline__ uint32_t scale_start_at(const gemm::RingPosition<kStages>& ring, uint32_t unit_parities) {
  static_assert(kStages <= 8, "stage in bits 0-7, parities from bit 16");
  return ring.stage | ring.phase << 8 | unit_parities << 16;
}

// The producer warp: claims units in order and feeds them to the ring and the dispatch queue until it
// claims one that is neither a GEMM, a send nor a pull.
template <class Config>
__device__ void produce_fused(FusedScheduler<Config>& s, uint32_t lane) {
  gemm::RingPosition<Config::kStages> ring;
  gemm::RingPosition<kQueueSlots> queue;
  const FusedParams<Config>& params = s.params;
  const gemm::PipelineWatch& watch = params.l1[0].args.watch;
  uint32_t handed_over = gemm::kNoUnit;
  bool dispatch_open = true;
  bool ring_open = true;  // lane 0: the math warps still walk the ring
  bool scale_warp_walks = false;  // lane 0 (kScaleWarp): the scale warp has taken over
  uint32_t unit_parities = 0;     // lane 0 (kScaleWarp): the walkers' next unit_ready parity per stage
  if constexpr (Config::kStreamed) {
    if (lane == 0 && params.ring_synchronized) {
      wait_own_call_published(s);
      // The wait counts against the first hand-overs' deadlines (set at the CTA's start): restart
      // them, unless they are too near already (then the walkers give up, and nothing is handed over).
      gemm::hand_over_in_time(s.smem.hand_over_deadline(), watch);
      gemm::hand_over_in_time(s.queue_deadline(), watch);
    }
    __syncwarp();
  }
  for (;;) {
    uint32_t unit = lane == 0 ? s.claim() : 0;
    unit = __shfl_sync(0xFFFFFFFFu, unit, 0);
    if (unit >= first_routed_unit<Config::kStreamed>(s.plan(), s.route_units()) && !s.built()) {
      // Traced steps of the CTA's first routed unit, before its claim is logged: 0 every rank's counts
      // in, 1 the routed tables built.
      const bool routes_in = lane == 0 && !(kLocalRoutesConfig<Config> && s.plan().local_routes) ? counts_in(s) : true;
      if (!__shfl_sync(0xFFFFFFFFu, routes_in, 0)) break;
      trace_step(s, lane == 0, TraceRole::producer, unit, UnitKind::none, 0);
      s.build(lane);
      trace_step(s, lane == 0, TraceRole::producer, unit, UnitKind::none, 1);
      // A rank without L2 tiles says so now (its arrival orders after its counts': rank_arrive).
      if (lane == 0 && s.l2_tiles() == 0) device::rank_arrive(s.view(), s.control(), s.epoch(2));
    }
    const UnitRef ref = s.classify(unit);
    if (lane == 0) trace_event(s, TraceRole::producer, unit, ref.kind, TraceWhat::claimed);
    // Send, route and pull units go to the dispatch warps; a bulk pull's bytes are the producer's too.
    if (ref.kind == UnitKind::send || (Config::kStreamed && ref.kind == UnitKind::route) ||
        ref.kind == UnitKind::pull) {
      const bool pushed = lane == 0 ? push_dispatch(s, queue, unit) : true;
      if (!__shfl_sync(0xFFFFFFFFu, pushed, 0)) {
        dispatch_open = false;
        break;
      }
      if constexpr (kBulkPullConfig<Config>) {
        if (ref.kind == UnitKind::pull && s.plan().bulk_pulls) {
          if (!run_pull(s, ref.index, lane)) break;
          if (lane == 0) trace_event(s, TraceRole::producer, unit, ref.kind, TraceWhat::done);
        }
      }
      continue;
    }
    // Send, route and pull units come first: past them the dispatch warps are done, and wait at the CTA's
    // end instead of polling their queue through the call.
    if (dispatch_open) {
      if (lane == 0) push_dispatch(s, queue, gemm::kNoUnit);
      dispatch_open = false;
    }
    if (!is_gemm(ref.kind)) {
      handed_over = kEndBit | unit;
      break;
    }
    bool ok = true;
    if (lane == 0) {
      const gemm::WorkUnit work = s.work(ref);
      const gemm::Tile& tile = work.tile;
      const bool first_linear = is_first_linear(ref.kind);
      ok = wait_for_operands(s, operand_wait(s, ref, tile));
      trace_event(s, TraceRole::producer, unit, ref.kind, TraceWhat::ready);
      // After a timeout the stages are loaded all the same (the record says the results are void),
      // so that the math warps' walk through the ring stays whole and the launch ends; unless the
      // math warps stopped walking it (a stage not freed in time): then nothing more is issued.
      const auto publish_tile = [&](uint32_t stage) {
        *s.unit_tile(stage) = UnitTile::of(work, first_linear);
        if constexpr (Config::kScaleWarp) unit_parities ^= 1u << stage;
      };
      if constexpr (Config::kScaleWarp) {
        if (!scale_warp_walks && *static_cast<volatile uint32_t*>(s.scale_warp_free()) != 0) {
          hand_over_scales(s, scale_start_at(ring, unit_parities));
          scale_warp_walks = true;
        }
      }
      ring_open = first_linear ? gemm::issue_unit<Config>(s.smem, ring, params.l1[tile.job], work, unit, publish_tile,
                                                          scale_warp_walks)
                               : gemm::issue_unit<Config>(s.smem, ring, params.l2[tile.job], work, unit, publish_tile,
                                                          scale_warp_walks);
      ok = ok && ring_open;
    }
    if (!__shfl_sync(0xFFFFFFFFu, ok, 0)) break;
  }
  if (lane == 0) {
    if (dispatch_open) push_dispatch(s, queue, gemm::kNoUnit);
    if (ring_open) gemm::issue_empty_stage<Config>(s.smem, ring, handed_over, watch, scale_warp_walks);
    if constexpr (Config::kScaleWarp) {
      if (!scale_warp_walks) hand_over_scales(s, kNoScaleStart);
    }
  }
}

// The scale warp (kScaleWarp), once its dispatch units are done: stages the weight scales of every GEMM
// unit from the hand-over on (gemm::stage_unit_weight_scales), then arrives on the end's stage. Only
// the hand-overs' shared deadline ends its wait for the hand-over, as the walkers' (a timeout's record
// says kGemmScaleHandOver where other waits name their stage).
template <class Config>
__device__ void stage_scales_fused(FusedScheduler<Config>& s, uint32_t lane) {
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  if (lane == 0) *static_cast<volatile uint32_t*>(s.scale_warp_free()) = 1;
  if (!gemm::wait_barrier<Config, true>(s.scale_hand_over(), 0, watch, kGemmScaleHandOver,
                                        gemm::SharedDeadline{s.smem.hand_over_deadline()}))
    return;
  const uint32_t start = *s.scale_start();
  if (start == kNoScaleStart) return;
  gemm::RingPosition<Config::kStages> ring;
  ring.stage = start & 0xFFu;
  ring.phase = start >> 8 & 1u;
  uint32_t unit_parities = start >> 16;
  uint32_t index;
  while (gemm::next_walker_unit(s.smem, ring, unit_parities, watch, lane, index)) {
    const UnitTile unit = *s.unit_tile(ring.stage);
    const gemm::MainloopArgs& args = unit.first_linear ? s.params.l1[unit.tile.job].args : s.params.l2[unit.tile.job].args;
    if (!gemm::stage_unit_weight_scales<Config>(s.smem, ring, args, unit.tile, unit.work(args.k_blocks).k_blocks, lane))
      return;
  }
}

// Converter warps (packed weights, prefill tiles): expand the GEMM units' weight tiles.
template <class Config>
__device__ void convert_fused(FusedScheduler<Config>& s, uint32_t thread, uint32_t lane) {
  gemm::RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  uint32_t index;
  while (gemm::next_walker_unit(s.smem, ring, unit_parities, watch, lane, index)) {
    const UnitTile& unit = *s.unit_tile(ring.stage);
    const gemm::KRange k_range =
        unit.work(unit.first_linear ? s.params.l1[0].args.k_blocks : s.params.l2[0].args.k_blocks).k_blocks;
    for (uint32_t kb = k_range.begin; kb < k_range.end; ++kb) {
      gemm::wait_barrier<Config>(s.smem.raw_full(ring.stage), ring.phase, watch, ring.stage);
      gemm::expand_weight_tile(s.smem, ring.stage, thread);
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(s.smem.full(ring.stage));
      ring.advance();
    }
  }
}

}  // namespace megamoe::fused
