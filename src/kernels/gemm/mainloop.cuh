// The grouped GEMM's mainloop: one producer thread streams weight tiles, token tiles and activation
// scales with TMA into the stage ring; two math warpgroups run wgmma over them into FP32 registers.
// The stage contents are the same for both tile layouts (pipeline.cuh); only which operand is
// wgmma's A differs.
#pragma once

#include <cuda.h>
#include <cuda/ptx>
#include <cuda/std/type_traits>

#include <cstdint>

#include "kernels/gemm/e2m1.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/gemm/split_k.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace megamoe::gemm {

struct MainloopArgs {
  uint32_t n_out;      // weight rows per group
  uint32_t k;          // reduction length
  uint32_t k_blocks;   // k / kBlockK
  uint32_t m_tiles;    // ceil(n_out / 256)
  GroupRows groups;
  const float* weight_scales;  // scaled recipes: [groups][n_out / 64][k / 128]
  const uint8_t* weight_shifts;  // fp8_fp4: [k / 128][weight_rows][4] (fp4_scales.h)
  uint32_t weight_rows;          // groups * n_out: the weight tensor's rows
  PipelineWatch watch;
};

// One GEMM of a launch: its operands' TMA descriptors, mainloop arguments and epilogue. A launch
// carries one or two (routed and shared experts) so that one persistent grid balances both.
inline constexpr uint32_t kMaxJobs = 2;

template <class Epilogue>
struct GemmJob {
  CUtensorMap weights_map;
  CUtensorMap acts_map;
  CUtensorMap act_scales_map;
  MainloopArgs args;
  Epilogue epilogue;
};

template <class Epilogue>
struct GemmJobs {
  GemmJob<Epilogue> job[kMaxJobs];
  uint32_t num_jobs;
  SplitArgs split;         // the launch's split-K workspace (weights_on_m only)
  uint32_t* unit_counter;  // the workspace's unit counter (UnitClaims), or nullptr
};

// Which work units a CTA runs, in increasing order: first unit blockIdx.x, then without a counter
// + gridDim.x, ...; with one (the workspace's, zeroed), the producer claims each next unit
// (gridDim.x + the counter's old value) when it is about to load it. Units then start in order
// across the grid whatever the earlier ones cost: the token tiles that share a weight tile start
// together and read its lines from L2, where with a fixed order the CTAs drift apart after a few
// uneven tiles and stream them from HBM each (bf16 L1 at 128 experts x 256 rows, random routing:
// 5095-5167 -> 3753-3767 us). The first unit is not claimed, so a launch of one wave waits on no atomic.
// Every CTA with a first unit claims once past the last unit; the claims' old values then end at
// num_units - 1, and that claim resets the counter for the next launch.
struct UnitClaims {
  uint32_t* counter;
  uint32_t num_units;
  __device__ uint32_t first() const { return blockIdx.x; }
  __device__ uint32_t next(uint32_t index) const {
    if (counter == nullptr) return index + gridDim.x;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device> claims(*counter);
    const uint32_t claimed = claims.fetch_add(1, cuda::memory_order_relaxed);
    if (claimed == num_units - 1) claims.store(0, cuda::memory_order_relaxed);
    return gridDim.x + claimed;
  }
};

// A unit slot's value after the CTA's last unit.
inline constexpr uint32_t kNoUnit = ~0u;

// The producer hands each unit's index to the other walkers (converters, math warpgroups) in the
// unit slot of the unit's first stage and arrives on that stage's unit_ready once it has claimed it,
// before issuing its copies, so that the walkers learn the next unit (and load its scales) while its
// bytes are still on the way. After the last unit it fills one more stage with kNoUnit and no bytes.
// unit_ready completes a phase only where a unit starts, and every walker waits for each such phase
// (compute-sanitizer's synccheck reports an arrival on a barrier whose last phase nobody waited
// for), so a walker keeps the parity it waits for next per stage: bit s of `parities`. The producer
// claims a stage again only after every walker has passed it, so at most one phase per stage is
// ever ahead of a walker.
template <class Config>
__device__ uint32_t next_unit(const SharedStorage<Config>& smem, const RingPosition<Config::kStages>& ring,
                              uint32_t& parities, const PipelineWatch& watch) {
  static_assert(Config::kStages <= 32, "one parity bit per stage");
  // Only a deadline ends this wait: then the slot may be unwritten, and the walk ends. In the fused
  // kernel the hand-over's, the same for every walker (SharedDeadline: its producer waits across CTAs
  // and ranks between hand-overs). The staged GEMM's producer waits only for free stages, which the
  // walkers have released before they wait for the next unit, so its hand-overs come at once and
  // each walker keeps its own clock (a shared deadline's stores and checks made ptxas spill in the
  // fp8_fp4 decode kernel's math warps).
  const uint32_t parity = (parities >> ring.stage) & 1u;
  bool handed;
  if constexpr (Config::kDispatchWarps)
    handed = wait_barrier<Config, true>(smem.unit_ready(ring.stage), parity, watch, ring.stage,
                                        SharedDeadline{smem.hand_over_deadline()});
  else
    handed = wait_barrier<Config, true>(smem.unit_ready(ring.stage), parity, watch, ring.stage);
  if (!handed) return kNoUnit;
  parities ^= 1u << ring.stage;
  return *smem.unit_slot(ring.stage);
}

// A walker warp's next unit (the converters', the scale warp's): true with its index, or false at the
// ring's end, whose stage the warp's arrival then completes. The end is any index with bit 31 set:
// kNoUnit, and in the fused schedule the end's carried unit (kernels/fused: kEndBit); unit indices
// stay below it.
inline constexpr uint32_t kEndOfRingBit = 1u << 31;
template <class Config>
__device__ __forceinline__ bool next_walker_unit(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                                 uint32_t& unit_parities, const PipelineWatch& watch, uint32_t lane,
                                                 uint32_t& index) {
  index = next_unit(smem, ring, unit_parities, watch);
  if ((index & kEndOfRingBit) == 0) return true;
  __syncwarp();
  if (lane == 0) cuda::ptx::mbarrier_arrive(smem.full(ring.stage));
  return false;
}

