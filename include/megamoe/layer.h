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

// One linear of a group of experts in the transformed layout (weights.h), in device memory: W1
// [experts, 2I, hidden] or W2 [experts, hidden, I]. Each recipe reads its own fields; make one with
// the constructor of its recipe.
//   fp8:     values E4M3 [experts, rows, cols]; scales f32 [experts, rows / 64, cols / 128].
//   fp8_fp4: values packed E2M1 pairs (e2m1x2) [experts, rows, cols / 2] with the sign bits of each
//            32-bit word interleaved; scales as fp8; shifts u8 [cols / 128, experts * rows, 4] derived
//            from the UE8M0 scales (kernels/gemm/fp4_scales.h prepares all three; DeviceWeights does it).
//   bf16:    values BF16 [experts, rows, cols].
struct LinearWeights {
  TensorView values;
  TensorView scales;
  TensorView shifts;

  static LinearWeights fp8(const TensorView& e4m3, const TensorView& scales) { return {e4m3, scales, {}}; }
  static LinearWeights fp8_fp4(const TensorView& e2m1x2, const TensorView& scales, const TensorView& shifts) {
    return {e2m1x2, scales, shifts};
  }
  static LinearWeights bf16(const TensorView& bf16) { return {bf16, {}, {}}; }
};

// Both linears of a group of experts.
struct ExpertGroupWeights {
  LinearWeights w1;  // [experts, 2I, hidden]: gate and up, interleaved in 64-row blocks
  LinearWeights w2;  // [experts, hidden, I]
};

// This rank's expert weights.
struct LayerWeights {
  ExpertGroupWeights routed;  // the rank's experts_per_rank routed experts
  // The shared experts concatenated into one (concat_shared_experts: [1, 2SI, hidden] and
  // [1, hidden, SI]), when num_shared_experts > 0.
  ExpertGroupWeights shared;
};

// Options of one call.
struct CallOptions {
  CallOptions(Schedule schedule_ = Schedule::staged) : schedule(schedule_) {}  // implicit: a Schedule converts
  // staged: six launches in sequence; fused: one persistent launch (kernels/fused) in which dispatch,
  // both GEMMs and combine overlap. Both compute the same steps; their tile shapes and splits of K
  // may differ, which moves FP32 sums by rounding. Every rank of a call uses the same schedule.
  Schedule schedule = Schedule::staged;
  // Optional, fused schedule only: an event log of the call, for seeing where its time goes
  // (tools/plot_trace.py). u8 [fused_trace_bytes(buffer)] on the device, read once the call is done.
  TensorView trace;
};

// One event of a fused call's log (CallOptions::trace), as the device writes it: CTA c's events
// are entries [c * kFusedTraceEventsPerCta, (c + 1) * kFusedTraceEventsPerCta), unused ones zero.
// Its producer logs each unit it claims (claimed) and each GEMM unit once what it reads is ready
// (ready); the math warps log each GEMM and combine unit they finish, the dispatch warps each send
// and pull unit (done). A role that fills its share of the CTA's entries logs no more.
struct FusedTraceEvent {
  uint64_t ns;     // the GPU's global timer
  uint32_t unit;   // the call's unit number, in claim order
  uint8_t kind;    // 0 send, 1 pull, 2 shared L1, 3 routed L1, 4 routed L2, 5 shared L2, 6 combine
  uint8_t what;    // 0 claimed, 1 ready, 2 done
  uint16_t cta;
};
inline constexpr int64_t kFusedTraceEventsPerCta = 4096;
int64_t fused_trace_bytes(const SymmBuffer& buffer);
// Whether this build logs events (configured with -DMEGAMOE_FUSED_TRACE=ON; its fused kernels run
// slower). Without it a call given CallOptions::trace is refused.
bool fused_trace_compiled();

// Views of the buffer's own input regions: a caller that writes x, x_scales and topk_weights there
// saves the copy the layer otherwise makes (peers read these rows from this rank's buffer). They hold
// one wave: num_tokens is at most tokens_per_wave(buffer.problem()).
LayerInputs buffer_input_views(const SymmBuffer& buffer, int32_t num_tokens, const TensorView& topk_idx);

// y: [num_tokens, hidden] bf16. A call of more tokens than one wave (tokens_per_wave) runs its
// waves one after the other on `stream`. recv_stats (optional): [experts_per_rank] i64, to which each
// call adds the routes every local expert received (for expert-load balancing).
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
// left in the buffer: the GEMM-only time of a one-wave call, for benchmarks (megamoe bench's
// gemm_only_us).
void expert_gemms(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, cudaStream_t stream);
}  // namespace detail

}  // namespace megamoe
