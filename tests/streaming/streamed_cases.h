// Shared by the streamed-layer tests (streamed_layer_gpu_test: emulated ranks on one GPU;
// streamed_process_test: one process and NCCL rank per GPU): one rank's batch and streamed calls on
// the same producer inputs, and the comparison of their outputs token by token.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/problem.h"
#include "megamoe/router.h"

namespace megamoe::streamed_test {

using testing::DeviceBuffer;

constexpr int32_t kHidden = 512;
constexpr int32_t kExperts = 32;
constexpr int32_t kTopK = 4;
constexpr int32_t kMaxTokens = 40;

// How the ring cuts a call: chunks of `tokens_per_slot` (kMaxTokens: one chunk per rank and call), in
// the slots of two calls (front_ring_shape): with fewer, a call's producers may wait for the previous
// call's readers on other ranks, which emulated ranks, sharing one GPU's SMs, cannot always run.
struct Chunking {
  int32_t tokens_per_slot = kMaxTokens;
  bool chunked() const { return tokens_per_slot < kMaxTokens; }
};
constexpr Chunking kChunksOf16{16};

// One rank's call: its producers' inputs, the batch producers' outputs, and both calls' outputs.
// combined: the router's logits come from router_logits on the rank's router weight, and the streamed
// call is streamed_mega_moe (producers and layer launched together) in `form`, given `uniform_tokens`
// (its batch form's routes go to topk_idx, which the batch call has finished with); else the logits
// are random and the streamed call is the producers into the ring, then mega_moe with
// CallOptions::streamed.
struct Call {
  int32_t tokens;
  int32_t top_k;
  bool combined;
  CallForm form = CallForm::streamed;
  int64_t uniform_tokens = 0;
  DeviceBuffer<uint16_t> x;  // bf16 [tokens][hidden]
  DeviceBuffer<float> logits;
  DeviceBuffer<int32_t> topk_idx;
  DeviceBuffer<float> topk_weights, x_scales;
  DeviceBuffer<uint8_t> x_fp8;
  DeviceBuffer<uint16_t> y_batch, y_streamed;
  Call(uint64_t seed, int32_t call, int32_t rank, int32_t tokens_, int32_t top_k_ = kTopK)
      : tokens(tokens_), top_k(top_k_), combined(call % 2 == 1), x(size_t(tokens_) * kHidden + 1),
        logits(size_t(tokens_) * kExperts + 1), topk_idx(size_t(tokens_) * top_k_ + 1),
        topk_weights(size_t(tokens_) * top_k_ + 1),
        x_scales(size_t(tokens_) * (kHidden / 128) + 1), x_fp8(size_t(tokens_) * kHidden + 1),
        y_batch(size_t(tokens_) * kHidden + 1), y_streamed(size_t(tokens_) * kHidden + 1) {
    std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(call) << 20) ^ (static_cast<uint64_t>(rank) << 40));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> host_x(size_t(tokens) * kHidden + 1);
    for (uint16_t& v : host_x) v = float_to_bf16(normal(rng));
    std::vector<float> host_logits(size_t(tokens) * kExperts + 1);
    for (float& v : host_logits) v = 2.0f * normal(rng);
    x.upload(host_x);
    logits.upload(host_logits);
    y_streamed.fill_bytes(0xFF);  // NaN: an element the streamed call does not write fails the check
  }
};

// How late each part of a rank's streamed call starts (ns): the route producer, the layout producer,
// the layer. A combined call (streamed_mega_moe) launches them together: only `route` applies.
struct Lateness {
  uint64_t route = 0, layout = 0, layer = 0;
};

Problem streamed_problem(int32_t ranks, int32_t rank, Recipe recipe, int32_t top_k = kTopK, Chunking chunking = {});

// The softmax router with top_k 4 (the default) or 8.
const RouterConfig& router(int32_t top_k = kTopK);

TensorView view_of(void* data, DType dtype, std::initializer_list<int64_t> shape);

