// The fused kernel's config and parameters, its shared-memory tables, its scheduler (FusedScheduler:
// the units' order and tiles, the routed tables built once every source's routes are in), and what
// every role uses: the event log, group flags, the pulled rows' readiness counts.
#pragma once

#include <cuda/atomic>
#include <cuda/ptx>

#include <cstdint>

#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused.h"
#include "kernels/fused/units.h"
#include "kernels/gemm/grouped_gemm.cuh"
#include "kernels/streaming/ring_device.cuh"

namespace megamoe::fused {

// The fused kernel's config: a GEMM config, and whether the kernel runs streamed calls (their
// inputs from the front ring, CallOptions::streamed) or batch calls. Compiled apart, so that a batch
// call's kernel carries none of the streamed calls' code (its dispatch warps have 40 registers).
template <class Gemm, bool kStreamedCalls>
struct FusedConfig : Gemm {
  static constexpr bool kStreamed = kStreamedCalls;
};

template <class Config>
struct FusedParams {
  gemm::GemmJob<gemm::SwigluEpilogue<Config>> l1[2];  // routed, shared
  gemm::GemmJob<gemm::StoreEpilogue<Config>> l2[2];   // routed, shared
  dispatch::DispatchArgs dispatch;
  dispatch::StagedInputs staged;
  combine::CombineArgs combine;
  UnitPlan plan;
  gemm::SplitArgs split;   // decode tiles' split K workspace (no capacity: every tile whole)
  FusedTraceEvent* trace;  // null: no event log
  // Launched right after this call's front-ring producers (streamed_mega_moe): the kernel synchronizes
  // with them through the ring only, and so starts while they run.
  bool ring_synchronized;
};

__device__ __forceinline__ bool is_gemm(UnitKind kind) {
  return kind == UnitKind::shared_l1 || kind == UnitKind::routed_l1 || kind == UnitKind::routed_l2 ||
         kind == UnitKind::shared_l2;
}
__device__ __forceinline__ bool is_first_linear(UnitKind kind) {
  return kind == UnitKind::routed_l1 || kind == UnitKind::shared_l1;
}

// Tile-done counts in flight from a math warpgroup to the dispatch warp that makes them.
inline constexpr uint32_t kTileDoneSlots = 32;

// The dispatch warps' table: a send unit's counts per global expert, or a pull unit's segments.
inline constexpr uint32_t kDispatchTableEntries = (kMaxExperts > kMaxSegments ? kMaxExperts : kMaxSegments) + 1;
// Send and pull units come in bursts (up to four pull units per CTA): the queue holds them all, so the
// producer goes on to the GEMM units behind them.
inline constexpr uint32_t kQueueSlots = 16;
// The producer's pulls use the ring's stages (weights, tokens, scales; not the packed weights' area,
// whose shifts init_pipeline set): the pool's segments first, then the bulk copies' bounce area.
inline constexpr uint32_t kPullSegmentBytes = 4 * (kMaxSegments + 1);
template <class Config>
inline constexpr uint32_t kPullAreaBytes = Config::kScaleOffset + Config::kStages * Config::kScaleStride;
// The bulk pulls are compiled into the prefill config only (units.h): the decode kernels spilled
// with them. A bulk-pulled row is counted twice for its expert: once its bytes are in the pool (the
// producer) and once its scales, route weight and source are (the dispatch warps).
template <class Config>
inline constexpr bool kBulkPullConfig = Config::kLayout == gemm::TileLayout::tokens_on_m;
// One rank's calls place their routes without pulls (UnitPlan::local_routes) in the batch calls'
// decode configs whose dispatch warps have 96 registers: the code stays out of the prefill and
// streamed kernels, and out of fp8_fp4's 64-token one (56 registers: its dispatch warps' spills went
// from 95 to 178 local-memory instructions with it). The launch clears the flag for the others.
template <class Config>
inline constexpr bool kLocalRoutesConfig = !Config::kStreamed && Config::kLayout == gemm::TileLayout::weights_on_m &&
                                           gemm::kProducerRegisters<Config> >= 96;
static_assert(kMaxLocalExperts + 1 + 2 * kMaxTopK <= kDispatchTableEntries, "place_local_routes' table");
template <class Config>
__device__ __forceinline__ uint32_t pull_counts_per_row(const UnitPlan& plan) {
  return kBulkPullConfig<Config> && plan.bulk_pulls ? 2 : 1;
}
// The ring's last stage carries, with this bit, the unit the producer claimed but did not run (the
// first combine unit, or one past the last): the math warps run it and claim the rest.
inline constexpr uint32_t kEndBit = gemm::kEndOfRingBit;

// The fused schedule's shared memory beyond the GEMM's stages, in the GEMM scheduler's area (u32
// words): the routed tiles' tables, the dispatch warps' table, their queue and its barriers, flags.
struct FusedTables {
  static constexpr uint32_t kTokenTilePrefix = 0;                                  // [kMaxLocalExperts + 1]
  static constexpr uint32_t kGroupBegin = kTokenTilePrefix + kMaxLocalExperts + 1;  // [kMaxLocalExperts + 1]
  static constexpr uint32_t kDispatchTable = kGroupBegin + kMaxLocalExperts + 1;   // [kDispatchTableEntries]
  static constexpr uint32_t kQueueSlot = kDispatchTable + kDispatchTableEntries;   // [kQueueSlots]
  static constexpr uint32_t kQueueFull = (kQueueSlot + kQueueSlots + 1) / 2 * 2;   // u64 mbarriers
  static constexpr uint32_t kQueueEmpty = kQueueFull + 2 * kQueueSlots;
  static constexpr uint32_t kPullLoaded = kQueueEmpty + 2 * kQueueSlots;           // u64 mbarriers [2]
  static constexpr uint32_t kSignals = kPullLoaded + 2 * 2;                         // SignalTargets (u64 aligned)
  static constexpr uint32_t kUnitTiles = kSignals + 8;                             // [ring stages] UnitTile
  static constexpr uint32_t kUnitTileWords = 8;
  static constexpr uint32_t kBuilt = kUnitTiles + 8 * kUnitTileWords;
  static constexpr uint32_t kDispatchFlag = kBuilt + 1;
  static constexpr uint32_t kMathFlag = kDispatchFlag + 1;
  static constexpr uint32_t kMathClaim = kMathFlag + 1;  // the combine loop's next unit
  static constexpr uint32_t kLastFlag = kMathClaim + 1;
  static constexpr uint32_t kTraceCounts = kLastFlag + 1;  // [kTraceRoles]: events logged per role
  static constexpr uint32_t kSplits = kTraceCounts + 3;     // RoutedSplits
  static constexpr uint32_t kPullState = kSplits + 6;       // the producer's pulls: phases, segments built
  // The tile-done hand-over (signal_tile_done), per math warpgroup: its mode, the entries it has
  // written and the dispatch warp has made, and its ring of entries.
  static constexpr uint32_t kTileDoneMode = kPullState + 2;                 // [math warpgroups]
  static constexpr uint32_t kTileDoneWritten = kTileDoneMode + 2;           // [math warpgroups]
  static constexpr uint32_t kTileDoneMade = kTileDoneWritten + 2;           // [math warpgroups]
  static constexpr uint32_t kTileDoneRing = kTileDoneMade + 2;              // [math warpgroups][kTileDoneSlots]
  // The dispatch warps' bulk staging (stage_send_inputs): its halves' mbarriers, their phases.
  static constexpr uint32_t kStageLoaded = (kTileDoneRing + 2 * kTileDoneSlots + 1) / 2 * 2;  // u64 mbarriers [2]
  static constexpr uint32_t kStagePhases = kStageLoaded + 2 * 2;
  // The dispatch queue's next hand-over deadline (gemm::SharedDeadline), a u64.
  static constexpr uint32_t kQueueDeadline = (kStagePhases + 1 + 1) / 2 * 2;
  // The scale warp's hand-over (gemm::GemmConfig::kScaleWarp; producer.cuh): its mbarrier, the ring
  // position it starts at, and the warp's flag that it is free.
  static constexpr uint32_t kScaleHandOver = kQueueDeadline + 2;  // u64 mbarrier
  static constexpr uint32_t kScaleStart = kScaleHandOver + 2;
  static constexpr uint32_t kScaleWarpFree = kScaleStart + 1;
  static constexpr uint32_t kWords = kScaleWarpFree + 1;
};

// Where the math warps count their tiles done, in shared memory: computed from the parameters inside
// the math loop, these addresses were hoisted out of it and held registers through the mainloop,
// which then spilled. Written by thread 0 at the start, and l2_tiles by the producer once built.
struct SignalTargets {
  ControlBlock* control;
  uint32_t* l1_done;
  uint32_t* shared_l1_done;
  uint32_t l2_tiles;  // the L2 tile arrivals (two warpgroups per tile) that complete this rank's L2
  uint32_t one_device;  // SymmView::one_device: the L2 count's scope (read here, not from the parameters,
                        // where it cost the prefill math role spills)
};
static_assert(sizeof(SignalTargets) <= 8 * 4, "the signal targets' words");
static_assert(sizeof(RoutedSplits) <= 6 * 4, "the split plans' words");

// A GEMM unit's tile, linear and split, written by the producer beside the unit slot of the unit's
// first stage: the math and converter warps read them there instead of deriving them from the unit
// index, whose walk (classification, group cursors) held registers through the mainloop.
struct UnitTile {
  gemm::Tile tile;
  uint32_t first_linear;
  uint32_t split;  // split tile << 16 | split << 8 | splits
  __device__ static UnitTile of(const gemm::WorkUnit& work, bool first_linear) {
    return {work.tile, first_linear, work.split_tile << 16 | work.split << 8 | work.splits};
  }
  __device__ gemm::WorkUnit work(uint32_t k_blocks) const {
    const uint32_t splits = split & 0xFFu, index = split >> 8 & 0xFFu;
    return {tile, split >> 16, index, splits, gemm::split_k_range(k_blocks, index, splits)};
  }
};
static_assert(sizeof(UnitTile) <= 4 * FusedTables::kUnitTileWords, "a unit tile's words");

// The dispatch warps' barrier (named barrier 9: 1-8 are the GEMM's).
inline constexpr uint32_t kDispatchThreads = 96;
struct DispatchSync {
  __device__ void operator()() const { asm volatile("bar.sync 9, %0;" ::"n"(kDispatchThreads) : "memory"); }
};
// The math warpgroups' barrier, as a callable.
template <class Config>
struct MathSync {
  __device__ void operator()() const { gemm::math_barrier<Config>(); }
};

// The fused schedule's tiles and shared state. The routed experts' groups come from the received
// counts, once every rank's are in: the producer builds the tables in shared memory before it
// hands out the first unit that needs them, and the other walkers read them from there. Everything
// else comes from the kernel's parameters when asked for, so that the math warps keep their registers.
template <class Config>
struct FusedScheduler {
  static constexpr uint32_t kBlockN = Config::kBlockN;
  static_assert(Config::kSchedulerBytes >= 4 * FusedTables::kWords, "the fused tables must fit the scheduler area");
  static_assert(Config::kMathWarpgroups <= 2, "tile-done words and makers (dispatch warps 1-2) per math warpgroup");
  const FusedParams<Config>& params;
  const gemm::SharedStorage<Config>& smem;
  uint32_t l1_cursor = 0, l2_cursor = 0;  // group_of_tile's, one per walk over the groups

