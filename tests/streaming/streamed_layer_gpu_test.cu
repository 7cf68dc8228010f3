// The fused layer reading its inputs from the front ring (CallOptions::streamed, docs/streaming.md):
// on every rank its output matches the same layer's on the batch producers' outputs (the same router,
// top-k and quantization written to tensors), token by token within the recipe's noise, over calls
// that alternate batch and streamed on one buffer (the ring's slots reused, the consumer cursors and
// the barrier epochs carried across calls), with uneven and empty ranks, a call in one chunk or in
// several (a final partial chunk; a call's chunks wrapping around the ring's end). Bad uses are
// refused naming the argument; a call whose producers never published times out naming the ring's
// wait; a chunk out of step with its call is a device error naming it.
#include <cuda/ptx>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/scoped_env.h"
#include "device_buffer.h"
#include "gpu_test_util.h"
#include "layer/sm_holder.h"
#include "megamoe/comm.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/producers.h"
#include "megamoe/router.h"
#include "megamoe/streaming.h"
#include "megamoe/token_check.h"
#include "streaming/streamed_cases.h"
#include "test_seed.h"

namespace megamoe {
namespace {

using namespace streamed_test;

class StreamedLayerRanks : public ::testing::TestWithParam<int> {};

TEST_P(StreamedLayerRanks, MatchesTheBatchCallFp8) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(GetParam(), LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::fp8, seed); }),
            0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, StreamedLayerRanks, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "_ranks";
                         });

TEST(StreamedLayerRecipes, MatchesTheBatchCallBf16AndFp8Fp4) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  for (const Recipe recipe : {Recipe::bf16, Recipe::fp8_fp4}) {
    EXPECT_EQ(run_ranks(2, LaunchMode::emulated, [&](Communicator& c) { streamed_against_batch(c, recipe, seed); }), 0)
        << to_string(recipe);
  }
}

TEST(StreamedLayerTopK, EightChoicesPerToken) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(2, LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::fp8, seed, 8); }),
            0);
}

// A rank with no tokens ends a call before its peers, but its next call writes nothing into them until
// they have ended this one (a race that showed as wrong outputs in a few percent of
// MatchesTheBatchCallFp8 runs; a late peer makes it certain here).
TEST(StreamedLayerFailures, AnEmptyRankWaitsForItsPeers) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  for (const int ranks : {2, 4})
    EXPECT_EQ(run_ranks(ranks, LaunchMode::emulated, [&](Communicator& c) { empty_rank_ahead_of_its_peers(c, seed); }),
              0)
        << ranks << " ranks";
}

// An input error (an expert id past the last, in a batch call on rank 0) leaves the front ring in step
// on every rank: check_device_error resets the ring only after an error that broke the call.
TEST(StreamedLayerFailures, InputErrorLeavesTheRingInStep) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(2, LaunchMode::emulated, [&](Communicator& c) { input_error_then_streamed(c, seed); }), 0);
}

// streamed_mega_moe's forms (streamed, batch, automatic picking either) interleaved on one buffer.
TEST(StreamedLayerForms, EveryFormMatchesTheBatchCall) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  for (const int ranks : {1, 2})
    EXPECT_EQ(run_ranks(ranks, LaunchMode::emulated, [&](Communicator& c) { forms_against_batch(c, seed); }), 0)
        << ranks << " ranks";
}

// Producers and layers late by random times on every rank, streamed calls back to back: a rank's
// layer may start long before a peer publishes, or a rank publish its next call while peers still
// read the previous one.
TEST(StreamedLayerLateness, RandomlyLateProducersAndLayers) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(4, LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::fp8, seed, kTopK, true); }),
            0);
}

// Calls in several chunks: the route units read each chunk as it is published, the pulls and the
// send units follow the call's rows around the ring's end.
class StreamedLayerChunks : public ::testing::TestWithParam<int> {};

