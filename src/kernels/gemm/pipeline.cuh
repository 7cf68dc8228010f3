// The grouped GEMM's shared-memory layout and its full/empty mbarrier ring.
//
// Stage s holds a 256-row weight tile, a BLOCK_N-row token tile and, for scaled recipes, the token
// tile's activation scales for that K block. full[s] completes when TMA has landed all three;
// empty[s] completes when all math warps are done reading them. With packed (fp8_fp4) weights, TMA
// lands the E2M1 tile in a raw area: in prefill tiles (raw_full[s]) converter warps write the E4M3
// weight tile before arriving on full[s]; decode tiles have no E4M3 tile, their math warps expand the
// raw one into wgmma's A registers.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/sync.cuh"
#include "kernels/gemm/e2m1.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "megamoe/config.h"
#include "megamoe/layout.h"

namespace megamoe::gemm {

// Which operand walks wgmma's M dimension (64 rows per instruction).
enum class TileLayout {
  // Decode: D[weight rows x tokens]. Few tokens per expert cost a narrow N (16..64), not a padded M.
  // Math warpgroup w owns weight rows [128w, 128w + 128) as two m64 blocks.
  weights_on_m,
  // Prefill: D[tokens x weight rows], 128 tokens x 256 weight rows. Math warpgroup w owns tokens
  // [64w, 64w + 64) against the weight rows in two n128 halves; activation scales are then per
  // accumulator row (two per thread) instead of per column.
  tokens_on_m,
};

// kStoreWarps_ (tokens_on_m L2 without packed weights): each math warpgroup stages its whole share of
// the tile's BF16 rows and goes back to its wgmmas, and a store warp of the producer warpgroup (idle
// without packed weights) copies them to their destinations (epilogue.cuh). The full-tile staging
// area costs the ring its fourth stage.
//
// kDispatchWarps_ (the fused schedule, kernels/fused): the producer warpgroup's other three warps run
// the dispatch units; with packed weights the converters are then their own warpgroups' warps only.
template <class Policy_, TileLayout kLayout_, uint32_t kBlockN_, bool kStoreWarps_ = false,
          bool kDispatchWarps_ = false>
struct GemmConfig {
  using Policy = Policy_;
  static constexpr TileLayout kLayout = kLayout_;
  static constexpr bool kStoreWarps = kStoreWarps_;
  static constexpr bool kDispatchWarps = kDispatchWarps_;
  static_assert(!(kStoreWarps && kDispatchWarps), "store and dispatch warps would be the same warps");
  static_assert(!kStoreWarps || (kLayout == TileLayout::tokens_on_m && !Policy::kPackedWeights),
                "store warps serve tokens_on_m tiles, from the producer warpgroup's idle warps");
  static constexpr uint32_t kBlockM = 256;        // weight rows per tile
  static constexpr uint32_t kBlockN = kBlockN_;   // tokens per tile
  static constexpr uint32_t kBlockK = Policy::kBlockK;
  static constexpr uint32_t kRowBytes = 128;      // K bytes per shared-memory row (128-byte swizzle)
  static constexpr uint32_t kMathWarpgroups = 2;
  // Packed (fp8_fp4) weights. Decode tiles (weights on wgmma's A) expand them in the math warps'
  // registers: a decode tile reads each weight once, and the round trip through an E4M3 tile in
  // shared memory (written by converter warps, read by the wgmmas) took three times the packed
  // bytes' shared-memory traffic. Prefill tiles need B from shared memory: converter warps (one
  // warpgroup after the math ones, and the producer warpgroup's idle warps: kConverterWarps) expand
  // each stage there; one warpgroup leaves the math 216 registers, which the promotion needs.
  static constexpr bool kPacked = Policy::kPackedWeights;
  static constexpr bool kExpandInRegisters = kPacked && kLayout == TileLayout::weights_on_m;
  static constexpr bool kConverters = kPacked && !kExpandInRegisters;
  static constexpr uint32_t kConverterWarpgroups = kConverters ? 1 : 0;
  static constexpr uint32_t kThreads = 128 * (1 + kMathWarpgroups + kConverterWarpgroups);
  static constexpr uint32_t kMathThreads = 128 * kMathWarpgroups;
  // FP32 accumulators per thread in each of its two accumulator blocks (m64 x n kBlockN, or m64 x n128).
  static constexpr uint32_t kAccRegs = kLayout == TileLayout::weights_on_m ? kBlockN / 2 : 64;
  static_assert(kLayout == TileLayout::weights_on_m || kBlockN == 128, "tokens_on_m tiles hold 128 tokens");

