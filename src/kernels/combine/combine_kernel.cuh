// The staged schedule's combine kernel.
#pragma once

#include "kernels/combine/combine.cuh"
#include "kernels/overlapped_launch.cuh"

namespace megamoe::combine {

// 128 registers per thread: a round of nine slots in flight.
inline constexpr int kCombineThreads = 512;
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const CombineArgs a) {
  wait_for_prior_kernels();
  allow_next_kernel();
  if (device::rank_call_failed(a.control) ||
      device::call_refused(a.control, a.rank, blockIdx.x == 0 && threadIdx.x == 0))
    return;
  combine_vectors(a, 0, uint64_t(a.num_tokens) * static_cast<uint32_t>(a.hidden) / 8,
                  blockIdx.x * uint64_t{blockDim.x} + threadIdx.x, uint64_t{gridDim.x} * blockDim.x);
}

}  // namespace megamoe::combine