// The first row of a tile's weights in the weight tensor (every group's rows, one after the other).
template <class Config>
__device__ __forceinline__ uint32_t tile_first_weight_row(const MainloopArgs& args, const Tile& tile) {
  return tile.group * args.n_out + tile.m_tile * Config::kBlockM;
}

// A tile's 64-row weight-scale blocks: the first, and how many lie inside its group. Blocks past the
// group's end (a partial last tile's) read none and contribute zero.
struct WeightRowBlocks {
  uint32_t first;
  uint32_t valid;
};
template <class Config>
__device__ __forceinline__ WeightRowBlocks tile_weight_row_blocks(const MainloopArgs& args, const Tile& tile) {
  const uint32_t first = tile_first_weight_row<Config>(args, tile) / 64;
  const uint32_t group_end = (tile.group + 1) * args.n_out / 64;
  return {first, min(Config::kBlockM / 64, group_end - first)};
}

// The scales of K block kb for a tile's four 64-row weight blocks.
template <class Config>
__device__ __forceinline__ float4 tile_weight_scales(const MainloopArgs& args, const Tile& tile, uint32_t kb) {
  const WeightRowBlocks blocks = tile_weight_row_blocks<Config>(args, tile);
  const float* scales = args.weight_scales + blocks.first * args.k_blocks + kb;
  float value[4];
#pragma unroll
  for (uint32_t b = 0; b < 4; ++b) value[b] = b < blocks.valid ? __ldg(scales + b * args.k_blocks) : 0.0f;
  return make_float4(value[0], value[1], value[2], value[3]);
}

// Loads work unit `index` (its K blocks' stages) into the ring: one thread. on_claim(stage) runs once
// the unit's first stage is free, before the walkers learn of the unit: what it writes beside the
// unit slot, they read with it. False when a stage was not freed in time (a timeout, recorded) or the
// unit's hand-over came past its deadline (the walkers gave up): the producer then issues nothing
// more, not even the end. With kScaleWarp, `scale_warp_walks` says whether the scale warp stages this
// unit's weight-block scales (and arrives on its stages' full barriers); if not, the producer does both
// (the fused kernel's warp 3 joins once its dispatch units are done: FusedScheduler::scale_hand_over).
struct NoClaimWork {
  __device__ void operator()(uint32_t) const {}
};
template <class Config, class Epilogue, class OnClaim = NoClaimWork>
__device__ __forceinline__ bool issue_unit(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                           const GemmJob<Epilogue>& job, const WorkUnit& unit, uint32_t index,
                                           const OnClaim& on_claim = {}, bool scale_warp_walks = true) {
  const Tile& tile = unit.tile;
  const MainloopArgs& args = job.args;
  const int32_t weight_row = static_cast<int32_t>(tile_first_weight_row<Config>(args, tile));
  // Decode tiles read each weight byte once per call: loaded evict-first, the weights do not push out
  // of L2 what is read again (the next call's code, tables and counters; the L1 output L2 reads).
  constexpr bool kEvictWeightsFirst = Config::kLayout == TileLayout::weights_on_m;
  const uint64_t weight_policy = kEvictWeightsFirst ? ptx::l2_evict_first_policy() : 0;
  const auto load_weights = [&](void* destination, const int32_t(&coords)[2], uint64_t* barrier) {
    if constexpr (kEvictWeightsFirst)
      ptx::tma_load_2d_with_policy(destination, &job.weights_map, coords, barrier, weight_policy);
    else
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, destination,
                                      &job.weights_map, coords, barrier);
  };
  const bool producer_scales = Config::kStageWeightScales && (!Config::kScaleWarp || !scale_warp_walks);
  for (uint32_t kb = unit.k_blocks.begin; kb < unit.k_blocks.end; ++kb) {
    // Loaded before the wait for a free stage, which hides their latency.
    [[maybe_unused]] float4 block_scales;
    if (producer_scales) block_scales = tile_weight_scales<Config>(args, tile, kb);
    // A stage not freed in time (recorded): the math warps stopped walking the ring, so nothing more
    // is issued; waiting again for every later stage would take two timeouts each.
    if (!wait_barrier<Config, true>(smem.empty(ring.stage), ring.phase ^ 1, args.watch, ring.stage)) return false;
    // Stored before the arrival below, which releases them to the math warps with the stage's bytes.
    if (producer_scales) *smem.weight_scales(ring.stage) = block_scales;
    if (kb == unit.k_blocks.begin) {
      *smem.unit_slot(ring.stage) = index;
      on_claim(ring.stage);
      if constexpr (Config::kDispatchWarps) {
        if (!hand_over_in_time(smem.hand_over_deadline(), args.watch)) return false;
      }
      cuda::ptx::mbarrier_arrive(smem.unit_ready(ring.stage));
    }
    uint64_t* full = smem.full(ring.stage);
    // E2M1 pairs (TMA zero-fills rows past the tensor) and the groups' shifts: their own barrier for
    // the converters, or full[s] for the math warps of decode tiles.
    uint32_t raw_bytes = 0;
    if constexpr (Config::kPacked) {
      const uint32_t rows_left = args.weight_rows - static_cast<uint32_t>(weight_row);
      raw_bytes = Config::kRawWeightBytes + (rows_left < Config::kBlockM ? rows_left : Config::kBlockM) * (Config::kBlockK / 32);
    }
    const uint32_t stage_bytes = Config::kStageTxBytes + (Config::kExpandInRegisters ? raw_bytes : 0);
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         full, stage_bytes);
    if (Config::kScaleWarp && !scale_warp_walks) cuda::ptx::mbarrier_arrive(full);  // the scale warp's
    const int32_t k_coord = static_cast<int32_t>(kb * Config::kBlockK);
    if constexpr (Config::kPacked) {
      uint64_t* raw_full = full;
      if constexpr (Config::kConverters) {
        raw_full = smem.raw_full(ring.stage);
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             raw_full, raw_bytes);
      }
      const uint32_t shift_bytes = raw_bytes - Config::kRawWeightBytes;
      const int32_t packed_coords[2] = {k_coord / 2, weight_row};
      load_weights(smem.raw_weights(ring.stage), packed_coords, raw_full);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem.raw_shifts(ring.stage),
                               args.weight_shifts + (uint64_t{kb} * args.weight_rows + weight_row) * 4, shift_bytes,
                               raw_full);
    } else {
      const int32_t weight_coords[2] = {k_coord, weight_row};
      load_weights(smem.weights(ring.stage), weight_coords, full);
    }
    const int32_t token_coords[2] = {k_coord, static_cast<int32_t>(tile.row_begin)};
    cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem.tokens(ring.stage),
                                    &job.acts_map, token_coords, full);
    if constexpr (Config::Policy::kScaled) {
      const int32_t scale_coords[2] = {static_cast<int32_t>(tile.row_begin & ~(Config::kScaleAlignRows - 1)),
                                       static_cast<int32_t>(kb)};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                      smem.act_scales(ring.stage), &job.act_scales_map, scale_coords, full);
    }
    ring.advance();
  }
  return true;
}

