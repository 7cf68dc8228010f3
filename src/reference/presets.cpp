#include "megamoe/presets.h"

#include <string>

#include "megamoe/error.h"

namespace megamoe {

const std::vector<Preset>& all_presets() {
  static const std::vector<Preset> presets = {
      {"tiny", 8, 2, 256, 256, 1, 2, 16, Recipe::fp8, "a small layer for tests and quick runs"},
      {"deepseek-v3", 256, 8, 7168, 2048, 1, 8, 128, Recipe::fp8,
       "DeepSeek-V3/R1 MoE layer: FP8 weights with 128x128 block scales; the router (sigmoid scores, group-limited "
       "top-k) is replaced by synthetic routing"},
      {"qwen3-235b-a22b", 128, 8, 4096, 1536, 0, 8, 128, Recipe::fp8,
       "Qwen3-235B-A22B MoE layer with the block-FP8 weights of its FP8 release"},
      {"gpt-oss-120b", 128, 4, 2944, 2944, 0, 8, 128, Recipe::fp8_fp4,
       "hidden and intermediate are 2880 in the model, padded to 2944 (23 x 128) because the kernels need "
       "multiples of 128; zero-padding real weights and activations is exact (padded channels contribute 0), "
       "synthetic weights fill all 2944. MXFP4 weights as the model ships them; its clamped SwiGLU and expert "
       "biases are not modeled"},
      {"mixtral-8x7b", 8, 2, 4096, 14336, 0, 8, 128, Recipe::bf16, "Mixtral-8x7B MoE layer in BF16"},
      {"deepseek-v4-flash", 256, 6, 4096, 2048, 1, 8, 128, Recipe::fp8_fp4,
       "DeepSeek-V4-Flash MoE layer (public config: n_routed_experts 256, num_experts_per_tok 6, hidden_size 4096, "
       "moe_intermediate_size 2048, n_shared_experts 1, swiglu_limit 10): MXFP4 routed experts, activation clamp "
       "10. The model's shared expert is block-FP8; here it runs in the routed experts' recipe. Its router "
       "(sqrtsoftplus scores, hash routing in the first layers) is replaced by synthetic routing",
       10.0f},
      {"deepseek-v4-pro", 384, 6, 7168, 3072, 1, 8, 128, Recipe::fp8_fp4,
       "DeepSeek-V4-Pro MoE layer (public config: n_routed_experts 384, num_experts_per_tok 6, hidden_size 7168, "
       "moe_intermediate_size 3072, n_shared_experts 1, swiglu_limit 10): MXFP4 routed experts, activation clamp "
       "10. The model's shared expert is block-FP8; here it runs in the routed experts' recipe. Its router is "
       "replaced by synthetic routing",
       10.0f},
  };
  return presets;
}

const Preset& find_preset(std::string_view name) {
  std::string valid;
  for (const Preset& preset : all_presets()) {
    if (preset.name == name) return preset;
    valid += valid.empty() ? "" : ", ";
    valid += preset.name;
  }
  throw Error(detail::concat("preset: unknown name '", name, "'; valid names are ", valid));
}

Problem preset_problem(const Preset& preset, int32_t num_ranks, int32_t max_tokens_per_rank) {
  Problem problem;
  problem.num_ranks = num_ranks;
  problem.rank = 0;
  problem.num_experts = preset.num_experts;
  problem.top_k = preset.top_k;
  problem.hidden = preset.hidden;
  problem.intermediate = preset.intermediate;
  problem.num_shared_experts = preset.num_shared_experts;
  problem.max_tokens_per_rank = max_tokens_per_rank;
  problem.recipe = preset.recipe;
  return problem;
}

}  // namespace megamoe
