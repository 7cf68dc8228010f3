// Shared host code of the grouped GEMM's launchers: TMA descriptors, validation, the BLOCK_N
// dispatch. Each recipe's translation unit instantiates it for its policy.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <mutex>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/grouped_gemm.cuh"
#include "kernels/gemm/tensor_map.h"
#include "kernels/overlapped_launch.cuh"
#include "megamoe/error.h"

namespace megamoe::gemm {

void check_launch(cudaError_t status, const char* what);

inline constexpr int kMaxDevices = 64;

template <class Policy>
constexpr CUtensorMapDataType operand_type() {
  return Policy::kElementBytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A kernel's shared-memory limit is an attribute of each device: set once per device a process
// launches on (a process may drive several GPUs).
template <auto kKernel>
void configure_once_per_device(uint32_t smem_bytes, const char* what) {
  static std::once_flag once[kMaxDevices];
  int device = 0;
  check_launch(cudaGetDevice(&device), "cudaGetDevice");
  require(device >= 0 && device < kMaxDevices, "device", "index ", device, " is past the ", kMaxDevices,
          " devices a process may launch on");
  std::call_once(once[device], [&] {
    check_launch(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)), what);
  });
}

// The TMA descriptors and mainloop arguments of one job under a config.
template <class Config, class Epilogue>
GemmJob<Epilogue> make_job(const GemmOperands& operands, const Epilogue& epilogue) {
  using Policy = typename Config::Policy;
  GemmJob<Epilogue> job{};
  const uint64_t weight_rows = uint64_t{operands.num_groups} * operands.n_out;
  if constexpr (Config::kPacked) {
    // E2M1 pairs: 64 bytes hold a K block of a row, 64-byte swizzled (pipeline.cuh: the raw area).
    job.weights_map = make_tensor_map_2d(operands.weights, CU_TENSOR_MAP_DATA_TYPE_UINT8, operands.k / 2, weight_rows,
                                         operands.k / 2, Config::kBlockK / 2, Config::kBlockM,
                                         CU_TENSOR_MAP_SWIZZLE_64B, "weights");
  } else {
    job.weights_map = make_tensor_map_2d(operands.weights, operand_type<Policy>(), operands.k, weight_rows,
                                         uint64_t{operands.k} * Policy::kElementBytes, Config::kBlockK,
                                         Config::kBlockM, CU_TENSOR_MAP_SWIZZLE_128B, "weights");
  }
  job.acts_map = make_tensor_map_2d(operands.acts, operand_type<Policy>(), operands.k, operands.act_rows,
                                    uint64_t{operands.k} * Policy::kElementBytes, Config::kBlockK, Config::kBlockN,
                                    CU_TENSOR_MAP_SWIZZLE_128B, "acts");
  if constexpr (Policy::kScaled) {
    job.act_scales_map = make_tensor_map_2d(operands.act_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, operands.act_rows,
                                            operands.k / 128, uint64_t{operands.act_rows} * 4, Config::kScaleBoxRows,
                                            1, CU_TENSOR_MAP_SWIZZLE_NONE, "act_scales");
  }
  MainloopArgs& args = job.args;
  args.n_out = operands.n_out;
  args.k = operands.k;
  args.k_blocks = operands.k / Config::kBlockK;
  args.m_tiles = (operands.n_out + Config::kBlockM - 1) / Config::kBlockM;
  args.groups = operands.groups;
  args.weight_scales = operands.weight_scales;
  args.weight_shifts = operands.weight_shifts;
  args.weight_rows = static_cast<uint32_t>(weight_rows);
  args.watch = PipelineWatch{operands.control, operands.rank, operands.timeout_ns};
  job.epilogue = epilogue;
  return job;
}

// A config's view of the split-K workspace: no capacity for configs that do not split.
template <class Config>
SplitArgs split_args(const SplitWorkspace& workspace) {
  SplitArgs split;
  if (kSplitsK<Config> && workspace.data != nullptr) {
    split.counters = static_cast<uint32_t*>(workspace.data);
    split.partials = reinterpret_cast<float*>(static_cast<char*>(workspace.data) + kSplitPartialsOffset);
    split.capacity_units = split_capacity_units(workspace.bytes, kSplitUnitBytes<Config>);
  }
  return split;
}