  __device__ uint32_t* words(uint32_t index) const { return smem.scheduler() + index; }
  __device__ uint32_t* token_tile_prefix() const { return words(FusedTables::kTokenTilePrefix); }
  __device__ uint32_t* group_begin() const { return words(FusedTables::kGroupBegin); }
  __device__ uint32_t* dispatch_table() const { return words(FusedTables::kDispatchTable); }
  __device__ uint32_t* queue_slot(uint32_t slot) const { return words(FusedTables::kQueueSlot + slot); }
  __device__ uint64_t* queue_deadline() const {
    return reinterpret_cast<uint64_t*>(words(FusedTables::kQueueDeadline));
  }
  __device__ uint64_t* queue_full(uint32_t slot) const {
    return reinterpret_cast<uint64_t*>(words(FusedTables::kQueueFull)) + slot;
  }
  __device__ uint64_t* queue_empty(uint32_t slot) const {
    return reinterpret_cast<uint64_t*>(words(FusedTables::kQueueEmpty)) + slot;
  }
  __device__ uint32_t* built_flag() const { return words(FusedTables::kBuilt); }
  __device__ UnitTile* unit_tile(uint32_t stage) const {
    static_assert(Config::kStages <= 8, "the unit tiles' slots");
    return reinterpret_cast<UnitTile*>(words(FusedTables::kUnitTiles + stage * FusedTables::kUnitTileWords));
  }
  __device__ uint64_t* pull_loaded() const { return reinterpret_cast<uint64_t*>(words(FusedTables::kPullLoaded)); }
  __device__ uint32_t* pull_segments() const { return reinterpret_cast<uint32_t*>(smem.base); }
  // The producer's pulls keep their state here rather than in registers, so that nothing of them
  // stays live through the producer's loop (40 registers).
  __device__ uint32_t* pull_phases() const { return words(FusedTables::kPullState); }
  __device__ uint32_t* pull_segments_built() const { return words(FusedTables::kPullState + 1); }
  __device__ uint64_t* stage_loaded() const { return reinterpret_cast<uint64_t*>(words(FusedTables::kStageLoaded)); }
  __device__ uint32_t* stage_phases() const { return words(FusedTables::kStagePhases); }
  __device__ SignalTargets* signal_targets() const {
    return reinterpret_cast<SignalTargets*>(words(FusedTables::kSignals));
  }
  __device__ uint64_t* scale_hand_over() const {
    return reinterpret_cast<uint64_t*>(words(FusedTables::kScaleHandOver));
  }
  __device__ uint32_t* scale_start() const { return words(FusedTables::kScaleStart); }
  __device__ uint32_t* scale_warp_free() const { return words(FusedTables::kScaleWarpFree); }
  __device__ uint32_t* tile_done_mode(uint32_t math_warpgroup) const {
    return words(FusedTables::kTileDoneMode + math_warpgroup);
  }
  __device__ uint32_t* tile_done_written(uint32_t w) const { return words(FusedTables::kTileDoneWritten + w); }
  __device__ uint32_t* tile_done_made(uint32_t w) const { return words(FusedTables::kTileDoneMade + w); }
  __device__ uint32_t* tile_done_entry(uint32_t w, uint32_t n) const {
    return words(FusedTables::kTileDoneRing + w * kTileDoneSlots + n % kTileDoneSlots);
  }

