#include "cli/estimate.h"

#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <thread>

#include "megamoe/error.h"
#include "megamoe/layout.h"
#include "megamoe/weights.h"

namespace megamoe::cli {
namespace {

// What a CUDA context and the kernels' modules take on a GPU, beyond the layer's own allocations.
constexpr uint64_t kContextBytes = 1ull << 30;

uint64_t stored_bytes(const StoredExpertSizes& s) { return s.w1 + s.w2 + s.w1_scales + s.w2_scales; }

// One token's row in a batch: x, its 1x128 scales, top-k ids and weights.
uint64_t token_bytes(const Problem& p) {
  const uint64_t h = static_cast<uint64_t>(p.hidden);
  return h * static_cast<uint64_t>(activation_bytes(p.recipe)) + (p.recipe != Recipe::bf16 ? h / kScaleBlock * 4 : 0) +
         static_cast<uint64_t>(p.top_k) * 8;
}

uint64_t total_tokens(const Problem& p, int32_t tokens) {
  return static_cast<uint64_t>(p.num_ranks) * static_cast<uint64_t>(tokens);
}

}  // namespace

uint64_t batches_host_bytes(const Problem& p, int32_t tokens) { return total_tokens(p, tokens) * token_bytes(p); }

uint64_t cpu_run_host_bytes(const Problem& p, int32_t tokens, int threads) {
  const uint64_t t = total_tokens(p, tokens);
  const uint64_t h = static_cast<uint64_t>(p.hidden);
  const uint64_t i = static_cast<uint64_t>(p.intermediate);
  const uint64_t slots = static_cast<uint64_t>(p.combine_slots());
  const uint64_t routes = t * (static_cast<uint64_t>(p.top_k) + (p.num_shared_experts > 0 ? 1 : 0));
  // The reference's combine slots (BF16 and a written flag per slot), its routes (20 bytes each), y.
  uint64_t bytes = batches_host_bytes(p, tokens) + t * (slots * (2 * h + 1) + 4) + routes * 20 + t * 2 * h;
  // Each worker holds one expert in its stored format and FP32 tiles of 16 tokens.
  const uint64_t items = static_cast<uint64_t>(p.num_experts) + (p.num_shared_experts > 0 ? 1 : 0);
  const uint64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t workers = std::min<uint64_t>(items, threads > 0 ? static_cast<uint64_t>(threads) : hardware);
  const uint64_t shared_i = static_cast<uint64_t>(p.num_shared_experts) * i;
  uint64_t expert = stored_bytes(canonical_sizes(p.recipe, p.hidden, p.intermediate));
  if (shared_i > 0)
    expert = std::max(expert, 2 * stored_bytes(canonical_sizes(p.recipe, p.hidden, static_cast<int32_t>(shared_i))));
  bytes += workers * (expert + 16 * (h + 3 * std::max(i, shared_i)) * 4);
  return bytes;
}

uint64_t gpu_run_host_bytes(const Problem& p, int32_t tokens) {
  // Batches, the ranks' y in shared memory and its copy in the result.
  return batches_host_bytes(p, tokens) + 2 * total_tokens(p, tokens) * 2 * static_cast<uint64_t>(p.hidden);
}

uint64_t gpu_run_device_bytes(const Problem& p, int32_t tokens, bool emulated) {
  const uint64_t h = static_cast<uint64_t>(p.hidden);
  const uint64_t buffer = BufferLayout::make(p).total_bytes;
  const uint64_t experts = static_cast<uint64_t>(p.experts_per_rank());
  uint64_t weights = experts * stored_bytes(transformed_sizes(p.recipe, p.hidden, p.intermediate));
  if (p.num_shared_experts > 0)
    weights += stored_bytes(transformed_sizes(p.recipe, p.hidden, p.num_shared_experts * p.intermediate));
  if (p.recipe == Recipe::fp8_fp4) weights += weights / 8;  // the kernels' derived scales and shifts
  const uint64_t per_rank = buffer + weights + static_cast<uint64_t>(tokens) * (token_bytes(p) + 2 * h) +
                            experts * 8;
  return (emulated ? static_cast<uint64_t>(p.num_ranks) : 1) * per_rank + kContextBytes;
}

uint64_t dump_bytes(const Problem& p, const std::vector<RankBatch>& batches) {
  const uint64_t h = static_cast<uint64_t>(p.hidden);
  std::vector<bool> used(static_cast<size_t>(p.num_experts), false);
  uint64_t bytes = 64 * 1024;  // manifest and .npy headers
  for (const RankBatch& batch : batches) {
    bytes += batch.x.size() + batch.x_scales.size() * 4 + batch.topk_idx.size() * 8 +
             static_cast<uint64_t>(batch.num_tokens) * 2 * h + static_cast<uint64_t>(p.experts_per_rank()) * 4;
    for (int32_t expert : batch.topk_idx)
      if (expert >= 0 && expert < p.num_experts) used[static_cast<size_t>(expert)] = true;
  }
  const uint64_t expert = stored_bytes(canonical_sizes(p.recipe, p.hidden, p.intermediate));
  bytes += static_cast<uint64_t>(std::count(used.begin(), used.end(), true)) * expert;
  bytes += static_cast<uint64_t>(p.num_shared_experts) * expert;
  return bytes;
}

uint64_t available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

GpuProbe probe_gpus_in_child() {
  GpuProbe probe;
  int fds[2];
  if (pipe(fds) != 0) return probe;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    GpuProbe found;
    int count = 0;
    if (cudaGetDeviceCount(&count) == cudaSuccess) {
      for (int device = 0; device < count; ++device) {
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, device) != cudaSuccess || prop.major != 9) continue;
        found.min_memory_bytes = found.hopper_gpus == 0 ? prop.totalGlobalMem
                                                        : std::min<uint64_t>(found.min_memory_bytes, prop.totalGlobalMem);
        ++found.hopper_gpus;
      }
    }
    const ssize_t written = write(fds[1], &found, sizeof(found));
    _exit(written == static_cast<ssize_t>(sizeof(found)) ? 0 : 1);
  }
  close(fds[1]);
  if (pid > 0) {
    GpuProbe found;
    if (read(fds[0], &found, sizeof(found)) == static_cast<ssize_t>(sizeof(found))) probe = found;
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  close(fds[0]);
  return probe;
}

std::string format_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

void require_fits(const std::string& subject, const char* resource, uint64_t need, uint64_t have) {
  if (have == 0 || need <= have) return;
  throw Error(subject + " does not fit: needs about " + format_bytes(need) + " of " + resource + ", " +
              format_bytes(have) + " available");
}

}  // namespace megamoe::cli