template <class Config, template <class> class EpilogueFor, class Job>
void launch_config(std::span<const Job> jobs, int grid, cudaStream_t stream) {
  using Epilogue = decltype(EpilogueFor<Config>::make(jobs[0].operands, jobs[0].output));
  GemmJobs<Epilogue> params{};
  params.num_jobs = static_cast<uint32_t>(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j)
    params.job[j] = make_job<Config>(jobs[j].operands, EpilogueFor<Config>::make(jobs[j].operands, jobs[j].output));
  const SplitWorkspace& workspace = jobs[0].operands.split_workspace;
  if (workspace.data != nullptr) params.unit_counter = static_cast<uint32_t*>(workspace.data) + kGemmUnitCounter;
  params.split = split_args<Config>(workspace);

  auto kernel = grouped_gemm_kernel<Config, Epilogue>;
  configure_once_per_device<grouped_gemm_kernel<Config, Epilogue>>(Config::kSmemBytes, "grouped GEMM");
  check_launch(launch_kernel(kernel, grid, Config::kThreads, Config::kSmemBytes, stream,
                             jobs[0].operands.overlapped_launch, params),
               "grouped GEMM launch");
}

// Which epilogues hand their prefill rows to store warps (GemmConfig::kStoreWarps): the L2 one.
template <template <class> class EpilogueFor>
inline constexpr bool kStoreWarpsFor = false;
template <class Config>
struct StoreEpilogueFor;
template <>
inline constexpr bool kStoreWarpsFor<StoreEpilogueFor> = true;

void validate_jobs(std::span<const GemmOperands* const> operands, uint32_t element_bytes, bool scaled);
void validate_packed_weights(const GemmOperands& operands);

// Launches the kernel of the first job's tile shape.
template <class Policy, template <class> class EpilogueFor, class Job>
void launch_policy(std::span<const Job> jobs, int grid, cudaStream_t stream) {
  require(!jobs.empty() && jobs.size() <= kMaxJobs, "jobs", "a launch runs 1..", kMaxJobs, " GEMMs, got ",
          jobs.size());
  const GemmOperands* operands[kMaxJobs] = {};
  for (size_t j = 0; j < jobs.size(); ++j) operands[j] = &jobs[j].operands;
  validate_jobs({operands, jobs.size()}, Policy::kElementBytes, Policy::kScaled);
  if constexpr (Policy::kPackedWeights)
    for (size_t j = 0; j < jobs.size(); ++j) validate_packed_weights(*operands[j]);
  require(grid >= 1, "grid", "must be at least 1, got ", grid);
  const auto launch = [&](auto config) { launch_config<decltype(config), EpilogueFor>(jobs, grid, stream); };
  const GemmOperands& first = jobs[0].operands;
  const TileShape shape = first.tile;
  if (shape.layout == TileLayout::tokens_on_m) {
    if constexpr (kStoreWarpsFor<EpilogueFor> && !Policy::kPackedWeights)
      return launch(GemmConfig<Policy, TileLayout::tokens_on_m, 128, true>{});
    else
      return launch(GemmConfig<Policy, TileLayout::tokens_on_m, 128>{});
  }
  if (shape.block_n == 16) return launch(GemmConfig<Policy, TileLayout::weights_on_m, 16>{});
  return launch(GemmConfig<Policy, TileLayout::weights_on_m, 64>{});
}

template <class Config>
struct SwigluEpilogueFor {
  static SwigluEpilogue<Config> make(const GemmOperands& operands, const SwigluOutput& output) {
    require(operands.n_out % 256 == 0, "n_out", "of the L1 GEMM (2 * intermediate) must be a multiple of 256, got ",
            operands.n_out);
    return SwigluEpilogue<Config>{output.acts, output.scales, output.row_weights, operands.n_out / 2,
                                  output.scale_rows, output.activation_clamp};
  }
};

template <class Config>
struct StoreEpilogueFor {
  static StoreEpilogue<Config> make(const GemmOperands& operands, const SlotDestination& destination) {
    return StoreEpilogue<Config>{destination, operands.n_out};
  }
};

}  // namespace megamoe::gemm

namespace megamoe::gemm::detail {
// One translation unit per recipe instantiates its kernels (gemm_fp8.cu, gemm_fp8_fp4.cu, gemm_bf16.cu).
void fp8_swiglu(std::span<const SwigluJob>, int, cudaStream_t);
void fp8_store(std::span<const StoreJob>, int, cudaStream_t);
void fp8_fp4_swiglu(std::span<const SwigluJob>, int, cudaStream_t);
void fp8_fp4_store(std::span<const StoreJob>, int, cudaStream_t);
void bf16_swiglu(std::span<const SwigluJob>, int, cudaStream_t);
void bf16_store(std::span<const StoreJob>, int, cudaStream_t);
}  // namespace megamoe::gemm::detail
