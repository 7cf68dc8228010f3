// The front ring on the GPU (docs/streaming.md): the producers (megamoe/producers.h) publish a call's
// routes and activations chunk by chunk, and a consumer that follows the protocol (wait for both
// halves, read, acknowledge) on every rank gets exactly the batch producers' outputs, for every
// source rank, across calls whose chunks wrap the ring, uneven and empty ranks, partial final chunks,
// concurrent ranks and graph replays. Waits that cannot complete time out naming the ring's wait.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/scoped_env.h"
#include "device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/streaming/ring_device.cuh"
#include "megamoe/comm.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/producers.h"
#include "megamoe/router.h"
#include "test_seed.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

// What one destination read of one source's call, in the batch outputs' layout.
struct Drained {
  int32_t* topk_idx;  // [max_tokens][top_k]
  float* topk_weights;
  uint8_t* x;  // [max_tokens][row_bytes]
  float* x_scales;  // [max_tokens][scale_blocks]
  FrontSlotMeta* metas;  // [chunks of the call], in the order read
  uint32_t* chunks;      // how many
};

// The test's consumer, one block: each source rank's chunks of one call in sequence order, until the
// one marked last; the sequence continues from this rank's consumer cursor.
__global__ void drain_ring(SymmView view, BufferLayout layout, FrontRingLayout ring, Drained* drained) {
  ControlBlock* control = layout.control_block(view.local());
  void* own = device::front_ring_of(view, layout, view.rank);
  for (int32_t src = 0; src < view.num_ranks; ++src) {
    void* src_ring = device::front_ring_of(view, layout, src);
    const Drained out = drained[src];
    uint64_t* cursor = ring.consumer_cursor(own, static_cast<uint32_t>(src));
    uint64_t seq = *cursor;
    for (uint32_t chunk = 0;; ++chunk, ++seq) {
      int ready = 1;
      if (threadIdx.x == 0) {
        ready = device::front_wait_ok(view, control,
                                      front_wait_ready<device::FrontRingAtomics>(ring, src_ring, src, seq,
                                                                                 view.timeout_ns));
      }
      if (!__syncthreads_and(ready)) return;
      const uint32_t slot = front_slot(seq, ring.num_slots);
      const FrontSlotMeta meta = *ring.slot_meta(src_ring, slot);
      for (uint32_t i = threadIdx.x; i < meta.valid * ring.top_k; i += blockDim.x) {
        out.topk_idx[meta.token_base * ring.top_k + i] = ring.slot_topk_idx(src_ring, slot)[i];
        out.topk_weights[meta.token_base * ring.top_k + i] = ring.slot_topk_weights(src_ring, slot)[i];
      }
      for (uint32_t i = threadIdx.x; i < meta.valid * ring.row_bytes; i += blockDim.x) {
        out.x[uint64_t{meta.token_base} * ring.row_bytes + i] = ring.slot_x(src_ring, slot)[i];
      }
      for (uint32_t i = threadIdx.x; i < meta.valid * ring.scale_blocks; i += blockDim.x) {
        out.x_scales[meta.token_base * ring.scale_blocks + i] = ring.slot_x_scales(src_ring, slot)[i];
      }
      if (threadIdx.x == 0) out.metas[chunk] = meta;
      __syncthreads();  // every read of the slot, before the acknowledgement
      if (threadIdx.x == 0) front_acknowledge<device::FrontRingAtomics>(ring, src_ring, view.rank, seq);
      if (meta.last) {
        if (threadIdx.x == 0) {
          *out.chunks = chunk + 1;
          *cursor = seq + 1;
        }
        break;
      }
    }
  }
}

TensorView view_of(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data, dtype, shape, Device::cuda);
}

constexpr int32_t kHidden = 512;
constexpr int32_t kMaxTokens = 40;

