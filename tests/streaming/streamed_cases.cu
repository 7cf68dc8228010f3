// The streamed-layer tests' shared calls (streamed_cases.h).
#include "streaming/streamed_cases.h"

#include <cuda/ptx>
#include <gtest/gtest.h>

#include <iterator>
#include <memory>
#include <stdexcept>

#include "gpu_test_util.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/producers.h"
#include "megamoe/streaming.h"
#include "megamoe/token_check.h"
#include "test_seed.h"

namespace megamoe::streamed_test {
namespace {

// Holds a stream for `ns` with one thread: a rank whose producer or layer comes late.
__global__ void spin_for(uint64_t ns) {
  const uint64_t start = cuda::ptx::get_sreg_globaltimer();
  while (cuda::ptx::get_sreg_globaltimer() - start < ns) {
  }
}

void hold_stream(cudaStream_t stream, uint64_t ns) {
  if (ns == 0) return;
  spin_for<<<1, 1, 0, stream>>>(ns);
  testing::cuda_check(cudaGetLastError(), "spin_for launch");
}

}  // namespace

Problem streamed_problem(int32_t ranks, int32_t rank, Recipe recipe, int32_t top_k, Chunking chunking) {
  Problem p;
  p.num_ranks = ranks;
  p.rank = rank;
  p.num_experts = kExperts;
  p.top_k = top_k;
  p.hidden = kHidden;
  p.intermediate = 256;
  p.num_shared_experts = 1;
  p.max_tokens_per_rank = kMaxTokens;
  p.recipe = recipe;
  const FrontRingShape ring = front_ring_shape(kMaxTokens, chunking.tokens_per_slot);
  p.front_num_slots = ring.num_slots;
  p.front_tokens_per_slot = ring.tokens_per_slot;
  return p;
}

const RouterConfig& router(int32_t top_k) {
  static const RouterConfig four = softmax_router(kExperts, 4, true);
  static const RouterConfig eight = softmax_router(kExperts, 8, true);
  return top_k == 8 ? eight : four;
}

TensorView view_of(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data, dtype, shape, Device::cuda);
}

int32_t call_tokens(uint64_t seed, int32_t call, int32_t rank, Chunking chunking) {
  if (chunking.chunked()) {
    const int32_t order[] = {33, 17, 40, 1, 0};
    return order[(call + rank) % 5];
  }
  const int32_t choices[] = {40, 17, 1, 0, 33};
  return choices[(seed + static_cast<uint64_t>(call) * 3 + static_cast<uint64_t>(rank) * 2) % 5];
}

bool some_call_wraps(const Problem& p, const std::vector<int32_t>& tokens) {
  uint64_t seq = 0;
  bool wraps = false;
  for (const int32_t t : tokens) {
    const uint32_t chunks = front_chunk_count(static_cast<uint32_t>(t), static_cast<uint32_t>(p.front_tokens_per_slot));
    wraps |= seq % p.front_num_slots + chunks > static_cast<uint64_t>(p.front_num_slots);
    seq += chunks;
  }
  return wraps;
}

DeviceBuffer<uint16_t> make_router_weight(uint64_t seed, int32_t rank) {
  std::mt19937_64 rng(seed * 31 + static_cast<uint64_t>(rank));
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<uint16_t> host(size_t(kExperts) * kHidden);
  for (uint16_t& v : host) v = float_to_bf16(normal(rng));
  return DeviceBuffer<uint16_t>(host);
}

void run_batch(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight, Call& c,
               cudaStream_t stream) {
  const Problem& p = buffer.problem();
  const int64_t t = c.tokens;
  if (c.combined) {
    router_logits(view_of(c.x.get(), DType::bf16, {t, kHidden}),
                  view_of(router_weight.get(), DType::bf16, {kExperts, kHidden}),
                  view_of(c.logits.get(), DType::f32, {t, kExperts}), stream);
  }
  route_tokens(router(c.top_k), view_of(c.logits.get(), DType::f32, {t, kExperts}), TensorView{},
               view_of(c.topk_idx.get(), DType::i32, {t, c.top_k}),
               view_of(c.topk_weights.get(), DType::f32, {t, c.top_k}),
               stream);
  if (p.recipe != Recipe::bf16) {
    quantize_activations(view_of(c.x.get(), DType::bf16, {t, kHidden}),
                         view_of(c.x_fp8.get(), DType::e4m3, {t, kHidden}),
                         view_of(c.x_scales.get(), DType::f32, {t, kHidden / 128}), stream);
  }
  run_batch_layer(buffer, weights, c, stream);
}

