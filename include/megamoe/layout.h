// The symmetric buffer's layout, shared by host and device: every offset and size is computed here
// and nowhere else. Sizes depend only on the Problem (never on a call's token count), so every rank
// computes the same layout and the same total. The token-sized regions and the pools hold one wave
// (Problem::wave_tokens): `tokens` below is the tokens per rank of one wave.
//
// Regions, in order (each starts on a kRegionAlign boundary):
//   control            counters and flags: barrier epochs, per-expert send counts, error record
//   recv_count         [experts_per_rank][num_ranks] u32      routes each source rank sends to each local expert
//   expert_rows        [experts_per_rank + 1] u32            prefix sum of received routes: the pool's expert offsets
//   x                  [tokens][hidden] activation           this rank's tokens (peers pull from here)
//   x_scales           [tokens][hidden / 128] f32            fp8 recipes only
//   topk_idx           [tokens][top_k] i32
//   topk_weights       [tokens][top_k] f32
//   src_index          [experts_per_rank][num_ranks][tokens] u32   token * top_k + k, scattered by source ranks
//   pool_source        [pool_rows] PoolSource                 where each pool row came from
//   pool_weight        [pool_rows] f32                        its route weight
//   l1_pool            [pool_rows][hidden] activation         expert-major: expert e's rows start at expert_rows[e]
//   l1_pool_scales     [hidden / 128][pool_rows] f32          K-block-major, so one TMA box holds a tile's scales
//   l2_pool            [pool_rows][intermediate] activation   L1 output (SwiGLU x route weight, re-quantized)
//   l2_pool_scales     [intermediate / 128][pool_rows] f32
//   shared_x_scales    [hidden / 128][tokens] f32             x's scales K-block-major, for the shared experts' L1
//   shared_l2          [tokens][S * intermediate] activation   shared experts' L1 output
//   shared_l2_scales   [S * intermediate / 128][tokens] f32
//   combine            [tokens][top_k + 1][hidden] bf16       L2 results, written by the owners; slot top_k = shared
//   front_ring         the streaming front ring (docs/streaming.md), when front_num_slots > 0
//   gemm_split         kGemmSplitWorkspaceBytes: the grouped GEMM's split-K counters and partial sums (local)
//   fused_counters     the fused schedule's readiness counters (local, zero between calls): rows pulled per
//                      local expert, L1 completions per routed token tile and per shared token tile,
//                      a streamed call's route counters (StreamedRouteCounters)
//   expanded_weights   fp8_fp4 only: the staged schedule's scratch for one linear's weights as E4M3
//                      (local; kExpandFp4Rows): the routed experts' [experts_per_rank][2 * intermediate]
//                      [hidden] when a wave can expect that many rows per expert (L1 is the larger
//                      linear), then the shared experts' [2 * S * intermediate][hidden] when they can
//                      expand (their wave_tokens rows, or in the routed experts' launch)
#pragma once

#include <cstdint>

#include "megamoe/config.h"
#include "megamoe/problem.h"
#include "megamoe/streaming.h"
#include "megamoe/types.h"

