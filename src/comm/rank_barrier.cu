#include "comm/rank_barrier.h"

#include "comm/check.h"
#include "kernels/comm/sync.cuh"

namespace megamoe {

namespace {

__global__ void __launch_bounds__(32) rank_barrier_kernel(SymmView view, BufferLayout layout) {
  device::rank_barrier(view, layout);
}

}  // namespace

void launch_rank_barrier(const SymmBuffer& buffer, cudaStream_t stream) {
  rank_barrier_kernel<<<1, 32, 0, stream>>>(buffer.view(), buffer.layout());
  MEGAMOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace megamoe