Problem ring_problem(int32_t ranks, int32_t rank, Recipe recipe) {
  Problem p;
  p.num_ranks = ranks;
  p.rank = rank;
  p.num_experts = 64;
  p.top_k = 6;
  p.hidden = kHidden;
  p.intermediate = 256;
  p.max_tokens_per_rank = kMaxTokens;
  p.recipe = recipe;
  p.front_num_slots = 3;
  p.front_tokens_per_slot = 16;  // a call of 40 tokens: 16 + 16 + 8, the ring's three slots
  return p;
}

const RouterConfig& ring_router() {
  static const RouterConfig config = softmax_router(64, 6, true);
  return config;
}

// Tokens of source `rank` in call `call`: full, partial, exactly one chunk, none.
int32_t call_tokens(uint64_t seed, int32_t call, int32_t rank) {
  const int32_t choices[] = {40, 33, 16, 0, 1, 17, 40};
  return choices[(seed + static_cast<uint64_t>(call) * 3 + static_cast<uint64_t>(rank) * 5) % 7];
}

// One source's producer inputs of one call, the same on every rank that makes them.
struct SourceInputs {
  DeviceBuffer<uint16_t> x;
  DeviceBuffer<float> logits;
  int32_t tokens;
};
SourceInputs make_inputs(uint64_t seed, int32_t call, int32_t rank, int32_t tokens) {
  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(call) << 20) ^ (static_cast<uint64_t>(rank) << 40));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(tokens) * kHidden);
  for (uint16_t& v : x) v = float_to_bf16(normal(rng));
  std::vector<float> logits(static_cast<size_t>(tokens) * ring_router().num_experts);
  for (float& v : logits) v = 2.0f * normal(rng);
  return {DeviceBuffer<uint16_t>(x), DeviceBuffer<float>(logits), tokens};
}
SourceInputs make_inputs(uint64_t seed, int32_t call, int32_t rank) {
  return make_inputs(seed, call, rank, call_tokens(seed, call, rank));
}

// What a destination drained from one source in one call, on the device and read back.
struct DrainBuffers {
  DeviceBuffer<int32_t> topk_idx;
  DeviceBuffer<float> topk_weights, x_scales;
  DeviceBuffer<uint8_t> x;
  DeviceBuffer<FrontSlotMeta> metas;
  DeviceBuffer<uint32_t> chunks;
  explicit DrainBuffers(const FrontRingLayout& ring)
      : topk_idx(kMaxTokens * ring.top_k), topk_weights(kMaxTokens * ring.top_k),
        x_scales(kMaxTokens * ring.scale_blocks + 1), x(kMaxTokens * ring.row_bytes), metas(ring.num_slots), chunks(1) {}
  Drained device() {
    return {topk_idx.get(), topk_weights.get(), x.get(), x_scales.get(), metas.get(), chunks.get()};
  }
};