  __device__ uint32_t num_groups() const { return params.dispatch.layout.experts_per_rank; }
  __device__ const UnitPlan& plan() const { return params.plan; }
  // A streamed call's route units: route_parts per source rank (units.h), from the most routes a
  // call may hold.
  __device__ RouteParts route_part_plan() const {
    return route_parts(params.dispatch.layout.wave_tokens * static_cast<uint32_t>(params.dispatch.problem.top_k));
  }
  __device__ uint32_t route_units() const {
    return Config::kStreamed ? static_cast<uint32_t>(params.dispatch.view.num_ranks) * route_part_plan().parts : 0u;
  }
  __device__ uint32_t l1_m_tiles() const { return params.l1[0].args.m_tiles; }
  __device__ uint32_t l2_m_tiles() const { return params.l2[0].args.m_tiles; }
  __device__ uint32_t shared_l1_m_tiles() const { return params.l1[1].args.m_tiles; }
  __device__ uint32_t shared_rows() const { return static_cast<uint32_t>(params.dispatch.num_tokens); }

  // The producer warp (all lanes), once every rank's counts are in; or at once in a one-rank call
  // that places its routes itself (UnitPlan::local_routes), from the call's routes.
  __device__ void build(uint32_t lane) const {
    uint32_t* begin = group_begin();
    const uint32_t groups = num_groups();
    if (kLocalRoutesConfig<Config> && plan().local_routes) {
      // The rows each expert gets: its routes (every expert is local), as local_route_rows counts them.
      const dispatch::DispatchArgs& a = params.dispatch;
      const uint32_t routes = static_cast<uint32_t>(a.num_tokens) * static_cast<uint32_t>(a.problem.top_k);
      for (uint32_t g = lane; g < groups; g += 32) begin[g] = 0;
      __syncwarp();
#pragma unroll 4
      for (uint32_t route = lane; route < routes; route += 32) {
        const int32_t expert = dispatch::local_route_expert(a, a.topk_idx[route]);
        if (expert >= 0) atomicAdd(&begin[expert], 1u);
      }
    } else {
      const uint32_t num_ranks = static_cast<uint32_t>(view().num_ranks);
      const uint32_t* recv_count = BufferLayout::at<uint32_t>(view().local(), params.dispatch.layout.recv_count);
      // Each expert's rows: its counts from every source rank, all loads in flight, then one scan.
      for (uint32_t g = lane; g < groups; g += 32) {
        uint32_t rows = 0;
        for (uint32_t r = 0; r < num_ranks; ++r) rows += recv_count[g * num_ranks + r];
        begin[g] = rows;
      }
    }
    __syncwarp();
    device::warp_exclusive_prefix(groups, lane, begin, [&](uint32_t g) { return begin[g]; });
    __syncwarp();
    // Past the receive capacity the call is refused: no routed tiles. Every CTA's producer tells the
    // ranks before anything of this CTA can arrive at the L2-done barrier (refuse_call).
    const uint32_t received = begin[groups];
    __syncwarp();
    if (received > params.dispatch.layout.recv_capacity) {
      for (uint32_t g = lane; g <= groups; g += 32) begin[g] = 0;
      if (lane == 0) dispatch::refuse_call(params.dispatch, received);
      __syncwarp();
    }
    device::warp_exclusive_prefix(groups, lane, token_tile_prefix(), [&](uint32_t g) {
      return (begin[g + 1] - begin[g] + kBlockN - 1) / kBlockN;
    });
    __syncwarp();
    if (lane == 0) {
      const uint32_t tiles = routed_token_tiles();
      *splits() = plan_routed_splits(plan().shared_l1_units, tiles * l1_m_tiles(), params.l1[0].args.k_blocks,
                                     plan().shared_l2_units, tiles * l2_m_tiles(), params.l2[0].args.k_blocks,
                                     gridDim.x, params.split.capacity_units);
      *built_flag() = 1;
      signal_targets()->l2_tiles = 2 * l2_tiles();
    }
    __syncwarp();
  }
  __device__ bool built() const { return *static_cast<volatile uint32_t*>(built_flag()) != 0; }