  static constexpr uint32_t kWeightBytes = kExpandInRegisters ? 0 : kBlockM * kRowBytes;  // the E4M3 (BF16) tile
  static constexpr uint32_t kTokenBytes = kBlockN * kRowBytes;
  // TMA needs the inner start coordinate 16-byte aligned, and a token tile starts at any pool row:
  // load the scales from the row rounded down to a multiple of 4, and 4 more.
  static constexpr uint32_t kScaleAlignRows = 4;
  static constexpr uint32_t kScaleBoxRows = kBlockN + kScaleAlignRows;
  static constexpr uint32_t kScaleBytes = Policy::kScaled ? kScaleBoxRows * 4 : 0;
  static constexpr uint32_t kScaleStride = (kScaleBytes + 127) / 128 * 128;
  // Scaled recipes: the producer also stores the K block's four 64-row weight-block scales into the
  // stage, past the activation scales, so that the math warps' K loop reads them from shared memory:
  // in prefill it need not hold the scales' address, stride and valid count in registers (the fused
  // fp8 prefill kernel's math warps spilled 48 instructions with them, 17 without); in decode their
  // loads leave the path from a unit's first wgmmas to its first promotion, and the producer, stages
  // ahead, hides their latency.
  static constexpr bool kStageWeightScales = Policy::kScaled;
  static constexpr uint32_t kWeightScaleOffset = (kScaleBytes + 15) / 16 * 16;  // within a stage's scale area
  static_assert(!kStageWeightScales || kWeightScaleOffset + 16 <= kScaleStride, "no room for the weight scales");
  // Packed (fp8_fp4) weights land in a raw area of the stage: E2M1 pairs (rows of 64 bytes, TMA's
  // 64-byte swizzle: 16-byte chunk g of row r at g ^ (r / 2) % 4, so that a quad's reads of one row
  // and the converters' of whole groups are free of bank conflicts) and each group of 32's shift.
  static constexpr uint32_t kRawWeightBytes = kPacked ? kBlockM * kBlockK / 2 : 0;
  static constexpr uint32_t kShiftBytes = kPacked ? kBlockM * (kBlockK / 32) : 0;
  static constexpr uint32_t kRawStride = kRawWeightBytes + kShiftBytes;
  // Expanding a stage takes about 50 instructions per group of 32 weights: 7 warps share it. In the
  // fused schedule the producer warpgroup's three other warps join once their dispatch units are done
  // (with four converter warps instead of seven the fused fp8_fp4 prefill call took 1.05-1.07x the time).
  static constexpr uint32_t kConverterWarps = kConverters ? 3 + 4 * kConverterWarpgroups : 0;
  static constexpr uint32_t kTableBytes = kPacked ? (kMaxE2M1Shift + 1) * sizeof(uint2) : 0;  // e2m1_table per shift
  // full[s] completes on TMA's bytes and the producer's arrival, plus each converter warp's. (Decode
  // tiles' raw bytes complete full[s] too; the producer adds them, since a last tile's shifts are fewer.)
  static constexpr uint32_t kStageTxBytes = (kPacked ? 0 : kWeightBytes) + kTokenBytes + kScaleBytes;
  // fp8 tokens_on_m tiles: the producer warpgroup's last warp (idle in the staged GEMM; in the fused
  // kernel once its dispatch units are done) stages the weight-block scales (mainloop.cuh:
  // stage_unit_weight_scales) and arrives on full[s] too, so that the producer thread's K-block loop
  // issues only copies: a scale load on its path cost a load latency per K block (staged GEMM, H100,
  // same run: fp8 L1 0.871 against 0.864 of plain FP8, L2 0.893 against 0.879).
  static constexpr bool kScaleWarp =
      kLayout == TileLayout::tokens_on_m && Policy::kScaled && !kConverters;
  static_assert(!kScaleWarp || kMathWarpgroups < 3, "store warps and tile-done makers are warps 1 to kMathWarpgroups");
  static constexpr uint32_t kFullArrivals = 1 + kConverterWarps + (kScaleWarp ? 1 : 0);
  // A pipeline wait's poll may suspend the warp this long (it resumes once the phase completes).
  // fp8_fp4's converter warps compete for issue slots with the waiting warps' polls; the other
  // configs keep the hardware's default, which measured no worse for them.
  static constexpr uint32_t kWaitSuspendNs = kConverters ? 20000 : 0;

