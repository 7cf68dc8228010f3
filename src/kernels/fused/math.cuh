// The fused kernel's math warpgroups: the GEMM units through the grouped GEMM's mainloop and
// epilogues, their tiles counted done, then the combine units.
#pragma once

#include "kernels/fused/scheduler.cuh"
#include "kernels/fused/tile_done.cuh"

namespace megamoe::fused {

// The math warpgroups: GEMM units from the ring; then, from the unit the producer handed over, the
// combine units, claimed by themselves.
template <class Config>
__device__ void math_fused(FusedScheduler<Config>& s, uint32_t math_warpgroup, uint32_t warp, uint32_t lane,
                           uint32_t math_thread) {
  const FusedParams<Config>& params = s.params;
  gemm::RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  float acc[2][Config::kAccRegs];
  // tokens_on_m: warpgroup 1 starts kStaggerKBlocks behind warpgroup 0 in its first unit
  // (grouped_gemm.cuh).
  constexpr bool kStaggered = Config::kLayout == gemm::TileLayout::tokens_on_m;
  constexpr uint32_t kNoStagger = ~0u;
  const gemm::PipelineWatch& watch = params.l1[0].args.watch;
  uint32_t index = 0;
  bool last_l2_tile = false;
  for (bool first_gemm = true;; first_gemm = false) {
    index = gemm::next_unit(s.smem, ring, unit_parities, watch);
    if ((index & kEndBit) != 0) break;
    const UnitTile& unit = *s.unit_tile(ring.stage);
    const gemm::Tile tile = unit.tile;
    const bool first_linear = unit.first_linear != 0;
    if (kStaggered && math_warpgroup == 1 && first_gemm) gemm::stagger_wait();
    const uint32_t k_blocks = first_linear ? params.l1[0].args.k_blocks : params.l2[0].args.k_blocks;
    const uint32_t stagger_kb =
        kStaggered && math_warpgroup == 0 && first_gemm ? min(gemm::kStaggerKBlocks, k_blocks - 1) : kNoStagger;
    // Only decode configs split: the others keep the whole K range a constant.
    const gemm::WorkUnit work =
        gemm::kSplitsK<Config> ? unit.work(k_blocks) : gemm::WorkUnit{tile, 0, 0, 1, {0, k_blocks}};
    // One copy of the mainloop for both linears (two held more registers than there are).
    const auto& l1 = params.l1[tile.job];
    const auto& l2 = params.l2[tile.job];
    const auto l1_prefetched = first_linear ? l1.epilogue.prefetch(s.smem, tile, math_warpgroup, warp, lane)
                                            : decltype(l1.epilogue.prefetch(s.smem, tile, 0, 0, 0)){};
    const auto l2_prefetched = first_linear ? decltype(l2.epilogue.prefetch(s.smem, tile, 0, 0, 0)){}
                                            : l2.epilogue.prefetch(s.smem, tile, math_warpgroup, warp, lane);
    gemm::consume_unit<Config>(s.smem, ring, work, first_linear ? l1.args : l2.args, math_warpgroup, warp, lane,
                               stagger_kb, acc);
    // Traced step 2 of a GEMM unit (0 and 1 are the producer's, for a CTA's first routed unit): its
    // mainloop done (math thread 0); the epilogue and the tile's count follow until its done event.
    trace_step(s, math_thread == 0, TraceRole::math, index, UnitKind::none, 2);
    // A split unit adds its partial sums to the tile's; the tile's last one runs the epilogue.
    bool tile_complete = true;
    if constexpr (gemm::kSplitsK<Config>) {
      if (work.splits > 1)
        tile_complete =
            gemm::gather_splits<Config>(s.split_args(first_linear), work, s.smem.split_flag(), math_thread, acc);
    }
    if (tile_complete) {
      if (first_linear) l1.epilogue.apply(s.smem, tile, acc, l1_prefetched, math_warpgroup, warp, lane, math_thread);
      else l2.epilogue.apply(s.smem, tile, acc, l2_prefetched, math_warpgroup, warp, lane, math_thread);
      last_l2_tile |= signal_tile_done(s, first_linear, tile, math_warpgroup, math_thread);
    }
    if (math_thread == 0) {
      const UnitKind kind = first_linear ? (tile.job == 0 ? UnitKind::routed_l1 : UnitKind::shared_l1)
                                         : (tile.job == 0 ? UnitKind::routed_l2 : UnitKind::shared_l2);
      trace_event(s, TraceRole::math, index, kind, TraceWhat::done);
    }
  }
  // The dispatch warp making this warpgroup's counts (or about to) stops once it has made the ones
  // written before this.
  if (math_thread % 128 == 0) finish_counts(s.tile_done_mode(math_warpgroup));
  // The last L2 tile of this rank tells every rank its results have landed: at the loop's end, which
  // follows at once (it was the last GEMM unit), since the arrival's code inside the loop held
  // registers through the mainloop.
  if (last_l2_tile) device::rank_arrive(s.view(), s.control(), s.epoch(2));
  // Combine: each unit's output vectors once every rank's L2 tiles are done.
  const combine::CombineArgs& c = params.combine;
  for (index &= ~kEndBit; index != (gemm::kNoUnit & ~kEndBit) && s.classify(index).kind == UnitKind::combine;) {
    const UnitRange vectors = unit_range(s.classify(index).index, s.plan().vectors_per_combine,
                                         static_cast<uint32_t>(c.num_tokens) * static_cast<uint32_t>(c.hidden) / 8);
    // Pass 0, while the ranks' L2 tiles are still being done: a dry first round through the same code
    // (a rolled loop), so that pass 1 starts with its code fetched. Its loads may read slots not yet
    // written; pass 1 reads them again after the wait's acquire.
    bool stopped = false;
#pragma unroll 1
    for (uint32_t pass = 0; pass < 2; ++pass) {
      if (pass == 1) {
        stopped = !group_flag(s.words(FusedTables::kMathFlag), math_thread, MathSync<Config>{}, [&] {
          return device::rank_wait(s.view(), s.control(), s.epoch(2)) &&
                 !device::call_refused(s.control(), s.view().rank, true);
        });
        if (stopped) break;
        if (math_thread == 0) trace_event(s, TraceRole::math, index, UnitKind::combine, TraceWhat::ready);
      }
      combine::combine_vectors<2>(c, vectors.begin, vectors.end, math_thread, Config::kMathThreads, pass == 0);
    }
    if (stopped) break;
    if (math_thread == 0) trace_event(s, TraceRole::math, index, UnitKind::combine, TraceWhat::done);
    uint32_t* next = s.words(FusedTables::kMathClaim);
    gemm::math_barrier<Config>();
    if (math_thread == 0) *next = s.claim();
    gemm::math_barrier<Config>();
    index = *next;
    gemm::math_barrier<Config>();
  }
}

}  // namespace megamoe::fused
