// The persistent, warp-specialized grouped GEMM kernel: scheduler + mainloop + one epilogue.
// Warpgroup 0 produces (one elected thread issues TMA; with packed fp8_fp4 weights its other three
// warps expand them; with store warps two of them store the L2 epilogue's rows) with few registers;
// warpgroups 1 and 2 run wgmma and the epilogue with many (setmaxnreg).
#pragma once

#include <cuda.h>
#include <cuda/ptx>

#include "kernels/gemm/mainloop.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/overlapped_launch.cuh"

namespace megamoe::gemm {

// setmaxnreg moves registers only within the CTA's allocation at launch: the launch bounds'
// per-thread count (64K / threads, rounded down to a multiple of 8) times the threads, 168 x 384
// and 128 x 512 here. The producer warpgroup and each converter warpgroup keep 40, the math
// warpgroups share the rest in multiples of 8: 232, or 216 beside a converter warpgroup. Asking for
// more than the allocation holds would leave the math warps waiting in setmaxnreg forever, where no
// pipeline timeout sees them: kRegistersFit is checked at compile time.
// The fused decode configs give the producer warpgroup, whose dispatch warps run the call's chain
// of dependent sends and pulls, 96: at 40 that chain spilled 230-300 instructions; their math needs
// no more than the 200 left (ptxas: no spills), except fp8_fp4's 64-token tiles, which spill at 200
// and get 56 (224 left; the fewest spills in all). The grouped GEMM's fp8 and bf16 decode configs
// give it 56 too: their producer thread also stages the weight-block scales and walks split-K plans
// (at 40 it spilled up to 40 instructions), and their math needs far fewer than the 224 left;
// fp8_fp4's decode math, which expands the weights in its registers, keeps 232. The fused fp8
// prefill config gives it 56 as well: at 40 its dispatch warps' sends and pulls, which run beside the
// GEMMs for much of a prefill call, spilled about 770 instructions (about 310 at 56), and its math
// code is the same at 224 as at 232. bf16 and fp8_fp4 measured slower at 8192 tokens that way.
template <class Config>
inline constexpr int kProducerRegisters =
    Config::kLayout == TileLayout::tokens_on_m
        ? (Config::kDispatchWarps && Config::Policy::kRecipe == Recipe::fp8 ? 56 : 40)
    : !Config::kDispatchWarps                  ? (Config::kPacked ? 40 : 56)
    : Config::kPacked && Config::kBlockN == 64 ? 56
                                               : 96;
template <class Config>
inline constexpr int kLaunchRegisters = 65536 / static_cast<int>(Config::kThreads) / 8 * 8;
template <class Config>
inline constexpr int kMathRegisters =
    (kLaunchRegisters<Config> * static_cast<int>(Config::kThreads) -
     128 * kProducerRegisters<Config> * (1 + static_cast<int>(Config::kConverterWarpgroups))) /
    (128 * static_cast<int>(Config::kMathWarpgroups)) / 8 * 8;
template <class Config>
inline constexpr bool kRegistersFit =
    128 * kProducerRegisters<Config> * (1 + static_cast<int>(Config::kConverterWarpgroups)) +
        128 * static_cast<int>(Config::kMathWarpgroups) * kMathRegisters<Config> <=
    kLaunchRegisters<Config> * static_cast<int>(Config::kThreads);

// The stage ring's barriers and, with packed weights, the E2M1 tables; all threads call it, followed
// by a CTA-wide barrier before the ring is used.
template <class Config>
__device__ __forceinline__ void init_pipeline(const SharedStorage<Config>& smem, uint32_t thread) {
  if (thread == 0) {
    const uint32_t full_arrivals = Config::kFullArrivals;  // by value: the wrapper takes a reference
    for (uint32_t stage = 0; stage < Config::kStages; ++stage) {
      cuda::ptx::mbarrier_init(smem.full(stage), full_arrivals);
      cuda::ptx::mbarrier_init(smem.empty(stage), Config::kMathWarpgroups * 4);
      if constexpr (Config::kConverters) cuda::ptx::mbarrier_init(smem.raw_full(stage), 1);
      cuda::ptx::mbarrier_init(smem.unit_ready(stage), 1);
    }
    // Make the initialized barriers visible to the async (TMA) proxy.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  if constexpr (Config::kPacked) {
    if (thread <= kMaxE2M1Shift) {
      const E2M1Table table = e2m1_table(thread);
      smem.e2m1_tables()[thread] = make_uint2(table.low, table.high);
    }
    // The shift areas start as valid table indices: a tile's rows past the tensor's end get no shifts
    // copied and are expanded with whatever their area holds (their codes are zero). The bulk copies
    // that later overwrite them are async-proxy writes: fence after the generic ones.
    for (uint32_t i = thread; i < Config::kStages * Config::kShiftBytes / 4; i += Config::kThreads)
      reinterpret_cast<uint32_t*>(smem.raw_shifts(i / (Config::kShiftBytes / 4)))[i % (Config::kShiftBytes / 4)] = 0;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
}

template <class Config, class Epilogue>
__global__ void __launch_bounds__(Config::kThreads, 1) grouped_gemm_kernel(const __grid_constant__ GemmJobs<Epilogue> jobs) {
  static_assert(kRegistersFit<Config>, "setmaxnreg split exceeds the CTA's registers at launch");
  // Aligned for the 128-byte swizzle atoms: the compiler then folds SharedStorage's padding to zero
  // and every stage address, hence every wgmma descriptor, to constants plus the stage offset.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const MainloopArgs& first = jobs.job[0].args;
  const SharedStorage<Config> smem(smem_raw);
  const uint32_t thread = threadIdx.x;
  const uint32_t warpgroup = thread / 128;
  const uint32_t warp = (thread % 128) / 32;
  const uint32_t lane = thread % 32;

  // The barriers and the E2M1 tables are shared memory only: set up before waiting for the previous
  // kernels of an overlapped launch (kernels/overlapped_launch.cuh).
  init_pipeline<Config>(smem, thread);
  wait_for_prior_kernels();
  allow_next_kernel();
  if (first.watch.control != nullptr && device::cta_call_failed(first.watch.control)) return;

  TileScheduler<Config::kBlockN> scheduler;
  const bool two_jobs = jobs.num_jobs > 1;
  scheduler.build(first.groups, first.m_tiles, two_jobs ? jobs.job[1].args.groups : GroupRows{nullptr, 1, 0},
                  two_jobs ? jobs.job[1].args.m_tiles : 0, smem.scheduler(), thread, Config::kThreads);
  __syncthreads();
  // Split K (kSplitsK, split_k.cuh): the host gives the other decode configs no capacity, and
  // tokens_on_m's constant 0 keeps its prefill kernels free of the plan.
  scheduler.plan_splits(first.k_blocks, two_jobs ? jobs.job[1].args.k_blocks : 0,
                        Config::kLayout == TileLayout::weights_on_m ? jobs.split.capacity_units : 0);

  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<kProducerRegisters<Config>>();
    if (warp == 0) {
      if (lane == 0) produce<Config>(smem, scheduler, jobs);
    } else if constexpr (Config::kConverterWarps > 0) {
      convert_weights<Config>(smem, scheduler, jobs, thread - 32, lane);
    } else {
      if constexpr (Config::kStoreWarps) {
        if (warp <= Config::kMathWarpgroups) Epilogue::store_staged_tiles(smem, jobs, warp - 1, lane);
      }
      if constexpr (Config::kScaleWarp) {
        if (warp == 3) stage_weight_scales<Config>(smem, scheduler, jobs, lane);
      }
    }
    return;
  }
  if constexpr (Config::kConverterWarpgroups > 0) {
    if (warpgroup > Config::kMathWarpgroups) {
      ptx::setmaxnreg_decrease<kProducerRegisters<Config>>();
      convert_weights<Config>(smem, scheduler, jobs, 96 + 128 * (warpgroup - 1 - Config::kMathWarpgroups) + thread % 128,
                              lane);
      return;
    }
  }

  ptx::setmaxnreg_increase<kMathRegisters<Config>>();
  // Broadcast from lane 0 so the compiler knows it is warp-uniform (descriptors in uniform registers).
  const uint32_t math_warpgroup = __shfl_sync(0xFFFFFFFFu, warpgroup - 1, 0);
  const uint32_t math_thread = thread - 128;
  RingPosition<Config::kStages> ring;
  uint32_t unit_parities = 0;
  float acc[2][Config::kAccRegs];
  // tokens_on_m: warpgroup 1 starts kStaggerKBlocks behind warpgroup 0 (pipeline.cuh), unless store
  // warps keep the epilogue short: then the lag only costs the three-stage ring depth (the leading
  // warpgroup waits on stages the lagging one still reads).
  constexpr bool kStaggered = Config::kLayout == TileLayout::tokens_on_m && !Config::kStoreWarps;
  constexpr uint32_t kNoStagger = ~0u;
  uint32_t group_cursor = 0;
  for (bool first_unit = true;; first_unit = false) {
    const uint32_t index = next_unit(smem, ring, unit_parities, first.watch);
    if (index == kNoUnit) break;
    if (kStaggered && math_warpgroup == 1 && first_unit) stagger_wait();
    const WorkUnit unit = scheduler.unit(index, group_cursor);
    const Tile& tile = unit.tile;
    const GemmJob<Epilogue>& job = jobs.job[tile.job];
    const auto prefetched = job.epilogue.prefetch(smem, tile, math_warpgroup, warp, lane);
    const uint32_t stagger_kb =
        kStaggered && math_warpgroup == 0 && first_unit ? min(kStaggerKBlocks, job.args.k_blocks - 1) : kNoStagger;
    consume_unit<Config>(smem, ring, unit, job.args, math_warpgroup, warp, lane, stagger_kb, acc);
    if constexpr (kSplitsK<Config>) {
      if (unit.splits > 1 && !gather_splits<Config>(jobs.split, unit, smem.split_flag(), math_thread, acc)) continue;
    }
    job.epilogue.apply(smem, tile, acc, prefetched, math_warpgroup, warp, lane, math_thread);
  }
  if constexpr (Config::kStoreWarps) Epilogue::finish_staging(smem, math_warpgroup, math_thread);
  // Results may have gone to peers' buffers: make them visible system-wide before whatever barrier
  // the next kernel crosses.
  __threadfence_system();
}

}  // namespace megamoe::gemm
