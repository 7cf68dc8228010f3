// Programmatic dependent launch: each kernel of the layer is launched while the one before it in
// the stream still runs, so that its launch, and whatever of its prologue reads nothing that earlier
// kernels write, overlap the earlier kernel's tail instead of following it.
//
// A kernel launched with launch_kernel(..., overlapped = true, ...) calls wait_for_prior_kernels()
// before it touches global memory that an earlier kernel writes or reads: that returns once every
// earlier kernel of the stream has completed and its writes are visible, as a plain launch would
// have waited. It then calls allow_next_kernel(), after which the next kernel may be launched (its
// blocks take SMs as this kernel's blocks leave them). Launched the plain way (overlapped = false),
// both calls do nothing.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace megamoe {

__device__ __forceinline__ void wait_for_prior_kernels() { cudaGridDependencySynchronize(); }
__device__ __forceinline__ void allow_next_kernel() { cudaTriggerProgrammaticLaunchCompletion(); }

// Launches `kernel`, overlapped with the stream's previous kernel or the plain way; returns the
// launch's status.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                          bool overlapped, Args&&... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &overlap;
  config.numAttrs = overlapped ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace megamoe