  __device__ uint32_t routed_token_tiles() const { return token_tile_prefix()[num_groups()]; }
  __device__ uint32_t shared_token_tiles() const { return (shared_rows() + kBlockN - 1) / kBlockN; }
  // Read only once built (units at or past first_routed_unit).
  __device__ RoutedSplits* splits() const { return reinterpret_cast<RoutedSplits*>(words(FusedTables::kSplits)); }
  __device__ RoutedUnits routed() const {
    const uint32_t tiles = routed_token_tiles();
    const RoutedSplits& split = *splits();
    return {gemm::split_units(tiles * l1_m_tiles(), split.l1), gemm::split_units(tiles * l2_m_tiles(), split.l2)};
  }
  __device__ uint32_t l2_tiles() const { return routed_token_tiles() * l2_m_tiles() + plan().shared_l2_units; }
  __device__ UnitRef classify(uint32_t unit) const {
    return fused::classify<Config::kStreamed>(
        plan(), unit >= first_routed_unit<Config::kStreamed>(plan(), route_units()) ? routed() : RoutedUnits{}, unit,
        route_units());
  }

  // A GEMM unit: its tile (tile.job is 0 for routed experts and 1 for shared ones) and, for a routed
  // tile in its linear's last wave, its split of K. A split tile's number counts within its linear:
  // split_args gives each linear its part of the workspace.
  __device__ gemm::WorkUnit work(const UnitRef& unit) {
    const bool first = is_first_linear(unit.kind);
    const uint32_t k_blocks = first ? params.l1[0].args.k_blocks : params.l2[0].args.k_blocks;
    if (unit.kind == UnitKind::shared_l1 || unit.kind == UnitKind::shared_l2)
      return {tile(unit.kind, unit.index), 0, 0, 1, {0, k_blocks}};
    const RoutedSplits& split = *splits();
    const gemm::SplitUnit part = gemm::split_unit(unit.index, first ? split.l1 : split.l2);
    return {tile(unit.kind, part.tile), part.split_tile, part.split, part.splits,
            gemm::split_k_range(k_blocks, part.split, part.splits)};
  }
  // A linear's part of the split workspace: L2's counters and partial slots follow L1's, so that an L2
  // split tile never shares one with an L1 split tile still being gathered.
  __device__ gemm::SplitArgs split_args(bool first_linear) const {
    gemm::SplitArgs args = params.split;
    const SplitSpace space = split_space(*splits(), first_linear);
    args.counters += space.counter_base;
    args.partials += uint64_t{space.slot_base} * gemm::kSplitUnitBytes<Config> / sizeof(float);
    args.capacity_units -= space.slot_base;
    return args;
  }