// Checks one source's drained call against the batch producers on the same inputs.
void expect_matches_batch(const Problem& p, SourceInputs& in, DrainBuffers& got, const std::string& where) {
  const FrontRingLayout ring = FrontRingLayout::make(p);
  const int64_t t = in.tokens;
  DeviceBuffer<int32_t> idx(t * p.top_k + 1);
  DeviceBuffer<float> weights(t * p.top_k + 1), scales(t * (kHidden / 128) + 1);
  DeviceBuffer<uint8_t> x(t * kHidden * 2 + 1);
  route_tokens(ring_router(), view_of(in.logits.get(), DType::f32, {t, p.num_experts}), TensorView{},
               view_of(idx.get(), DType::i32, {t, p.top_k}), view_of(weights.get(), DType::f32, {t, p.top_k}),
               nullptr);
  if (p.recipe != Recipe::bf16) {
    quantize_activations(view_of(in.x.get(), DType::bf16, {t, kHidden}), view_of(x.get(), DType::e4m3, {t, kHidden}),
                         view_of(scales.get(), DType::f32, {t, kHidden / 128}), nullptr);
  } else {
    testing::cuda_check(cudaMemcpy(x.get(), in.x.get(), t * kHidden * 2, cudaMemcpyDeviceToDevice), "copy x");
  }
  testing::cuda_check(cudaDeviceSynchronize(), "batch producers");
  // Only what this call wrote: the buffers' tails past its tokens may never have been written.
  const size_t routes = static_cast<size_t>(t) * p.top_k;
  EXPECT_EQ(got.topk_idx.download(routes), idx.download(routes)) << where << ": topk_idx";
  std::vector<float> want_w = weights.download(routes), got_w = got.topk_weights.download(routes);
  EXPECT_EQ(0, std::memcmp(want_w.data(), got_w.data(), routes * sizeof(float))) << where << ": topk_weights";
  const size_t bytes = static_cast<size_t>(t) * ring.row_bytes;
  EXPECT_EQ(got.x.download(bytes), x.download(bytes)) << where << ": x";
  const size_t blocks = static_cast<size_t>(t) * ring.scale_blocks;
  std::vector<float> want_s = scales.download(blocks), got_s = got.x_scales.download(blocks);
  EXPECT_EQ(0, std::memcmp(want_s.data(), got_s.data(), blocks * sizeof(float))) << where << ": x_scales";
  const uint32_t chunks = front_chunk_count(static_cast<uint32_t>(t), ring.tokens_per_slot);
  ASSERT_EQ(got.chunks.download()[0], chunks) << where;
  const std::vector<FrontSlotMeta> metas = got.metas.download(chunks);
  for (uint32_t c = 0; c < chunks; ++c) {
    const FrontSlotMeta want = front_chunk_meta(static_cast<uint32_t>(t), ring.tokens_per_slot, c);
    EXPECT_EQ(metas[c].token_base, want.token_base) << where << ", chunk " << c;
    EXPECT_EQ(metas[c].valid, want.valid) << where << ", chunk " << c;
    EXPECT_EQ(metas[c].last, want.last) << where << ", chunk " << c;
    EXPECT_EQ(metas[c].call_tokens, want.call_tokens) << where << ", chunk " << c;
  }
}

// The consumer's table of where each source's chunks go, uploaded before any launch or capture.
DeviceBuffer<Drained> drain_table(std::vector<DrainBuffers>& per_source) {
  std::vector<Drained> host;
  for (DrainBuffers& d : per_source) host.push_back(d.device());
  return DeviceBuffer<Drained>(host);
}

void launch_drain(SymmBuffer& buffer, DeviceBuffer<Drained>& table, cudaStream_t stream) {
  drain_ring<<<1, 256, 0, stream>>>(buffer.view(), buffer.layout(), FrontRingLayout::make(buffer.problem()),
                                    table.get());
  testing::cuda_check(cudaGetLastError(), "drain_ring launch");
}

void produce(SymmBuffer& buffer, SourceInputs& in, cudaStream_t stream) {
  const int64_t t = in.tokens;
  route_tokens(ring_router(), view_of(in.logits.get(), DType::f32, {t, buffer.problem().num_experts}), TensorView{},
               buffer, stream);
  quantize_activations(view_of(in.x.get(), DType::bf16, {t, kHidden}), buffer, stream);
}

