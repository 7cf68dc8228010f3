// What an engine runs on the GPU before the MoE layer, in batch mode: the activations' 1x128 FP8
// quantization (x and x_scales of LayerInputs) and the router: its logits and its choice of each
// token's experts and weights (topk_idx and topk_weights). Each matches its CPU reference
// (quantize_activations_host here, router_logits and route_tokens in router.h) and checks its
// arguments, naming them. In streaming mode (docs/streaming.md) route_tokens and quantize_activations
// publish the same outputs chunk by chunk into a SymmBuffer's front ring instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/router.h"
#include "megamoe/tensor.h"

namespace megamoe {

class SymmBuffer;

// x: [tokens, hidden] BF16, hidden a positive multiple of 128 -> x_out [tokens, hidden] E4M3 and
// x_scales [tokens, hidden / 128] f32: each 1x128 block by Fp8BlockQuantizer (formats.h) of its
// largest magnitude (NaN values do not count toward it and stay NaN).
void quantize_activations(const TensorView& x, const TensorView& x_out, const TensorView& x_scales,
                          cudaStream_t stream);
void quantize_activations_host(const uint16_t* x, int64_t tokens, int64_t hidden, uint8_t* x_out, float* x_scales);

// The device's router_logits (router.h): x [tokens, hidden] BF16 (hidden a multiple of 8), weight
// [num_experts, hidden] BF16 -> logits [tokens, num_experts] f32, FP32 sums on the tensor cores (their
// order differs from the reference's, so the last bits may).
void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits, cudaStream_t stream);

// The device's route_tokens (router.h): logits [tokens, num_experts] f32, bias [num_experts] f32
// (sigmoid scoring only; an empty view means zero) -> topk_idx [tokens, top_k] i32 and topk_weights
// [tokens, top_k] f32. One warp per token: at most kMaxRouterExperts experts and kMaxRouterGroups
// groups. Logits that are not finite give that token unspecified routes (the CPU reference throws).
inline constexpr int32_t kMaxRouterExperts = 1024;
inline constexpr int32_t kMaxRouterGroups = 32;
void route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias,
                  const TensorView& topk_idx, const TensorView& topk_weights, cudaStream_t stream);

// Streaming mode: this rank's next call's tokens published chunk by chunk into `buffer`'s front ring
// (its Problem has front_num_slots > 0 and a ring that holds the call), for a consumer to take while
// later chunks are produced (a streamed layer call, CallOptions::streamed, reads them). route_tokens
// writes each chunk's routes and its metadata (the route half), quantize_activations its activations,
// quantized for fp8 recipes and copied for bf16 (the layout half; with shared experts also into the
// buffer's x regions, where this rank's shared experts read them in a streamed call); config and x
// must match the buffer's Problem. Launch both on one stream, in either order, before the call that
// consumes them; a call with no tokens publishes one empty chunk.
// A producer that waits past the buffer's timeout for a slot's previous chunk to be acknowledged
// records a device error (kWaitFrontConsumed: slot, generation) that check_device_error reports.
void route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias, SymmBuffer& buffer,
                  cudaStream_t stream);
void quantize_activations(const TensorView& x, SymmBuffer& buffer, cudaStream_t stream);

}  // namespace megamoe