// Fills the ring's next stage with no bytes and `index` in its unit slot: the last stage of a
// producer (index kNoUnit), or a unit the math warps run without operands (the fused schedule's
// dispatch and combine units). The arrivals complete the stage's phases as the producer's; past the
// hand-over's deadline there are none (the walkers have given up on the stage). `scale_warp_walks` as
// in issue_unit.
template <class Config>
__device__ __forceinline__ void issue_empty_stage(const SharedStorage<Config>& smem,
                                                  RingPosition<Config::kStages>& ring, uint32_t index,
                                                  const PipelineWatch& watch, bool scale_warp_walks = true) {
  wait_barrier<Config, true>(smem.empty(ring.stage), ring.phase ^ 1, watch, ring.stage);
  *smem.unit_slot(ring.stage) = index;
  if constexpr (Config::kDispatchWarps) {
    if (!hand_over_in_time(smem.hand_over_deadline(), watch)) return;  // the walkers gave up on it
  }
  cuda::ptx::mbarrier_arrive(smem.unit_ready(ring.stage));
  cuda::ptx::mbarrier_arrive(smem.full(ring.stage));
  if (Config::kScaleWarp && !scale_warp_walks) cuda::ptx::mbarrier_arrive(smem.full(ring.stage));
  if constexpr (Config::kConverters) cuda::ptx::mbarrier_arrive(smem.raw_full(ring.stage));
  ring.advance();
}

template <class Config, class Epilogue>
__device__ void produce(const SharedStorage<Config>& smem, const TileScheduler<Config::kBlockN>& scheduler,
                        const GemmJobs<Epilogue>& jobs) {
  RingPosition<Config::kStages> ring;
  const UnitClaims claims{jobs.unit_counter, scheduler.num_units()};
  uint32_t group_cursor = 0;
  for (uint32_t index = claims.first(); index < claims.num_units; index = claims.next(index)) {
    const WorkUnit unit = scheduler.unit(index, group_cursor);
    if (!issue_unit<Config>(smem, ring, jobs.job[unit.tile.job], unit, index)) return;
  }
  // The end: a stage with no bytes whose slot says so.
  issue_empty_stage<Config>(smem, ring, kNoUnit, jobs.job[0].args.watch);
}

// fp8_fp4 prefill tiles: expands a stage's E2M1 weight tile (groups of 32 codes in the kernels'
// packing, e2m1.cuh) into the E4M3 tile the wgmmas read, laid out as TMA's 128-byte swizzle would
// have left it (16-byte chunk c of row r at c ^ r % 8): per group, 16 packed bytes in (chunk g of
// its row at g ^ (r / 2) % 4, the raw tile's 64-byte swizzle), two chunks out, the first from the
// four words' low halves. Converter thread t takes groups t, t + kThreads, ...: consecutive threads
// on consecutive groups keep the loads and the swizzled stores free of bank conflicts, and since
// kThreads is a multiple of 32 (8 rows of 4 groups), every group of a thread has the same place in
// its row and the same row phase (r % 8). Its shared addresses then step by constants: the
// per-group address arithmetic had been a quarter of the converters' instructions.
template <class Config>
__device__ __forceinline__ void expand_weight_tile(const SharedStorage<Config>& smem, uint32_t stage, uint32_t thread) {
  constexpr uint32_t kGroupsPerRow = Config::kBlockK / 32;
  constexpr uint32_t kGroups = Config::kBlockM * kGroupsPerRow;
  constexpr uint32_t kThreads = 32 * Config::kConverterWarps;
  static_assert(kThreads % (8 * kGroupsPerRow) == 0, "a converter thread's groups must share their row phase");
  const uint32_t row = thread / kGroupsPerRow, part = thread % kGroupsPerRow;
  const uint32_t chunk0 = 16 * ((2 * part) ^ (row % 8)), chunk1 = 16 * ((2 * part + 1) ^ (row % 8));
  const uint8_t* codes_in = smem.raw_weights(stage) + row * (Config::kBlockK / 2) + 16 * (part ^ (row / 2 % 4));
  const uint8_t* shifts_in = smem.raw_shifts(stage) + thread;
  uint8_t* row_out = smem.weights(stage) + row * Config::kRowBytes;
#pragma unroll 1
  for (uint32_t group = thread; group < kGroups; group += kThreads) {
    const uint4 codes = *reinterpret_cast<const uint4*>(codes_in);
    // Rows past the tensor's end have zero codes and an earlier stage's shifts (init_pipeline zeroes them first).
    const uint2 table = smem.e2m1_tables()[*shifts_in];
    const E2M1Table lookup{table.x, table.y};
    *reinterpret_cast<uint4*>(row_out + chunk0) =
        make_uint4(expand_e2m1_low(codes.x, lookup), expand_e2m1_low(codes.y, lookup),
                   expand_e2m1_low(codes.z, lookup), expand_e2m1_low(codes.w, lookup));
    *reinterpret_cast<uint4*>(row_out + chunk1) =
        make_uint4(expand_e2m1_high(codes.x, lookup), expand_e2m1_high(codes.y, lookup),
                   expand_e2m1_high(codes.z, lookup), expand_e2m1_high(codes.w, lookup));
    codes_in += kThreads * 16;
    shifts_in += kThreads;
    row_out += kThreads / kGroupsPerRow * Config::kRowBytes;
  }
}