namespace megamoe {

inline constexpr uint64_t kRegionAlign = 4096;
// Pool row counts are a multiple of this, so K-block-major scale rows stay 16-byte aligned, with at
// least kPoolRowAlign - 1 rows beyond the worst case, so a GEMM tile (at most this many rows) that
// starts at an expert's last row stays inside the pool (expert offsets are unaligned prefix sums).
inline constexpr uint64_t kPoolRowAlign = 256;
// The grouped GEMM's workspace (kernels/gemm/split_k.cuh): counters (split K's arrival counter per
// split tile, and the last one the launch's work-unit counter), then one wave of work units' partial
// sums: 132 SMs (H100/H200) x 16 KiB (16-token tiles).
inline constexpr uint32_t kGemmSplitCounters = 1024;
inline constexpr uint32_t kGemmUnitCounter = kGemmSplitCounters - 1;
inline constexpr uint64_t kGemmSplitWorkspaceBytes = kGemmSplitCounters * 4ull + 132ull * 16384;

// fp8_fp4 prefill: from this many expected rows per expert, a staged launch expands its weights
// once into E4M3 scratch and runs fp8's kernel (kernels/gemm/gemm.h) instead of converting each
// weight tile once per token tile. The expansion costs one pass over the weights (reading half a
// byte per weight, writing one), so it pays only when enough token tiles share each weight tile:
// at 1024 rows per expert it measured 0.74-0.83 of fp8's speed against the converters' 0.67-0.73,
// at 4096 rows 0.90-0.97 against 0.65-0.74 (docs/experiments.md, "Stop 52").
inline constexpr uint64_t kExpandFp4Rows = 1024;
MEGAMOE_HD constexpr bool expands_fp4_weights(Recipe recipe, uint64_t expected_rows_per_expert) {
  return recipe == Recipe::fp8_fp4 && expected_rows_per_expert >= kExpandFp4Rows;
}

MEGAMOE_HD uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

MEGAMOE_HD uint64_t ceil_div(uint64_t value, uint64_t divisor) { return (value + divisor - 1) / divisor; }

// What a pool row carries back to its source: rank, token, and which top-k choice it is.
struct PoolSource {
  uint32_t rank;
  uint32_t token_topk;  // token * top_k + k
};

// kWaitGemmStage's `detail` when the fused kernel's scale warp waited for its hand-over from the producer.
inline constexpr uint32_t kGemmScaleHandOver = 0xFFFFu;

// Codes of the device error record (DeviceError::code).
enum DeviceErrorCode : uint32_t {
  kDeviceOk = 0,
  kDeviceTimeout = 1,           // a spin-wait gave up: `site`, `peer`, `expected`, `seen` say on what, `detail` = the
                                //   timeout in ms (except kWaitGemmStage, whose `detail` is the stage)
  kDeviceBadExpertId = 2,       // topk_idx held an id outside [-1, num_experts): `seen` = id, `detail` = token, `choice` = k
  kDeviceSlotOverflow = 3,      // more routes to one (expert, source rank) than a token count allows
  kDeviceCapacityExceeded = 4,  // rank `peer` received `seen` routes, more than Problem::recv_capacity
                                //   (`expected`): the call did nothing on any rank
  kDeviceStreamedChunks = 5,    // a streamed call read source rank `peer`'s chunk `detail` out of step
                                //   with its call: `seen` its first token << 32 | its call's tokens,
                                //   `expected` the same as the call's first chunk puts them (`choice` 1:
                                //   the call's tokens, at most max_tokens_per_rank)
  kDeviceStreamedTokens = 6,    // a streamed call's own front-ring chunks hold `seen` tokens, its
                                //   num_tokens said `expected`
};

// Whether an error leaves the call's protocol incomplete: a wait gave up, or a streamed chunk was out
// of step (its reader gave up without counting). The rank's later waits stop, and the buffer's counts
// and front ring no longer agree with its peers' (a new buffer is needed with several ranks). Input
// errors (ids, slots, capacity) do not: the call runs to its end on every rank.
MEGAMOE_HD constexpr bool breaks_call(uint32_t code) {
  return code == kDeviceTimeout || code == kDeviceStreamedChunks || code == kDeviceStreamedTokens;
}

// Where a spin-wait was waiting (DeviceError::site).
enum WaitSite : uint32_t {
  kWaitNone = 0,
  kWaitGridBarrier = 1,
  kWaitRankBarrier = 2,
  kWaitFrontRouteReady = 5,
  kWaitFrontLayoutReady = 6,
  kWaitFrontConsumed = 7,
  kWaitTest = 8,
  kWaitGemmStage = 9,         // a GEMM pipeline stage inside one CTA (`detail` = stage, or kGemmScaleHandOver)
  // The fused schedule's waits (kernels/fused): `choice` = the expert or token tile waited for.
  kWaitFusedInputs = 10,      // this rank's send units (inputs staged for the shared experts)
  kWaitFusedRows = 11,        // rows of a local expert pulled into the pool
  kWaitFusedL1Tile = 12,      // L1 outputs of a routed token tile
  kWaitFusedSharedL1Tile = 13,  // L1 outputs of a shared-expert token tile
  kWaitFusedTileDone = 14,    // tile-done counts handed over by a math warpgroup (`detail` = warpgroup)
  kWaitFusedRoutes = 15,      // a streamed call's route units (every source's routes indexed here)
};

// The first error a kernel hits is recorded (first writer wins) for the host to report: in
// ControlBlock::error if it breaks the call (breaks_call), else in ControlBlock::input_error, so that
// an input error cannot hide a later failure from the waits and resets that go by the first.
struct DeviceError {
  uint32_t code;
  uint32_t site;
  uint32_t rank;
  uint32_t block;
  uint32_t thread;
  uint32_t peer;
  uint32_t detail;
  uint32_t choice;  // the top-k choice of an input error's route
  uint64_t expected;
  uint64_t seen;
};

// Counters at the head of the buffer.
struct ControlBlock {
  DeviceError error;        // one that broke the call
  DeviceError input_error;  // an input error (a bad expert id, a slot overflow, a refused call)
  uint64_t barrier_epoch;                   // local: how many rank barriers this rank has entered
  uint64_t barrier_arrivals[kMaxRanks];     // written by peers: the epoch each peer has reached
  uint32_t grid_barrier_count;              // arrivals of this rank's blocks (grid barrier)
  uint32_t grid_barrier_generation;
  uint32_t finished_blocks;                 // blocks of the running send_routes grid that have finished
  // The fused schedule (kernels/fused): work units claimed, send units done, L2 tile completions.
  // Zero between calls: the kernel's last block resets them.
  uint32_t fused_claims;
  uint32_t fused_sends_done;
  uint32_t fused_l2_done;
  // Set by a rank whose received routes exceed the capacity, in its own and every peer's block,
  // before its L2-done arrival: then no rank writes y. Cleared by check_device_error.
  uint32_t capacity_exceeded_by;  // 0, or 1 + that rank
};

// The fused schedule's counters (region fused_counters), for token tiles of at least
// kFusedMinTokenTile rows.
inline constexpr uint32_t kFusedMinTokenTile = 16;
struct FusedCounters {
  uint32_t* rows_pulled;     // [experts_per_rank]
  uint32_t* l1_done;         // [routed token tiles]: +1 per math warpgroup and L1 weight tile
  uint32_t* shared_l1_done;  // [shared token tiles]
};

// A streamed call's route units' counters (the fused counters' last words): the source ranks whose
// routes are indexed, each source's parts done and chunks in the call (what the kernel's end
// acknowledges), and each (local expert, source) pair's next table slot. The slots take a device
// atomic per route, so they start on a 128-byte line of their own, away from sources_done, which
// every CTA polls.
struct StreamedRouteCounters {
  uint32_t* sources_done;  // [1]
  uint32_t* parts_done;    // [num_ranks]
  uint32_t* chunks;        // [num_ranks]
  uint32_t* cursors;       // [experts_per_rank][num_ranks]
};

struct Region {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  MEGAMOE_HD uint64_t end() const { return offset + bytes; }
};

// The tokens per rank of one wave: Problem::wave_tokens, or the default chosen from the buffer's
// size (defined below BufferLayout, which it sizes).
MEGAMOE_HD int32_t tokens_per_wave(const Problem& p);

struct BufferLayout {
  // Derived sizes.
  uint32_t experts_per_rank = 0;
  uint32_t wave_tokens = 0;         // Problem::tokens_per_wave() rounded up to a multiple of 4
  uint32_t recv_capacity = 0;       // routes a wave may send this rank (recv_capacity_rows)
  uint32_t pool_rows = 0;           // rows of the expert-major pools: recv_capacity and a tile's overhang
  uint32_t hidden_blocks = 0;       // hidden / 128
  uint32_t intermediate_blocks = 0; // intermediate / 128
  uint32_t shared_intermediate = 0; // num_shared_experts * intermediate
  uint32_t activation_bytes = 0;    // 1 for the fp8 recipes, 2 for bf16