  // Epilogue staging: one row per token, padded by 16 bytes so the transposing stores spread over banks.
  // weights_on_m stages whole rows (128 output channels of L1, 256 features of L2). tokens_on_m
  // stages 128 bytes of each row per pass (L1: 128 E4M3 or 64 BF16 channels; L2: 64 features), which
  // leaves room for a fourth stage; the passes' global stores are still whole 16-byte chunks. With
  // store warps, tokens_on_m L2 stages whole rows, so the math warpgroups never wait for the stores.
  static constexpr uint32_t kPassBytes = 128;
  static constexpr uint32_t kL1StagingChannels =
      kLayout == TileLayout::weights_on_m ? 128 : kPassBytes / Policy::kElementBytes;
  static constexpr uint32_t kL1StagingStride = kL1StagingChannels * Policy::kElementBytes + 16;
  static constexpr uint32_t kL2StagingStride =
      (kLayout == TileLayout::weights_on_m || kStoreWarps ? kBlockM * 2 : kPassBytes) + 16;
  static constexpr uint32_t kStagingBytes =
      kBlockN * (kL1StagingStride > kL2StagingStride ? kL1StagingStride : kL2StagingStride);
  // weights_on_m spreads a token's channels over all 8 math warps: per-warp amax parts + scales.
  static constexpr uint32_t kExchangeBytes =
      kLayout == TileLayout::weights_on_m ? (4 * kMathWarpgroups + 2) * kBlockN * 4 : 0;
  static constexpr uint32_t kSchedulerBytes = 2 * (kMaxGroups + 1) * 4;
  // A word for split K (whether this CTA's unit was its tile's last), then at byte 8 the deadline of
  // the next hand-over (SharedDeadline), in the area's spare bytes: no other area moves.
  static constexpr uint32_t kFlagBytes = 16;
  static constexpr uint32_t kMaxStages = 8;
  // Per stage, the index of the work unit whose first K block the stage holds (mainloop.cuh).
  static constexpr uint32_t kUnitSlotBytes = kMaxStages * 4;
  // Store warps: per math warpgroup, the tile whose rows it has staged (StagedTile).
  static constexpr uint32_t kStagedTileBytes = kStoreWarps ? 16 * kMathWarpgroups : 0;

  static constexpr uint32_t kSmemLimit = 227 * 1024;
  static constexpr uint32_t kFixedBytes = 1024 /* alignment slack */ + kStagingBytes + kExchangeBytes +
                                          kSchedulerBytes + kFlagBytes + kUnitSlotBytes + kStagedTileBytes +
                                          kTableBytes + 4 * kMaxStages * 16 /* barriers */;
  static constexpr uint32_t kStageBytes = kWeightBytes + kTokenBytes + kScaleStride + kRawStride;
  static constexpr uint32_t kStagesFit = (kSmemLimit - kFixedBytes - (kPacked ? 1024 : 0)) / kStageBytes;
  static constexpr uint32_t kStages = kStagesFit > kMaxStages ? kMaxStages : kStagesFit;
  static_assert(kStages >= 2, "tile does not fit shared memory with two stages");

