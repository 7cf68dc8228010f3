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
//   - with packed weights in prefill tiles, the converter warpgroup expands the GEMM units' weight tiles.
// The math warps' loop holds nothing but GEMMs: with dispatch code in it, values hoisted out of the
// loop held registers through the mainloop, which then spilled (a loop of pulls before it did too).
// The dispatch warps' 40 registers (prefill configs) keep about 6 KB per SM in flight: prefill rows
// moved at about 125 GB/s that way (docs/fused.md).
// Readiness counters (layout.h, FusedCounters) are released after the writes they cover and acquired
// before the TMA loads that read them (with proxy fences: the writes are generic, the loads async).
// The last CTA to finish resets every counter for the next call.
#pragma once

#include <cuda/atomic>
#include <cuda/ptx>

#include <cstdint>

#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused.h"
#include "kernels/fused/units.h"
#include "kernels/gemm/grouped_gemm.cuh"

namespace megamoe::fused {

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
template <class Config>
__device__ __forceinline__ uint32_t pull_counts_per_row(const UnitPlan& plan) {
  return kBulkPullConfig<Config> && plan.bulk_pulls ? 2 : 1;
}
// The ring's last stage carries, with this bit, the unit the producer claimed but did not run (the
// first combine unit, or one past the last): the math warps run it and claim the rest.
inline constexpr uint32_t kEndBit = 0x80000000u;

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
  static constexpr uint32_t kWords = kStagePhases + 1;
};

// Where the math warps count their tiles done, in shared memory: computed from the parameters inside
// the math loop, these addresses were hoisted out of it and held registers through the mainloop,
// which then spilled. Written by thread 0 at the start, and l2_tiles by the producer once built.
struct SignalTargets {
  ControlBlock* control;
  uint32_t* l1_done;
  uint32_t* shared_l1_done;
  uint32_t l2_tiles;  // the L2 tile arrivals (two warpgroups per tile) that complete this rank's L2
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
  __device__ uint32_t l1_m_tiles() const { return params.l1[0].args.m_tiles; }
  __device__ uint32_t l2_m_tiles() const { return params.l2[0].args.m_tiles; }
  __device__ uint32_t shared_l1_m_tiles() const { return params.l1[1].args.m_tiles; }
  __device__ uint32_t shared_rows() const { return static_cast<uint32_t>(params.dispatch.num_tokens); }

