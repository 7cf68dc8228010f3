// The whole MoE layer on GPUs: inline dispatch, experts (L1 -> SwiGLU x route weight -> re-quantize
// -> L2), combine. One call per rank, on a CUDA stream; every rank of the group calls it for the
// same layer. No host synchronization and no allocation: a call can be captured in a CUDA graph and
// replayed with new inputs written to the same tensors.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/comm.h"
#include "megamoe/tensor.h"

namespace megamoe {

// This rank's inputs for one call, in device memory. num_tokens may differ across ranks and may be 0.
struct LayerInputs {
  int32_t num_tokens = 0;
  TensorView x;             // [num_tokens, hidden]: e4m3 (fp8 and fp8_fp4 recipes) or bf16
  TensorView x_scales;      // [num_tokens, hidden / 128] f32 (fp8 and fp8_fp4 recipes)
  TensorView topk_idx;      // [num_tokens, top_k] i32: global expert ids, -1 = masked route
  TensorView topk_weights;  // [num_tokens, top_k] f32
  // Before SwiGLU, gate = min(gate, c) and up = clamp(up, -c, c) (megamoe/activation.h), routed and
  // shared experts alike. 0 or +infinity: no clamp; negative or NaN is an argument error.
  float activation_clamp = 0.0f;
};

// This rank's expert weights in the transformed layout (weights.h), in device memory.
//   fp8:     w* E4M3 [.., rows, cols], *_scales f32 per 64 rows x 128 columns.
//   fp8_fp4: w* packed E2M1 pairs (e2m1x2) [.., rows, cols / 2] with the sign bits of each 32-bit
//            word interleaved; *_scales f32 per 64 rows x 128 columns and *_shifts u8
//            [cols / 128, experts * rows, 4] derived from the UE8M0 scales (kernels/gemm/fp4_scales.h
//            prepares all three; DeviceWeights does it).
//   bf16:    w* BF16, no scales.
struct LayerWeights {
  TensorView w1;         // [experts_per_rank, 2I, hidden]
  TensorView w1_scales;  // [experts_per_rank, 2I / 64, hidden / 128] f32
  TensorView w1_shifts;  // fp8_fp4: [hidden / 128, experts_per_rank * 2I, 4] u8
  TensorView w2;         // [experts_per_rank, hidden, I]
  TensorView w2_scales;  // [experts_per_rank, hidden / 64, I / 128] f32
  TensorView w2_shifts;  // fp8_fp4: [I / 128, experts_per_rank * hidden, 4] u8
  // The shared experts concatenated into one (concat_shared_experts), when num_shared_experts > 0.
  TensorView shared_w1;         // [1, 2SI, hidden]
  TensorView shared_w1_scales;  // [1, 2SI / 64, hidden / 128]
  TensorView shared_w1_shifts;  // fp8_fp4: [hidden / 128, 2SI, 4]
  TensorView shared_w2;         // [1, hidden, SI]
  TensorView shared_w2_scales;  // [1, hidden / 64, SI / 128]
  TensorView shared_w2_shifts;  // fp8_fp4: [SI / 128, hidden, 4]
};

// Options of one call.
struct CallOptions {
  // staged: six launches in sequence; fused: one persistent launch (kernels/fused) in which dispatch,
  // both GEMMs and combine overlap. Both compute the same steps; their tile shapes (and split K,
  // staged only) may differ, which moves FP32 sums by rounding.
  Schedule schedule = Schedule::staged;
};

// Views of the buffer's own input regions: a caller that writes x, x_scales and topk_weights there
// saves the copy the layer otherwise makes (peers read these rows from this rank's buffer).
LayerInputs buffer_input_views(const SymmBuffer& buffer, int32_t num_tokens, const TensorView& topk_idx);

// y: [num_tokens, hidden] bf16. recv_stats (optional): [experts_per_rank] i64, to which each call adds
// the routes every local expert received (for expert-load balancing).
// Errors found on the device (an expert id outside [-1, num_experts), a stuck wait) are recorded in
// the buffer; SymmBuffer::check_device_error reports them.
void fp8_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                  cudaStream_t stream, const TensorView& recv_stats = {}, const CallOptions& options = {});
void fp8_fp4_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights,
                      const TensorView& y, cudaStream_t stream, const TensorView& recv_stats = {},
                      const CallOptions& options = {});
void bf16_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                   cudaStream_t stream, const TensorView& recv_stats = {}, const CallOptions& options = {});
// Whichever of the three the buffer's recipe calls for.
void mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
              cudaStream_t stream, const TensorView& recv_stats = {}, const CallOptions& options = {});

namespace detail {
// The staged call's L1 and L2 launches alone, on the rows the previous call with the same inputs
// left in the buffer: the GEMM-only time of a call, for benchmarks (megamoe bench's gemm_only_us).
void expert_gemms(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, cudaStream_t stream);
}  // namespace detail

}  // namespace megamoe
