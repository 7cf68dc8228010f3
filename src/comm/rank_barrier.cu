#include "comm/rank_barrier.h"

#include "comm/check.h"
#include "kernels/comm/sync.cuh"
#include "kernels/overlapped_launch.cuh"

namespace megamoe {

namespace {

__global__ void __launch_bounds__(32) rank_barrier_kernel(SymmView view, BufferLayout layout) {
  wait_for_prior_kernels();
  allow_next_kernel();
  // A broken call does not arrive: its arrival would pass the peers' wait for this barrier although
  // its GEMMs stopped, and a peer would combine results this rank never wrote, reporting nothing (the
  // fused schedule's end arrival follows the same rule). The peers time out here, naming this rank.
  if (device::cta_call_failed(layout.control_block(view.local()))) return;
  device::rank_barrier(view, layout);
}

}  // namespace

void launch_rank_barrier(const SymmBuffer& buffer, cudaStream_t stream) {
  MEGAMOE_CHECK_CUDA(launch_kernel(rank_barrier_kernel, 1, 32, 0, stream, overlap_launches(buffer.comm()),
                                   buffer.view(), buffer.layout()));
}

}  // namespace megamoe