  uint32_t max_routed_token_tiles = 0;  // fused counters: token tiles the pool can hold
  uint32_t max_shared_token_tiles = 0;

  Region control, recv_count, expert_rows, x, x_scales, topk_idx, topk_weights, src_index, pool_source,
      pool_weight, l1_pool, l1_pool_scales, l2_pool, l2_pool_scales, shared_x_scales, shared_l2,
      shared_l2_scales, combine, front_ring, gemm_split, fused_counters, expanded_weights;
  uint64_t expanded_shared_offset = 0;  // the shared experts' part of expanded_weights, from its start
  uint64_t total_bytes = 0;

  // Worst case of rows one rank's pool must hold: every source rank sends every token of a wave to
  // this rank, each with as many distinct local experts as top-k allows.
  MEGAMOE_HD static uint64_t worst_case_pool_rows(const Problem& p) {
    return worst_case_pool_rows(p, tokens_per_wave(p));
  }
  MEGAMOE_HD static uint64_t worst_case_pool_rows(const Problem& p, int32_t wave_tokens) {
    return static_cast<uint64_t>(p.num_ranks) * static_cast<uint64_t>(wave_tokens) *
           static_cast<uint64_t>(p.max_routes_per_token_to_rank());
  }
  // The routes a wave may send one rank: Problem::recv_capacity, or the worst case (0, or larger).
  MEGAMOE_HD static uint64_t recv_capacity_rows(const Problem& p, int32_t wave_tokens) {
    const uint64_t worst = worst_case_pool_rows(p, wave_tokens);
    const uint64_t capacity = p.recv_capacity > 0 ? static_cast<uint64_t>(p.recv_capacity) : worst;
    return capacity < worst ? capacity : worst;
  }