// fp8_fp4 decode tiles: the A registers of one m64 block's K block (kFp8 layout in wgmma.cuh) for
// the thread whose first row in the tile is `row`: per 32-wide K step g, word lane % 4 of group g
// of rows `row` and `row` + 8, each expanded with its group's table into the low-half register
// (columns 4 (lane % 4)..) and the high-half one (16 further). Both rows share their swizzle phase.
template <class Config>
__device__ __forceinline__ void expand_a_fragments(const SharedStorage<Config>& smem, uint32_t stage, uint32_t row,
                                                   uint32_t lane, uint32_t (&a)[4][4]) {
  constexpr uint32_t kRawRowBytes = Config::kBlockK / 2;
  const uint8_t* codes = smem.raw_weights(stage) + row * kRawRowBytes + 4 * (lane % 4);
  const uint32_t phase = row / 2 % 4;
  // Each row's four shifts (at most kMaxE2M1Shift: no byte carries into the next) as byte offsets
  // into the tables (8 bytes each): one shift per row here instead of one address computation per group.
  static_assert(kMaxE2M1Shift * sizeof(uint2) < 256, "a table offset fits its byte");
  const uint32_t offsets[2] = {*reinterpret_cast<const uint32_t*>(smem.raw_shifts(stage) + 4 * row) << 3,
                               *reinterpret_cast<const uint32_t*>(smem.raw_shifts(stage) + 4 * (row + 8)) << 3};
  const char* tables = reinterpret_cast<const char*>(smem.e2m1_tables());
#pragma unroll
  for (uint32_t g = 0; g < 4; ++g)
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(codes + 8 * kRawRowBytes * h + 16 * (g ^ phase));
      // Byte g, zero-extended, by one PRMT. Rows past the tensor's end keep an earlier stage's shifts
      // (init_pipeline zeroes them first, so they are always valid offsets) and have zero codes.
      const uint2 table = *reinterpret_cast<const uint2*>(tables + __byte_perm(offsets[h], 0, 0x4440 + g));
      const E2M1Table lookup{table.x, table.y};
      a[g][h] = expand_e2m1_low(word, lookup);
      a[g][2 + h] = expand_e2m1_high(word, lookup);
    }
}

// Converter warps (fp8_fp4 prefill tiles): expand each stage's weight tile, then arrive on full[s]. The
// expansion is generic-proxy writes that the wgmmas read through the async proxy: fence first.
template <class Config, class Epilogue>
__device__ void convert_weights(const SharedStorage<Config>& smem, const TileScheduler<Config::kBlockN>& scheduler,
                                const GemmJobs<Epilogue>& jobs, uint32_t thread, uint32_t lane) {
  RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  const PipelineWatch& watch = jobs.job[0].args.watch;
  uint32_t group_cursor = 0;
  uint32_t index;
  while (next_walker_unit(smem, ring, unit_parities, watch, lane, index)) {
    const WorkUnit unit = scheduler.unit(index, group_cursor);
    const MainloopArgs& args = jobs.job[unit.tile.job].args;
    for (uint32_t kb = unit.k_blocks.begin; kb < unit.k_blocks.end; ++kb) {
      wait_barrier<Config>(smem.raw_full(ring.stage), ring.phase, args.watch, ring.stage);
      expand_weight_tile(smem, ring.stage, thread);
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(smem.full(ring.stage));
      ring.advance();
    }
  }
}

// kScaleWarp: the weight-block scales of a unit's stages, written by one warp walking the units as
// the other walkers do, each followed by its arrival on full[s]. It writes a stage once its last use
// was released (the producer's wait), and loads the scales of eight K blocks at once (one per lane: K
// block kb + lane / 4, 64-row block lane % 4), so that a load latency falls on every eighth K block
// only, and on none of the producer's copies. Blocks past the group's end read none (zero). False
// after a timeout (recorded).
template <class Config>
__device__ bool stage_unit_weight_scales(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                         const MainloopArgs& args, const Tile& tile, KRange k_blocks, uint32_t lane) {
  constexpr uint32_t kBatchKBlocks = 32 / 4;
  const WeightRowBlocks blocks = tile_weight_row_blocks<Config>(args, tile);
  const float* block_scales = args.weight_scales + (blocks.first + lane % 4) * args.k_blocks;
  float scale = 0.0f;
  for (uint32_t kb = k_blocks.begin; kb < k_blocks.end; ++kb) {
    const uint32_t slot = (kb - k_blocks.begin) % kBatchKBlocks;
    if (slot == 0) {
      const uint32_t lane_kb = kb + lane / 4;
      scale = lane % 4 < blocks.valid && lane_kb < k_blocks.end ? __ldg(block_scales + lane_kb) : 0.0f;
    }
    if (!wait_barrier<Config, true>(smem.empty(ring.stage), ring.phase ^ 1, args.watch, ring.stage)) return false;
    if (lane / 4 == slot) reinterpret_cast<float*>(smem.weight_scales(ring.stage))[lane % 4] = scale;
    __syncwarp();
    if (lane == 0) cuda::ptx::mbarrier_arrive(smem.full(ring.stage));
    ring.advance();
  }
  return true;
}

