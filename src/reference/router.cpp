#include "megamoe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "megamoe/config.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

// Indices of the `count` largest values, largest first; ties to the lower index.
std::vector<int32_t> largest(std::span<const float> values, int32_t count) {
  std::vector<int32_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int32_t a, int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  order.resize(static_cast<size_t>(count));
  return order;
}

}  // namespace

RouterConfig deepseek_v3_router() {
  RouterConfig config;
  config.num_experts = 256;
  config.top_k = 8;
  config.scoring = RouterScoring::sigmoid;
  config.num_groups = 8;
  config.topk_groups = 4;
  config.normalize = true;
  config.routed_scaling = 2.5f;
  return config;
}

RouterConfig softmax_router(int32_t num_experts, int32_t top_k, bool normalize) {
  RouterConfig config;
  config.num_experts = num_experts;
  config.top_k = top_k;
  config.normalize = normalize;
  return config;
}

void validate(const RouterConfig& c) {
  require(c.num_experts >= 1, "num_experts", "must be at least 1, got ", c.num_experts);
  require(c.top_k >= 1 && c.top_k <= std::min(c.num_experts, kMaxTopK), "top_k", "must be in [1, ",
          std::min(c.num_experts, kMaxTopK), "], got ", c.top_k);
  require(c.num_groups >= 1 && c.num_experts % c.num_groups == 0, "num_groups",
          "must divide num_experts (", c.num_experts, "), got ", c.num_groups);
  require(c.topk_groups >= 1 && c.topk_groups <= c.num_groups, "topk_groups", "must be in [1, num_groups = ",
          c.num_groups, "], got ", c.topk_groups);
  require(c.scoring == RouterScoring::sigmoid || c.num_groups == 1, "num_groups",
          "must be 1 with softmax scoring (groups are the sigmoid router's), got ", c.num_groups);
  const int32_t group_size = c.num_experts / c.num_groups;
  require(c.num_groups == 1 || group_size >= 2, "num_groups",
          "must leave at least two experts per group (a group scores its best two), got ", group_size);
  require(c.top_k <= c.topk_groups * group_size, "top_k", "must be at most the experts of the chosen groups (",
          c.topk_groups * group_size, "), got ", c.top_k);
  require(std::isfinite(c.routed_scaling) && c.routed_scaling > 0.0f, "routed_scaling",
          "must be positive and finite, got ", c.routed_scaling);
}

std::vector<float> router_logits(std::span<const uint16_t> x, std::span<const uint16_t> weight, int32_t tokens,
                                 int32_t hidden, int32_t num_experts) {
  require(tokens >= 0 && hidden >= 1 && num_experts >= 1, "router_logits", "needs tokens >= 0, hidden >= 1 and ",
          "num_experts >= 1, got ", tokens, ", ", hidden, ", ", num_experts);
  require(x.size() == static_cast<size_t>(tokens) * hidden, "x", "must hold tokens x hidden = ", tokens, " x ",
          hidden, " values, got ", x.size());
  require(weight.size() == static_cast<size_t>(num_experts) * hidden, "weight",
          "must hold num_experts x hidden = ", num_experts, " x ", hidden, " values, got ", weight.size());
  std::vector<float> logits(static_cast<size_t>(tokens) * num_experts);
  for (int32_t t = 0; t < tokens; ++t)
    for (int32_t e = 0; e < num_experts; ++e) {
      float sum = 0.0f;
      for (int32_t h = 0; h < hidden; ++h)
        sum += bf16_to_float(x[static_cast<size_t>(t) * hidden + h]) *
               bf16_to_float(weight[static_cast<size_t>(e) * hidden + h]);
      logits[static_cast<size_t>(t) * num_experts + e] = sum;
    }
  return logits;
}

void route_tokens(const RouterConfig& c, std::span<const float> logits, std::span<const float> bias, int32_t tokens,
                  std::span<int32_t> topk_idx, std::span<float> topk_weights) {
  validate(c);
  const size_t experts = static_cast<size_t>(c.num_experts);
  const size_t routes = static_cast<size_t>(tokens) * c.top_k;
  require(tokens >= 0 && logits.size() == static_cast<size_t>(tokens) * experts, "logits",
          "must hold tokens x num_experts = ", tokens, " x ", c.num_experts, " values, got ", logits.size());
  require(bias.empty() || bias.size() == experts, "bias", "must be empty or hold num_experts = ", c.num_experts,
          " values, got ", bias.size());
  require(bias.empty() || c.scoring == RouterScoring::sigmoid, "bias",
          "corrects the sigmoid router's choice only; softmax scoring takes none");
  require(topk_idx.size() == routes && topk_weights.size() == routes, "topk_idx",
          "and topk_weights must hold tokens x top_k = ", routes, " values, got ", topk_idx.size(), " and ",
          topk_weights.size());
  const int32_t group_size = c.num_experts / c.num_groups;
  std::vector<float> score(experts), choice(experts), group_score(static_cast<size_t>(c.num_groups));
  for (int32_t t = 0; t < tokens; ++t) {
    const std::span<const float> row = logits.subspan(static_cast<size_t>(t) * experts, experts);
    for (size_t e = 0; e < experts; ++e)
      require(std::isfinite(row[e]), "logits", "token ", t, ", expert ", e, ": ", row[e], " is not finite");
    if (c.scoring == RouterScoring::softmax) {
      const float top = *std::max_element(row.begin(), row.end());
      float total = 0.0f;
      for (size_t e = 0; e < experts; ++e) total += score[e] = std::exp(row[e] - top);
      for (size_t e = 0; e < experts; ++e) choice[e] = score[e] /= total;
    } else {
      for (size_t e = 0; e < experts; ++e) {
        score[e] = 1.0f / (1.0f + std::exp(-row[e]));
        choice[e] = score[e] + (bias.empty() ? 0.0f : bias[e]);
      }
      if (c.num_groups > 1) {
        for (int32_t g = 0; g < c.num_groups; ++g) {
          const std::span<const float> members(choice.data() + static_cast<size_t>(g) * group_size, group_size);
          const std::vector<int32_t> best = largest(members, 2);
          group_score[g] = members[best[0]] + members[best[1]];
        }
        std::vector<bool> kept(static_cast<size_t>(c.num_groups), false);
        for (int32_t g : largest(group_score, c.topk_groups)) kept[g] = true;
        for (size_t e = 0; e < experts; ++e)
          if (!kept[e / group_size]) choice[e] = -std::numeric_limits<float>::infinity();
      }
    }
    const std::vector<int32_t> chosen = largest(choice, c.top_k);
    float sum = 0.0f;
    for (int32_t e : chosen) sum += score[e];
    for (int32_t k = 0; k < c.top_k; ++k) {
      const size_t route = static_cast<size_t>(t) * c.top_k + k;
      topk_idx[route] = chosen[k];
      const float weight = c.normalize && sum > 0.0f ? score[chosen[k]] / sum : score[chosen[k]];
      topk_weights[route] = weight * c.routed_scaling;
    }
  }
}

}  // namespace megamoe