TEST_P(StreamedLayerChunks, MatchesTheBatchCallFp8) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(GetParam(), LaunchMode::emulated,
                      [&](Communicator& c) {
                        streamed_against_batch(c, Recipe::fp8, seed, kTopK, false, kChunksOf16);
                      }),
            0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, StreamedLayerChunks, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "_ranks";
                         });

// Chunks of 7 tokens in 12 slots (a call of 40: five chunks of 7 and one of 5) for bf16 (no scales),
// chunks of 16 for fp8_fp4 and top-8, and randomly late producers and layers with chunks of 16.
TEST(StreamedLayerChunkedRecipes, Bf16Fp8Fp4TopKAndLateness) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(2, LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::bf16, seed, kTopK, false, {7}); }),
            0)
      << "bf16";
  EXPECT_EQ(run_ranks(2, LaunchMode::emulated, [&](Communicator& c) {
              streamed_against_batch(c, Recipe::fp8_fp4, seed, kTopK, false, kChunksOf16);
            }),
            0)
      << "fp8_fp4";
  EXPECT_EQ(run_ranks(2, LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::fp8, seed, 8, false, kChunksOf16); }),
            0)
      << "top-8";
  EXPECT_EQ(run_ranks(4, LaunchMode::emulated,
                      [&](Communicator& c) { streamed_against_batch(c, Recipe::fp8, seed, kTopK, true, kChunksOf16); }),
            0)
      << "late";
}

// streamed_mega_moe captured once in a CUDA graph and replayed with new inputs written to the same
// tensors: every replay reads its own chunks (the cursors are in memory, the ring's slots wrap) and
// matches a batch call on the same inputs; in one chunk per call and in chunks of 12 (three per call
// in 8 slots: the third replay's chunks take slots 6, 7 and 0).
void replay_streamed_call(uint64_t seed, Chunking chunking) {
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    const Problem p = streamed_problem(1, 0, Recipe::fp8, kTopK, chunking);
    SymmBuffer buffer(comm, p);
    const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
    const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, 0);
    constexpr int32_t kTokens = 33;
    Call captured(seed, 1, 0, kTokens);  // combined: run_streamed calls streamed_mega_moe
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    testing::cuda_check(cudaStreamBeginCapture(comm.stream(), cudaStreamCaptureModeThreadLocal), "capture");
    run_streamed(buffer, weights->view(), router_weight, captured, comm.stream());
    testing::cuda_check(cudaStreamEndCapture(comm.stream(), &graph), "end capture");
    testing::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int32_t replay = 0; replay < 5; ++replay) {
      Call fresh(seed + 100 + static_cast<uint64_t>(replay), 1, 0, kTokens);  // new x, the same shapes
      // In the stream's order: D2D copies and memsets on the legacy stream may still run when a
      // non-blocking stream's replay starts.
      testing::cuda_check(cudaMemcpyAsync(captured.x.get(), fresh.x.get(), fresh.x.size() * 2,
                                          cudaMemcpyDeviceToDevice, comm.stream()),
                          "new x");
      captured.y_streamed.fill_bytes(0xFF, comm.stream());
      testing::cuda_check(cudaGraphLaunch(exec, comm.stream()), "replay");
      run_batch(buffer, weights->view(), router_weight, fresh, comm.stream());
      buffer.check_device_error(comm.stream());
      std::vector<uint16_t> want = fresh.y_batch.download(), got = captured.y_streamed.download();
      want.resize(size_t(kTokens) * kHidden);
      got.resize(size_t(kTokens) * kHidden);
      const TokenCheck check = check_tokens(got, want, kHidden, Recipe::fp8);
      EXPECT_TRUE(check.ok()) << "replay " << replay << ", slots of " << chunking.tokens_per_slot << ", seed " << seed
                              << ": " << check.first_failure;
    }
    uint64_t cursors[3] = {};
    testing::cuda_check(cudaMemcpy(cursors, buffer.local() + buffer.layout().front_ring.offset, sizeof(cursors),
                                   cudaMemcpyDeviceToHost),
                        "cursors");
    const uint64_t chunks = 5u * front_chunk_count(kTokens, static_cast<uint32_t>(p.front_tokens_per_slot));
    EXPECT_EQ(cursors[0], chunks) << "route producer's cursor";
    EXPECT_EQ(cursors[1], chunks) << "layout producer's cursor";
    EXPECT_EQ(cursors[2], chunks) << "consumer's cursor";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    if (::testing::Test::HasFailure()) throw std::runtime_error("replays differ");
  });
  EXPECT_EQ(failed, 0) << "slots of " << chunking.tokens_per_slot;
}