  // The producer warp (all lanes), once every rank's counts are in.
  __device__ void build(uint32_t lane) const {
    const uint32_t num_ranks = static_cast<uint32_t>(view().num_ranks);
    const uint32_t* recv_count = BufferLayout::at<uint32_t>(view().local(), params.dispatch.layout.recv_count);
    uint32_t* begin = group_begin();
    const uint32_t groups = num_groups();
    // Each expert's rows: its counts from every source rank, all loads in flight, then one scan.
    for (uint32_t g = lane; g < groups; g += 32) {
      uint32_t rows = 0;
      for (uint32_t r = 0; r < num_ranks; ++r) rows += recv_count[g * num_ranks + r];
      begin[g] = rows;
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
    return fused::classify(plan(), unit >= first_routed_unit(plan()) ? routed() : RoutedUnits{}, unit);
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
  // The rank barrier's epoch before this call (+1: counts sent, +2: L2 done); only the last CTA to
  // finish moves it, once every CTA has.
  __device__ uint64_t epoch(uint32_t step) const {
    return device::GpuRef<uint64_t>(control()->barrier_epoch).load(cuda::memory_order_relaxed) + step;
  }
  __device__ uint32_t claim() const {
    return cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(control()->fused_claims)
        .fetch_add(1, cuda::memory_order_relaxed);
  }
};

// The event log (CallOptions::trace; kFusedTrace, fused.h). Each role has its share of the CTA's
// entries and its count in shared memory; one thread per role logs.
enum class TraceRole : uint32_t { producer, math, dispatch };
// Entries [trace_share(role), trace_share(role + 1)) of the CTA's: half for the producer (two events
// per unit), three eighths for the math warps, the rest for the dispatch warps.
__host__ __device__ constexpr uint32_t trace_share(uint32_t role) {
  constexpr uint32_t kEvents = static_cast<uint32_t>(kFusedTraceEventsPerCta);
  return role == 0 ? 0 : role == 1 ? kEvents / 2 : role == 2 ? kEvents / 8 * 7 : kEvents;
}
enum class TraceWhat : uint8_t { claimed, ready, done };

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

// Thread 0 of a group computes a flag; every thread of the group gets it.
template <class Sync, class Compute>
__device__ bool group_flag(uint32_t* flag, uint32_t thread, const Sync& sync, const Compute& compute) {
  if (thread == 0) *flag = compute() ? 1u : 0u;
  sync();
  const bool value = *flag != 0;
  sync();  // the flag may be written again
  return value;
}

// What GEMM unit `unit`'s stages read waits for: a readiness counter reaching `expected`. One wait
// site for every kind: one inlined spin-wait per kind made each fused kernel about 200 instructions
// longer.
struct OperandWait {
  const uint32_t* counter;
  uint32_t expected;
  WaitSite site;
  uint32_t choice;
};
template <class Config>
__device__ OperandWait operand_wait(const FusedScheduler<Config>& s, const UnitRef& unit, const gemm::Tile& tile) {
  const FusedCounters counters = s.counters();
  if (unit.kind == UnitKind::shared_l1)
    return {&s.control()->fused_sends_done, s.plan().send_units, kWaitFusedInputs, 0};
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
      device::wait_at_least_gpu(s.view(), s.control(), wait.counter, wait.expected, wait.site, wait.choice);
  // The rows were written by generic stores; the stages read them through the async proxy. Global
  // memory only: the fence over every state space also waits for this thread's memory operations
  // (a MEMBAR.GPU in SASS), the global one does not.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  return ready;
}

// Hands `value` (a send or pull unit, or kNoUnit: no more) to the dispatch warps (one thread).
template <class Config>
__device__ void push_dispatch(const FusedScheduler<Config>& s, gemm::RingPosition<kQueueSlots>& queue, uint32_t value) {
  gemm::wait_barrier<Config, true>(s.queue_empty(queue.stage), queue.phase ^ 1, s.params.l1[0].args.watch,
                                   queue.stage);
  *s.queue_slot(queue.stage) = value;
  cuda::ptx::mbarrier_arrive(s.queue_full(queue.stage));
  queue.advance();
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
    const bool counts_in = lane == 0 ? device::rank_wait(s.view(), s.control(), s.epoch(1)) : true;
    if (!__shfl_sync(0xFFFFFFFFu, counts_in, 0)) return false;
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
  dispatch::pull_rows_bulk(a, segments, rows.begin, rows.end, bounce, lane, [&](uint32_t first, uint32_t count) {
    count_pulled_rows(rows_pulled, segments, first, count);
  });
  if (lane == 0) *s.pull_phases() = bounce.phases;  // lane 0 waited on the halves
  __syncwarp();
  return true;
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
  for (;;) {
    uint32_t unit = lane == 0 ? s.claim() : 0;
    unit = __shfl_sync(0xFFFFFFFFu, unit, 0);
    if (unit >= first_routed_unit(s.plan()) && !s.built()) {
      const bool counts_in = lane == 0 ? device::rank_wait(s.view(), s.control(), s.epoch(1)) : true;
      if (!__shfl_sync(0xFFFFFFFFu, counts_in, 0)) break;
      s.build(lane);
      // A rank without L2 tiles says so now (its arrival orders after its counts': rank_arrive).
      if (lane == 0 && s.l2_tiles() == 0) device::rank_arrive(s.view(), s.control(), s.epoch(2));
    }
    const UnitRef ref = s.classify(unit);
    if (lane == 0) trace_event(s, TraceRole::producer, unit, ref.kind, TraceWhat::claimed);
    // Send and pull units go to the dispatch warps; a bulk pull's bytes are the producer's too.
    if (ref.kind == UnitKind::send || ref.kind == UnitKind::pull) {
      if (lane == 0) push_dispatch(s, queue, unit);
      if constexpr (kBulkPullConfig<Config>) {
        if (ref.kind == UnitKind::pull && s.plan().bulk_pulls) {
          if (!run_pull(s, ref.index, lane)) break;
          if (lane == 0) trace_event(s, TraceRole::producer, unit, ref.kind, TraceWhat::done);
        }
      }
      continue;
    }
    // Send and pull units come first: past them the dispatch warps are done, and wait at the CTA's
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
      // so that the math warps' walk through the ring stays whole and the launch ends.
      const auto publish_tile = [&](uint32_t stage) { *s.unit_tile(stage) = UnitTile::of(work, first_linear); };
      if (first_linear) gemm::issue_unit<Config>(s.smem, ring, params.l1[tile.job], work, unit, publish_tile);
      else gemm::issue_unit<Config>(s.smem, ring, params.l2[tile.job], work, unit, publish_tile);
    }
    if (!__shfl_sync(0xFFFFFFFFu, ok, 0)) break;
  }
  if (lane == 0) {
    if (dispatch_open) push_dispatch(s, queue, gemm::kNoUnit);
    gemm::issue_empty_stage<Config>(s.smem, ring, handed_over, watch);
  }
}

// Converter warps (packed weights, prefill tiles): expand the GEMM units' weight tiles.
template <class Config>
__device__ void convert_fused(FusedScheduler<Config>& s, uint32_t thread, uint32_t lane) {
  gemm::RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  for (;;) {
    const uint32_t index = gemm::next_unit(s.smem, ring, unit_parities, watch);
    if ((index & kEndBit) != 0) {
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(s.smem.full(ring.stage));  // completes the last stage
      return;
    }
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

// Pull rows in flight per lane of the dispatch warps (in prefill configs their 40 registers hold
// four 16-byte vectors).
inline constexpr int kDispatchPullUnroll = 4;

// In the prefill config one dispatch thread stages a send unit's token rows with bulk copies through
// the ring's shared memory (dispatch::stage_rows_bulk), while the other threads copy the scales and
// route weights: the three warps' 16-byte vectors, about 6 KB in flight per SM, were latency-bound
// on the rows (~100 µs for a 63-token unit of DeepSeek-V3). The ring is idle until the CTA's send
// units are done: every GEMM unit and the producer's bulk pulls wait for all of this rank's sends.
template <class Config>
__device__ void stage_send_inputs(const FusedScheduler<Config>& s, UnitRange tokens, uint32_t thread) {
  const dispatch::StagedInputs& staged = s.params.staged;
  const bool bulk = Config::kLayout == gemm::TileLayout::tokens_on_m && dispatch::bulk_stageable(staged.copies[0]);
  if (bulk && thread == 0) {
    static_assert(kPullAreaBytes<Config> >= kPullSegmentBytes + 2 * 1024, "the staging's bounce area");
    dispatch::BounceArea bounce{s.smem.base + kPullSegmentBytes, kPullAreaBytes<Config> - kPullSegmentBytes,
                                s.stage_loaded(), *s.stage_phases()};
    dispatch::stage_rows_bulk(staged.copies[0], tokens.begin, tokens.end, bounce);
    *s.stage_phases() = bounce.phases;
  }
  // One call, every thread (thread 0 after its bulk copies): each inlined copy of stage_inputs adds
  // its three loops to the warps' code, which spilled more with a variable thread count.
  dispatch::stage_inputs(staged, bulk ? 1 : 0, tokens.begin, tokens.end, thread, kDispatchThreads);
}

// A send unit: this unit's tokens' inputs into the buffer, their routes counted and scattered; the
// last one to finish sends the counts and arrives on the cross-rank barrier.
template <class Config>
__device__ void run_send(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const UnitRange tokens = unit_range(index, s.plan().tokens_per_send, static_cast<uint32_t>(a.num_tokens));
  stage_send_inputs(s, tokens, thread);
  DispatchSync{}();  // the scales the shared experts' copy reads are the ones just staged
  dispatch::stage_shared_scales(a, tokens.begin, tokens.end, thread, kDispatchThreads);
  const uint32_t top_k = static_cast<uint32_t>(a.problem.top_k);
  dispatch::count_and_scatter(a, tokens.begin * top_k, tokens.end * top_k, s.dispatch_table(), thread,
                              kDispatchThreads, DispatchSync{});
  // Peers read the staged inputs and the scattered indices once the barrier is crossed.
  __threadfence_system();
  DispatchSync{}();
  const bool last = group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{}, [&] {
    return device::atomic_add_acq_rel_sys(&s.control()->fused_sends_done, 1u) + 1 == s.plan().send_units;
  });
  if (!last) return;
  dispatch::send_counts(a, thread, kDispatchThreads);
  __threadfence_system();
  DispatchSync{}();
  if (thread == 0) device::rank_arrive(s.view(), s.control(), s.epoch(1));
}

// The dispatch warps' start of pull unit `index`: once every rank's counts are in, the pool's segments
// built in their table (published by the unit's builder when `publish`), and the unit's rows. False
// after a timeout.
template <class Config>
__device__ bool start_dispatch_pull(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, bool publish,
                                    dispatch::PoolSegments& segments, UnitRange& rows) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{},
                  [&] { return device::rank_wait(s.view(), s.control(), s.epoch(1)); }))
    return false;
  uint32_t* segment_begin = s.dispatch_table();
  dispatch::build_segments(a, segment_begin, thread, kDispatchThreads, DispatchSync{}, publish);
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  segments = {segment_begin, a.layout.experts_per_rank * num_ranks, num_ranks};
  rows = pull_rows(index, s.plan().pull_units, segment_begin[segments.num_segments]);
  return true;
}

