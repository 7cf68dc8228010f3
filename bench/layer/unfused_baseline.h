// The unfused baseline of `megamoe bench`: the MoE layer as a careful user builds it from vendor
// parts, in the way of Megatron-LM's all-to-all token dispatcher:
//   route_layout + gather_rows      count routes per expert and permute token rows into a send
//                                   buffer grouped by (destination rank, local expert)
//   ncclAlltoAll of the counts      then the counts to the host, which sizes the variable all-to-all
//   grouped ncclSend/ncclRecv       token rows (and their 1x128 FP32 scales for fp8)
//   regroup_rows                    source-major -> expert-major (more than one rank)
//   per expert: cuBLASLt L1         -> swiglu (+ E4M3 quantization) -> per expert: cuBLASLt L2
//   regroup_rows back, grouped ncclSend/ncclRecv of the BF16 results back to their tokens' ranks
//   shared experts                  cuBLASLt L1 -> swiglu -> cuBLASLt L2 on this rank's tokens
//   combine                         y = sum over k of route weight x result (+ shared), FP32, into BF16
// Everything runs on one stream; the host waits once per call (for the counts).
//
// Weights: the fused layer's transformed weights (weights.h), read as they are. L2 weights are
// canonical already; L1's rows come out of the GEMM in the transformed gate/up order, and swiglu takes
// each channel's gate and up from there, so no second copy of the weights is needed.
//
// Numerics: bf16 computes the recipe's math (route weights applied in the combine rather than before
// L2, and L1's output rounded to BF16 before SwiGLU: both differences are at BF16 rounding level).
// fp8 uses cuBLASLt's per-tensor scaling: one FP32 scale for all of x (kActivationScale), one per
// weight matrix kind (synthetic_weight_range(fan_in) / 448) and one for the SwiGLU output
// (kSwigluScale), in place of the recipe's 1x128 / 128x128 block scales. It moves the same bytes (the
// 1x128 scales of x travel with the rows) and does the same FLOPs, but its y is not the recipe's y.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "megamoe/comm.h"
#include "megamoe/layer.h"
#include "megamoe/problem.h"

namespace megamoe::bench {

class UnfusedBaseline {
 public:
  // A typical 1x128 block scale of the synthetic activations: amax = sqrt(3) x the mean token factor
  // 1.25 (synthetic_batches), over 448.
  static constexpr float kActivationScale = 1.7320508f * 1.25f / 448.0f;
  // SwiGLU outputs stay well inside +-56 for synthetic data, so E4M3's 448 maps to 56.
  static constexpr float kSwigluScale = 1.0f / 8.0f;

  // For an NCCL rank (comm.nccl() not null); allocates for problem.max_tokens_per_rank tokens per rank.
  // `weights` (this rank's, in problem.recipe, fp8 or bf16) must outlive this object.
  UnfusedBaseline(Communicator& comm, const Problem& problem, const LayerWeights& weights);
  ~UnfusedBaseline();
  UnfusedBaseline(const UnfusedBaseline&) = delete;
  UnfusedBaseline& operator=(const UnfusedBaseline&) = delete;

  // y [inputs.num_tokens, hidden] BF16 = the layer of `inputs`, issued on `stream`; every rank of the
  // group calls it for the same layer. Returns once the host has issued every step (it waits for the
  // stream once, for the counts, and does not wait for the rest).
  void run(const LayerInputs& inputs, const TensorView& y, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::bench