TEST(StreamedLayerGraph, ReplaysReadTheirOwnChunks) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  replay_streamed_call(seed, Chunking{});
  replay_streamed_call(seed, Chunking{12});
}

// One rank's fp8 layer on a buffer whose ring cuts calls as `chunking` does, with a short timeout, for
// the failure tests: body(comm, buffer, weights, router_weight, seed); `name` says what failed.
template <class Body>
void failure_case(Chunking chunking, const char* name, const Body& body) {
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  const uint64_t seed = testing::test_seed();
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    const Problem p = streamed_problem(1, 0, Recipe::fp8, kTopK, chunking);
    SymmBuffer buffer(comm, p);
    const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
    const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, 0);
    body(comm, buffer, weights->view(), router_weight, seed);
    if (::testing::Test::HasFailure()) throw std::runtime_error(name);
  });
  EXPECT_EQ(failed, 0) << name;
}

// A streamed call whose producers never published times out naming the ring's wait; after
// check_device_error a streamed call works again; a call that miscounts its tokens is refused on the
// device.
TEST(StreamedLayerTimeouts, UnpublishedInputsTimeOut) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  failure_case(Chunking{}, "timeout", [&](Communicator& comm, SymmBuffer& buffer, const LayerWeights& weights,
                                          const DeviceBuffer<uint16_t>& router_weight, uint64_t seed) {
    Call c(seed, 0, 0, 17);
    testing::cuda_check(cudaDeviceSynchronize(), "allocations");
    run_streamed_layer(buffer, weights, c, c.tokens, comm.stream());
    const std::string unpublished = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(unpublished.find("waiting for a front-ring slot's routes (expected value 1, saw 0)"), std::string::npos)
        << unpublished;
    expect_exact_after(buffer, weights, router_weight, c, comm.stream(),
                       "after the timeout, seed " + std::to_string(seed));

    // A call that says one token fewer than its producers published is a device error naming both.
    route_tokens(router(), view_of(c.logits.get(), DType::f32, {c.tokens, kExperts}), TensorView{}, buffer,
                 comm.stream());
    quantize_activations(view_of(c.x.get(), DType::bf16, {c.tokens, kHidden}), buffer, comm.stream());
    run_streamed_layer(buffer, weights, c, c.tokens - 1, comm.stream());
    const std::string miscounted = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(miscounted.find("a streamed call of 16 tokens found 17 in this rank's front ring"),
              std::string::npos)
        << miscounted;
  });
}

