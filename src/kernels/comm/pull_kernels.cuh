// Standalone pull kernels over back-to-back rows, for the communication benchmark and its tests:
// each block (one per multiprocessor of the rank's budget) takes every gridDim.x-th row.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/comm/pull.cuh"

namespace megamoe::device {

enum class PullMethod { bulk, vector };

inline constexpr uint32_t kPullStages = 8;         // bulk: shared-memory slots per block
inline constexpr int kPullStoresInFlight = 2;      // bulk: stores still reading slots while loads go on
inline constexpr int kPullVectorThreads = 512;     // vector: 16 warps per block

template <uint32_t kStages>
__global__ void __launch_bounds__(32) pull_rows_bulk_kernel(PulledRows rows, uint32_t count) {
  extern __shared__ __align__(128) char slots[];
  __shared__ uint64_t full[kStages];
  if (threadIdx.x == 0) {
    pull_rows_bulk<kPullStoresInFlight>(rows, blockIdx.x, count, gridDim.x, slots, full, kStages);
  }
}

// With the layer's loads in flight per lane (kPullRowUnroll), so that it measures the layer's pull.
__global__ void __launch_bounds__(kPullVectorThreads) pull_rows_vector_kernel(PulledRows rows, uint32_t count) {
  const uint32_t warps = blockDim.x / 32;
  pull_rows_vector<kPullRowUnroll>(rows, blockIdx.x * warps + threadIdx.x / 32, count, gridDim.x * warps,
                                   threadIdx.x % 32);
}

// Launches `blocks` blocks pulling `count` rows; returns the launch status.
// The bulk kernel's dynamic shared-memory limit is a process-wide attribute of the function. Setting
// it to each launch's own need would let a thread launching shorter rows lower it under another
// thread's launch of longer ones (emulated ranks, or an engine's threads), which then fails with
// cudaErrorLaunchOutOfResources. So it is always set to the same value, the most the device allows,
// and each launch checks its own need against that.
inline cudaError_t launch_pull_rows(PullMethod method, const PulledRows& rows, uint32_t count, int blocks,
                                    cudaStream_t stream) {
  if (method == PullMethod::bulk) {
    const auto kernel = pull_rows_bulk_kernel<kPullStages>;
    int device = 0, optin_bytes = 0;
    cudaFuncAttributes attributes{};
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess)
      status = cudaDeviceGetAttribute(&optin_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (status == cudaSuccess) status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) return status;
    const int dynamic_limit = optin_bytes - static_cast<int>(attributes.sharedSizeBytes);
    const uint64_t shared_bytes = uint64_t{kPullStages} * rows.item_bytes();
    if (shared_bytes > static_cast<uint64_t>(dynamic_limit)) return cudaErrorInvalidValue;
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_limit);
    if (status != cudaSuccess) return status;
    kernel<<<blocks, 32, shared_bytes, stream>>>(rows, count);
  } else {
    pull_rows_vector_kernel<<<blocks, kPullVectorThreads, 0, stream>>>(rows, count);
  }
  return cudaGetLastError();
}

}  // namespace megamoe::device
