// The router an engine runs before the MoE layer, as a CPU reference: logits = x · W_routerᵀ (BF16
// inputs, FP32 sums), scores, and each token's top-k expert ids and weights in the layout the layer
// takes (LayerInputs::topk_idx, topk_weights). The streaming route producer (docs/streaming.md,
// slice 4) is checked against it.
//
// Two scorings cover the presets:
//   - softmax (Qwen3, gpt-oss, Mixtral): p = softmax(logits); the top_k largest p; weights p, over
//     their sum when `normalize`.
//   - sigmoid (DeepSeek-V3/V4): s = sigmoid(logits); the choice uses s + bias (the load-balancing
//     correction), the weights s without it. Experts form num_groups equal groups; a group's score is
//     the sum of its two best s + bias; a token chooses among the experts of its topk_groups best
//     groups only. Weights s over their sum when `normalize`, then times routed_scaling.
// Ties go to the lower index, for groups and experts alike.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace megamoe {

enum class RouterScoring { softmax, sigmoid };

struct RouterConfig {
  int32_t num_experts = 0;
  int32_t top_k = 0;
  RouterScoring scoring = RouterScoring::softmax;
  int32_t num_groups = 1;   // sigmoid: the experts' equal groups
  int32_t topk_groups = 1;  // sigmoid: groups a token chooses among
  bool normalize = true;    // weights over their sum across the chosen experts
  float routed_scaling = 1.0f;
};

// DeepSeek-V3's router (256 experts, top-8 of 4 of 8 groups, normalized, x 2.5) and a softmax top-k one.
RouterConfig deepseek_v3_router();
RouterConfig softmax_router(int32_t num_experts, int32_t top_k, bool normalize);

// Throws megamoe::Error naming the field and the rule.
void validate(const RouterConfig& config);

// logits [tokens][num_experts] = x [tokens][hidden] · weight [num_experts][hidden]ᵀ, BF16 bits in,
// FP32 products summed in order.
std::vector<float> router_logits(std::span<const uint16_t> x, std::span<const uint16_t> weight, int32_t tokens,
                                 int32_t hidden, int32_t num_experts);

// topk_idx and topk_weights: [tokens][top_k], the chosen experts in decreasing order of their choice
// score. bias: [num_experts] (sigmoid only; empty means zero).
void route_tokens(const RouterConfig& config, std::span<const float> logits, std::span<const float> bias,
                  int32_t tokens, std::span<int32_t> topk_idx, std::span<float> topk_weights);

}  // namespace megamoe