// A chunk whose metadata disagrees with its call's first chunk (here chunk 1 of a call of 33 tokens in
// chunks of 16, made to say it starts at token 20) is a device error naming the source, the chunk and
// both placements; after check_device_error the ring works again.
TEST(StreamedLayerTimeouts, ChunkOutOfStepIsNamed) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  failure_case(kChunksOf16, "out of step", [&](Communicator& comm, SymmBuffer& buffer, const LayerWeights& weights,
                                               const DeviceBuffer<uint16_t>& router_weight, uint64_t seed) {
    Call c(seed, 0, 0, 33);
    testing::cuda_check(cudaDeviceSynchronize(), "allocations");
    const int64_t t = c.tokens;
    route_tokens(router(), view_of(c.logits.get(), DType::f32, {t, kExperts}), TensorView{}, buffer, comm.stream());
    quantize_activations(view_of(c.x.get(), DType::bf16, {t, kHidden}), buffer, comm.stream());
    testing::cuda_check(cudaStreamSynchronize(comm.stream()), "producers");
    const FrontRingLayout ring = FrontRingLayout::make(buffer.problem());
    FrontSlotMeta* meta = ring.slot_meta(buffer.local() + buffer.layout().front_ring.offset, 1);
    const uint32_t token_base = 20;
    testing::cuda_check(cudaMemcpy(&meta->token_base, &token_base, sizeof(token_base), cudaMemcpyHostToDevice),
                        "meta");
    run_streamed_layer(buffer, weights, c, c.tokens, comm.stream());
    const std::string out_of_step = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(out_of_step.find("a streamed call read rank 0's front-ring chunk 1 as starting at token 20 of a call "
                               "of 33 tokens, where the call puts it at token 16 of 33"),
              std::string::npos)
        << out_of_step;
    expect_exact_after(buffer, weights, router_weight, c, comm.stream(),
                       "after the reset, seed " + std::to_string(seed));
  });
}

// An input error left unchecked, then a call that breaks (nothing published): both are reported, the
// failure first, and the ring is reset, which the input error's own record must not prevent.
TEST(StreamedLayerTimeouts, AnInputErrorDoesNotHideALaterFailure) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  failure_case(Chunking{}, "input error, then timeout", [&](Communicator& comm, SymmBuffer& buffer,
                                                             const LayerWeights& weights,
                                                             const DeviceBuffer<uint16_t>& router_weight, uint64_t seed) {
    Call bad(seed, 1, 0, 17), c(seed, 3, 0, 17);
    testing::cuda_check(cudaDeviceSynchronize(), "allocations");
    run_batch(buffer, weights, router_weight, bad, comm.stream());
    const int32_t past_last = kExperts + 5;
    testing::cuda_check(cudaMemcpyAsync(bad.topk_idx.get(), &past_last, sizeof(past_last), cudaMemcpyHostToDevice,
                                        comm.stream()),
                        "bad id");
    run_batch_layer(buffer, weights, bad, comm.stream());
    run_streamed_layer(buffer, weights, c, c.tokens, comm.stream());  // nothing published: it times out
    const std::string both = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(both.find("timed out"), std::string::npos) << both;
    EXPECT_NE(both.find("; before it, an input error: "), std::string::npos) << both;
    EXPECT_NE(both.find("routes to expert id " + std::to_string(kExperts + 5)), std::string::npos) << both;
    expect_exact_after(buffer, weights, router_weight, c, comm.stream(), "after the reset, seed " + std::to_string(seed));
  });
}

