#include "layer/layer_scenarios.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <thread>

#include "layer/sm_holder.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/token_check.h"
#include "test_seed.h"

namespace megamoe::layer_test {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

template <typename T>
struct Device {
  T* data = nullptr;
  size_t count = 0;
  explicit Device(size_t n) : count(n) {
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&data), std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  ~Device() { cudaFree(data); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};

// The most routes one rank receives in a reference's call.
int64_t most_routes_received(const ReferenceResult& reference) {
  int64_t most = 0;
  for (const auto& per_expert : reference.recv_counts) {
    int64_t received = 0;
    for (uint32_t count : per_expert) received += count;
    most = std::max(most, received);
  }
  return most;
}

Problem case_problem(const LayerCase& c) {
  Problem p;
  p.num_ranks = static_cast<int32_t>(c.tokens_per_rank.size());
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.hidden = c.hidden;
  p.intermediate = c.intermediate;
  p.num_shared_experts = c.num_shared_experts;
  p.max_tokens_per_rank = std::max(1, *std::max_element(c.tokens_per_rank.begin(), c.tokens_per_rank.end()));
  p.recipe = c.recipe;
  p.wave_tokens = c.wave_tokens;
  return p;
}

struct Caller {
  Schedule schedule;
  void operator()(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                  cudaStream_t stream, const TensorView& stats) const {
    mega_moe(buffer, inputs, weights, y, stream, stats, CallOptions{schedule});
  }
};

// y against the reference, token by token (token_check.h): every element written (no poison left),
// each token within its bound; `skip` marks tokens not compared.
void check_y(const CaseData& data, const std::string& what, int32_t rank, const ReferenceResult& reference,
             const std::vector<uint16_t>& y, std::span<const uint8_t> skip = {}) {
  const TokenCheck check = check_tokens(y, reference.y[rank], data.problem.hidden, data.problem.recipe, skip,
                                        reference.slots[rank], data.problem.combine_slots());
  std::printf("%s rank %d: %d tokens compared, worst token %d normalized error %.3g (bound %.1e)\n", what.c_str(),
              rank, check.compared, check.worst_token, check.worst_error, token_bound(data.problem.recipe));
  if (!check.ok())
    throw Error(detail::concat("y: rank ", rank, " of ", what, ": ", check.failed, " of ", check.compared,
                               " tokens differ from the reference; the first: ", check.first_failure,
                               "; replay: ", data.replay));
}

// size_variants: every variant's inputs and output allocated and filled first, then variant_calls
// calls back to back, each on the next variant; every variant's last output and the statistics of
// all calls are checked.
void run_variants(Communicator& comm, const CaseData& data, SymmBuffer& buffer, const DeviceWeights& weights,
                  const Caller& call_layer) {
  const Problem& p = buffer.problem();
  const LayerCase& c = data.c;
  const size_t variants = c.size_variants.size();
  std::vector<std::unique_ptr<DeviceBatch>> inputs;
  std::vector<std::unique_ptr<Device<uint16_t>>> ys;
  for (size_t v = 0; v < variants; ++v) {
    const int32_t tokens = c.size_variants[v][p.rank];
    inputs.push_back(std::make_unique<DeviceBatch>(p, tokens));
    ys.push_back(std::make_unique<Device<uint16_t>>(size_t(tokens) * p.hidden));
  }
  Device<int64_t> stats(p.experts_per_rank());
  cudaStream_t stream = comm.stream();
  comm.barrier();  // every rank has allocated
  cuda_ok(cudaMemsetAsync(stats.data, 0, stats.count * sizeof(int64_t), stream), "cudaMemset");
  for (size_t v = 0; v < variants; ++v) {
    inputs[v]->fill(data.variant_batches[v][p.rank], stream);
    cuda_ok(cudaMemsetAsync(ys[v]->data, 0xFF, ys[v]->count * sizeof(uint16_t), stream), "poison y");
  }
  const TensorView stats_view =
      TensorView::contiguous(stats.data, DType::i64, {p.experts_per_rank()}, megamoe::Device::cuda);
  std::vector<int64_t> want(stats.count, 0);
  for (int32_t call = 0; call < c.variant_calls; ++call) {
    const size_t v = static_cast<size_t>(call) % variants;
    const int32_t tokens = c.size_variants[v][p.rank];
    call_layer(buffer, inputs[v]->inputs(), weights.view(),
               TensorView::contiguous(ys[v]->data, DType::bf16, {tokens, p.hidden}, megamoe::Device::cuda), stream,
               stats_view);
    for (size_t e = 0; e < want.size(); ++e) want[e] += data.variant_references[v].recv_counts[p.rank][e];
  }
  buffer.check_device_error(stream);
  for (size_t v = 0; v < variants; ++v) {
    std::vector<uint16_t> host_y(ys[v]->count);
    if (!host_y.empty())
      cuda_ok(cudaMemcpy(host_y.data(), ys[v]->data, host_y.size() * 2, cudaMemcpyDeviceToHost), "download y");
    check_y(data, "case " + c.name + " variant " + std::to_string(v), p.rank, data.variant_references[v], host_y);
  }
  std::vector<int64_t> host_stats(stats.count);
  cuda_ok(cudaMemcpy(host_stats.data(), stats.data, stats.count * 8, cudaMemcpyDeviceToHost), "download stats");
  for (size_t e = 0; e < want.size(); ++e)
    require(host_stats[e] == want[e], "recv_stats", "rank ", p.rank, " of case ", c.name, ": local expert ", e,
            " counted ", host_stats[e], " routes over ", c.variant_calls, " calls, the reference ", want[e],
            "; replay: ", data.replay);
  cuda_ok(cudaStreamSynchronize(stream), "variants");
  comm.barrier();  // no rank frees while another's kernels may still read its buffer
}

// repeat_expert: every third token's second slot names its first slot's expert.
void repeat_first_expert(const LayerCase& c, std::vector<RankBatch>& batches) {
  require(c.top_k >= 2 && c.masked_fraction == 0.0f, "repeat_expert", "case ", c.name,
          " needs top_k >= 2 and no masked routes");
  for (RankBatch& batch : batches)
    for (int32_t t = 0; t < batch.num_tokens; t += 3) {
      int32_t* ids = batch.topk_idx.data() + size_t(t) * c.top_k;
      ids[1] = ids[0];
    }
}

// nonfinite_tokens: up to four tokens of each rank, spread over its batch, each get one kind of
// non-finite input: a NaN in x; an infinite x scale (bf16: an infinity in x); a NaN route weight; a
// -infinity route weight (on an unmasked route, so that it is used).
void poison_tokens(const Problem& p, std::vector<RankBatch>& batches, std::vector<std::vector<uint8_t>>& poisoned) {
  constexpr int32_t kKinds = 4;
  constexpr size_t kElement = 5;  // any element of the row
  const float inf = std::numeric_limits<float>::infinity();
  poisoned.assign(batches.size(), {});
  for (size_t r = 0; r < batches.size(); ++r) {
    RankBatch& batch = batches[r];
    poisoned[r].assign(static_cast<size_t>(batch.num_tokens), 0);
    const int32_t count = std::min(kKinds, batch.num_tokens);
    for (int32_t kind = 0; kind < count; ++kind) {
      const int32_t t = kind * batch.num_tokens / count;
      poisoned[r][t] = 1;
      const size_t element = size_t(t) * p.hidden + kElement;
      const auto set_bf16_x = [&](uint16_t bits) {
        batch.x[2 * element] = static_cast<uint8_t>(bits & 0xFF);
        batch.x[2 * element + 1] = static_cast<uint8_t>(bits >> 8);
      };
      const int32_t* ids = batch.topk_idx.data() + size_t(t) * p.top_k;
      int32_t slot = 0;  // the first unmasked route, if there is one
      while (slot + 1 < p.top_k && ids[slot] < 0) ++slot;
      const size_t route = size_t(t) * p.top_k + slot;
      switch (kind) {
        case 0:
          if (p.recipe == Recipe::bf16) set_bf16_x(0x7FC0);
          else batch.x[element] = 0x7F;  // E4M3 NaN
          break;
        case 1:
          if (p.recipe == Recipe::bf16) set_bf16_x(0x7F80);
          else batch.x_scales[size_t(t) * (p.hidden / kScaleBlock)] = inf;
          break;
        case 2: batch.topk_weights[route] = std::numeric_limits<float>::quiet_NaN(); break;
        default: batch.topk_weights[route] = -inf; break;
      }
    }
  }
}

}  // namespace

std::unique_ptr<CaseData> prepare(const LayerCase& c) {
  auto data = std::make_unique<CaseData>();
  data->c = c;
  data->problem = case_problem(c);
  validate(data->problem);
  const uint64_t seed = testing::announced_test_seed(("case " + c.name).c_str());
  data->seed = seed;
  data->replay = testing::replay_command(seed);
  data->weights = std::make_unique<SyntheticWeights>(data->problem, seed);
  data->batches = synthetic_batches(data->problem, c.tokens_per_rank, c.routing, seed + 1, c.masked_fraction);
  if (c.repeat_expert) repeat_first_expert(c, data->batches);
  if (c.graph) {
    data->first_batches = synthetic_batches(data->problem, c.tokens_per_rank, c.routing, seed + 2, c.masked_fraction);
    const Problem& p = data->problem;
    data->first_recv_counts.assign(p.num_ranks, std::vector<uint32_t>(p.experts_per_rank(), 0));
    for (const RankBatch& batch : data->first_batches)
      for (int32_t expert : batch.topk_idx)
        if (expert >= 0) ++data->first_recv_counts[p.owner_rank(expert)][p.local_expert(expert)];
  }
  ReferenceOptions with_slots;  // the per-route check needs each route's contribution
  with_slots.keep_slots = true;
  data->reference = reference_moe(data->problem, data->batches, *data->weights, with_slots);
  if (c.nonfinite_tokens) poison_tokens(data->problem, data->batches, data->poisoned);
  if (c.capacity_margin) {
    data->problem.recv_capacity = most_routes_received(data->reference) + *c.capacity_margin;
    if (*c.capacity_margin < 0) {
      std::vector<int32_t> half(c.tokens_per_rank.size());
      for (size_t r = 0; r < half.size(); ++r) half[r] = c.tokens_per_rank[r] / 2;
      data->fitting_batches = synthetic_batches(data->problem, half, c.routing, seed + 7, c.masked_fraction);
      data->fitting_reference = reference_moe(data->problem, data->fitting_batches, *data->weights, with_slots);
      require(most_routes_received(data->fitting_reference) <= data->problem.recv_capacity, "capacity_margin",
              "case ", c.name, ": half the tokens must fit the capacity");
    }
  }
  for (size_t v = 0; v < c.size_variants.size(); ++v) {
    data->variant_batches.push_back(
        synthetic_batches(data->problem, c.size_variants[v], c.routing, seed + 3 + v, c.masked_fraction));
    data->variant_references.push_back(
        reference_moe(data->problem, data->variant_batches.back(), *data->weights, with_slots));
  }
  return data;
}

void run_rank(Communicator& comm, const CaseData& data, Schedule schedule) {
  const Caller call_layer{schedule};
  Problem p = data.problem;
  p.rank = comm.rank();
  const LayerCase& c = data.c;
  SymmBuffer buffer(comm, p);
  DeviceWeights weights(p, *data.weights);
  const int32_t tokens = c.tokens_per_rank[p.rank];
  DeviceBatch inputs(p, tokens);
  Device<uint16_t> y(size_t(tokens) * p.hidden);
  Device<int64_t> stats(p.experts_per_rank());
  cudaStream_t stream = comm.stream();
  cuda_ok(cudaMemsetAsync(stats.data, 0, stats.count * sizeof(int64_t), stream), "cudaMemset");
  const TensorView y_view = TensorView::contiguous(y.data, DType::bf16, {tokens, p.hidden}, megamoe::Device::cuda);
  const TensorView stats_view =
      TensorView::contiguous(stats.data, DType::i64, {p.experts_per_rank()}, megamoe::Device::cuda);
  // The call after a refused one (capacity_margin < 0) has its own inputs.
  std::optional<DeviceBatch> fitting;
  if (!data.fitting_batches.empty()) fitting.emplace(p, data.fitting_batches[p.rank].num_tokens);
  // Emulated ranks share one GPU, where an allocation may wait for another rank's spinning kernel:
  // every rank allocates before any rank launches, and frees only after every rank has finished.
  comm.barrier();
  struct FinishTogether {
    Communicator& comm;
    cudaStream_t stream;
    ~FinishTogether() {
      cudaStreamSynchronize(stream);
      try {
        comm.barrier();
      } catch (const Error&) {  // the group gave up: another rank failed, and reports it
      }
    }
  } finish_together{comm, stream};

  if (!c.size_variants.empty()) return run_variants(comm, data, buffer, weights, call_layer);
  if (c.hold_half_the_sms && p.rank == 0) {
    cudaStream_t other;
    cuda_ok(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "cudaStreamCreate");
    hold_half_the_sms(other);
    cuda_ok(cudaStreamDestroy(other), "cudaStreamDestroy");  // the kernel runs on
  }

  // What check_device_error reports after the call just made ("" for nothing).
  const auto reported_error = [&] {
    try {
      buffer.check_device_error(stream);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // A peer of the rank that called late or never (`which`): its call timed out, naming that rank.
  const auto require_timeout_naming = [&](int32_t rank, const char* which, const std::string& reported) {
    const std::string names_it = "for rank " + std::to_string(rank);
    require(reported.find("timed out") != std::string::npos && reported.find(names_it) != std::string::npos,
            "check_device_error", "rank ", p.rank, " of case ", c.name, ": expected a timeout naming the ", which,
            " rank ('", names_it, "'), got: ", reported.empty() ? "no error" : reported);
  };

  if (c.absent_rank >= 0) {
    if (p.rank == c.absent_rank) return;  // never calls; waits for the others in finish_together
    inputs.fill(data.batches[p.rank], stream);
    const auto start = std::chrono::steady_clock::now();
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, stats_view);
    const std::string reported = reported_error();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double timeout = static_cast<double>(buffer.view().timeout_ns) * 1e-9;
    std::printf("case %s rank %d: reported after %.2f s (timeout %.2f s): %s\n", c.name.c_str(), p.rank, seconds,
                timeout, reported.c_str());
    require_timeout_naming(c.absent_rank, "absent", reported);
    // Each later kernel of the call stops at once after the first timeout; a few timeouts are slack.
    require(seconds <= 3 * timeout + 2.0, "check_device_error", "rank ", p.rank, " of case ", c.name,
            ": reported after ", seconds, " s, more than three timeouts (", timeout, " s) and 2 s");
    return;
  }

  if (c.late_rank >= 0) {
    const double timeout = static_cast<double>(buffer.view().timeout_ns) * 1e-9;
    if (p.rank == c.late_rank) std::this_thread::sleep_for(std::chrono::duration<double>(3 * timeout));
    inputs.fill(data.batches[p.rank], stream);
    cuda_ok(cudaMemsetAsync(y.data, 0xFF, y.count * sizeof(uint16_t), stream), "poison y");
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, stats_view);
    const std::string reported = reported_error();
    std::printf("case %s rank %d%s: %s\n", c.name.c_str(), p.rank, p.rank == c.late_rank ? " (late)" : "",
                reported.empty() ? "no error" : reported.c_str());
    if (p.rank != c.late_rank) {
      require_timeout_naming(c.late_rank, "late", reported);
    } else if (reported.empty()) {
      // No error: then every token is exact, although the peers' calls broke before their experts ran.
      std::vector<uint16_t> host_y(y.count);
      if (!host_y.empty()) cuda_ok(cudaMemcpy(host_y.data(), y.data, y.count * 2, cudaMemcpyDeviceToHost), "download y");
      check_y(data, "case " + c.name + " (the late rank, no error reported)", p.rank, data.reference, host_y);
    }
    return;
  }

  if (c.capacity_margin && *c.capacity_margin < 0) {
    // Refused on every rank: y keeps its poison, and each rank's host hears of the capacity.
    inputs.fill(data.batches[p.rank], stream);
    cuda_ok(cudaMemsetAsync(y.data, 0xFF, y.count * sizeof(uint16_t), stream), "poison y");
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, {});
    std::string reported;
    try {
      buffer.check_device_error(stream);
    } catch (const Error& e) {
      reported = e.what();
    }
    std::printf("case %s rank %d reported: %s\n", c.name.c_str(), p.rank, reported.c_str());
    require(reported.find("receive capacity") != std::string::npos, "check_device_error", "rank ", p.rank,
            " of case ", c.name, ": expected the refused call's error, got: ", reported.empty() ? "no error" : reported);
    std::vector<uint16_t> host_y(y.count);
    if (!host_y.empty()) cuda_ok(cudaMemcpy(host_y.data(), y.data, y.count * 2, cudaMemcpyDeviceToHost), "download y");
    for (size_t i = 0; i < host_y.size(); ++i)
      require(host_y[i] == 0xFFFF, "y", "rank ", p.rank, " of case ", c.name, ": a refused call wrote element ", i);
    // The error checked, the buffer is whole: a call that fits is exact.
    const int32_t fitting_tokens = data.fitting_batches[p.rank].num_tokens;
    fitting->fill(data.fitting_batches[p.rank], stream);
    const TensorView fitting_y =
        TensorView::contiguous(y.data, DType::bf16, {fitting_tokens, p.hidden}, megamoe::Device::cuda);
    call_layer(buffer, fitting->inputs(), weights.view(), fitting_y, stream, {});
    buffer.check_device_error(stream);
    host_y.assign(size_t(fitting_tokens) * p.hidden, 0);
    if (!host_y.empty()) cuda_ok(cudaMemcpy(host_y.data(), y.data, host_y.size() * 2, cudaMemcpyDeviceToHost), "y");
    check_y(data, "case " + c.name + " (the call after the refused one)", p.rank, data.fitting_reference, host_y);
    return;
  }

