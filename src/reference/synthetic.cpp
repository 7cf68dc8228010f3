#include "megamoe/synthetic.h"

#include <cmath>
#include <string>

#include "megamoe/error.h"
#include "reference/e4m3_table.h"

namespace megamoe {

namespace {

// Streams of the rank batches (host only; the weights' streams are in the header).
enum class BatchStream : uint32_t { x = 0, x_token_scale = 1, routing = 2, mask = 3, route_weight = 4 };

uint64_t batch_stream(int32_t rank, BatchStream kind) {
  return (2ull << 56) | (static_cast<uint64_t>(static_cast<uint32_t>(rank)) << 8) | static_cast<uint32_t>(kind);
}

// The zipf expert order is shared by all ranks, so the same experts are hot everywhere.
constexpr uint64_t kZipfOrderStream = 3ull << 56;
constexpr double kZipfExponent = 1.1;

// Sequential draws from one stream.
class Draws {
 public:
  Draws(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}
  uint64_t bits() { return synthetic_bits(seed_, stream_, next_++); }
  double unit() { return static_cast<double>(bits() >> 11) * 0x1p-53; }  // [0, 1)

 private:
  uint64_t seed_;
  uint64_t stream_;
  uint64_t next_ = 0;
};

// One matrix [rows][cols] in the recipe's canonical stored format.
void generate_matrix(Recipe recipe, uint64_t seed, uint64_t rows, uint64_t cols, int32_t fan_in,
                     uint64_t values_stream, uint64_t scales_stream, std::vector<uint8_t>& codes,
                     std::vector<float>& block_scales, std::vector<uint8_t>& mx_scales) {
  const float range = synthetic_weight_range(fan_in);
  const uint64_t count = rows * cols;
  switch (recipe) {
    case Recipe::fp8: {
      // synthetic_e4m3_code, with the stream's key and the conversion's table taken out of the loop.
      codes.resize(count);
      const E4m3Table& e4m3 = E4m3Table::instance();
      const uint64_t key = mix64(mix64(seed + kGoldenGamma) ^ values_stream);
      for (uint64_t i = 0; i < count; ++i) {
        const uint64_t bits = mix64(key + (i + 1) * kGoldenGamma);
        codes[i] = e4m3(uniform_from_24_bits(static_cast<uint32_t>(bits >> 40)) * kE4M3Max);
      }
      block_scales.resize((rows / kScaleBlock) * (cols / kScaleBlock));
      for (uint64_t b = 0; b < block_scales.size(); ++b) {
        block_scales[b] = synthetic_fp8_block_scale(seed, scales_stream, b, range);
      }
      break;
    }
    case Recipe::fp8_fp4: {
      codes.resize(count / 2);
      for (uint64_t p = 0; p < count / 2; ++p) codes[p] = synthetic_e2m1_pair(seed, values_stream, p);
      mx_scales.resize(count / kMxBlock);
      for (uint64_t g = 0; g < mx_scales.size(); ++g) {
        mx_scales[g] = synthetic_ue8m0_scale(seed, scales_stream, g, range);
      }
      break;
    }
    case Recipe::bf16: {
      codes.resize(2 * count);
      for (uint64_t i = 0; i < count; ++i) {
        const uint16_t bits = synthetic_bf16(seed, values_stream, i, range);
        codes[2 * i] = static_cast<uint8_t>(bits & 0xFF);
        codes[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
      }
      break;
    }
  }
}

// Expert ids in zipf popularity order: a Fisher-Yates shuffle of 0..n-1 keyed by the seed.
std::vector<int32_t> zipf_order(int32_t num_experts, uint64_t seed) {
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  for (int32_t e = 0; e < num_experts; ++e) order[static_cast<size_t>(e)] = e;
  Draws draws(seed, kZipfOrderStream);
  for (int32_t i = num_experts - 1; i > 0; --i) {
    const auto j = static_cast<int32_t>(draws.bits() % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

// Draws `count` distinct experts, each with probability proportional to its popularity among
// those not drawn yet. `taken` must be all false on entry and is all false again on return.
void draw_distinct(const std::vector<double>& popularity, double total, int32_t count, Draws& draws,
                   std::vector<bool>& taken, int32_t* out) {
  double remaining = total;
  for (int32_t k = 0; k < count; ++k) {
    const double target = draws.unit() * remaining;
    double cumulative = 0.0;
    int32_t pick = -1;
    for (size_t e = 0; e < popularity.size(); ++e) {
      if (taken[e]) continue;
      pick = static_cast<int32_t>(e);  // the last candidate also absorbs rounding at the top end
      cumulative += popularity[e];
      if (target < cumulative) break;
    }
    out[k] = pick;
    taken[static_cast<size_t>(pick)] = true;
    remaining -= popularity[static_cast<size_t>(pick)];
  }
  for (int32_t k = 0; k < count; ++k) taken[static_cast<size_t>(out[k])] = false;
}

void generate_x(const Problem& p, int32_t rank, uint64_t seed, RankBatch& batch) {
  const uint64_t hidden = static_cast<uint64_t>(p.hidden);
  const uint64_t tokens = static_cast<uint64_t>(batch.num_tokens);
  // Values u * sqrt(3) * f: standard deviation ~f, with a per-token factor f in [0.5, 2) so the
  // activation scales differ from token to token.
  std::vector<float> row(hidden);
  if (p.recipe == Recipe::bf16) {
    batch.x.resize(2 * tokens * hidden);
  } else {
    batch.x.resize(tokens * hidden);
    batch.x_scales.resize(tokens * (hidden / kScaleBlock));
  }
  for (uint64_t t = 0; t < tokens; ++t) {
    const float factor =
        0.5f + 0.75f * (1.0f + synthetic_uniform(seed, batch_stream(rank, BatchStream::x_token_scale), t));
    for (uint64_t h = 0; h < hidden; ++h) {
      row[h] = synthetic_uniform(seed, batch_stream(rank, BatchStream::x), t * hidden + h) * 1.7320508f * factor;
    }
    if (p.recipe == Recipe::bf16) {
      for (uint64_t h = 0; h < hidden; ++h) {
        const uint16_t bits = float_to_bf16(row[h]);
        batch.x[2 * (t * hidden + h)] = static_cast<uint8_t>(bits & 0xFF);
        batch.x[2 * (t * hidden + h) + 1] = static_cast<uint8_t>(bits >> 8);
      }
      continue;
    }
    for (uint64_t block = 0; block < hidden / kScaleBlock; ++block) {
      const float* values = row.data() + block * kScaleBlock;
      float amax = 0.0f;
      for (int c = 0; c < kScaleBlock; ++c) amax = std::fmax(amax, std::fabs(values[c]));
      const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
      batch.x_scales[t * (hidden / kScaleBlock) + block] = quantizer.scale;
      uint8_t* codes = batch.x.data() + t * hidden + block * kScaleBlock;
      for (int c = 0; c < kScaleBlock; ++c) codes[c] = quantizer.quantize(values[c]);
    }
  }
}

void generate_routes(const Problem& p, int32_t rank, Routing routing, uint64_t seed, float masked_fraction,
                     const std::vector<double>& popularity, double total_popularity, RankBatch& batch) {
  const int32_t top_k = p.top_k;
  const size_t routes = static_cast<size_t>(batch.num_tokens) * static_cast<size_t>(top_k);
  batch.topk_idx.assign(routes, -1);
  batch.topk_weights.assign(routes, 0.0f);
  Draws expert_draws(seed, batch_stream(rank, BatchStream::routing));
  Draws mask_draws(seed, batch_stream(rank, BatchStream::mask));
  Draws weight_draws(seed, batch_stream(rank, BatchStream::route_weight));
  std::vector<bool> taken(static_cast<size_t>(p.num_experts), false);
  for (int32_t t = 0; t < batch.num_tokens; ++t) {
    int32_t* ids = batch.topk_idx.data() + static_cast<size_t>(t) * top_k;
    float* weights = batch.topk_weights.data() + static_cast<size_t>(t) * top_k;
    if (routing == Routing::one_expert) {
      ids[0] = 0;
      taken[0] = true;
      draw_distinct(popularity, total_popularity - popularity[0], top_k - 1, expert_draws, taken, ids + 1);
      taken[0] = false;
    } else {
      draw_distinct(popularity, total_popularity, top_k, expert_draws, taken, ids);
    }
    float sum = 0.0f;
    for (int32_t k = 0; k < top_k; ++k) {
      const bool masked = mask_draws.unit() < static_cast<double>(masked_fraction);
      const float raw = 0.5f + static_cast<float>(weight_draws.unit());
      if (masked) {
        ids[k] = -1;
      } else {
        weights[k] = raw;
        sum += raw;
      }
    }
    for (int32_t k = 0; k < top_k; ++k) {
      if (ids[k] >= 0) weights[k] /= sum;
    }
  }
}

}  // namespace

SyntheticWeights::SyntheticWeights(const Problem& problem, uint64_t seed) : problem_(problem), seed_(seed) {
  validate(problem);
}

StoredExpert SyntheticWeights::routed_expert(int32_t global_expert) const {
  require(global_expert >= 0 && global_expert < problem_.num_experts, "global_expert", "must be in [0, ",
          problem_.num_experts, "), got ", global_expert);
  return generate(false, global_expert);
}

StoredExpert SyntheticWeights::shared_expert(int32_t index) const {
  require(index >= 0 && index < problem_.num_shared_experts, "index", "must be in [0, num_shared_experts = ",
          problem_.num_shared_experts, "), got ", index);
  return generate(true, index);
}

StoredExpert SyntheticWeights::generate(bool shared, int32_t index) const {
  auto stream = [shared, index](WeightMatrix matrix) {
    return shared ? shared_weight_stream(index, matrix) : routed_weight_stream(index, matrix);
  };
  const uint64_t hidden = static_cast<uint64_t>(problem_.hidden);
  const uint64_t intermediate = static_cast<uint64_t>(problem_.intermediate);
  StoredExpert out;
  out.hidden = problem_.hidden;
  out.intermediate = problem_.intermediate;
  generate_matrix(problem_.recipe, seed_, 2 * intermediate, hidden, problem_.hidden, stream(WeightMatrix::w1),
                  stream(WeightMatrix::w1_scales), out.w1, out.w1_scales, out.w1_mx_scales);
  generate_matrix(problem_.recipe, seed_, hidden, intermediate, problem_.intermediate, stream(WeightMatrix::w2),
                  stream(WeightMatrix::w2_scales), out.w2, out.w2_scales, out.w2_mx_scales);
  return out;
}

std::string_view to_string(Routing routing) {
  switch (routing) {
    case Routing::uniform: return "uniform";
    case Routing::zipf: return "zipf";
    case Routing::one_expert: return "one_expert";
  }
  return "?";
}

bool parse_routing(std::string_view text, Routing& routing) {
  for (Routing candidate : {Routing::uniform, Routing::zipf, Routing::one_expert}) {
    if (text == to_string(candidate)) {
      routing = candidate;
      return true;
    }
  }
  return false;
}

std::vector<RankBatch> synthetic_batches(const Problem& problem, const std::vector<int32_t>& tokens_per_rank,
                                         Routing routing, uint64_t seed, float masked_fraction) {
  validate(problem);
  require(tokens_per_rank.size() == static_cast<size_t>(problem.num_ranks), "tokens_per_rank",
          "must have one entry per rank (", problem.num_ranks, "), got ", tokens_per_rank.size());
  require(masked_fraction >= 0.0f && masked_fraction <= 1.0f, "masked_fraction", "must be in [0, 1], got ",
          masked_fraction);
  require(routing != Routing::one_expert || problem.top_k <= problem.num_experts, "routing",
          "one_expert needs top_k <= num_experts");

  // Popularity of each expert id: equal, or zipf over the shuffled order.
  std::vector<double> popularity(static_cast<size_t>(problem.num_experts), 1.0);
  if (routing == Routing::zipf) {
    const std::vector<int32_t> order = zipf_order(problem.num_experts, seed);
    for (size_t position = 0; position < order.size(); ++position) {
      popularity[static_cast<size_t>(order[position])] = std::pow(static_cast<double>(position + 1), -kZipfExponent);
    }
  }
  double total_popularity = 0.0;
  for (double value : popularity) total_popularity += value;

  std::vector<RankBatch> batches(static_cast<size_t>(problem.num_ranks));
  for (int32_t rank = 0; rank < problem.num_ranks; ++rank) {
    const int32_t tokens = tokens_per_rank[static_cast<size_t>(rank)];
    require(tokens >= 0 && tokens <= problem.max_tokens_per_rank, "tokens_per_rank",
            "entry ", rank, " must be in [0, max_tokens_per_rank = ", problem.max_tokens_per_rank, "], got ", tokens);
    RankBatch& batch = batches[static_cast<size_t>(rank)];
    batch.num_tokens = tokens;
    generate_x(problem, rank, seed, batch);
    generate_routes(problem, rank, routing, seed, masked_fraction, popularity, total_popularity, batch);
  }
  return batches;
}

}  // namespace megamoe