// The staged GEMM's scale warp (kScaleWarp): every unit's stages, then its arrival on the end's.
template <class Config, class Epilogue>
__device__ void stage_weight_scales(const SharedStorage<Config>& smem, const TileScheduler<Config::kBlockN>& scheduler,
                                    const GemmJobs<Epilogue>& jobs, uint32_t lane) {
  RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  uint32_t group_cursor = 0;
  uint32_t index;
  while (next_walker_unit(smem, ring, unit_parities, jobs.job[0].args.watch, lane, index)) {
    const WorkUnit unit = scheduler.unit(index, group_cursor);
    if (!stage_unit_weight_scales<Config>(smem, ring, jobs.job[unit.tile.job].args, unit.tile, unit.k_blocks, lane))
      return;
  }
}

// Arrives on a stage's empty barrier for this warp (every wgmma reading the stage has completed).
template <class Config>
__device__ __forceinline__ void release_stage_at(const SharedStorage<Config>& smem, uint32_t stage, uint32_t lane) {
  __syncwarp();
  if (lane == 0) cuda::ptx::mbarrier_arrive(smem.empty(stage));
}

// Releases the ring's current stage (every wgmma reading it has completed) and moves to the next.
template <class Config>
__device__ __forceinline__ void release_stage(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                              uint32_t lane) {
  release_stage_at(smem, ring.stage, lane);
  ring.advance();
}

// Issues the wgmmas of one K block (kBlockK / kMmaK of them, 32 bytes of K each) of A · B into d and
// commits them as one group; with `accumulate` false the first starts d from zero.
template <class Config, class Mma, uint32_t kRegs>
__device__ __forceinline__ void issue_k_block(ptx::SmemDescSw128 desc_a, ptx::SmemDescSw128 desc_b,
                                              float (&d)[kRegs], bool accumulate) {
  constexpr uint32_t kMmasPerBlock = Config::kBlockK / Config::Policy::kMmaK;
  ptx::fence_registers(d);
  ptx::wgmma_fence();
#pragma unroll
  for (uint32_t kk = 0; kk < kMmasPerBlock; ++kk)
    Mma::mma(desc_a.plus(32 * kk).value(), desc_b.plus(32 * kk).value(), d, accumulate || kk > 0);
  ptx::wgmma_commit();
}

// The same with A from registers (fp8_fp4 decode tiles: a[kk] is K slice kk's fragment), starting d
// from zero. The caller keeps `a` unchanged until the group has been waited for.
template <class Config, class Mma, uint32_t kRegs>
__device__ __forceinline__ void issue_k_block_a_registers(uint32_t (&a)[Config::kBlockK / 32][4],
                                                          ptx::SmemDescSw128 desc_b, float (&d)[kRegs]) {
  ptx::fence_registers(d);
  ptx::wgmma_fence();
#pragma unroll
  for (uint32_t kk = 0; kk < Config::kBlockK / 32; ++kk) Mma::mma(a[kk], desc_b.plus(32 * kk).value(), d, kk > 0);
  ptx::wgmma_commit();
}

// Runs step(stage, phase, kb) for K blocks k_blocks.begin..end-1 over the ring. When the ring is at
// stage 0 and the range fills whole ring passes (DeepSeek-V3's shapes), the stages are unrolled: every stage
// index is then a constant, so shared-memory addresses and wgmma descriptors fold to constants
// instead of being rebuilt (and moved to uniform registers) each K block. (Not for fp8_fp4, whose
// math warpgroups have fewer registers: the unrolled loop spills there.)
// (Host and device: the CPU tests check its ring bookkeeping; the kernels pass device lambdas.)
#pragma nv_exec_check_disable
template <bool kUnroll, uint32_t kStages, class Step>
__host__ __device__ __forceinline__ void for_each_k_block(RingPosition<kStages>& ring, KRange k_blocks,
                                                          const Step& step) {
  if (kUnroll && ring.stage == 0 && (k_blocks.end - k_blocks.begin) % kStages == 0) {
    for (uint32_t kb = k_blocks.begin; kb < k_blocks.end; kb += kStages) {
#pragma unroll
      for (uint32_t s = 0; s < kStages; ++s) step(s, ring.phase, kb + s);
      ring.phase ^= 1;
    }
  } else {
    for (uint32_t kb = k_blocks.begin; kb < k_blocks.end; ++kb) {
      step(ring.stage, ring.phase, kb);
      ring.advance();
    }
  }
}

// weights_on_m, scaled recipes: the staged weight-block scales of this warpgroup's two m64 blocks
// (tile blocks 2w and 2w + 1) for the stage's K block.
template <class Config>
__device__ __forceinline__ float2 warpgroup_weight_scales(const SharedStorage<Config>& smem, uint32_t stage,
                                                          uint32_t warpgroup) {
  const float4 scales = *smem.weight_scales(stage);
  return warpgroup == 0 ? make_float2(scales.x, scales.y) : make_float2(scales.z, scales.w);
}