// A failed call whose CTAs did not all start before it failed (all SMs but two held past the timeout):
// the late CTAs run nothing but still count themselves finished, so the last CTA resets the call's
// counters and the barrier's epoch; after check_device_error the next calls are exact.
TEST(StreamedLayerTimeouts, LateCtasOfAFailedCallLeaveNothingBehind) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  failure_case(Chunking{}, "late CTAs", [&](Communicator& comm, SymmBuffer& buffer, const LayerWeights& weights,
                                            const DeviceBuffer<uint16_t>& router_weight, uint64_t seed) {
    Call c(seed, 0, 0, 17);
    testing::cuda_check(cudaDeviceSynchronize(), "allocations");
    cudaStream_t other = nullptr;
    testing::cuda_check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "cudaStreamCreate");
    const auto start = std::chrono::steady_clock::now();
    layer_test::hold_all_but_sms(other, 1500, 2);  // past the 1 s timeout; at most a few CTAs resident
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the holder has its SMs before the layer
    run_streamed_layer(buffer, weights, c, c.tokens, comm.stream());  // nothing published: it times out
    const std::string unpublished = testing::device_failure(buffer, comm.stream());
    const double call_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    // The call ended while the holder still held every SM but two: its grid (one CTA per SM) ran on
    // those two, so all but two of its CTAs started after it had failed, the case this test is for.
    // (They need not wait for the holder: each runs nothing and leaves a free SM to the next.)
    const cudaError_t holder = cudaStreamQuery(other);
    testing::cuda_check(cudaStreamSynchronize(other), "the held SMs");
    testing::cuda_check(cudaStreamDestroy(other), "cudaStreamDestroy");
    EXPECT_NE(unpublished.find("timed out"), std::string::npos) << unpublished;
    EXPECT_EQ(holder, cudaErrorNotReady) << "the failed call took " << call_ms
                                         << " ms: it ended only after the held SMs were let go (1.5 s)";
    for (int32_t round = 0; round < 2; ++round)
      expect_exact_after(buffer, weights, router_weight, c, comm.stream(),
                         "round " + std::to_string(round) + " after the failed call, seed " + std::to_string(seed));
  });
}

// After refused streamed_mega_moe calls, and the stream's work done: no producer moved a cursor or
// published a slot (a launched producer would have done both).
void expect_ring_untouched(const SymmBuffer& buffer, cudaStream_t stream) {
  testing::cuda_check(cudaStreamSynchronize(stream), "the stream's work");
  const FrontRingLayout ring = FrontRingLayout::make(buffer.problem());
  std::vector<uint64_t> words((ring.cursors.bytes + ring.ready.bytes) / sizeof(uint64_t), 1);
  const char* base = buffer.local() + buffer.layout().front_ring.offset;
  testing::cuda_check(cudaMemcpy(words.data(), base + ring.cursors.offset, ring.cursors.bytes, cudaMemcpyDeviceToHost),
                      "cursors");
  testing::cuda_check(cudaMemcpy(words.data() + ring.cursors.bytes / sizeof(uint64_t), base + ring.ready.offset,
                                 ring.ready.bytes, cudaMemcpyDeviceToHost),
                      "ready words");
  for (const uint64_t word : words)
    if (word != 0) throw std::runtime_error("a refused streamed_mega_moe published a chunk");
}

