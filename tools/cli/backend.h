// Backends of `megamoe run`: the CPU reference, or the GPU layer (gpu_backend.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/estimate.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"

namespace megamoe::cli {

enum class BackendKind { automatic, cpu, gpu };

std::string_view to_string(BackendKind kind);
bool parse_backend(std::string_view text, BackendKind& kind);

struct BackendOptions {
  int threads = 0;  // CPU worker threads, 0 = all hardware threads
  // Called now and then from the calling thread with (units done, units to do).
  std::function<void(int64_t, int64_t)> progress;
  float activation_clamp = 0.0f;  // the preset's clamp before SwiGLU (megamoe/activation.h); 0: none
};

struct BackendResult {
  ReferenceResult result;  // y and receive counts of every rank
  std::string name;        // "cpu" or "gpu"
};

// Runs on all local GPUs (emulated ranks when there are fewer GPUs than ranks) and checks a sample of
// tokens against the CPU reference.
BackendResult run_gpu_backend(const Problem& problem, const std::vector<RankBatch>& batches,
                              const SyntheticWeights& weights, const BackendOptions& options);

BackendResult run_cpu_backend(const Problem& problem, const std::vector<RankBatch>& batches,
                              const SyntheticWeights& weights, const BackendOptions& options);

struct BackendChoice {
  BackendKind kind = BackendKind::cpu;  // cpu or gpu, never automatic
  std::string reason;
  GpuProbe gpus;  // what the probe found; not probed (zeros) when cpu was requested
};

// `automatic` picks gpu when a Hopper GPU is present (all three recipes have GPU kernels), else cpu.
// gpu and automatic probe the GPUs in a child process (estimate.h).
BackendChoice choose_backend(BackendKind requested);

BackendResult run_backend(BackendKind kind, const Problem& problem, const std::vector<RankBatch>& batches,
                          const SyntheticWeights& weights, const BackendOptions& options);

}  // namespace megamoe::cli
