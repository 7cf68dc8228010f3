// What an engine runs on the GPU before the MoE layer, in batch mode: the activations' 1x128 FP8
// quantization (x and x_scales of LayerInputs) and the router: its logits and its choice of each
// token's experts and weights (topk_idx and topk_weights). Each matches its CPU reference
// (quantize_activations_host here, router_logits and route_tokens in router.h) and checks its
// arguments, naming them. The streaming mode
// (docs/streaming.md, slice 4) is to publish the same outputs chunk by chunk.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/router.h"
#include "megamoe/tensor.h"

namespace megamoe {

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

}  // namespace megamoe