  MEGAMOE_HD static BufferLayout make(const Problem& p) { return make(p, tokens_per_wave(p)); }
  // The layout for waves of `wave_tokens` tokens per rank, whatever Problem::wave_tokens says.
  MEGAMOE_HD static BufferLayout make(const Problem& p, int32_t wave_tokens) {
    BufferLayout l;
    const bool scaled = p.recipe != Recipe::bf16;
    l.experts_per_rank = static_cast<uint32_t>(p.experts_per_rank());
    l.wave_tokens = static_cast<uint32_t>(align_up(static_cast<uint64_t>(wave_tokens), 4));
    l.recv_capacity = static_cast<uint32_t>(recv_capacity_rows(p, wave_tokens));
    l.pool_rows = static_cast<uint32_t>(align_up(uint64_t{l.recv_capacity} + kPoolRowAlign - 1, kPoolRowAlign));
    l.hidden_blocks = static_cast<uint32_t>(p.hidden / kScaleBlock);
    l.intermediate_blocks = static_cast<uint32_t>(p.intermediate / kScaleBlock);
    l.shared_intermediate = static_cast<uint32_t>(p.num_shared_experts * p.intermediate);
    l.activation_bytes = p.recipe == Recipe::bf16 ? 2u : 1u;

    const uint64_t tokens = l.wave_tokens;
    const uint64_t rows = l.pool_rows;
    const uint64_t act = l.activation_bytes;
    uint64_t cursor = 0;
    auto place = [&cursor](Region& region, uint64_t bytes) {
      region.offset = cursor;
      region.bytes = bytes;
      cursor = align_up(cursor + bytes, kRegionAlign);
    };
    place(l.control, sizeof(ControlBlock) + sizeof(uint64_t) * static_cast<uint64_t>(p.num_experts));
    place(l.recv_count, sizeof(uint32_t) * l.experts_per_rank * static_cast<uint64_t>(p.num_ranks));
    place(l.expert_rows, sizeof(uint32_t) * (l.experts_per_rank + 1ull));
    place(l.x, tokens * static_cast<uint64_t>(p.hidden) * act);
    place(l.x_scales, scaled ? sizeof(float) * tokens * l.hidden_blocks : 0);
    place(l.topk_idx, sizeof(int32_t) * tokens * static_cast<uint64_t>(p.top_k));
    place(l.topk_weights, sizeof(float) * tokens * static_cast<uint64_t>(p.top_k));
    place(l.src_index, sizeof(uint32_t) * l.experts_per_rank * static_cast<uint64_t>(p.num_ranks) * tokens);
    place(l.pool_source, sizeof(PoolSource) * rows);
    place(l.pool_weight, sizeof(float) * rows);
    place(l.l1_pool, rows * static_cast<uint64_t>(p.hidden) * act);
    place(l.l1_pool_scales, scaled ? sizeof(float) * rows * l.hidden_blocks : 0);
    place(l.l2_pool, rows * static_cast<uint64_t>(p.intermediate) * act);
    place(l.l2_pool_scales, scaled ? sizeof(float) * rows * l.intermediate_blocks : 0);
    place(l.shared_x_scales, scaled && p.num_shared_experts > 0 ? sizeof(float) * tokens * l.hidden_blocks : 0);
    place(l.shared_l2, tokens * l.shared_intermediate * act);
    place(l.shared_l2_scales, scaled ? sizeof(float) * tokens * (l.shared_intermediate / kScaleBlock) : 0);
    place(l.combine, sizeof(uint16_t) * tokens * static_cast<uint64_t>(p.combine_slots()) *
                         static_cast<uint64_t>(p.hidden));
    place(l.front_ring, FrontRingLayout::make(p).total_bytes);
    place(l.gemm_split, kGemmSplitWorkspaceBytes);
    // Every expert's last token tile may be partial: at most rows / tile + experts tiles.
    l.max_routed_token_tiles = static_cast<uint32_t>(rows / kFusedMinTokenTile) + l.experts_per_rank;
    l.max_shared_token_tiles = static_cast<uint32_t>(ceil_div(tokens, kFusedMinTokenTile));
    place(l.fused_counters, sizeof(uint32_t) * (uint64_t{l.streamed_cursor_word(static_cast<uint32_t>(p.num_ranks))} +
                                                static_cast<uint64_t>(p.num_ranks) * l.experts_per_rank));
    // A wave of `tokens` expects at most this many rows per routed expert (as a call counts them), and
    // the shared experts' one group has `tokens` rows.
    const uint64_t routed_rows = tokens * static_cast<uint64_t>(p.num_ranks) * static_cast<uint64_t>(p.top_k) /
                                 static_cast<uint64_t>(p.num_experts > 0 ? p.num_experts : 1);
    // The shared experts run in the routed tile shape or their own (layer's run_expert_gemms), so
    // either may make them expand.
    const bool routed_expands = expands_fp4_weights(p.recipe, routed_rows);
    const bool shared_expands = p.num_shared_experts > 0 && (routed_expands || expands_fp4_weights(p.recipe, tokens));
    l.expanded_shared_offset =
        routed_expands ? uint64_t{l.experts_per_rank} * 2 * static_cast<uint64_t>(p.intermediate) * p.hidden : 0;
    place(l.expanded_weights,
          l.expanded_shared_offset +
              (shared_expands ? uint64_t{2} * l.shared_intermediate * static_cast<uint64_t>(p.hidden) : 0));
    l.total_bytes = cursor;
    return l;
  }