// Tokens of `rank` in call `call`: full, partial, one, none. In chunks, a fixed order in which rank
// 0's third call (33, 17, then 40 tokens) takes slots past the ring's last one and on from its first,
// in chunks of 16 (6 slots) and of 7 (12 slots).
int32_t call_tokens(uint64_t seed, int32_t call, int32_t rank, Chunking chunking);

// Whether some call of `tokens` (in order, from sequence 0) takes slots past the ring's last one.
bool some_call_wraps(const Problem& p, const std::vector<int32_t>& tokens);

// A rank's router weight: [experts][hidden] bf16, logits of about unit spread.
DeviceBuffer<uint16_t> make_router_weight(uint64_t seed, int32_t rank);

// The batch call: the producers into tensors, then the layer on them.
void run_batch(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight, Call& c,
               cudaStream_t stream);

// The batch call's layer alone, on c's inputs as run_batch's producers left them.
void run_batch_layer(SymmBuffer& buffer, const LayerWeights& weights, Call& c, cudaStream_t stream);

// Random lateness: each part late by up to 200 us half of the time.
Lateness random_lateness(uint64_t seed, int32_t call, int32_t rank);

// The layer alone on `tokens` tokens of what this rank's producers published (CallOptions::streamed).
void run_streamed_layer(SymmBuffer& buffer, const LayerWeights& weights, Call& c, int32_t tokens, cudaStream_t stream);

// The streamed call: the producers into the buffer's front ring, then the layer reading it, each part
// starting as late as `late` says.
void run_streamed(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight,
                  Call& c, cudaStream_t stream, const Lateness& late = {});

// After a failed call: the batch call on c's inputs and its streamed twin agree token by token.
void expect_exact_after(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight,
                        Call& c, cudaStream_t stream, const std::string& when);

// A streamed call, then a batch call with an out-of-range expert id on rank 0 (an input error: only
// rank 0 reports it), then a streamed call that must match its batch twin on every rank: an input
// error leaves the front ring in step.
void input_error_then_streamed(Communicator& comm, uint64_t seed);

// streamed_mega_moe in each form (streamed, batch, automatic with and without uniform_tokens) against
// the batch call, every rank giving a call the same form, in a buffer whose max_tokens_per_rank is
// past kStreamedCallsUpToTokens (so that automatic picks batch when uniform_tokens is 0).
void forms_against_batch(Communicator& comm, uint64_t seed);

// Every rank runs kCalls calls, each as a batch call and then as a streamed call (every other one
// through streamed_mega_moe), enqueued back to back; then each streamed output is checked against
// its batch twin (throws after a failure). late: every batch call first, then the streamed calls back
// to back with random lateness on every rank (chunks published long before or after their readers
// start, ranks a call apart; a ring of two calls' slots never makes a producer wait for a slot,
// front_ring_gpu_test does).
void streamed_against_batch(Communicator& comm, Recipe recipe, uint64_t seed, int32_t top_k = kTopK,
                            bool late = false, Chunking chunking = {});

// Checks each call's streamed output against its batch twin, token by token, once the stream's work is
// done (throws after a failure).
void expect_streamed_match_batch(Communicator& comm, SymmBuffer& buffer,
                                 const std::vector<std::unique_ptr<Call>>& calls, Recipe recipe, uint64_t seed,
                                 Chunking chunking);

// Rank 0 has no tokens in the first call, and every other rank's streamed layer of that call starts
// 20 ms late. Rank 0's call has no combine unit to wait for the others, so it ends first; its next
// (batch) call's sends must still wait for the peers' call to end before writing their route tables
// and counts, which a peer's streamed call, still to run, writes too. Then a call of 17 tokens
// everywhere, batch and streamed, whose outputs must agree.
void empty_rank_ahead_of_its_peers(Communicator& comm, uint64_t seed);

}  // namespace megamoe::streamed_test