// weights_on_m, scaled recipes: adds one m64 block's K-block partial sums to its FP32 result, times
// the block's weight scale and each token's activation scale (partial register i holds token
// 8 (i / 4) + 2 (lane % 4) + i % 2). kReread: the activation scales are re-read per use (volatile),
// as fp8's tiles need: kept live across both m64 blocks they would cost BLOCK_N / 4 registers and
// make the widest tile spill. fp8_fp4's decode loop reads them once for both blocks, as measured
// at a162dea.
template <bool kReread, uint32_t kRegs, uint32_t kAccRegs>
__device__ __forceinline__ void promote_weights_on_m(float (&acc)[kAccRegs], float (&partial)[kRegs], float row_scale,
                                                     const float* act_scales, uint32_t lane) {
  using Scale = cuda::std::conditional_t<kReread, const volatile float, const float>;
  ptx::fence_registers(partial);
#pragma unroll
  for (uint32_t i = 0; i < kRegs; i += 2) {
    Scale* scales = act_scales + 8 * (i / 4) + 2 * (lane % 4);
    acc[i] += partial[i] * (row_scale * scales[0]);
    acc[i + 1] += partial[i + 1] * (row_scale * scales[1]);
  }
}

// weights_on_m, fp8_fp4 (A from registers): K block kb + 1's weights are expanded while kb's
// wgmmas run, so that the expansion's latency (shared loads, table lookups, PRMTs: eight math warps,
// two per scheduler, hide little of it) overlaps the tensor cores and the promotion instead of
// adding to each K block's time. Two register buffers of A fragments, each 2 m64 blocks x 4 K steps;
// the stage of kb is released once its wgmmas have completed and it has been promoted.
template <class Config, uint32_t kWidth>
__device__ void consume_weights_on_m_packed(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                            const Tile& tile, KRange k_blocks, const MainloopArgs& args,
                                            uint32_t warpgroup, uint32_t lane, float (&tile_acc)[2][Config::kAccRegs]) {
  using Mma = typename Config::Policy::template Mma<kWidth>;
  constexpr uint32_t kRegs = kWidth / 2;
  const uint32_t first_row = 128 * warpgroup + 16 * (threadIdx.x / 32 % 4) + lane / 4;
  const PipelineWatch& watch = args.watch;
  uint32_t a[2][2][Config::kBlockK / 32][4];  // [buffer][m64 block][K step][register]
  float partial[2][kRegs];
  const auto expand = [&](uint32_t (&into)[2][Config::kBlockK / 32][4]) {
    wait_barrier<Config>(smem.full(ring.stage), ring.phase, watch, ring.stage);
#pragma unroll
    for (uint32_t j = 0; j < 2; ++j) expand_a_fragments(smem, ring.stage, first_row + 64 * j, lane, into[j]);
  };
  const auto step = [&](uint32_t (&current)[2][Config::kBlockK / 32][4], uint32_t (&next)[2][Config::kBlockK / 32][4],
                        uint32_t kb) {
    const uint32_t stage = ring.stage;
#pragma unroll
    for (uint32_t j = 0; j < 2; ++j)
      issue_k_block_a_registers<Config, Mma>(current[j], smem.tokens_desc(stage), partial[j]);
    ring.advance();
    if (kb + 1 < k_blocks.end) expand(next);
    ptx::wgmma_wait<0>();
    ptx::fence_registers(reinterpret_cast<uint32_t(&)[2 * 4 * Config::kBlockK / 32]>(current));
    const float* act_scales = smem.act_scales(stage) + (tile.row_begin & (Config::kScaleAlignRows - 1));
    const float2 row_scales = warpgroup_weight_scales(smem, stage, warpgroup);
    promote_weights_on_m<false>(tile_acc[0], partial[0], row_scales.x, act_scales, lane);
    promote_weights_on_m<false>(tile_acc[1], partial[1], row_scales.y, act_scales, lane);
    release_stage_at(smem, stage, lane);
  };
  expand(a[0]);
  for (uint32_t kb = k_blocks.begin; kb < k_blocks.end; kb += 2) {
    step(a[0], a[1], kb);
    if (kb + 1 < k_blocks.end) step(a[1], a[0], kb + 1);
  }
}

// weights_on_m with wgmmas kWidth tokens wide (<= BLOCK_N): acc[j][0, kWidth / 2) is m64 block j of
// this warpgroup's 128 weight rows x the tile's first kWidth tokens; the rest of acc stays as it is
// (zero: the tile has no more tokens).
template <class Config, uint32_t kWidth>
__device__ void consume_weights_on_m_width(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                           const Tile& tile, KRange k_blocks, const MainloopArgs& args,
                                           uint32_t warpgroup, uint32_t lane, float (&tile_acc)[2][Config::kAccRegs]) {
  using Policy = typename Config::Policy;
  using Mma = typename Policy::template Mma<kWidth>;
  constexpr uint32_t kRegs = kWidth / 2;
  if constexpr (Config::kExpandInRegisters) {
    return consume_weights_on_m_packed<Config, kWidth>(smem, ring, tile, k_blocks, args, warpgroup, lane, tile_acc);
  }
  // Block j's first kRegs registers: the accumulator of a kWidth-wide wgmma.
  const auto narrow = [&](uint32_t j) -> float(&)[kRegs] { return reinterpret_cast<float(&)[kRegs]>(tile_acc[j]); };
  constexpr uint32_t kM64Bytes = 64 * Config::kRowBytes;

  const PipelineWatch& watch = args.watch;
  for_each_k_block<!Config::kPacked>(ring, k_blocks, [&](uint32_t stage, uint32_t phase, uint32_t kb) {
    wait_barrier<Config>(smem.full(stage), phase, watch, stage);
    const ptx::SmemDescSw128 desc_tokens = smem.tokens_desc(stage);
    if constexpr (Policy::kScaled) {
      const float* act_scales = smem.act_scales(stage) + (tile.row_begin & (Config::kScaleAlignRows - 1));
      const float2 row_scales = warpgroup_weight_scales(smem, stage, warpgroup);
      float partial[2][kRegs];
      const auto promote = [&](uint32_t j) {
        promote_weights_on_m<true>(tile_acc[j], partial[j], j == 0 ? row_scales.x : row_scales.y, act_scales, lane);
      };
      // Both m64 blocks' wgmmas in flight, block 0 promoted while block 1's run.
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        const ptx::SmemDescSw128 desc_weights = smem.weights_desc(stage).plus((2 * warpgroup + j) * kM64Bytes);
        issue_k_block<Config, Mma>(desc_weights, desc_tokens, partial[j], false);
      }
      ptx::wgmma_wait<1>();
      promote(0);
      ptx::wgmma_wait<0>();
      promote(1);
    } else {
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        const ptx::SmemDescSw128 desc_weights = smem.weights_desc(stage).plus((2 * warpgroup + j) * kM64Bytes);
        issue_k_block<Config, Mma>(desc_weights, desc_tokens, narrow(j), kb > k_blocks.begin);
      }
      ptx::wgmma_wait<0>();
      ptx::fence_registers(narrow(0));
      ptx::fence_registers(narrow(1));
    }
    release_stage_at(smem, stage, lane);
  });
}

