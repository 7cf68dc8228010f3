// The GPU backend of `megamoe run`: the whole layer on the local GPUs (one process per GPU through
// NCCL when there are enough GPUs, else emulated ranks on GPU 0), then a check of a sample of
// tokens against the CPU reference.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cli/backend.h"
#include "comm/launcher.h"
#include "megamoe/comm.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"

namespace megamoe::cli {
namespace {

// Tokens per rank checked against the CPU reference.
constexpr int32_t kSampledTokens = 4;

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

// Memory the rank processes write their results into (anonymous, shared across fork).
class SharedResults {
 public:
  SharedResults(const Problem& p, const std::vector<RankBatch>& batches) {
    uint64_t offset = 0;
    for (const RankBatch& batch : batches) {
      y_offsets_.push_back(offset);
      offset += uint64_t(batch.num_tokens) * p.hidden * sizeof(uint16_t);
    }
    stats_offset_ = (offset + 7) / 8 * 8;
    bytes_ = stats_offset_ + uint64_t(p.num_ranks) * (p.experts_per_rank() + 1) * sizeof(int64_t);
    base_ = static_cast<char*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    require(base_ != MAP_FAILED, "--backend gpu", "could not map ", bytes_, " bytes of shared memory");
    experts_per_rank_ = p.experts_per_rank();
  }
  ~SharedResults() { munmap(base_, bytes_); }
  uint16_t* y(int32_t rank) const { return reinterpret_cast<uint16_t*>(base_ + y_offsets_[rank]); }
  // [experts_per_rank] receive counts, then the call's time in nanoseconds.
  int64_t* stats(int32_t rank) const {
    return reinterpret_cast<int64_t*>(base_ + stats_offset_) + int64_t(rank) * (experts_per_rank_ + 1);
  }

