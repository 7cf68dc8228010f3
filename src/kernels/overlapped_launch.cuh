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

namespace detail {
// cudaLaunchKernelEx with the programmatic-dependent attribute when `overlapped`, and the cluster
// attribute when `clustered` (then set even for 1 x 1 x 1: a kernel that uses its cluster always
// launches as one).
template <class... Params, class... Args>
cudaError_t launch_kernel_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                             bool overlapped, bool clustered, dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (overlapped) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (clustered) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster.x;
    attributes[count].val.clusterDim.y = cluster.y;
    attributes[count++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
}  // namespace detail

// Launches `kernel`, overlapped with the stream's previous kernel or the plain way; returns the
// launch's status.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                          bool overlapped, Args&&... args) {
  return detail::launch_kernel_ex(kernel, grid, block, smem_bytes, stream, overlapped, false, dim3(1, 1, 1),
                                  std::forward<Args>(args)...);
}

// The same with the grid's blocks in clusters of `cluster`.
template <class... Params, class... Args>
cudaError_t launch_kernel_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block,
                                      size_t smem_bytes, cudaStream_t stream, bool overlapped, Args&&... args) {
  return detail::launch_kernel_ex(kernel, grid, block, smem_bytes, stream, overlapped, true, cluster,
                                  std::forward<Args>(args)...);
}

}  // namespace megamoe
