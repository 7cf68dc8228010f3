// Whole-layer test cases, each run once per rank by run_ranks (emulated ranks or processes) against
// the CPU reference computed before the ranks start, token by token (token_check.h). A failing rank
// throws megamoe::Error naming the rank, the case, what differed and the command that replays it
// (MEGAMOE_TEST_SEED); run_ranks prints it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"

namespace megamoe::layer_test {

struct LayerCase {
  std::string name;
  Recipe recipe = Recipe::fp8;
  int32_t num_experts = 8;
  int32_t top_k = 2;
  int32_t hidden = 256;
  int32_t intermediate = 256;
  int32_t num_shared_experts = 0;
  std::vector<int32_t> tokens_per_rank;  // its size is the number of ranks
  Routing routing = Routing::uniform;
  float masked_fraction = 0.0f;
  int32_t repeats = 1;      // calls on the same buffer; receive statistics must add up
  bool graph = false;       // capture one call in a CUDA graph, replay it with a second set of inputs
  int32_t bad_expert_rank = -1;  // this rank puts an out-of-range expert id in topk_idx
  // Back-to-back calls with changing sizes: each call takes the next of these token counts per rank
  // (its own inputs and output), cycling; every variant's last output is checked.
  std::vector<std::vector<int32_t>> size_variants;
  int32_t variant_calls = 0;
  // Rank 0 first launches, on another stream, a kernel that holds half the multiprocessors for a
  // while: the call must complete with the SMs it gets.
  bool hold_half_the_sms = false;
  // Every third token names its first choice's expert again in its second slot (a repeated expert is
  // valid: the token gets that expert's output once per slot, each weighted by its slot's weight).
  bool repeat_expert = false;
  // Up to four tokens per rank get NaN or infinity in x, x_scales or topk_weights. The contract: no
  // error, no hang, and every other token of every rank matches the reference.
  bool nonfinite_tokens = false;
  // This rank never calls the layer: the others' spin-waits must time out (set MEGAMOE_TIMEOUT_MS
  // short) and check_device_error must name it.
  int32_t absent_rank = -1;
  // This rank calls only after the others have timed out waiting for it (set MEGAMOE_TIMEOUT_MS
  // short): their calls broke. Each rank must then report an error or return the exact output; none
  // may return without an error and with results its peers never produced.
  int32_t late_rank = -1;
  // Problem::recv_capacity = the most routes any rank receives + this margin (unset: the worst case).
  // Below zero, the call must be refused on every rank (y untouched, an error naming the capacity),
  // and the next call, with fewer tokens, must be exact.
  std::optional<int32_t> capacity_margin;
  // Problem::wave_tokens: the buffer holds this many tokens per rank and a call runs in waves.
  int32_t wave_tokens = 0;
};

// Inputs and expected outputs of one case, built on the host before any rank starts.
struct CaseData {
  LayerCase c;
  Problem problem;  // rank 0's; each rank sets its own rank
  std::unique_ptr<SyntheticWeights> weights;
  std::vector<RankBatch> batches;         // the inputs of the (last) checked call
  ReferenceResult reference;
  std::vector<RankBatch> first_batches;   // graph cases: the inputs the graph was captured with
  std::vector<std::vector<uint32_t>> first_recv_counts;  // and the routes they send to each rank's experts
  std::vector<std::vector<RankBatch>> variant_batches;  // size_variants' inputs
  std::vector<ReferenceResult> variant_references;
  // nonfinite_tokens: per rank, [tokens], nonzero for a token whose inputs were made non-finite after
  // the reference was computed (not compared).
  std::vector<std::vector<uint8_t>> poisoned;
  uint64_t seed = 0;
  std::string replay;  // the command that runs this case again with this seed
  // capacity_margin < 0: the inputs and reference of the call after the refused one (half the tokens).
  std::vector<RankBatch> fitting_batches;
  ReferenceResult fitting_reference;
};

std::unique_ptr<CaseData> prepare(const LayerCase& c);

// The per-rank body: builds the buffer and weights, runs the calls, checks y and the statistics.
void run_rank(Communicator& comm, const CaseData& data, Schedule schedule);

}  // namespace megamoe::layer_test