 private:
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t stats_offset_ = 0;
  int32_t experts_per_rank_ = 0;
  std::vector<uint64_t> y_offsets_;
};

void run_rank(Communicator& comm, const Problem& problem, const std::vector<RankBatch>& batches, uint64_t seed,
              float activation_clamp, const SharedResults& results) {
  Problem p = problem;
  p.rank = comm.rank();
  const RankBatch& batch = batches[p.rank];
  SymmBuffer buffer(comm, p);
  const auto weights = DeviceWeights::synthetic(p, seed);
  DeviceBatch inputs(p, batch.num_tokens);
  void* y = nullptr;
  void* stats = nullptr;
  cuda_ok(cudaMalloc(&y, std::max<uint64_t>(16, uint64_t(batch.num_tokens) * p.hidden * 2)), "cudaMalloc(y)");
  cuda_ok(cudaMalloc(&stats, p.experts_per_rank() * sizeof(int64_t)), "cudaMalloc(stats)");
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  cudaStream_t stream = comm.stream();
  inputs.fill(batch, stream);
  const TensorView y_view = TensorView::contiguous(y, DType::bf16, {batch.num_tokens, p.hidden}, Device::cuda);
  const TensorView stats_view = TensorView::contiguous(stats, DType::i64, {p.experts_per_rank()}, Device::cuda);
  comm.barrier();  // every rank has allocated before any rank launches

  auto call = [&](const TensorView& statistics) {
    LayerInputs layer_inputs = inputs.inputs();
    layer_inputs.activation_clamp = activation_clamp;
    mega_moe(buffer, layer_inputs, weights->view(), y_view, stream, statistics);
  };
  call({});  // warm-up: module loading, TMA descriptors
  cuda_ok(cudaMemsetAsync(stats, 0, p.experts_per_rank() * sizeof(int64_t), stream), "cudaMemsetAsync");
  cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
  call(stats_view);
  cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
  buffer.check_device_error(stream);
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cuda_ok(cudaMemcpy(results.y(p.rank), y, uint64_t(batch.num_tokens) * p.hidden * 2, cudaMemcpyDeviceToHost),
          "download y");
  cuda_ok(cudaMemcpy(results.stats(p.rank), stats, p.experts_per_rank() * sizeof(int64_t), cudaMemcpyDeviceToHost),
          "download receive counts");
  results.stats(p.rank)[p.experts_per_rank()] = static_cast<int64_t>(ms * 1e6);
  comm.barrier();  // no rank frees while another still runs
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(y);
  cudaFree(stats);
}

// Compares kSampledTokens evenly spaced tokens of every rank with the CPU reference.
void check_sample(const Problem& problem, const std::vector<RankBatch>& batches, const SyntheticWeights& weights,
                  float activation_clamp, const ReferenceResult& gpu) {
  std::vector<std::vector<int32_t>> subset(batches.size());
  for (size_t r = 0; r < batches.size(); ++r) {
    const int32_t tokens = batches[r].num_tokens;
    for (int32_t i = 0; i < std::min(tokens, kSampledTokens); ++i)
      subset[r].push_back(static_cast<int32_t>(int64_t(i) * tokens / std::min(tokens, kSampledTokens)));
  }
  ReferenceOptions options;
  options.token_subset = &subset;
  options.activation_clamp = activation_clamp;
  const ReferenceResult reference = reference_moe(problem, batches, weights, options);
  double diff = 0, norm = 0;
  size_t checked = 0;
  for (size_t r = 0; r < batches.size(); ++r) {
    for (int32_t token : subset[r]) {
      for (int32_t h = 0; h < problem.hidden; ++h) {
        const size_t i = size_t(token) * problem.hidden + h;
        const double got = bf16_to_float(gpu.y[r][i]), want = bf16_to_float(reference.y[r][i]);
        diff += (got - want) * (got - want);
        norm += want * want;
      }
      ++checked;
    }
  }
  const double error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  const double bound = problem.recipe == Recipe::bf16 ? 5e-3 : 2e-2;  // E4M3 activations: 2e-2
  std::printf("check: %zu sampled tokens against the CPU reference, normalized error %.3g (bound %.0e)\n", checked,
              error, bound);
  require(error <= bound, "--backend gpu", "the sampled tokens differ from the CPU reference: normalized error ", error,
          " > ", bound);
  for (size_t r = 0; r < batches.size(); ++r)
    for (size_t e = 0; e < gpu.recv_counts[r].size(); ++e)
      require(gpu.recv_counts[r][e] == reference.recv_counts[r][e], "--backend gpu", "rank ", r, " local expert ", e,
              " received ", gpu.recv_counts[r][e], " routes on the GPU, ", reference.recv_counts[r][e], " per the reference");
}

}  // namespace

BackendResult run_gpu_backend(const Problem& problem, const std::vector<RankBatch>& batches,
                              const SyntheticWeights& weights, const BackendOptions& options) {
  // Counted in a child process: this one must stay free of CUDA to fork NCCL ranks.
  const int32_t gpus = count_hopper_gpus_in_child();
  require(gpus >= 1, "--backend gpu", "needs a Hopper GPU; found none");
  const LaunchMode mode = gpus >= problem.num_ranks ? LaunchMode::processes : LaunchMode::emulated;
  std::printf("gpu: %d ranks %s\n", problem.num_ranks,
              mode == LaunchMode::processes ? "as processes, one per GPU (NCCL)" : "emulated on GPU 0");
  std::fflush(stdout);
  if (options.progress) options.progress(0, 2);
  SharedResults results(problem, batches);
  const int failed = run_ranks(problem.num_ranks, mode, [&](Communicator& comm) {
    run_rank(comm, problem, batches, weights.seed(), options.activation_clamp, results);
  });
  require(failed == 0, "--backend gpu", failed, " of ", problem.num_ranks, " ranks failed (see above)");
  if (options.progress) options.progress(1, 2);

  BackendResult outcome;
  outcome.name = "gpu";
  for (int32_t r = 0; r < problem.num_ranks; ++r) {
    const uint16_t* y = results.y(r);
    outcome.result.y.emplace_back(y, y + size_t(batches[r].num_tokens) * problem.hidden);
    const int64_t* stats = results.stats(r);
    outcome.result.recv_counts.emplace_back(stats, stats + problem.experts_per_rank());
    std::printf("gpu: rank %d layer call %.1f us\n", r, stats[problem.experts_per_rank()] / 1e3);
  }
  check_sample(problem, batches, weights, options.activation_clamp, outcome.result);
  if (options.progress) options.progress(2, 2);
  return outcome;
}

}  // namespace megamoe::cli