// A pull unit (at decode), by the dispatch warps: its share of the received rows into the pool, each
// row counted for its expert.
template <class Config>
__device__ void run_dispatch_pull(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  dispatch::PoolSegments segments;
  UnitRange rows;
  if (!start_dispatch_pull(s, index, thread, index == 0, segments, rows)) return;
  const uint32_t num_ranks = segments.num_ranks;
  uint32_t* rows_pulled = s.counters().rows_pulled;
  constexpr uint32_t kWarps = kDispatchThreads / 32;
  for (uint32_t row = rows.begin + thread / 32; row < rows.end; row += kWarps) {
    dispatch::pull_row<kDispatchPullUnroll>(a, segments, row, lane);
    // The L1 tiles read the row through the async proxy once its expert's count is complete. The
    // warp's stores are ordered before lane 0's release by the warp barrier.
    __syncwarp();
    if (lane == 0) {
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(rows_pulled[segments.find(row) / num_ranks])
          .fetch_add(1, cuda::memory_order_release);
    }
  }
}

// A pull unit (bulk_pulls), by the dispatch warps: its rows' scales, route weights and sources into
// the pool while the producer copies their bytes (run_pull), each row counted for its expert again.
template <class Config>
__device__ void run_pull_metadata(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  dispatch::PoolSegments segments;
  UnitRange rows;
  if (!start_dispatch_pull(s, index, thread, false, segments, rows)) return;  // run_pull publishes
  uint32_t* rows_pulled = s.counters().rows_pulled;
  dispatch::pull_rows_metadata(a, segments, rows.begin, rows.end, thread / 32, kDispatchThreads / 32, lane,
                               [&](uint32_t first, uint32_t count) {
                                 count_pulled_rows(rows_pulled, segments, first, count);
                               });
}