void run_batch_layer(SymmBuffer& buffer, const LayerWeights& weights, Call& c, cudaStream_t stream) {
  const int64_t t = c.tokens;
  LayerInputs in;
  in.num_tokens = c.tokens;
  in.topk_idx = view_of(c.topk_idx.get(), DType::i32, {t, c.top_k});
  in.topk_weights = view_of(c.topk_weights.get(), DType::f32, {t, c.top_k});
  if (buffer.problem().recipe == Recipe::bf16) {
    in.x = view_of(c.x.get(), DType::bf16, {t, kHidden});
  } else {
    in.x = view_of(c.x_fp8.get(), DType::e4m3, {t, kHidden});
    in.x_scales = view_of(c.x_scales.get(), DType::f32, {t, kHidden / 128});
  }
  mega_moe(buffer, in, weights, view_of(c.y_batch.get(), DType::bf16, {t, kHidden}), stream, {},
           CallOptions(Schedule::fused));
}

Lateness random_lateness(uint64_t seed, int32_t call, int32_t rank) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(call) * 131 + static_cast<uint64_t>(rank));
  std::uniform_int_distribution<uint64_t> late(0, 200'000);
  const auto draw = [&] { return rng() % 2 == 0 ? late(rng) : uint64_t{0}; };
  Lateness l;
  l.route = draw();
  l.layout = draw();
  l.layer = draw();
  return l;
}

void run_streamed_layer(SymmBuffer& buffer, const LayerWeights& weights, Call& c, int32_t tokens, cudaStream_t stream) {
  LayerInputs in;
  in.num_tokens = tokens;
  CallOptions options(Schedule::fused);
  options.streamed = true;
  mega_moe(buffer, in, weights, view_of(c.y_streamed.get(), DType::bf16, {tokens, kHidden}), stream, {}, options);
}

void run_streamed(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight,
                  Call& c, cudaStream_t stream, const Lateness& late) {
  const int64_t t = c.tokens;
  hold_stream(stream, late.route);
  if (c.combined) {
    StreamedCall call;
    call.router = &router(c.top_k);
    call.x = view_of(c.x.get(), DType::bf16, {t, kHidden});
    call.router_weight = view_of(router_weight.get(), DType::bf16, {kExperts, kHidden});
    call.logits = view_of(c.logits.get(), DType::f32, {t, kExperts});
    call.form = c.form;
    call.uniform_tokens = c.uniform_tokens;
    call.topk_idx = view_of(c.topk_idx.get(), DType::i32, {t, c.top_k});
    streamed_mega_moe(buffer, call, weights, view_of(c.y_streamed.get(), DType::bf16, {t, kHidden}), stream);
    return;
  }
  route_tokens(router(c.top_k), view_of(c.logits.get(), DType::f32, {t, kExperts}), TensorView{}, buffer, stream);
  hold_stream(stream, late.layout);
  quantize_activations(view_of(c.x.get(), DType::bf16, {t, kHidden}), buffer, stream);
  hold_stream(stream, late.layer);
  run_streamed_layer(buffer, weights, c, c.tokens, stream);
}

void expect_exact_after(SymmBuffer& buffer, const LayerWeights& weights, const DeviceBuffer<uint16_t>& router_weight,
                        Call& c, cudaStream_t stream, const std::string& when) {
  c.y_streamed.fill_bytes(0xFF, stream);
  run_batch(buffer, weights, router_weight, c, stream);
  run_streamed(buffer, weights, router_weight, c, stream);
  buffer.check_device_error(stream);
  std::vector<uint16_t> want = c.y_batch.download(), got = c.y_streamed.download();
  want.resize(size_t(c.tokens) * kHidden);
  got.resize(size_t(c.tokens) * kHidden);
  const TokenCheck check = check_tokens(got, want, kHidden, Recipe::fp8);
  EXPECT_TRUE(check.ok()) << when << ": " << check.first_failure;
}