  // Offsets from the 1024-aligned base.
  static constexpr uint32_t kWeightOffset = 0;
  static constexpr uint32_t kTokenOffset = kWeightOffset + kStages * kWeightBytes;
  static constexpr uint32_t kScaleOffset = kTokenOffset + kStages * kTokenBytes;
  static constexpr uint32_t kRawOffset = (kScaleOffset + kStages * kScaleStride + 1023) / 1024 * 1024;
  static constexpr uint32_t kFullOffset = kRawOffset + kStages * kRawStride;
  static constexpr uint32_t kEmptyOffset = kFullOffset + kStages * 8;
  static constexpr uint32_t kRawFullOffset = kEmptyOffset + kStages * 8;
  static constexpr uint32_t kUnitReadyOffset = kRawFullOffset + kStages * 8;
  static constexpr uint32_t kTableOffset = kUnitReadyOffset + kStages * 8;
  static constexpr uint32_t kSchedulerOffset = kTableOffset + kTableBytes;
  static constexpr uint32_t kFlagOffset = kSchedulerOffset + kSchedulerBytes;
  static_assert(kFlagOffset % 8 == 0, "the hand-over deadline's u64 in the flag area");
  static constexpr uint32_t kUnitSlotOffset = kFlagOffset + kFlagBytes;
  static constexpr uint32_t kStagedTileOffset = kUnitSlotOffset + kUnitSlotBytes;
  static constexpr uint32_t kExchangeOffset = kStagedTileOffset + kStagedTileBytes;
  static constexpr uint32_t kStagingOffset = (kExchangeOffset + kExchangeBytes + 127) / 128 * 128;
  static constexpr uint32_t kSmemBytes = kStagingOffset + kStagingBytes + 1024;
  static_assert(kSmemBytes <= kSmemLimit, "shared memory budget exceeded");
  static_assert(kTokenBytes % 1024 == 0, "token tiles must be whole 8-row swizzle atoms");
  static_assert(kRawStride % 1024 == 0, "raw weight tiles must start where the 64-byte swizzle's pattern does");
};

// Store warps: the tile whose rows a math warpgroup has staged, or job kNoStagedTile once it has no more.
struct StagedTile {
  uint32_t job;
  uint32_t row_begin;
  uint32_t rows;
  uint32_t m_tile;
};
inline constexpr uint32_t kNoStagedTile = ~0u;

template <class Config>
struct SharedStorage {
  uint8_t* base;          // 1024-byte aligned (swizzle atoms)
  uint32_t base_address;  // the same, as a shared-window address (wgmma descriptors)

