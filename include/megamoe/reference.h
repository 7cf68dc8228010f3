// The CPU reference backend: the whole layer for all ranks in one process, with the recipes'
// quantization steps, FP32 accumulation. It is the oracle of every GPU test and the `cpu` backend
// of the command-line tool.
//
// Per routed (token, k) with expert e = topk_idx[token][k] >= 0 and weight w = topk_weights[token][k]:
//   h      = W1[e] . x                      FP32 accumulation over dequantized x and W1
//   a[c]   = SiLU(h_gate[c]) * h_up[c] * w  for c < I, after the optional activation clamp
//            (activation.h: h_gate <= c, |h_up| <= c; routed and shared experts alike)
//   a'     = fp8: E4M3 with one FP32 scale per 1x128 channels (Fp8BlockQuantizer); bf16: BF16
//   o      = BF16(W2[e] . a')               written to combine slot k of the token
// Shared experts (concatenated into one MLP of S*I channels, route weight 1) write slot top_k.
//   y[token] = BF16(sum of the token's written slots, in FP32, slots in order 0..top_k)
// Masked routes (-1) write nothing and add nothing. An expert named in two slots of a token runs twice,
// once per slot with that slot's weight, and the token sums both.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megamoe/problem.h"
#include "megamoe/weights.h"

namespace megamoe {

// One rank's inputs in host memory.
struct RankBatch {
  int32_t num_tokens = 0;
  std::vector<uint8_t> x;           // [tokens][hidden]: E4M3 codes, or BF16 (2 bytes each, little endian)
  std::vector<float> x_scales;      // [tokens][hidden / 128], fp8 recipes
  std::vector<int32_t> topk_idx;    // [tokens][top_k], global expert ids, -1 = masked route
  std::vector<float> topk_weights;  // [tokens][top_k]
};

// Throws megamoe::Error naming the field and the rule: sizes, token count over max_tokens_per_rank,
// an expert id outside [-1, num_experts) (with its token and slot), more than max_tokens_per_rank
// routes to one expert (possible only when tokens repeat an expert: a repeated expert is valid, each
// slot is its own route with its own weight), a weight that is NaN or infinite, a non-positive or
// non-finite activation scale.
void validate_batch(const Problem& problem, const RankBatch& batch, int32_t rank);

// Supplies canonical stored weights on demand, so large models need not be resident at once.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual StoredExpert routed_expert(int32_t global_expert) const = 0;
  virtual StoredExpert shared_expert(int32_t index) const = 0;
};

struct ReferenceResult {
  std::vector<std::vector<uint16_t>> y;            // per rank: [tokens][hidden] BF16
  std::vector<std::vector<uint32_t>> recv_counts;  // per rank: routes received by each local expert
  // With ReferenceOptions::keep_slots, per rank: [tokens][top_k + 1][hidden] BF16, each combine slot
  // (the routes, then the shared experts) as summed into y, 0 where nothing was written.
  std::vector<std::vector<uint16_t>> slots;
};

struct ReferenceOptions {
  int threads = 0;  // 0: all hardware threads
  // Called now and then from one thread with (experts done, experts to do).
  std::function<void(int64_t, int64_t)> progress;
  // When set, only these tokens' outputs are computed, per rank (a GPU run checked on a sample);
  // the outputs of other tokens are left as 0 and the receive counts are still exact.
  const std::vector<std::vector<int32_t>>* token_subset = nullptr;
  // Before SwiGLU, as LayerInputs::activation_clamp: 0 or +infinity is no clamp; negative or NaN is
  // an argument error.
  float activation_clamp = 0.0f;
  bool keep_slots = false;  // fill ReferenceResult::slots (what each route added to y)
};

// `problem.rank` is ignored: all ranks are computed. batches.size() must equal num_ranks.
ReferenceResult reference_moe(const Problem& problem, const std::vector<RankBatch>& batches,
                              const WeightSource& weights, const ReferenceOptions& options = {});

}  // namespace megamoe