  // fn(name, region) for every region, in the order make() places them (for `megamoe info` and the
  // tests). A region added to make() is added here too: layout_test checks that these tile the buffer.
  template <typename Fn>
  void for_each_region(Fn&& fn) const {
    fn("control", control);
    fn("recv_count", recv_count);
    fn("expert_rows", expert_rows);
    fn("x", x);
    fn("x_scales", x_scales);
    fn("topk_idx", topk_idx);
    fn("topk_weights", topk_weights);
    fn("src_index", src_index);
    fn("pool_source", pool_source);
    fn("pool_weight", pool_weight);
    fn("l1_pool", l1_pool);
    fn("l1_pool_scales", l1_pool_scales);
    fn("l2_pool", l2_pool);
    fn("l2_pool_scales", l2_pool_scales);
    fn("shared_x_scales", shared_x_scales);
    fn("shared_l2", shared_l2);
    fn("shared_l2_scales", shared_l2_scales);
    fn("combine", combine);
    fn("front_ring", front_ring);
    fn("gemm_split", gemm_split);
    fn("fused_counters", fused_counters);
    fn("expanded_weights", expanded_weights);
  }

  // ---- Typed accessors, given the buffer's base address on some rank ----
  template <typename T>
  MEGAMOE_HD static T* at(void* base, const Region& region) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + region.offset);
  }
  MEGAMOE_HD ControlBlock* control_block(void* base) const { return at<ControlBlock>(base, control); }
  // Per global expert: the routes this rank's dispatch blocks have counted so far; the value an
  // arriving block reads back is its scatter offset.
  MEGAMOE_HD uint64_t* send_count(void* base) const {
    return reinterpret_cast<uint64_t*>(static_cast<char*>(base) + control.offset + sizeof(ControlBlock));
  }
  MEGAMOE_HD uint32_t* recv_count_ptr(void* base, uint32_t local_expert, uint32_t src_rank, uint32_t num_ranks) const {
    return at<uint32_t>(base, recv_count) + local_expert * num_ranks + src_rank;
  }
  MEGAMOE_HD uint32_t* src_index_ptr(void* base, uint32_t local_expert, uint32_t src_rank, uint32_t num_ranks) const {
    return at<uint32_t>(base, src_index) + (static_cast<uint64_t>(local_expert) * num_ranks + src_rank) * wave_tokens;
  }
  MEGAMOE_HD FusedCounters fused(void* base) const {
    uint32_t* first = at<uint32_t>(base, fused_counters);
    return {first, first + experts_per_rank, first + experts_per_rank + max_routed_token_tiles};
  }
  // The fused counters' last words: a streamed call's route counters (num_ranks: the problem's), the
  // table slots from word streamed_cursor_word of the region (a multiple of 32 words).
  MEGAMOE_HD uint32_t streamed_cursor_word(uint32_t num_ranks) const {
    return (experts_per_rank + max_routed_token_tiles + max_shared_token_tiles + 1 + 2 * num_ranks + 31) / 32 * 32;
  }
  MEGAMOE_HD StreamedRouteCounters streamed_routes(void* base, uint32_t num_ranks) const {
    uint32_t* region = at<uint32_t>(base, fused_counters);
    uint32_t* first = region + experts_per_rank + max_routed_token_tiles + max_shared_token_tiles;
    return {first, first + 1, first + 1 + num_ranks, region + streamed_cursor_word(num_ranks)};
  }
  MEGAMOE_HD uint16_t* combine_slot(void* base, uint32_t token, uint32_t slot, uint32_t slots, uint32_t hidden) const {
    return at<uint16_t>(base, combine) + (static_cast<uint64_t>(token) * slots + slot) * hidden;
  }
};