  if (c.bad_expert_rank >= 0) {
    RankBatch batch = data.batches[p.rank];
    if (p.rank == c.bad_expert_rank && tokens > 0) batch.topk_idx[0] = p.num_experts + 5;
    inputs.fill(batch, stream);
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, stats_view);
    bool reported = false;
    try {
      buffer.check_device_error(stream);
    } catch (const Error& e) {
      reported = std::string(e.what()).find(std::to_string(p.num_experts + 5)) != std::string::npos;
      std::printf("rank %d reported: %s\n", p.rank, e.what());
    }
    require(reported == (p.rank == c.bad_expert_rank), "topk_idx", "rank ", p.rank,
            reported ? " reported an error it did not have" : " did not report the out-of-range expert id");
    // The buffer stays usable after an input error: the next call, with valid routes, is exact (the
    // counters the failed call left behind were reset).
    inputs.fill(data.batches[p.rank], stream);
    cuda_ok(cudaMemsetAsync(y.data, 0xFF, y.count * sizeof(uint16_t), stream), "poison y");
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, {});
    buffer.check_device_error(stream);
    std::vector<uint16_t> host_y(y.count);
    if (!host_y.empty()) cuda_ok(cudaMemcpy(host_y.data(), y.data, y.count * 2, cudaMemcpyDeviceToHost), "download y");
    check_y(data, "case " + c.name, p.rank, data.reference, host_y);
    return;
  }

  const int64_t checked_calls = c.graph ? 2 : c.repeats;
  if (c.graph) {
    // One eager call, then capture a call and replay it twice: with the capture-time inputs, then
    // with the checked inputs written into the same tensors.
    inputs.fill(data.first_batches[p.rank], stream);
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, {});
    cuda_ok(cudaStreamSynchronize(stream), "eager call");
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, stats_view);
    cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    cuda_ok(cudaStreamSynchronize(stream), "replay");
    inputs.fill(data.batches[p.rank], stream);
    cuda_ok(cudaMemsetAsync(y.data, 0xFF, y.count * sizeof(uint16_t), stream), "poison y");
    cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    cuda_ok(cudaStreamSynchronize(stream), "replay");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  } else {
    inputs.fill(data.batches[p.rank], stream);
    for (int32_t call = 0; call < c.repeats; ++call) {
      cuda_ok(cudaMemsetAsync(y.data, 0xFF, y.count * sizeof(uint16_t), stream), "poison y");
      call_layer(buffer, inputs.inputs(), weights.view(), y_view, stream, stats_view);
    }
  }
  buffer.check_device_error(stream);

  std::vector<uint16_t> host_y(y.count);
  if (!host_y.empty()) cuda_ok(cudaMemcpy(host_y.data(), y.data, y.count * 2, cudaMemcpyDeviceToHost), "download y");
  check_y(data, "case " + c.name, p.rank, data.reference, host_y,
          data.poisoned.empty() ? std::span<const uint8_t>() : std::span<const uint8_t>(data.poisoned[p.rank]));

  // Statistics: every call adds the routes each local expert received. Graph cases captured the
  // statistics only in the graph, replayed once with each input set.
  std::vector<int64_t> host_stats(stats.count);
  cuda_ok(cudaMemcpy(host_stats.data(), stats.data, stats.count * 8, cudaMemcpyDeviceToHost), "download stats");
  std::vector<int64_t> want(stats.count, 0);
  for (size_t e = 0; e < want.size(); ++e) want[e] = int64_t(data.reference.recv_counts[p.rank][e]) * checked_calls;
  if (c.graph) {
    for (size_t e = 0; e < want.size(); ++e)
      want[e] = int64_t(data.reference.recv_counts[p.rank][e]) + int64_t(data.first_recv_counts[p.rank][e]);
  }
  for (size_t e = 0; e < want.size(); ++e)
    require(host_stats[e] == want[e], "recv_stats", "rank ", p.rank, " of case ", c.name, ": local expert ", e,
            " counted ", host_stats[e], " routes, the reference ", want[e], "; replay: ", data.replay);
}

}  // namespace megamoe::layer_test
