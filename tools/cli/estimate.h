// What a `megamoe run` will need, known before it starts: host memory, GPU memory, disk for --dump,
// and what the machine has. Estimates count the large arrays (batches, outputs, buffers, weights),
// so a problem that cannot fit is refused before any work instead of after minutes of it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "megamoe/problem.h"
#include "megamoe/reference.h"

namespace megamoe::cli {

// Host bytes of the synthetic batches of every rank, `tokens` each.
uint64_t batches_host_bytes(const Problem& problem, int32_t tokens);

// Host bytes of the CPU backend (the reference for all ranks), batches included. `threads` 0 = all.
uint64_t cpu_run_host_bytes(const Problem& problem, int32_t tokens, int threads);

// Host bytes of the GPU backend (batches, the ranks' outputs, the sampled check).
uint64_t gpu_run_host_bytes(const Problem& problem, int32_t tokens);

// Device bytes one GPU needs: its rank's buffer, weights, inputs and output, or every rank's when
// the ranks are emulated on one GPU; plus an allowance for the CUDA context.
uint64_t gpu_run_device_bytes(const Problem& problem, int32_t tokens, bool emulated);

// Bytes `megamoe run --dump` writes for these batches (the weights of every expert they route to).
uint64_t dump_bytes(const Problem& problem, const std::vector<RankBatch>& batches);

// MemAvailable of /proc/meminfo (0 when unknown).
uint64_t available_host_bytes();

// Hopper GPUs and the smallest memory among them, asked in a child process (this one must stay free
// of CUDA so the GPU backend can fork NCCL ranks).
struct GpuProbe {
  int32_t hopper_gpus = 0;
  uint64_t min_memory_bytes = 0;
};
GpuProbe probe_gpus_in_child();

// "1.23 GiB" (or MiB, KiB, B, TiB as fits).
std::string format_bytes(uint64_t bytes);

// Throws megamoe::Error "<subject> does not fit: needs about N of <resource>, M available" when
// need > have; does nothing when `have` is unknown (0).
void require_fits(const std::string& subject, const char* resource, uint64_t need, uint64_t have);

}  // namespace megamoe::cli
