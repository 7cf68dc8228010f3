#include "cli/backend.h"

namespace megamoe::cli {

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
  if (requested == BackendKind::cpu) return {requested, "requested with --backend", {}};
  const GpuProbe gpus = probe_gpus_in_child();
  if (requested == BackendKind::gpu) return {requested, "requested with --backend", gpus};
  const std::string found = std::to_string(gpus.hopper_gpus) + " Hopper GPU" + (gpus.hopper_gpus == 1 ? "" : "s");
  if (gpus.hopper_gpus == 0) return {BackendKind::cpu, "auto: no Hopper GPU (found " + found + ")", gpus};
  return {BackendKind::gpu, "auto: Hopper GPU " + found, gpus};
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