// The dispatch warps: run the send and pull units the producer hands them, in order.
template <class Config>
__device__ void dispatch_fused(const FusedScheduler<Config>& s, uint32_t thread, uint32_t lane) {
  gemm::RingPosition<kQueueSlots> queue;
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  for (;;) {
    // Only its own timeout ends this wait: then the slot may be unwritten, and the warps stop.
    if (!gemm::wait_barrier<Config, true>(s.queue_full(queue.stage), queue.phase, watch, queue.stage)) return;
    const uint32_t unit = *s.queue_slot(queue.stage);
    if (unit == gemm::kNoUnit) return;
    const UnitRef ref = s.classify(unit);
    if (ref.kind == UnitKind::send) run_send(s, ref.index, thread);
    else if (kBulkPullConfig<Config> && s.plan().bulk_pulls) run_pull_metadata(s, ref.index, thread, lane);
    else run_dispatch_pull(s, ref.index, thread, lane);
    DispatchSync{}();  // the table and the slot are free again
    if (thread == 0) trace_event(s, TraceRole::dispatch, unit, ref.kind, TraceWhat::done);
    if (thread == 0) cuda::ptx::mbarrier_arrive(s.queue_empty(queue.stage));
    queue.advance();
  }
}

// Tile-done counts. Each fence before a count holds the thread that makes it for microseconds, and a
// math warpgroup's next wgmmas wait for all of its threads; so once the dispatch warps are done with
// their units, a dispatch warp makes the counts a math warpgroup hands it (make_handed_counts), and
// the warpgroup makes its own only until then. A warpgroup's mode says which: its own counts, handed
// over, or finished without handing over (the dispatch warp then waits for nothing from it).
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
  // system-scope release orders them, and the last count's acquire orders every tile's before the rank
  // arrival. (A sequentially consistent system fence before it was redundant.)
  return device::atomic_add_acq_rel_sys(&targets.control->fused_l2_done, 1u) + 1 == targets.l2_tiles;
}