// Every rank sources and consumes `calls` calls, enqueued back to back: the next call's producers run
// while other ranks still consume the last one, and the calls' chunks wrap the three slots.
void streamed_calls(Communicator& comm, Recipe recipe, uint64_t seed) {
  constexpr int32_t kCalls = 6;
  const Problem p = ring_problem(comm.size(), comm.rank(), recipe);
  SymmBuffer buffer(comm, p);
  const FrontRingLayout ring = FrontRingLayout::make(p);
  // Everything is allocated before the first launch: cudaFree and some allocations wait for the whole
  // device, where other ranks' consumers wait for this rank's producers.
  std::vector<SourceInputs> own;
  std::vector<std::vector<DrainBuffers>> drains(kCalls);
  std::vector<DeviceBuffer<Drained>> tables;
  for (int32_t call = 0; call < kCalls; ++call) {
    own.push_back(make_inputs(seed, call, comm.rank()));
    for (int32_t src = 0; src < comm.size(); ++src) drains[call].emplace_back(ring);
    tables.push_back(drain_table(drains[call]));
  }
  testing::cuda_check(cudaDeviceSynchronize(), "allocations");
  comm.barrier();
  for (int32_t call = 0; call < kCalls; ++call) {
    produce(buffer, own[call], comm.stream());
    launch_drain(buffer, tables[call], comm.stream());
  }
  buffer.check_device_error(comm.stream());
  comm.barrier();
  for (int32_t call = 0; call < kCalls; ++call) {
    for (int32_t src = 0; src < comm.size(); ++src) {
      SourceInputs in = make_inputs(seed, call, src);
      expect_matches_batch(p, in, drains[call][src],
                           "rank " + std::to_string(comm.rank()) + " from source " + std::to_string(src) +
                               ", call " + std::to_string(call) + " (" + std::to_string(in.tokens) +
                               " tokens), seed " + std::to_string(seed));
    }
  }
  if (::testing::Test::HasFailure()) throw std::runtime_error("drained chunks differ from the batch outputs");
}

class FrontRingRanks : public ::testing::TestWithParam<int> {};

TEST_P(FrontRingRanks, StreamedChunksMatchTheBatchProducersFp8) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  EXPECT_EQ(run_ranks(GetParam(), LaunchMode::emulated, [&](Communicator& c) { streamed_calls(c, Recipe::fp8, seed); }),
            0);
}

TEST_P(FrontRingRanks, StreamedChunksMatchTheBatchProducersBf16) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1;
  EXPECT_EQ(
      run_ranks(GetParam(), LaunchMode::emulated, [&](Communicator& c) { streamed_calls(c, Recipe::bf16, seed); }), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FrontRingRanks, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

// A captured graph of one call (producers, then the consumer), replayed: each replay continues the
// ring's sequence from the cursors in memory, so every replay reads its own chunks, not stale ones.
TEST(FrontRingGraph, ReplaysContinueTheSequence) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    const Problem p = ring_problem(1, 0, Recipe::fp8);
    SymmBuffer buffer(comm, p);
    const FrontRingLayout ring = FrontRingLayout::make(p);
    SourceInputs in = make_inputs(seed, 0, 0, 33);  // three chunks: replays wrap the three slots
    std::vector<DrainBuffers> drains;
    drains.emplace_back(ring);
    DeviceBuffer<Drained> table = drain_table(drains);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    testing::cuda_check(cudaStreamBeginCapture(comm.stream(), cudaStreamCaptureModeThreadLocal), "capture");
    produce(buffer, in, comm.stream());
    launch_drain(buffer, table, comm.stream());
    testing::cuda_check(cudaStreamEndCapture(comm.stream(), &graph), "end capture");
    testing::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    const uint32_t chunks = front_chunk_count(static_cast<uint32_t>(in.tokens), ring.tokens_per_slot);
    for (int replay = 0; replay < 5; ++replay) {
      testing::cuda_check(cudaMemsetAsync(drains[0].x.get(), 0, drains[0].x.size(), comm.stream()), "clear");
      testing::cuda_check(cudaGraphLaunch(exec, comm.stream()), "replay");
      buffer.check_device_error(comm.stream());
      expect_matches_batch(p, in, drains[0], "replay " + std::to_string(replay) + ", seed " + std::to_string(seed));
      uint64_t cursors[3] = {};
      testing::cuda_check(cudaMemcpy(cursors, buffer.local() + buffer.layout().front_ring.offset, sizeof(cursors),
                                     cudaMemcpyDeviceToHost),
                          "cursors");
      const uint64_t sequence = uint64_t{chunks} * (replay + 1);
      EXPECT_EQ(cursors[0], sequence) << "route producer's cursor after replay " << replay;
      EXPECT_EQ(cursors[1], sequence) << "layout producer's cursor after replay " << replay;
      EXPECT_EQ(cursors[2], sequence) << "consumer's cursor after replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    if (::testing::Test::HasFailure()) throw std::runtime_error("replays differ");
  });
  EXPECT_EQ(failed, 0);
}