// weights_on_m: the wgmmas are 16, 32 or 64 tokens wide (up to BLOCK_N), as tile.mma_rows needs
// (scheduler.cuh: a group's only token tile narrows them to its rows).
template <class Config>
__device__ void consume_weights_on_m(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                     const Tile& tile, KRange k_blocks, const MainloopArgs& args, uint32_t warpgroup,
                                     uint32_t lane, float (&acc)[2][Config::kAccRegs]) {
  if constexpr (Config::kBlockN >= 64) {
    if (tile.mma_rows > 32)
      return consume_weights_on_m_width<Config, 64>(smem, ring, tile, k_blocks, args, warpgroup, lane, acc);
  }
  if constexpr (Config::kBlockN >= 32) {
    if (tile.mma_rows > 16)
      return consume_weights_on_m_width<Config, 32>(smem, ring, tile, k_blocks, args, warpgroup, lane, acc);
  }
  consume_weights_on_m_width<Config, 16>(smem, ring, tile, k_blocks, args, warpgroup, lane, acc);
}

// tokens_on_m, scaled recipes: each K block runs the 256 weight rows as two n128 halves through one
// partial accumulator (the 128 FP32 results leave no registers for two): wgmma, wait, promote with
// act_scale[token] x weight_scale[64-row block] into the FP32 result. The tensor cores stay busy
// while one warpgroup promotes only through the other warpgroup's wgmmas.
template <class Config>
__device__ void consume_tokens_on_m_scaled(const SharedStorage<Config>& shared, RingPosition<Config::kStages>& ring,
                                           const Tile& tile, KRange k_blocks, const MainloopArgs& args,
                                           uint32_t warpgroup, uint32_t warp, uint32_t lane, uint32_t stagger_kb,
                                           float (&acc)[2][Config::kAccRegs]) {
  // The wgmma descriptors' shared-window base held through the loop: rebuilt at each K block's top
  // (the cluster id's read, then a chain of uniform operations) it lay between a block's last
  // promotion and the next block's first wgmmas (SASS, fp8 L1).
  SharedStorage<Config> smem = shared;
  smem.base_address = ptx::held_register(shared.base_address);
  // Held too: rebuilt from the thread index at the second half's release, its read sat among that
  // half's wgmma instructions (SASS, fp8 L1).
  const uint32_t held_lane = ptx::held_register(lane);
  using Mma = typename Config::Policy::template Mma<128>;
  static_assert(Config::kStageWeightScales, "the producer stages the weight-block scales");
  constexpr uint32_t kHalfBytes = 128 * Config::kRowBytes;
  const uint32_t token = 64 * warpgroup + 16 * warp + lane / 4;
  const uint32_t scale_row = (tile.row_begin & (Config::kScaleAlignRows - 1)) + token;
  const PipelineWatch& watch = args.watch;
  // fp8: warpgroup 0 lets warpgroup 1 start once its first half of K block stagger_kb has completed,
  // so that each warpgroup's halves fall between the other's instead of in step with them (both
  // promoting at once leaves the tensor cores idle). Not fp8_fp4: its stages complete when the
  // converters finish.
  constexpr bool kStaggerAfterFirstHalf = !Config::kPacked;

  float partial[Config::kAccRegs];
  // Whether the next K block's stage has landed, tested while this block's second half runs: a wait's
  // poll at the top of the next block put its latency between this block's last promotion and the
  // next block's first wgmmas, the gap the other warpgroup's half must cover (ncu, fp8 L2: the
  // poll's result waited for in about 5% of the math warps' time, the stage ready in 99% of them).
  bool next_stage_landed = false;
  for_each_k_block<!Config::kPacked>(ring, k_blocks, [&](uint32_t stage, uint32_t phase, uint32_t kb) {
    if (!kStaggerAfterFirstHalf && kb == stagger_kb) stagger_arrive();
    if (!next_stage_landed) wait_barrier<Config>(smem.full(stage), phase, watch, stage);
    const ptx::SmemDescSw128 desc_tokens = smem.tokens_desc(stage, 64 * warpgroup);
    float4 block_scales;  // the tile's four 64-row blocks (issue_unit)
    float act_scale[2];
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      issue_k_block<Config, Mma>(desc_tokens, smem.weights_desc(stage).plus(h * kHalfBytes), partial, false);
      // The scales are loaded once the first half's wgmmas are issued: loaded before them, the
      // products' wait for the loads sat between those wgmma instructions (SASS, fp8 L1 and L2).
      if (h == 0) {
        block_scales = ptx::load_shared_v4(smem.weight_scales_address(stage));
        const uint32_t act_scales = smem.act_scales_address(stage) + 4 * scale_row;
        act_scale[0] = ptx::load_shared(act_scales);
        act_scale[1] = ptx::load_shared(act_scales + 4 * 8);
      }
      const float row_scales[4] = {block_scales.x, block_scales.y, block_scales.z, block_scales.w};
      if (h == 1) {
        const bool wraps = stage + 1 == Config::kStages;
        next_stage_landed = kb + 1 < k_blocks.end &&
                            cuda::ptx::mbarrier_test_wait_parity(smem.full(wraps ? 0 : stage + 1), wraps ? phase ^ 1 : phase);
      }
      ptx::wgmma_wait<0>();
      if (kStaggerAfterFirstHalf && h == 0 && kb == stagger_kb) stagger_arrive();
      ptx::fence_registers(partial);
      // The scales are in registers: the producer may refill the stage while the last half is promoted.
      if (h == 1) release_stage_at(smem, stage, held_lane);
      // Register i holds column 8 (i / 4) + ...: the first 32 lie in weight block 2h, the rest in 2h + 1;
      // registers with i % 4 >= 2 hold the token 8 rows further down.
      const float scale[2][2] = {{act_scale[0] * row_scales[2 * h], act_scale[1] * row_scales[2 * h]},
                                 {act_scale[0] * row_scales[2 * h + 1], act_scale[1] * row_scales[2 * h + 1]}};
#pragma unroll
      for (uint32_t i = 0; i < Config::kAccRegs; ++i) acc[h][i] += partial[i] * scale[i / 32][(i % 4) / 2];
    }
  });
}

