#include "layer/layer_scenarios.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "layer/sm_holder.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"

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
  return p;
}

struct Caller {
  Schedule schedule;
  void operator()(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                  cudaStream_t stream, const TensorView& stats) const {
    mega_moe(buffer, inputs, weights, y, stream, stats, CallOptions{schedule});
  }
};

// y against the reference: every element written (no poison left), normalized error within bound.
void check_y(const CaseData& data, int32_t rank, const std::vector<uint16_t>& y) {
  const std::vector<uint16_t>& want = data.reference.y[rank];
  double diff = 0, norm = 0;
  size_t worst = 0;
  double worst_error = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    const double got = bf16_to_float(y[i]), expected = bf16_to_float(want[i]);
    require(!std::isnan(got), "y", "rank ", rank, " of case ", data.c.name, ": element ", i, " (token ",
            i / data.problem.hidden, ") was not written or is NaN");
    diff += (got - expected) * (got - expected);
    norm += expected * expected;
    if (std::fabs(got - expected) > worst_error) {
      worst_error = std::fabs(got - expected);
      worst = i;
    }
  }
  const double error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  // fp8, fp8_fp4: the FP8 wgmma accumulates with ~14 mantissa bits, so ~0.5% of the re-quantized L1
  // outputs round to the neighbouring E4M3 code (6-12% off): a token sees about two such flips, and
  // its own error ~5e-3, rarely above 2e-2 (one 1-token rank measured 2.1e-2). The error of n tokens
  // averages n tokens' flips, so the bound is 2e-2 from 4 tokens on and widens as 1/sqrt(n) below.
  const double tokens = static_cast<double>(want.size()) / data.problem.hidden;
  const double bound = data.problem.recipe == Recipe::bf16 ? 5e-3 : 2e-2 * std::sqrt(4.0 / std::clamp(tokens, 1.0, 4.0));
  std::printf("case %s rank %d: y normalized error %.3g over %zu values (bound %.1e)\n", data.c.name.c_str(), rank,
              error, want.size(), bound);
  if (error > bound) {
    throw Error(detail::concat("y: rank ", rank, " of case ", data.c.name, ": normalized error ", error, " > ", bound,
                               "; worst element ", worst, " (token ", worst / data.problem.hidden, ") got ",
                               bf16_to_float(y[worst]), " want ", bf16_to_float(want[worst])));
  }
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
    CaseData view_data;
    view_data.c = c;
    view_data.c.name = c.name + " variant " + std::to_string(v);
    view_data.problem = data.problem;
    view_data.reference = data.variant_references[v];
    std::vector<uint16_t> host_y(ys[v]->count);
    if (!host_y.empty())
      cuda_ok(cudaMemcpy(host_y.data(), ys[v]->data, host_y.size() * 2, cudaMemcpyDeviceToHost), "download y");
    check_y(view_data, p.rank, host_y);
  }
  std::vector<int64_t> host_stats(stats.count);
  cuda_ok(cudaMemcpy(host_stats.data(), stats.data, stats.count * 8, cudaMemcpyDeviceToHost), "download stats");
  for (size_t e = 0; e < want.size(); ++e)
    require(host_stats[e] == want[e], "recv_stats", "rank ", p.rank, " of case ", c.name, ": local expert ", e,
            " counted ", host_stats[e], " routes over ", c.variant_calls, " calls, the reference ", want[e]);
  cuda_ok(cudaStreamSynchronize(stream), "variants");
  comm.barrier();  // no rank frees while another's kernels may still read its buffer
}

}  // namespace

std::unique_ptr<CaseData> prepare(const LayerCase& c) {
  auto data = std::make_unique<CaseData>();
  data->c = c;
  data->problem = case_problem(c);
  validate(data->problem);
  const uint64_t seed = std::random_device{}();
  std::printf("case %s: seed %llu\n", c.name.c_str(), static_cast<unsigned long long>(seed));
  data->weights = std::make_unique<SyntheticWeights>(data->problem, seed);
  data->batches = synthetic_batches(data->problem, c.tokens_per_rank, c.routing, seed + 1, c.masked_fraction);
  if (c.graph) {
    data->first_batches = synthetic_batches(data->problem, c.tokens_per_rank, c.routing, seed + 2, c.masked_fraction);
    const Problem& p = data->problem;
    data->first_recv_counts.assign(p.num_ranks, std::vector<uint32_t>(p.experts_per_rank(), 0));
    for (const RankBatch& batch : data->first_batches)
      for (int32_t expert : batch.topk_idx)
        if (expert >= 0) ++data->first_recv_counts[p.owner_rank(expert)][p.local_expert(expert)];
  }
  data->reference = reference_moe(data->problem, data->batches, *data->weights);
  for (size_t v = 0; v < c.size_variants.size(); ++v) {
    data->variant_batches.push_back(
        synthetic_batches(data->problem, c.size_variants[v], c.routing, seed + 3 + v, c.masked_fraction));
    data->variant_references.push_back(reference_moe(data->problem, data->variant_batches.back(), *data->weights));
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
    check_y(data, p.rank, host_y);
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
  check_y(data, p.rank, host_y);

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
            " counted ", host_stats[e], " routes, the reference ", want[e]);
}

}  // namespace megamoe::layer_test