// A consumer whose source never publishes, and producers whose slots are never acknowledged, time out
// naming the wait; after check_device_error the ring is back to its initial state and works again.
TEST(FrontRingTimeouts, UnpublishedAndUnacknowledgedSlotsTimeOut) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  const uint64_t seed = testing::test_seed();
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    const Problem p = ring_problem(1, 0, Recipe::fp8);
    SymmBuffer buffer(comm, p);
    const FrontRingLayout ring = FrontRingLayout::make(p);
    std::vector<DrainBuffers> drains;
    drains.emplace_back(ring);
    DeviceBuffer<Drained> table = drain_table(drains);
    SourceInputs in = make_inputs(seed, 0, 0, 40);  // three chunks: a whole call takes every slot

    launch_drain(buffer, table, comm.stream());  // nothing published
    const std::string unpublished = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(unpublished.find("waiting for a front-ring slot's routes (expected value 1, saw 0)"), std::string::npos)
        << unpublished;

    produce(buffer, in, comm.stream());  // call 1 takes the three slots
    produce(buffer, in, comm.stream());  // call 2: slot 0 was never acknowledged
    const std::string unacknowledged = testing::device_failure(buffer, comm.stream());
    EXPECT_NE(unacknowledged.find("waiting for a front-ring slot to be consumed (expected value 1, saw 0)"),
              std::string::npos)
        << unacknowledged;

    produce(buffer, in, comm.stream());  // the ring was reset: a whole call works again
    launch_drain(buffer, table, comm.stream());
    buffer.check_device_error(comm.stream());
    expect_matches_batch(p, in, drains[0], "after the reset, seed " + std::to_string(seed));
    if (::testing::Test::HasFailure()) throw std::runtime_error("timeouts");
  });
  EXPECT_EQ(failed, 0);
}

TEST(FrontRingArguments, ErrorsNameTheArgument) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(1, LaunchMode::emulated, [&](Communicator& comm) {
    DeviceBuffer<uint16_t> x(41 * kHidden);
    DeviceBuffer<float> logits(41 * 64);
    Problem no_ring = ring_problem(1, 0, Recipe::fp8);
    no_ring.front_num_slots = 0;
    {
      SymmBuffer buffer(comm, no_ring);
      const std::string m = testing::error_message([&] {
        quantize_activations(view_of(x.get(), DType::bf16, {4, kHidden}), buffer, nullptr);
      });
      if (m.find("buffer: has no front ring") == std::string::npos) throw std::runtime_error(m);
    }
    SymmBuffer buffer(comm, ring_problem(1, 0, Recipe::fp8));
    std::string m = testing::error_message([&] {
      quantize_activations(view_of(x.get(), DType::bf16, {41, kHidden}), buffer, nullptr);
    });
    if (m.find("x: holds 41 tokens") == std::string::npos) throw std::runtime_error(m);
    m = testing::error_message([&] { quantize_activations(view_of(x.get(), DType::bf16, {4, 256}), buffer, nullptr); });
    if (m.find("x:") == std::string::npos) throw std::runtime_error(m);
    m = testing::error_message([&] {
      route_tokens(softmax_router(64, 4, true), view_of(logits.get(), DType::f32, {4, 64}), TensorView{}, buffer,
                   nullptr);
    });
    if (m.find("config:") == std::string::npos) throw std::runtime_error(m);
    m = testing::error_message([&] {
      route_tokens(ring_router(), view_of(logits.get(), DType::f32, {41, 64}), TensorView{}, buffer, nullptr);
    });
    if (m.find("logits: holds 41 tokens") == std::string::npos) throw std::runtime_error(m);
  });
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace megamoe