void input_error_then_streamed(Communicator& comm, uint64_t seed) {
  const Problem p = streamed_problem(comm.size(), comm.rank(), Recipe::fp8);
  SymmBuffer buffer(comm, p);
  const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
  const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, comm.rank());
  Call first(seed, 1, comm.rank(), 17), bad(seed, 3, comm.rank(), 17), after(seed, 5, comm.rank(), 33);
  testing::cuda_check(cudaDeviceSynchronize(), "allocations");
  comm.barrier();
  cudaStream_t stream = comm.stream();
  expect_exact_after(buffer, weights->view(), router_weight, first, stream, "the first streamed call");
  // A batch call whose first route on rank 0 names an expert past the last: an input error, recorded
  // on rank 0 only; every rank's call runs to its end.
  run_batch(buffer, weights->view(), router_weight, bad, stream);
  if (comm.rank() == 0) {
    const int32_t past_last = kExperts + 5;
    testing::cuda_check(cudaMemcpyAsync(bad.topk_idx.get(), &past_last, sizeof(past_last), cudaMemcpyHostToDevice,
                                        stream),
                        "bad id");
  }
  run_batch_layer(buffer, weights->view(), bad, stream);
  const std::string reported = testing::device_failure(buffer, stream);
  if (comm.rank() == 0 && reported.find(std::to_string(kExperts + 5)) == std::string::npos)
    throw std::runtime_error("rank 0 did not report the bad expert id: '" + reported + "'");
  if (comm.rank() != 0 && reported != "no device error")
    throw std::runtime_error("rank " + std::to_string(comm.rank()) + " reported " + reported);
  comm.barrier();
  // The front ring, in step on every rank after the input error, takes the next streamed call.
  expect_exact_after(buffer, weights->view(), router_weight, after, stream, "the streamed call after an input error");
  if (::testing::Test::HasFailure()) throw std::runtime_error("a streamed call after an input error differs");
}

void forms_against_batch(Communicator& comm, uint64_t seed) {
  Problem p = streamed_problem(comm.size(), comm.rank(), Recipe::fp8);
  p.max_tokens_per_rank = static_cast<int32_t>(kStreamedCallsUpToTokens) + kMaxTokens;
  const FrontRingShape ring = front_ring_shape(p.max_tokens_per_rank, 0);
  p.front_num_slots = ring.num_slots;
  p.front_tokens_per_slot = ring.tokens_per_slot;
  // automatic given the calls' largest count and given nothing (the buffer's maximum, past the
  // threshold: batch) picks whatever choose_call_form says; both forms are also asked for by name.
  if (choose_call_form(p, 0) != CallForm::batch) throw std::runtime_error("the buffer's maximum is past the threshold");
  struct Form {
    CallForm form;
    int64_t uniform_tokens;
  };
  const Form forms[] = {{CallForm::streamed, 0}, {CallForm::batch, 0}, {CallForm::automatic, kMaxTokens},
                        {CallForm::automatic, 0}, {CallForm::batch, kMaxTokens}, {CallForm::streamed, kMaxTokens}};
  SymmBuffer buffer(comm, p);
  const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
  const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, comm.rank());
  std::vector<std::unique_ptr<Call>> calls;
  for (int32_t call = 0; call < static_cast<int32_t>(std::size(forms)); ++call) {
    calls.push_back(std::make_unique<Call>(seed, call, comm.rank(), call_tokens(seed, call, comm.rank(), {})));
    calls.back()->combined = true;
    calls.back()->form = forms[call].form;
    calls.back()->uniform_tokens = forms[call].uniform_tokens;
  }
  testing::cuda_check(cudaDeviceSynchronize(), "allocations");
  comm.barrier();
  for (auto& c : calls) {
    run_batch(buffer, weights->view(), router_weight, *c, comm.stream());
    run_streamed(buffer, weights->view(), router_weight, *c, comm.stream());
  }
  buffer.check_device_error(comm.stream());
  testing::cuda_check(cudaStreamSynchronize(comm.stream()), "calls");
  for (size_t call = 0; call < calls.size(); ++call) {
    Call& c = *calls[call];
    std::vector<uint16_t> want = c.y_batch.download(), got = c.y_streamed.download();
    want.resize(size_t(c.tokens) * kHidden);
    got.resize(size_t(c.tokens) * kHidden);
    const TokenCheck check = check_tokens(got, want, kHidden, Recipe::fp8);
    EXPECT_TRUE(check.ok()) << "rank " << comm.rank() << " of " << comm.size() << ", call " << call << " ("
                            << c.tokens << " tokens), form " << to_string(c.form) << ", uniform_tokens "
                            << c.uniform_tokens << ", seed " << seed << ": " << check.first_failure;
  }
  if (::testing::Test::HasFailure()) throw std::runtime_error("a form's outputs differ from the batch outputs");
}

