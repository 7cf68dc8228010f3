// The whole MoE layer on GPUs: inline dispatch, experts (L1 -> SwiGLU x route weight -> re-quantize
// -> L2), combine. One call per rank, on a CUDA stream; every rank of the group calls it for the
// same layer. No host synchronization and no allocation: a call can be captured in a CUDA graph and
// replayed with new inputs written to the same tensors.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/comm.h"
#include "megamoe/tensor.h"

namespace megamoe {

struct RouterConfig;

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
  // Fused schedule only: the call's inputs come from the buffer's front ring (docs/streaming.md), as
  // this call's producers published them (route_tokens and quantize_activations into the buffer,
  // megamoe/producers.h), not from LayerInputs, whose tensors stay empty; inputs.num_tokens is the
  // producers' token count. Each rank reads every rank's routes itself, so the call needs no count
  // exchange. A call runs in one wave (the buffer's wave must hold its max_tokens_per_rank), its
  // ranks' chunks read as they are published.
  bool streamed = false;
  // Optional, fused schedule only: an event log of the call, for seeing where its time goes
  // (tools/plot_trace.py). u8 [fused_trace_bytes(buffer)] on the device, read once the call is done.
  TensorView trace;
};

// One event of a fused call's log (CallOptions::trace), as the device writes it: CTA c's events
// are entries [c * kFusedTraceEventsPerCta, (c + 1) * kFusedTraceEventsPerCta), unused ones zero.
// Its producer logs each unit it claims (claimed) and each GEMM unit once what it reads is ready
// (ready); the math warps log each GEMM and combine unit they finish, the dispatch warps each send
// and pull unit (done). Steps inside a unit (kernels/fused: run_send, run_dispatch_pull, the producer's
// routed tables, the math warps' mainloop) say where its time went between those. A role that fills
// its share of the CTA's entries logs no more.
struct FusedTraceEvent {
  uint64_t ns;     // the GPU's global timer
  uint32_t unit;   // the call's unit number, in claim order
  uint8_t kind;    // 0 send, 1 pull, 2 shared L1, 3 routed L1, 4 routed L2, 5 shared L2, 6 combine, 8 route
  uint8_t what;    // 0 claimed, 1 ready, 2 done, 3 + i: step i inside the unit (tools/plot_trace.py)
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

// Streaming mode in one call (docs/streaming.md): this rank's producers, the router's logits
// (router_logits: x times router_weight into `logits`), its top-k (route_tokens) and the activations'
// quantization (quantize_activations), both published into `buffer`'s front ring, then the layer
// reading the ring (CallOptions::streamed, fused schedule). The layer's kernel is launched to start
// while the producers still run: it waits for their chunks through the ring, not for their kernels
// to end, which only this sequence of launches makes safe. Every argument is checked before any
// launch; the layer's limits are CallOptions::streamed's.
//
// `form` picks how the call runs (types.h): streamed as above; batch, the same producers writing the
// layer's inputs (this buffer's input regions, buffer_input_views, and `topk_idx`), then the fused
// layer on them, as an engine runs without streaming; automatic, whichever choose_call_form picks.
// Every rank must run a call in the same form: a streamed rank would wait for ring chunks that a
// batch rank never publishes, and time out naming the ring site. So the choice depends only on what
// every rank passes alike: the Problem and `uniform_tokens`.
struct StreamedCall {
  const RouterConfig* router = nullptr;  // the scoring and top-k (router.h)
  TensorView x;              // [num_tokens, hidden] bf16
  TensorView router_weight;  // [num_experts, hidden] bf16
  TensorView router_bias;    // [num_experts] f32 for sigmoid scoring, or empty (zero)
  TensorView logits;         // [num_tokens, num_experts] f32: scratch the router's logits go to
  CallForm form = CallForm::automatic;
  // The same on every rank: the most tokens any rank has in this call (an engine's padded batch size
  // or the largest count over its data-parallel ranks), at least this rank's; 0 means the problem's
  // max_tokens_per_rank. choose_call_form decides by it.
  int64_t uniform_tokens = 0;
  TensorView topk_idx;       // [num_tokens, top_k] i32: scratch for the batch form's routes (unless form is streamed)
  TensorView trace;          // optional: the fused layer's event log, as CallOptions::trace (a trace build)
};
void streamed_mega_moe(SymmBuffer& buffer, const StreamedCall& call, const LayerWeights& weights,
                       const TensorView& y, cudaStream_t stream, const TensorView& recv_stats = {});

// automatic's choice for a call of `uniform_tokens` (StreamedCall::uniform_tokens, 0 = the problem's
// max_tokens_per_rank): streamed up to kStreamedCallsUpToTokens tokens, batch above. 0 for now: on
// one H200 streamed calls took 1.04-1.32x the batch sequence's time at every size measured
// (bench/results/streaming-*-2026-12-05.json; docs/streaming.md, "When streaming pays").
inline constexpr int64_t kStreamedCallsUpToTokens = 0;
CallForm choose_call_form(const Problem& p, int64_t uniform_tokens);

namespace detail {
// The staged call's L1 and L2 launches alone, on the rows the previous call with the same inputs
// left in the buffer: the GEMM-only time of a one-wave call, for benchmarks (megamoe bench's
// gemm_only_us).
void expert_gemms(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, cudaStream_t stream);
}  // namespace detail

}  // namespace megamoe
