// The description of one MoE layer and of this rank's place in it.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/config.h"
#include "megamoe/types.h"

namespace megamoe {

struct Problem {
  int32_t num_ranks = 1;
  int32_t rank = 0;
  int32_t num_experts = 0;          // routed experts over all ranks
  int32_t top_k = 0;                // routed choices per token
  int32_t hidden = 0;
  int32_t intermediate = 0;         // per expert; L1 produces 2 * intermediate (gate and up)
  int32_t num_shared_experts = 0;   // always-on experts computed on every rank for its own tokens
  int32_t max_tokens_per_rank = 0;  // the most tokens one call passes on a rank (fewer are fine)
  // Tokens per rank of one wave. The buffer's token-sized regions and its pools hold one wave, so a
  // smaller wave shrinks the buffer. A call runs waves_per_call(problem) waves one after the other on
  // its stream, wave w over tokens [w * W, (w + 1) * W) of every rank, each a whole dispatch, both
  // GEMMs and combine. Every rank runs every wave (a rank with fewer tokens runs empty ones), so each
  // wave past the first costs a call's fixed cost even when no rank has tokens for it.
  // 0 (the default): chosen from the buffer's size (tokens_per_wave in layout.h); at least
  // max_tokens_per_rank: one wave per call.
  int32_t wave_tokens = 0;
  // Routes this rank's expert pools hold per wave (rows received from all ranks). 0: the worst case,
  // every rank sending every token of a wave here, which any routing fits. A smaller capacity shrinks
  // the buffer (BufferLayout), and a wave whose routing sends some rank more is refused on every rank:
  // none of that wave's y is written, and check_device_error raises kDeviceCapacityExceeded.
  int64_t recv_capacity = 0;
  Recipe recipe = Recipe::fp8;
  // Streaming chunk-ready front ring (docs/streaming.md); zero slots means the batch-ready path only.
  int32_t front_num_slots = 0;
  int32_t front_tokens_per_slot = 0;

  MEGAMOE_HD int32_t experts_per_rank() const { return num_experts / num_ranks; }
  MEGAMOE_HD int32_t owner_rank(int32_t expert) const { return expert / experts_per_rank(); }
  MEGAMOE_HD int32_t local_expert(int32_t expert) const { return expert % experts_per_rank(); }
  // Combine slots per token: one per top-k choice plus one for the shared experts' sum.
  MEGAMOE_HD int32_t combine_slots() const { return top_k + 1; }
  // A token sends at most this many routes to one rank (its top-k ids are distinct).
  MEGAMOE_HD int32_t max_routes_per_token_to_rank() const {
    return top_k < experts_per_rank() ? top_k : experts_per_rank();
  }
};

// Throws megamoe::Error naming the field and the rule when the problem cannot be run.
void validate(const Problem& problem);

// A stable digest of everything that must agree across ranks (all fields but `rank`, plus the
// library version and the buffer size); ranks exchange it when they create a buffer.
uint64_t fingerprint(const Problem& problem);

std::string describe(const Problem& problem);

}  // namespace megamoe