  // Tile `index` of a GEMM unit kind.
  __device__ gemm::Tile tile(UnitKind kind, uint32_t index) {
    switch (kind) {
      case UnitKind::shared_l1:
        return gemm::tile_of_group<kBlockN>(1, 0, index, 0, shared_rows(), shared_l1_m_tiles());
      case UnitKind::shared_l2:
        return gemm::tile_of_group<kBlockN>(1, 0, index, 0, shared_rows(), params.l2[1].args.m_tiles);
      default: {
        const bool first = kind == UnitKind::routed_l1;
        const uint32_t m_tiles = first ? l1_m_tiles() : l2_m_tiles();
        const uint32_t* prefix = token_tile_prefix();
        const uint32_t group =
            gemm::group_of_tile(prefix, num_groups(), index / m_tiles, first ? l1_cursor : l2_cursor);
        const uint32_t* begin = group_begin();
        return gemm::tile_of_group<kBlockN>(0, group, index - prefix[group] * m_tiles, begin[group],
                                            begin[group + 1] - begin[group], m_tiles);
      }
    }
  }
  // The readiness counter index of a tile's token tile.
  __device__ uint32_t token_tile(const gemm::Tile& tile) const {
    return tile.job == 1 ? tile.row_begin / kBlockN
                         : token_tile_prefix()[tile.group] + (tile.row_begin - group_begin()[tile.group]) / kBlockN;
  }

