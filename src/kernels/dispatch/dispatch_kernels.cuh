// The staged schedule's dispatch kernels (dispatch.cuh describes the steps).
#pragma once

#include "kernels/dispatch/dispatch.cuh"
#include "kernels/overlapped_launch.cuh"

namespace megamoe::dispatch {

// Dynamic shared memory: num_experts u32 counters. Three steps that used to be three kernels (input
// copies, counting and scattering, publishing the counts): at one token per rank each kernel
// boundary cost a launch's wait and first round trips. Every block finishes, also after a timeout,
// so that the finished-block count returns to zero; the last one publishes.
__global__ void send_routes(const DispatchArgs a, const StagedInputs staged) {
  extern __shared__ uint32_t expert_cursor[];
  wait_for_prior_kernels();
  allow_next_kernel();
  ControlBlock* control = a.layout.control_block(a.view.local());
  bool failed = device::cta_call_failed(control);
  if (!failed) {
    stage_inputs(staged, 0, 0, static_cast<uint32_t>(a.num_tokens), blockIdx.x * uint64_t{blockDim.x} + threadIdx.x,
                 uint64_t{gridDim.x} * blockDim.x);
    // Not into a peer whose previous call (a fused one: after a staged call every rank is past its
    // last barrier) has not ended.
    failed = __syncthreads_and(threadIdx.x != 0 || device::peers_previous_call_ended(a.view, control)) == 0;
  }
  if (!failed) {
    const uint32_t routes = static_cast<uint32_t>(a.num_tokens) * static_cast<uint32_t>(a.problem.top_k);
    const uint32_t per_block = (routes + gridDim.x - 1) / gridDim.x;
    const uint32_t begin = blockIdx.x * per_block;
    const uint32_t end = begin + per_block < routes ? begin + per_block : routes;
    count_and_scatter(a, begin < routes ? begin : routes, end, expert_cursor, threadIdx.x, blockDim.x,
                      [] { __syncthreads(); });
  }
  // The staged inputs and the indices scattered to peers, system-wide before the last block's barrier
  // releases them.
  device::fence_ranks(a.view);
  if (device::last_block_to_finish(control) && !failed && !device::rank_call_failed(control)) publish_counts(a);
}

// Dynamic shared memory: (experts_per_rank * num_ranks + 1) u32. The launch bounds hold the
// registers to what the block size allows (a launch asking for more would fail).
inline constexpr int kPullThreads = 512;
__global__ void __launch_bounds__(kPullThreads) pull(const DispatchArgs a) {
  extern __shared__ uint32_t segment_begin[];
  wait_for_prior_kernels();
  allow_next_kernel();
  if (device::cta_call_failed(a.layout.control_block(a.view.local()))) return;
  build_segments(a, segment_begin, threadIdx.x, blockDim.x, [] { __syncthreads(); }, blockIdx.x == 0);
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  const PoolSegments segments{segment_begin, a.layout.experts_per_rank * num_ranks, num_ranks};
  const uint32_t total_rows = segment_begin[segments.num_segments];
  const uint32_t warps = blockDim.x / 32;
  const uint32_t first_warp = blockIdx.x * warps + threadIdx.x / 32;
  const uint32_t total_warps = gridDim.x * warps;
  for (uint32_t row = first_warp; row < total_rows; row += total_warps) pull_row(a, segments, row, threadIdx.x % 32);
  stage_shared_scales(a, 0, static_cast<uint32_t>(a.num_tokens), blockIdx.x * uint64_t{blockDim.x} + threadIdx.x,
                      uint64_t{gridDim.x} * blockDim.x);
}

}  // namespace megamoe::dispatch