  // `raw` is the kernel's dynamic shared memory: base stays pointer arithmetic on it, so the compiler
  // keeps every access a shared one (LDS/STS) instead of falling back to generic loads and stores.
  __device__ explicit SharedStorage(uint8_t* raw) {
    const uint32_t raw_address = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    const uint32_t padding = (1024 - raw_address % 1024) % 1024;
    base = raw + padding;
    base_address = raw_address + padding;
  }
  // wgmma descriptors of a stage's weight tile and of its token tile from row `row` on.
  __device__ ptx::SmemDescSw128 weights_desc(uint32_t stage) const {
    return desc_at(Config::kWeightOffset / 16 + stage * (Config::kWeightBytes / 16));
  }
  __device__ ptx::SmemDescSw128 tokens_desc(uint32_t stage, uint32_t row = 0) const {
    return desc_at(Config::kTokenOffset / 16 + stage * (Config::kTokenBytes / 16) + row * (Config::kRowBytes / 16));
  }
  __device__ uint8_t* weights(uint32_t stage) const {
    return base + Config::kWeightOffset + stage * Config::kWeightBytes;
  }
  __device__ uint8_t* tokens(uint32_t stage) const { return base + Config::kTokenOffset + stage * Config::kTokenBytes; }
  __device__ float* act_scales(uint32_t stage) const {
    return reinterpret_cast<float*>(base + Config::kScaleOffset + stage * Config::kScaleStride);
  }
  // kStageWeightScales: the stage's K block's scales of the tile's four 64-row weight blocks.
  __device__ float4* weight_scales(uint32_t stage) const {
    return reinterpret_cast<float4*>(base + Config::kScaleOffset + stage * Config::kScaleStride +
                                     Config::kWeightScaleOffset);
  }
  // The same two, as shared-window addresses (ptx::load_shared).
  __device__ uint32_t act_scales_address(uint32_t stage) const {
    return base_address + Config::kScaleOffset + stage * Config::kScaleStride;
  }
  __device__ uint32_t weight_scales_address(uint32_t stage) const {
    return act_scales_address(stage) + Config::kWeightScaleOffset;
  }
  __device__ uint8_t* raw_weights(uint32_t stage) const { return base + Config::kRawOffset + stage * Config::kRawStride; }
  __device__ uint8_t* raw_shifts(uint32_t stage) const { return raw_weights(stage) + Config::kRawWeightBytes; }
  __device__ uint64_t* raw_full(uint32_t stage) const {
    return reinterpret_cast<uint64_t*>(base + Config::kRawFullOffset) + stage;
  }
  // Completes when the producer has claimed a unit's first stage and written its unit slot, before
  // its bytes land (mainloop.cuh: next_unit).
  __device__ uint64_t* unit_ready(uint32_t stage) const {
    return reinterpret_cast<uint64_t*>(base + Config::kUnitReadyOffset) + stage;
  }
  __device__ uint2* e2m1_tables() const { return reinterpret_cast<uint2*>(base + Config::kTableOffset); }
  __device__ uint64_t* full(uint32_t stage) const {
    return reinterpret_cast<uint64_t*>(base + Config::kFullOffset) + stage;
  }
  __device__ uint64_t* empty(uint32_t stage) const {
    return reinterpret_cast<uint64_t*>(base + Config::kEmptyOffset) + stage;
  }
  __device__ uint32_t* scheduler() const { return reinterpret_cast<uint32_t*>(base + Config::kSchedulerOffset); }
  __device__ uint32_t* split_flag() const { return reinterpret_cast<uint32_t*>(base + Config::kFlagOffset); }
  __device__ uint32_t* unit_slot(uint32_t stage) const {
    return reinterpret_cast<uint32_t*>(base + Config::kUnitSlotOffset) + stage;
  }
  __device__ uint64_t* hand_over_deadline() const {
    return reinterpret_cast<uint64_t*>(base + Config::kFlagOffset + 8);
  }
  __device__ StagedTile* staged_tile(uint32_t math_warpgroup) const {
    return reinterpret_cast<StagedTile*>(base + Config::kStagedTileOffset) + math_warpgroup;
  }
  __device__ float* exchange() const { return reinterpret_cast<float*>(base + Config::kExchangeOffset); }
  __device__ uint8_t* staging() const { return base + Config::kStagingOffset; }
  __device__ uint32_t staging_address() const { return base_address + Config::kStagingOffset; }

