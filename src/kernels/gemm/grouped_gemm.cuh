// The persistent, warp-specialized grouped GEMM kernel: scheduler + mainloop + one epilogue.
// Warpgroup 0 produces (one elected thread issues TMA) with few registers; warpgroups 1 and 2 run
// wgmma and the epilogue with many (setmaxnreg).
#pragma once

#include <cuda.h>
#include <cuda/ptx>

#include "kernels/gemm/mainloop.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"

namespace megamoe::gemm {

inline constexpr uint32_t kProducerRegisters = 40;
inline constexpr uint32_t kMathRegisters = 232;

template <class Config, class Epilogue>
__global__ void __launch_bounds__(Config::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap weights_map, const __grid_constant__ CUtensorMap acts_map,
                        const __grid_constant__ CUtensorMap act_scales_map, const MainloopArgs args,
                        const Epilogue epilogue) {
  extern __shared__ uint8_t smem_raw[];
  if (args.watch.control != nullptr && device::rank_timed_out(args.watch.control)) return;
  const SharedStorage<Config> smem(smem_raw);
  const uint32_t thread = threadIdx.x;
  const uint32_t warpgroup = thread / 128;
  const uint32_t warp = (thread % 128) / 32;
  const uint32_t lane = thread % 32;

  TileScheduler<Config::kBlockN> scheduler;
  scheduler.build(args.groups, args.m_tiles, smem.scheduler(), thread, Config::kThreads);
  if (thread == 0) {
    for (uint32_t stage = 0; stage < Config::kStages; ++stage) {
      cuda::ptx::mbarrier_init(smem.full(stage), 1);
      cuda::ptx::mbarrier_init(smem.empty(stage), Config::kMathWarpgroups * 4);
    }
    // Make the initialized barriers visible to the async (TMA) proxy.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    if (warp == 0 && lane == 0) {
      produce<Config>(smem, scheduler, &weights_map, &acts_map, &act_scales_map, args);
    }
    return;
  }

  ptx::setmaxnreg_increase<kMathRegisters>();
  const uint32_t math_warpgroup = warpgroup - 1;
  const uint32_t math_thread = thread - 128;
  RingPosition<Config::kStages> ring;
  float acc[2][Config::kAccRegs];
  const uint32_t num_tiles = scheduler.num_tiles();
  for (uint32_t index = blockIdx.x; index < num_tiles; index += gridDim.x) {
    const Tile tile = scheduler.tile(index);
    consume_tile<Config>(smem, ring, tile, args, math_warpgroup, lane, acc);
    epilogue.apply(smem, tile, acc, math_warpgroup, warp, lane, math_thread);
  }
  // Results may have gone to peers' buffers: make them visible system-wide before whatever barrier
  // the next kernel crosses.
  __threadfence_system();
}

}  // namespace megamoe::gemm