void streamed_against_batch(Communicator& comm, Recipe recipe, uint64_t seed, int32_t top_k,
                            bool late, Chunking chunking) {
  // More chunks than the ring has slots; under MEGAMOE_TEST_QUICK (runs under compute-sanitizer) the
  // three calls that first pass the ring's last slot in chunks.
  const int32_t num_calls = testing::quick_run() ? 3 : 5;
  const Problem p = streamed_problem(comm.size(), comm.rank(), recipe, top_k, chunking);
  SymmBuffer buffer(comm, p);
  const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
  const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, comm.rank());
  // Everything is allocated before the first launch: an allocation may wait for the whole device,
  // where other ranks' kernels wait for this rank's.
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<int32_t> tokens;
  for (int32_t call = 0; call < num_calls; ++call) {
    tokens.push_back(call_tokens(seed, call, comm.rank(), chunking));
    calls.push_back(std::make_unique<Call>(seed, call, comm.rank(), tokens.back(), top_k));
  }
  if (chunking.chunked() && comm.rank() == 0)
    EXPECT_TRUE(some_call_wraps(p, tokens)) << "no call's chunks pass the ring's last slot";
  testing::cuda_check(cudaDeviceSynchronize(), "allocations");
  comm.barrier();
  if (late) {
    for (auto& c : calls) run_batch(buffer, weights->view(), router_weight, *c, comm.stream());
    for (int32_t call = 0; call < num_calls; ++call)
      run_streamed(buffer, weights->view(), router_weight, *calls[call], comm.stream(),
                   random_lateness(seed, call, comm.rank()));
  } else {
    for (auto& c : calls) {
      run_batch(buffer, weights->view(), router_weight, *c, comm.stream());
      run_streamed(buffer, weights->view(), router_weight, *c, comm.stream());
    }
  }
  expect_streamed_match_batch(comm, buffer, calls, recipe, seed, chunking);
}

void expect_streamed_match_batch(Communicator& comm, SymmBuffer& buffer,
                                 const std::vector<std::unique_ptr<Call>>& calls, Recipe recipe, uint64_t seed,
                                 Chunking chunking) {
  try {
    buffer.check_device_error(comm.stream());
  } catch (const std::exception& e) {
    // A timeout names the wait; what led to it depends on every rank's calls (seed, tokens).
    std::string tokens;
    for (const auto& c : calls) tokens += (tokens.empty() ? "" : ", ") + std::to_string(c->tokens);
    throw std::runtime_error(std::string(e.what()) + " (seed " + std::to_string(seed) + "; this rank's calls: " +
                             tokens + " tokens)");
  }
  testing::cuda_check(cudaStreamSynchronize(comm.stream()), "calls");
  for (size_t call = 0; call < calls.size(); ++call) {
    Call& c = *calls[call];
    const size_t n = size_t(c.tokens) * kHidden;
    std::vector<uint16_t> want = c.y_batch.download(), got = c.y_streamed.download();
    want.resize(n);
    got.resize(n);
    const TokenCheck check = check_tokens(got, want, kHidden, recipe);
    EXPECT_TRUE(check.ok()) << "rank " << comm.rank() << " of " << comm.size() << ", call " << call << " ("
                            << c.tokens << " tokens, slots of " << chunking.tokens_per_slot << "), "
                            << to_string(recipe) << ", seed " << seed << ": " << check.first_failure;
  }
  if (::testing::Test::HasFailure()) throw std::runtime_error("streamed outputs differ from the batch outputs");
}

void empty_rank_ahead_of_its_peers(Communicator& comm, uint64_t seed) {
  const Problem p = streamed_problem(comm.size(), comm.rank(), Recipe::fp8);
  SymmBuffer buffer(comm, p);
  const std::unique_ptr<DeviceWeights> weights = DeviceWeights::synthetic(p, seed);
  const DeviceBuffer<uint16_t> router_weight = make_router_weight(seed, comm.rank());
  // Calls 0 and 2 of Call's numbering: producers into the ring, then the layer (not combined), so
  // that the layer's lateness applies.
  std::vector<std::unique_ptr<Call>> calls;
  calls.push_back(std::make_unique<Call>(seed, 0, comm.rank(), comm.rank() == 0 ? 0 : 17));
  calls.push_back(std::make_unique<Call>(seed, 2, comm.rank(), 17));
  testing::cuda_check(cudaDeviceSynchronize(), "allocations");
  comm.barrier();
  Lateness late;
  if (comm.rank() != 0) late.layer = 20'000'000;  // 20 ms: far longer than rank 0's whole first call
  run_batch(buffer, weights->view(), router_weight, *calls[0], comm.stream());
  run_streamed(buffer, weights->view(), router_weight, *calls[0], comm.stream(), late);
  run_batch(buffer, weights->view(), router_weight, *calls[1], comm.stream());
  run_streamed(buffer, weights->view(), router_weight, *calls[1], comm.stream());
  expect_streamed_match_batch(comm, buffer, calls, Recipe::fp8, seed, {});
}

}  // namespace megamoe::streamed_test