 private:
  // Offsets in 16-byte units, so that a stage's descriptor is one multiply-add on the base's.
  __device__ ptx::SmemDescSw128 desc_at(uint32_t offset_units) const {
    return {ptx::SmemDescSw128::at(base_address).low + offset_units};
  }
};

// Position in the stage ring; the phase bit flips each time the ring wraps.
template <uint32_t kStages>
struct RingPosition {
  uint32_t stage = 0;
  uint32_t phase = 0;
  __host__ __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Where a pipeline wait records that it gave up.
struct PipelineWatch {
  ControlBlock* control;  // nullable
  uint32_t rank;
  uint64_t timeout_ns;
};

// When a wait gives up. Its own: twice the communication timeout after it began.
struct OwnDeadline {
  __device__ __forceinline__ bool passed(uint64_t now, uint64_t start, const PipelineWatch& watch) const {
    return now - start > 2 * watch.timeout_ns;
  }
};

// The fused kernel's hand-overs (a unit slot of the ring, a slot of the dispatch queue) and the
// walkers that wait for them keep one deadline in shared memory, so that no walker gives up on a
// hand-over that others take: walkers of one unit of which some ran it while others left would no
// longer meet at wgmma's warpgroup-wide instructions and the named barriers (a hang). Each hand-over
// sets the next one's deadline, three communication timeouts later; the producer hands nothing over
// within kHandOverMarginNs of it (and then issues nothing more), and a walker gives up only past it,
// by which time a hand-over made in time has long arrived. (Host and device:
// tests/gemm/hand_over_test.cu plays the rule against random timings.)
inline constexpr uint64_t kHandOverMarginNs = 1000000;

// The walkers' deadline for the hand-over after one made at `now` (the first: at the kernel's start).
// Three timeouts: the producer's own waits between two hand-overs (a streamed call's inputs: two
// timeouts) must fire first and name the cause.
__host__ __device__ __forceinline__ uint64_t next_hand_over_deadline(uint64_t now, uint64_t timeout_ns) {
  return now + 3 * timeout_ns + kHandOverMarginNs;
}
// Whether the producer may still make, at `now`, the hand-over whose walkers give up past `deadline`.
__host__ __device__ __forceinline__ bool hand_over_allowed(uint64_t now, uint64_t deadline) {
  return now + kHandOverMarginNs <= deadline;
}

struct SharedDeadline {
  const uint64_t* deadline;  // next_hand_over_deadline of the last hand-over
  __device__ __forceinline__ bool passed(uint64_t now, uint64_t, const PipelineWatch&) const {
    return now > *static_cast<const volatile uint64_t*>(deadline);
  }
};

// Sets the deadline of the hand-over after one at `now` (the first: at the kernel's start).
__device__ __forceinline__ void set_hand_over_deadline(uint64_t* deadline, uint64_t now, const PipelineWatch& watch) {
  *static_cast<volatile uint64_t*>(deadline) = next_hand_over_deadline(now, watch.timeout_ns);
}

// The producer (one thread), just before a hand-over's arrival: false once it is too late (the walkers
// give up on it); else the next hand-over's deadline is set.
__device__ __forceinline__ bool hand_over_in_time(uint64_t* deadline, const PipelineWatch& watch) {
  const uint64_t now = global_timer_ns();
  if (watch.control != nullptr && !hand_over_allowed(now, *deadline)) return false;
  set_hand_over_deadline(deadline, now, watch);
  return true;
}

// Waits for the mbarrier phase of the given parity; true once it completed. These waits are inside one
// CTA, so a timeout means a broken pipeline (a TMA fault or a bookkeeping bug) or a wait behind one
// that timed out elsewhere: the first records a DeviceError, and the kernel must then end with the
// record readable instead of hanging or faulting. Two kinds:
// - data waits (a stage's bytes: full, raw_full) give up at their next check once the rank's record
//   says timed out: the warps then compute garbage from a stale stage, store it to the tile their unit
//   named (a valid one) and release the stage, so the ring keeps moving;
// - hand-over waits (kHandOver: a unit slot, a free stage, the dispatch queue) do not give up on the
//   record, only at a deadline: what they hand over is read next, and a slot the producer has not
//   written in this launch may be uninitialised shared memory: a walker that read it could store
//   anywhere, and math warpgroups that read different slots would no longer meet at their named
//   barriers. The producer writes every slot it claims and the end marker on every exit path, so these
//   waits complete. The producer's wait for a free stage, and the staged GEMM's walkers (next_unit:
//   their hand-overs come at once), give up on their own clocks (two timeouts). In the fused kernel
//   the walkers of a slot (unit slots, the dispatch queue) give up at the deadline they share with its
//   hand-over (SharedDeadline), whose producer hands nothing over once it is near: every walker of a
//   slot takes its unit or none does.
// An input error (a bad expert id) is no reason to give up: its route is skipped and the pipeline
// stays whole.
// (No printf or trap here: a function call inside the wgmma pipeline would serialize it.)
//
// The checks are rare (every kPollsPerCheck polls): a system-scope load of the error record takes
// about a microsecond, and a barrier that completes meanwhile would be noticed that much later,
// which at every stage would stall the pipeline.
template <class Config, bool kHandOver = false, class Deadline = OwnDeadline>
__device__ __forceinline__ bool wait_barrier(uint64_t* barrier, uint32_t parity, const PipelineWatch& watch,
                                             uint32_t stage, const Deadline& deadline = {}) {
  constexpr uint32_t kPollsPerCheck = 1024;
  const auto poll = [&] {
    if constexpr (Config::kWaitSuspendNs > 0) {
      const uint32_t suspend_ns = Config::kWaitSuspendNs;  // by value: the wrapper takes a reference
      return cuda::ptx::mbarrier_try_wait_parity(barrier, parity, suspend_ns);
    } else {
      return cuda::ptx::mbarrier_try_wait_parity(barrier, parity);
    }
  };
  if (cuda::ptx::mbarrier_try_wait_parity(barrier, parity)) return true;
  const uint64_t start = global_timer_ns();
  uint32_t polls = 0;
  while (!poll()) {
    if (watch.control == nullptr || ++polls % kPollsPerCheck != 0) continue;
    if (!kHandOver && device::rank_call_failed(watch.control)) return false;
    // Twice the communication timeout: in the fused schedule the ring waits behind the producer,
    // whose own waits (for other CTAs and ranks, one timeout each) must fire first and name the cause.
    if (deadline.passed(global_timer_ns(), start, watch)) {
      DeviceError error{};
      error.code = kDeviceTimeout;
      error.site = kWaitGemmStage;
      error.rank = watch.rank;
      error.block = blockIdx.x;
      error.thread = ptx::thread_index();
      error.peer = watch.rank;
      error.detail = stage;
      error.expected = parity;
      error.seen = parity ^ 1;
      device::record_error(watch.control, error);
      return false;
    }
  }
  return true;
}

// Barrier among the math warpgroups only (named barrier 1; 0 is __syncthreads).
template <class Config>
__device__ __forceinline__ void math_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(Config::kMathThreads) : "memory");
}

