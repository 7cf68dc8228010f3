#include "comm/rank_barrier.h"

#include "comm/check.h"
#include "kernels/comm/sync.cuh"
#include "kernels/overlapped_launch.cuh"

namespace megamoe {

namespace {

__global__ void __launch_bounds__(32) rank_barrier_kernel(SymmView view, BufferLayout layout) {
  wait_for_prior_kernels();
  allow_next_kernel();
  device::rank_barrier(view, layout);
}

}  // namespace

void launch_rank_barrier(const SymmBuffer& buffer, cudaStream_t stream) {
  MEGAMOE_CHECK_CUDA(launch_kernel(rank_barrier_kernel, 1, 32, 0, stream, overlap_launches(buffer.comm()),
                                   buffer.view(), buffer.layout()));
}

}  // namespace megamoe