// The default wave (Problem::wave_tokens = 0): the whole call when its buffer fits
// kDefaultBufferBytes, else the fewest equal waves whose buffer fits, but no wave smaller than
// default_wave_floor. With fewer expected rows per routed expert a wave's GEMMs turn from compute to
// weight streaming, and every wave reads all local weights once: at 512 rows per expert those reads
// take about a fifth of the wave's tensor-core time (FP8: 990 TFLOP/s against 4.8 TB/s, one byte per
// weight), so extra waves cost little beyond their fixed cost. Past the floor the buffer may exceed
// the budget (a large model at few ranks: one H200 holds all 256 DeepSeek-V3 experts, whose weights
// a second wave would read again). The choice ignores recv_capacity, which only shrinks the pools.
inline constexpr uint64_t kDefaultBufferBytes = uint64_t{3} << 29;  // 1.5 GiB
inline constexpr uint64_t kMinWaveRowsPerExpert = 512;

// The smallest default wave: kMinWaveRowsPerExpert expected rows per routed expert under uniform
// routing (num_ranks * W * top_k routes over num_experts experts).
MEGAMOE_HD int32_t default_wave_floor(const Problem& p) {
  const uint64_t routes_per_token = static_cast<uint64_t>(p.num_ranks) * static_cast<uint64_t>(p.top_k);
  return static_cast<int32_t>(ceil_div(kMinWaveRowsPerExpert * static_cast<uint64_t>(p.num_experts),
                                       routes_per_token > 0 ? routes_per_token : 1));
}

MEGAMOE_HD int32_t tokens_per_wave(const Problem& p) {
  const int32_t all = p.max_tokens_per_rank;
  if (p.wave_tokens > 0) return p.wave_tokens < all ? p.wave_tokens : all;
  const int32_t floor = default_wave_floor(p);
  if (all <= floor) return all;
  Problem worst = p;
  worst.recv_capacity = 0;
  // Waves of ceil(all / n) tokens; the buffer shrinks as n grows. The most waves whose waves still
  // hold `floor` tokens: ceil(all / n) >= floor while n (floor - 1) < all. Binary search for the
  // fewest that fit; when none does, it ends at the most.
  int32_t fewest = 1, most = floor > 1 ? (all - 1) / (floor - 1) : all;
  while (fewest < most) {
    const int32_t waves = fewest + (most - fewest) / 2;
    if (BufferLayout::make(worst, static_cast<int32_t>(ceil_div(all, waves))).total_bytes <= kDefaultBufferBytes)
      most = waves;
    else
      fewest = waves + 1;
  }
  return static_cast<int32_t>(ceil_div(all, most));
}

MEGAMOE_HD int32_t waves_per_call(const Problem& p) {
  const int32_t wave = tokens_per_wave(p);
  return wave > 0 ? (p.max_tokens_per_rank + wave - 1) / wave : 1;
}

// The routes one rank receives per wave when every rank routes uniformly: a capacity of a small
// multiple of this fits ordinary routing (Problem::recv_capacity).
MEGAMOE_HD int64_t mean_recv_routes(const Problem& p) { return int64_t{tokens_per_wave(p)} * p.top_k; }

}  // namespace megamoe