// A math warpgroup's thread 0: hands `entry` to the dispatch warp that makes the counts, unless its
// ring is full (then false: the thread makes the count itself, and never waits here).
template <class Config>
__device__ bool hand_over_tile_done(const FusedScheduler<Config>& s, uint32_t math_warpgroup, uint32_t entry) {
  const uint32_t written = *s.tile_done_written(math_warpgroup);
  if (written - *static_cast<volatile uint32_t*>(s.tile_done_made(math_warpgroup)) >= kTileDoneSlots) return false;
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
    if (!group_flag(s.words(FusedTables::kMathFlag), math_thread, MathSync<Config>{}, [&] {
          return device::rank_wait(s.view(), s.control(), s.epoch(2)) &&
                 !device::call_refused(s.control(), s.view().rank, true);
        }))
      break;
    if (math_thread == 0) trace_event(s, TraceRole::math, index, UnitKind::combine, TraceWhat::ready);
    const UnitRange vectors = unit_range(s.classify(index).index, s.plan().vectors_per_combine,
                                         static_cast<uint32_t>(c.num_tokens) * static_cast<uint32_t>(c.hidden) / 8);
    combine::combine_vectors<2>(c, vectors.begin, vectors.end, math_thread, Config::kMathThreads);
    if (math_thread == 0) trace_event(s, TraceRole::math, index, UnitKind::combine, TraceWhat::done);
    uint32_t* next = s.words(FusedTables::kMathClaim);
    gemm::math_barrier<Config>();
    if (math_thread == 0) *next = s.claim();
    gemm::math_barrier<Config>();
    index = *next;
    gemm::math_barrier<Config>();
  }
}

// The last CTA to finish: every counter back to zero, the barrier's epoch past this call's two.
template <class Config>
__device__ void reset_counters(const FusedScheduler<Config>& s, uint32_t thread) {
  const FusedCounters counters = s.counters();
  const uint32_t routed_tiles = s.built() ? s.routed_token_tiles() : 0;
  const uint32_t shared_tiles = s.shared_token_tiles();
  for (uint32_t i = thread; i < s.num_groups(); i += Config::kThreads) counters.rows_pulled[i] = 0;
  for (uint32_t i = thread; i < routed_tiles; i += Config::kThreads) counters.l1_done[i] = 0;
  for (uint32_t i = thread; i < shared_tiles; i += Config::kThreads) counters.shared_l1_done[i] = 0;
  if (thread == 0) {
    ControlBlock* control = s.control();
    const uint64_t next_epoch = s.epoch(2);
    control->fused_claims = 0;
    control->fused_sends_done = 0;
    control->fused_l2_done = 0;
    control->finished_blocks = 0;
    device::GpuRef<uint64_t>(control->barrier_epoch).store(next_epoch, cuda::memory_order_relaxed);
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
    *s.signal_targets() = SignalTargets{s.control(), counters.l1_done, counters.shared_l1_done, 0};
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
    *s.pull_phases() = 0;
    *s.stage_phases() = 0;
    *s.pull_segments_built() = 0;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // the pulls' barriers complete on TMA's bytes
  }
  wait_for_prior_kernels();
  allow_next_kernel();
  const bool timed_out = device::rank_timed_out(s.control());
  __syncthreads();
  if (timed_out) return;

  // Each role ends in its own copy of finish_cta: no code after the roles joins their register budgets.
  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<gemm::kProducerRegisters<Config>>();
    if (warp == 0) {
      produce_fused(s, lane);
    } else {
      dispatch_fused(s, thread - 32, lane);
      if (warp <= Config::kMathWarpgroups && lane == 0) make_handed_counts(s, warp - 1);
    }
    finish_cta(s, thread);
  } else if (warpgroup > Config::kMathWarpgroups) {  // converters; none without them (kThreads)
    ptx::setmaxnreg_decrease<gemm::kProducerRegisters<Config>>();
    convert_fused(s, 128 * (warpgroup - 1 - Config::kMathWarpgroups) + thread % 128, lane);
    finish_cta(s, thread);
  } else {
    ptx::setmaxnreg_increase<gemm::kMathRegisters<Config>>();
    const uint32_t math_warpgroup = __shfl_sync(0xFFFFFFFFu, warpgroup - 1, 0);
    math_fused(s, math_warpgroup, warp, lane, thread - 128);
    finish_cta(s, thread);
  }
}

}  // namespace megamoe::fused