  // This rank's words, from the parameters.
  __device__ const SymmView& view() const { return params.dispatch.view; }
  __device__ ControlBlock* control() const { return params.dispatch.layout.control_block(view().local()); }
  __device__ FusedCounters counters() const { return params.dispatch.layout.fused(view().local()); }
  __device__ StreamedRouteCounters streamed_routes() const {
    return params.dispatch.layout.streamed_routes(view().local(), static_cast<uint32_t>(view().num_ranks));
  }
  // The rank barrier's epoch before this call (+1: counts sent, +2: L2 done, +3: the call ended);
  // only the last CTA to finish moves it, once every CTA has.
  __device__ uint64_t epoch(uint32_t step) const {
    return device::GpuRef<uint64_t>(control()->barrier_epoch).load(cuda::memory_order_relaxed) + step;
  }
  __device__ uint32_t claim() const {
    return cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(control()->fused_claims)
        .fetch_add(1, cuda::memory_order_relaxed);
  }
};

// Whether every source's routes to this rank are counted (one thread): every rank's counts have
// arrived (a batch call), or every source's chunk is indexed here (a streamed call; two timeouts, so
// that a route unit's own wait for its chunk names a missing chunk). False after a timeout.
template <class Config>
__device__ bool counts_in(const FusedScheduler<Config>& s) {
  if constexpr (Config::kStreamed)
    return device::wait_at_least_gpu(s.view(), s.control(), s.streamed_routes().sources_done,
                                     static_cast<uint32_t>(s.view().num_ranks), kWaitFusedRoutes, 0, 2);
  return device::rank_wait(s.view(), s.control(), s.epoch(1));
}

// The event log (CallOptions::trace; kFusedTrace, fused.h). Each role has its share of the CTA's
// entries and its count in shared memory; one thread per role logs.
enum class TraceRole : uint32_t { producer, math, dispatch };
// Entries [trace_share(role), trace_share(role + 1)) of the CTA's: half for the producer (two events
// per unit), three eighths for the math warps, the rest for the dispatch warps.
__host__ __device__ constexpr uint32_t trace_share(uint32_t role) {
  constexpr uint32_t kEvents = static_cast<uint32_t>(kFusedTraceEventsPerCta);
  return role == 0 ? 0 : role == 1 ? kEvents / 2 : role == 2 ? kEvents / 8 * 7 : kEvents;
}
// claimed, ready, done, and from `step` on the points inside a unit that trace_step logs (what 3 + i:
// step i, numbered per role and kind where it is logged).
enum class TraceWhat : uint8_t { claimed, ready, done, step };

template <class Config>
__device__ void trace_event(const FusedScheduler<Config>& s, TraceRole role, uint32_t unit, UnitKind kind,
                            TraceWhat what) {
  if constexpr (!kFusedTrace) return;
  FusedTraceEvent* log = s.params.trace;
  if (log == nullptr) return;
  const uint32_t r = static_cast<uint32_t>(role);
  uint32_t* count = s.words(FusedTables::kTraceCounts) + r;
  const uint32_t entry = trace_share(r) + *count;
  if (entry >= trace_share(r + 1)) return;
  *count += 1;
  log[uint64_t{blockIdx.x} * kFusedTraceEventsPerCta + entry] =
      FusedTraceEvent{gemm::global_timer_ns(), unit, static_cast<uint8_t>(kind), static_cast<uint8_t>(what),
                      static_cast<uint16_t>(blockIdx.x)};
}

// Step `step` of unit `unit`, logged by the role's thread for which `logs` holds: where a unit's time
// goes between its events. Traced builds only, the thread's test too: with an `if (thread == 0)`
// around an empty call the untraced fused fp8_fp4 64-token kernel's registers were allocated
// differently (its math warps spilled 23 instructions instead of 16).
template <class Config>
__device__ __forceinline__ void trace_step(const FusedScheduler<Config>& s, bool logs, TraceRole role, uint32_t unit,
                                           UnitKind kind, uint32_t step) {
  if constexpr (kFusedTrace) {
    if (logs) trace_event(s, role, unit, kind, static_cast<TraceWhat>(static_cast<uint32_t>(TraceWhat::step) + step));
  }
}

// Thread 0 of a group computes a flag; every thread of the group gets it.
template <class Sync, class Compute>
__device__ bool group_flag(uint32_t* flag, uint32_t thread, const Sync& sync, const Compute& compute) {
  if (thread == 0) *flag = compute() ? 1u : 0u;
  sync();
  const bool value = *flag != 0;
  sync();  // the flag may be written again
  return value;
}

// Counts pool rows [first, first + count) pulled for their experts (one thread, release): the L1 tiles
// read the rows through the async proxy once their expert's count is complete (pull_counts_per_row).
__device__ inline void count_pulled_rows(uint32_t* rows_pulled, const dispatch::PoolSegments& segments,
                                         uint32_t first, uint32_t count) {
  for (uint32_t row = first; row < first + count;) {
    const uint32_t expert = segments.find(row) / segments.num_ranks;
    const uint32_t expert_end = segments.segment_begin[(expert + 1) * segments.num_ranks];
    const uint32_t rows_of_expert = min(first + count, expert_end) - row;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(rows_pulled[expert])
        .fetch_add(rows_of_expert, cuda::memory_order_release);
    row += rows_of_expert;
  }
}

}  // namespace megamoe::fused