// tokens_on_m, unscaled recipes: one n256 wgmma per K slice (an n256 accumulator's registers 0..63
// are columns 0..127, so it is acc[0] followed by acc[1]; one instruction reads the token rows once
// instead of twice). wgmma accumulates across all of K, and K block kb's wgmmas stay in flight while
// kb + 1's are issued (except with store warps, below); kb's stage is released once they complete.
template <class Config>
__device__ void consume_tokens_on_m_unscaled(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                             KRange k_blocks, const MainloopArgs& args, uint32_t warpgroup,
                                             uint32_t lane, uint32_t stagger_kb, float (&acc)[2][Config::kAccRegs]) {
  using Mma = typename Config::Policy::template Mma<2 * 128>;
  // With store warps the ring has three stages: holding each stage until the next K block's wgmmas
  // are issued leaves the producer about one stage ahead, so there each K block's wgmmas are waited
  // for and its stage released at once (the other warpgroup's wgmmas fill the wait).
  constexpr bool kReleaseEachKBlock = Config::kStoreWarps;
  float(&tile_acc)[2 * Config::kAccRegs] = reinterpret_cast<float(&)[2 * Config::kAccRegs]>(acc);
  const PipelineWatch& watch = args.watch;
  uint32_t held_stage = 0;
  for_each_k_block<true>(ring, k_blocks, [&](uint32_t stage, uint32_t phase, uint32_t kb) {
    if (kb == stagger_kb) stagger_arrive();
    wait_barrier<Config>(smem.full(stage), phase, watch, stage);
    const bool accumulate = kb > k_blocks.begin;
    issue_k_block<Config, Mma>(smem.tokens_desc(stage, 64 * warpgroup), smem.weights_desc(stage), tile_acc, accumulate);
    if constexpr (kReleaseEachKBlock) {
      ptx::wgmma_wait<0>();
      release_stage_at(smem, stage, lane);
    } else {
      if (accumulate) {
        ptx::wgmma_wait<1>();  // K block kb - 1's group
        release_stage_at(smem, held_stage, lane);
      }
      held_stage = stage;
    }
  });
  ptx::wgmma_wait<0>();
  ptx::fence_registers(tile_acc);
  if constexpr (!kReleaseEachKBlock) release_stage_at(smem, held_stage, lane);
}

// tokens_on_m: acc[h] is this warpgroup's 64 tokens x weight rows [128h, 128h + 128) of the tile.
// Thread (warp, lane) holds tokens 64w + 16 warp + lane / 4 (+ 8 for registers with i % 4 >= 2).
template <class Config>
__device__ void consume_tokens_on_m(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                                    const Tile& tile, KRange k_blocks, const MainloopArgs& args, uint32_t warpgroup,
                                    uint32_t warp, uint32_t lane, uint32_t stagger_kb,
                                    float (&acc)[2][Config::kAccRegs]) {
  // A last partial tile may leave this warpgroup's 64 tokens empty: it skips the wgmmas, so the tile
  // costs the other warpgroup's half of the tensor-core time.
  if (64 * warpgroup >= tile.rows) {
    for (uint32_t kb = k_blocks.begin; kb < k_blocks.end; ++kb) {
      wait_barrier<Config>(smem.full(ring.stage), ring.phase, args.watch, ring.stage);
      release_stage(smem, ring, lane);
    }
    return;
  }
  if constexpr (Config::Policy::kScaled)
    consume_tokens_on_m_scaled<Config>(smem, ring, tile, k_blocks, args, warpgroup, warp, lane, stagger_kb, acc);
  else
    consume_tokens_on_m_unscaled<Config>(smem, ring, k_blocks, args, warpgroup, lane, stagger_kb, acc);
}

// Accumulates one work unit (a tile, or a split of its K range) into acc (FP32), in the layout of the config.
template <class Config>
__device__ void consume_unit(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                             const WorkUnit& unit, const MainloopArgs& args, uint32_t warpgroup, uint32_t warp,
                             uint32_t lane, uint32_t stagger_kb, float (&acc)[2][Config::kAccRegs]) {
  const Tile& tile = unit.tile;
#pragma unroll
  for (uint32_t j = 0; j < 2; ++j)
#pragma unroll
    for (uint32_t i = 0; i < Config::kAccRegs; ++i) acc[j][i] = 0.0f;
  if constexpr (Config::kLayout == TileLayout::weights_on_m)
    consume_weights_on_m<Config>(smem, ring, tile, unit.k_blocks, args, warpgroup, lane, acc);
  else
    consume_tokens_on_m<Config>(smem, ring, tile, unit.k_blocks, args, warpgroup, warp, lane, stagger_kb, acc);
}

}  // namespace megamoe::gemm