// Barrier within one math warpgroup (named barriers 2 and 3): tokens_on_m epilogues touch only
// their own warpgroup's token rows, so the two warpgroups never wait for each other there.
__device__ __forceinline__ void warpgroup_barrier(uint32_t math_warpgroup) {
  asm volatile("bar.sync %0, 128;" ::"r"(2 + math_warpgroup) : "memory");
}

// Store warps: math warpgroup w hands its staged rows to store warp w through named barriers 5 + w
// (rows staged) and 7 + w (rows stored: the staging rows are free again), each counting the
// warpgroup's 128 threads and the warp's 32. The waiting side then sees the arriving side's
// shared-memory accesses done (the arrive orders them before it).
inline constexpr uint32_t kHandoffThreads = 128 + 32;
__device__ __forceinline__ uint32_t rows_staged_barrier(uint32_t math_warpgroup) { return 5 + math_warpgroup; }
__device__ __forceinline__ uint32_t rows_stored_barrier(uint32_t math_warpgroup) { return 7 + math_warpgroup; }
__device__ __forceinline__ void handoff_arrive(uint32_t barrier) {
  asm volatile("bar.arrive %0, %1;" ::"r"(barrier), "n"(kHandoffThreads) : "memory");
}
__device__ __forceinline__ void handoff_wait(uint32_t barrier) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(kHandoffThreads) : "memory");
}

// tokens_on_m staggers the math warpgroups by kStaggerKBlocks K blocks (named barrier 4):
// warpgroup 1 starts once warpgroup 0 has begun its first tile's K block kStaggerKBlocks (fp8: once
// that K block's first half has completed, mainloop.cuh). The ring keeps them within kStages of
// each other, so the lag persists, and each one's epilogue then overlaps the other's wgmmas instead
// of both leaving the tensor cores idle at once. (Not with store warps, whose epilogue is a few
// stmatrix: grouped_gemm.cuh.)
inline constexpr uint32_t kStaggerKBlocks = 2;
__device__ __forceinline__ void stagger_arrive() { asm volatile("bar.arrive 4, 256;" ::: "memory"); }
__device__ __forceinline__ void stagger_wait() { asm volatile("bar.sync 4, 256;" ::: "memory"); }

}  // namespace megamoe::gemm
