#include "cli/backend.h"

#include "comm/launcher.h"

namespace megamoe::cli {

namespace {

// Whether a Hopper GPU is present, asked in a child process: this process must stay free of CUDA so
// that the GPU backend can still fork one NCCL rank per GPU.
bool find_hopper(std::string& found) {
  const int32_t count = count_hopper_gpus_in_child();
  found = std::to_string(count) + " Hopper GPU" + (count == 1 ? "" : "s");
  return count > 0;
}

}  // namespace

std::string_view to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::automatic: return "auto";
    case BackendKind::cpu: return "cpu";
    case BackendKind::gpu: return "gpu";
  }
  return "?";
}

bool parse_backend(std::string_view text, BackendKind& kind) {
  for (BackendKind candidate : {BackendKind::automatic, BackendKind::cpu, BackendKind::gpu}) {
    if (text == to_string(candidate)) {
      kind = candidate;
      return true;
    }
  }
  return false;
}

BackendChoice choose_backend(BackendKind requested) {
  if (requested != BackendKind::automatic) return {requested, "requested with --backend"};
  std::string found;
  const bool hopper = find_hopper(found);
  if (!hopper) return {BackendKind::cpu, "auto: no Hopper GPU (found " + found + ")"};
  return {BackendKind::gpu, "auto: Hopper GPU " + found};
}

BackendResult run_cpu_backend(const Problem& problem, const std::vector<RankBatch>& batches,
                              const SyntheticWeights& weights, const BackendOptions& options) {
  ReferenceOptions reference_options;
  reference_options.threads = options.threads;
  reference_options.progress = options.progress;
  reference_options.activation_clamp = options.activation_clamp;
  return {reference_moe(problem, batches, weights, reference_options), "cpu"};
}

BackendResult run_backend(BackendKind kind, const Problem& problem, const std::vector<RankBatch>& batches,
                          const SyntheticWeights& weights, const BackendOptions& options) {
  if (kind == BackendKind::gpu) return run_gpu_backend(problem, batches, weights, options);
  return run_cpu_backend(problem, batches, weights, options);
}

}  // namespace megamoe::cli