TEST(StreamedLayerArguments, ErrorsNameTheArgument) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    const auto expect = [&](const std::string& got, const std::string& part) {
      if (got.find(part) == std::string::npos) throw std::runtime_error("expected '" + part + "' in: " + got);
    };
    const Problem p = streamed_problem(1, 0, Recipe::fp8);
    const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, 1);
    DeviceBuffer<uint16_t> y(size_t(kMaxTokens + 1) * kHidden);
    DeviceBuffer<uint8_t> x(size_t(kMaxTokens) * kHidden);
    const auto call = [&](SymmBuffer& buffer, const LayerInputs& in, CallOptions options) {
      mega_moe(buffer, in, weights->view(), view_of(y.get(), DType::bf16, {in.num_tokens, kHidden}), comm.stream(), {},
               options);
    };
    CallOptions streamed(Schedule::fused);
    streamed.streamed = true;
    CallOptions staged(Schedule::staged);
    staged.streamed = true;
    LayerInputs in;
    in.num_tokens = 4;
    {
      Problem no_ring = p;
      no_ring.front_num_slots = 0;
      SymmBuffer buffer(comm, no_ring);
      expect(testing::error_message([&] { call(buffer, in, streamed); }),
             "options.streamed: needs a buffer with a front ring");
    }
    {
      Problem small_wave = p;
      small_wave.wave_tokens = 16;
      SymmBuffer small(comm, small_wave);
      expect(testing::error_message([&] { call(small, in, streamed); }),
             "options.streamed: reads a call in one wave: the buffer's wave (16 tokens");
    }
    SymmBuffer buffer(comm, p);
    expect(testing::error_message([&] { call(buffer, in, staged); }),
           "options.streamed: runs in the fused schedule only");
    LayerInputs given = in;
    given.x = view_of(x.get(), DType::e4m3, {4, kHidden});
    expect(testing::error_message([&] { call(buffer, given, streamed); }),
           "inputs.x: must be empty in a streamed call");

    // streamed_mega_moe checks everything before its first launch: after each refusal the ring's
    // producers have published nothing (their cursors are still 0).
    DeviceBuffer<uint16_t> x_bf16(size_t(kMaxTokens + 1) * kHidden);
    DeviceBuffer<uint16_t> weight(size_t(kExperts) * kHidden);
    DeviceBuffer<float> logits(size_t(kMaxTokens + 1) * kExperts), bias(kExperts);
    x_bf16.fill_bytes(0, comm.stream());  // the calls that run route zero logits: ties, valid experts
    weight.fill_bytes(0, comm.stream());
    logits.fill_bytes(0, comm.stream());
    const auto streamed_call = [&](int64_t tokens) {
      StreamedCall c;
      c.router = &router();
      c.x = view_of(x_bf16.get(), DType::bf16, {tokens, kHidden});
      c.router_weight = view_of(weight.get(), DType::bf16, {kExperts, kHidden});
      c.logits = view_of(logits.get(), DType::f32, {tokens, kExperts});
      c.form = CallForm::streamed;
      return c;
    };
    const auto run = [&](const StreamedCall& c, int64_t y_tokens) {
      streamed_mega_moe(buffer, c, weights->view(), view_of(y.get(), DType::bf16, {y_tokens, kHidden}), comm.stream());
    };
    StreamedCall no_router = streamed_call(4);
    no_router.router = nullptr;
    expect(testing::error_message([&] { run(no_router, 4); }), "call.router: is required");
    const RouterConfig wide = softmax_router(2 * kExperts, kTopK, true);
    StreamedCall wrong_router = streamed_call(4);
    wrong_router.router = &wide;
    expect(testing::error_message([&] { run(wrong_router, 4); }), "call.router: routes to 64 experts");
    StreamedCall short_logits = streamed_call(4);
    short_logits.logits = view_of(logits.get(), DType::f32, {3, kExperts});
    expect(testing::error_message([&] { run(short_logits, 4); }), "call.logits:");
    StreamedCall biased = streamed_call(4);
    biased.router_bias = view_of(bias.get(), DType::f32, {kExperts});
    expect(testing::error_message([&] { run(biased, 4); }), "call.router_bias: corrects the sigmoid router's");
    expect(testing::error_message([&] { run(streamed_call(4), 5); }), "y:");
    expect(testing::error_message([&] { run(streamed_call(kMaxTokens + 1), kMaxTokens + 1); }),
           "call.x: holds 41 tokens, more than the buffer's max_tokens_per_rank (40)");
    StreamedCall automatic = streamed_call(4);
    automatic.form = CallForm::automatic;
    expect(testing::error_message([&] { run(automatic, 4); }), "call.topk_idx:");
    DeviceBuffer<int32_t> topk_idx(size_t(4) * kTopK);
    automatic.topk_idx = view_of(topk_idx.get(), DType::i32, {4, kTopK});
    automatic.uniform_tokens = 3;
    expect(testing::error_message([&] { run(automatic, 4); }),
           "call.uniform_tokens: is 0 or the most tokens any rank has in this call: at least this rank's 4, at most "
           "max_tokens_per_rank (40); got 3");
    automatic.uniform_tokens = kMaxTokens + 1;
    expect(testing::error_message([&] { run(automatic, 4); }), "call.uniform_tokens:");
    // An event log the build cannot fill, or of the wrong size, is refused before the producers run.
    DeviceBuffer<uint8_t> log(8);
    StreamedCall traced = streamed_call(4);
    traced.trace = view_of(log.get(), DType::u8, {8});
    expect(testing::error_message([&] { run(traced, 4); }),
           fused_trace_compiled() ? "call.trace:" : "call.trace: this build logs no events");
    expect_ring_untouched(buffer, comm.stream());

    {
      // automatic may pick the ring for some calls: a buffer without one is refused whatever this
      // call's tokens; batch needs none.
      Problem no_ring = p;
      no_ring.front_num_slots = 0;
      SymmBuffer plain(comm, no_ring);
      StreamedCall in_batch = automatic;
      in_batch.uniform_tokens = 0;
      expect(testing::error_message([&] {
               streamed_mega_moe(plain, in_batch, weights->view(), view_of(y.get(), DType::bf16, {4, kHidden}),
                                 comm.stream());
             }),
             "buffer: has no front ring, which form automatic needs");
      in_batch.form = CallForm::batch;
      streamed_mega_moe(plain, in_batch, weights->view(), view_of(y.get(), DType::bf16, {4, kHidden}), comm.stream());
      plain.check_device_error(comm.stream());
    }
    {
      // A streamed layer call refused after its producers ran leaves their call unread: the next
      // layer call would read it, one call late, and is refused instead.
      SymmBuffer behind(comm, p);
      const TensorView x4 = view_of(x_bf16.get(), DType::bf16, {4, kHidden});
      const TensorView logits4 = view_of(logits.get(), DType::f32, {4, kExperts});
      const auto produce = [&] {
        route_tokens(router(), logits4, TensorView{}, behind, comm.stream());
        quantize_activations(x4, behind, comm.stream());
      };
      produce();
      expect(testing::error_message([&] {
               mega_moe(behind, in, weights->view(), view_of(y.get(), DType::bf16, {5, kHidden}), comm.stream(), {},
                        streamed);
             }),
             "y:");
      produce();
      expect(testing::error_message([&] {
               mega_moe(behind, in, weights->view(), view_of(y.get(), DType::bf16, {4, kHidden}), comm.stream(), {},
                        streamed);
             }),
             "options.streamed: reads the call this rank's producers published last, but the front ring holds more "
             "than one it has not read (route_tokens 2 and quantize_activations 2 calls, streamed layer calls 0)");
      StreamedCall again = streamed_call(4);
      expect(testing::error_message([&] {
               streamed_mega_moe(behind, again, weights->view(), view_of(y.get(), DType::bf16, {4, kHidden}),
                                 comm.stream());
             }),
             "buffer: reads the call this rank's producers published last");
      behind.check_device_error(comm.stream());
    }

    // A router past what the device's top-k takes (and a layer past the fused schedule's experts) is
    // refused before the first producer is launched, though the producers check it only later.
    Problem many = p;
    many.num_experts = 1056;
    SymmBuffer wide_buffer(comm, many);
    const std::unique_ptr<DeviceWeights> wide_weights = DeviceWeights::synthetic(many, 1);
    const RouterConfig wide_router = softmax_router(many.num_experts, kTopK, true);
    DeviceBuffer<uint16_t> wide_weight(size_t(many.num_experts) * kHidden);
    DeviceBuffer<float> wide_logits(size_t(4) * many.num_experts);
    StreamedCall too_many = streamed_call(4);
    too_many.router = &wide_router;
    too_many.router_weight = view_of(wide_weight.get(), DType::bf16, {many.num_experts, kHidden});
    too_many.logits = view_of(wide_logits.get(), DType::f32, {4, many.num_experts});
    expect(testing::error_message([&] {
             streamed_mega_moe(wide_buffer, too_many, wide_weights->view(), view_of(y.get(), DType::bf16, {4, kHidden}),
                               comm.stream());
           }),
           "call.router: runs on the device with at most 1024 experts in at most 32 groups; got 1056 in 1");
    expect_ring_untouched(wide_buffer, comm.stream());
  });
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace megamoe
