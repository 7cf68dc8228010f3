// Shared host code of the grouped GEMM's launchers: TMA descriptors, validation, the BLOCK_N
// dispatch. Each recipe's translation unit instantiates it for its policy.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/grouped_gemm.cuh"
#include "megamoe/error.h"

namespace megamoe::gemm {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so binaries do not link libcuda
// (CI machines without a driver still load them).
CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, uint64_t inner, uint64_t outer,
                               uint64_t row_stride_bytes, uint32_t box_inner, uint32_t box_outer,
                               CUtensorMapSwizzle swizzle, const char* what);

void check_launch(cudaError_t status, const char* what);

template <class Policy>
constexpr CUtensorMapDataType operand_type() {
  return Policy::kElementBytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

void validate_operands(const GemmOperands& operands, uint32_t element_bytes, bool scaled);

template <class Config, class Epilogue>
void launch_config(const GemmOperands& operands, const Epilogue& epilogue, int grid, cudaStream_t stream) {
  using Policy = typename Config::Policy;
  const CUtensorMap weights_map = make_tensor_map_2d(
      operands.weights, operand_type<Policy>(), operands.k, uint64_t{operands.num_groups} * operands.n_out,
      uint64_t{operands.k} * Policy::kElementBytes, Config::kBlockK, Config::kBlockM, CU_TENSOR_MAP_SWIZZLE_128B,
      "weights");
  const CUtensorMap acts_map = make_tensor_map_2d(operands.acts, operand_type<Policy>(), operands.k,
                                                  operands.act_rows, uint64_t{operands.k} * Policy::kElementBytes,
                                                  Config::kBlockK, Config::kBlockN, CU_TENSOR_MAP_SWIZZLE_128B, "acts");
  CUtensorMap act_scales_map{};
  if constexpr (Policy::kScaled) {
    act_scales_map = make_tensor_map_2d(operands.act_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, operands.act_rows,
                                        operands.k / 128, uint64_t{operands.act_rows} * 4, Config::kScaleBoxRows, 1,
                                        CU_TENSOR_MAP_SWIZZLE_NONE, "act_scales");
  }
  MainloopArgs args;
  args.n_out = operands.n_out;
  args.k = operands.k;
  args.k_blocks = operands.k / Config::kBlockK;
  args.m_tiles = (operands.n_out + Config::kBlockM - 1) / Config::kBlockM;
  args.groups = operands.groups;
  args.weight_scales = operands.weight_scales;
  args.watch = PipelineWatch{operands.control, operands.rank, operands.timeout_ns};

  auto kernel = grouped_gemm_kernel<Config, Epilogue>;
  static const bool configured = [&] {
    check_launch(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes),
                 "cudaFuncSetAttribute(grouped GEMM shared memory)");
    return true;
  }();
  (void)configured;
  kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(weights_map, acts_map, act_scales_map, args,
                                                                  epilogue);
  check_launch(cudaGetLastError(), "grouped GEMM launch");
}

// Launches the kernel whose token tile is `block_n` (16, 32, ... up to the policy's largest).
template <class Policy, template <class> class EpilogueFor, uint32_t kBlockN, class Output>
void launch_block_n(uint32_t block_n, const GemmOperands& operands, const Output& output, int grid,
                    cudaStream_t stream) {
  if constexpr (kBlockN < Policy::kMaxBlockN) {
    if (block_n > kBlockN) {
      return launch_block_n<Policy, EpilogueFor, 2 * kBlockN>(block_n, operands, output, grid, stream);
    }
  }
  using Config = GemmConfig<Policy, kBlockN>;
  launch_config<Config>(operands, EpilogueFor<Config>::make(operands, output), grid, stream);
}

template <class Policy, template <class> class EpilogueFor, class Output>
void launch_policy(const GemmOperands& operands, const Output& output, int grid, cudaStream_t stream) {
  validate_operands(operands, Policy::kElementBytes, Policy::kScaled);
  require(grid >= 1, "grid", "must be at least 1, got ", grid);
  const uint32_t block_n = choose_block_n(operands.expected_rows_per_group, Policy::kMaxBlockN);
  launch_block_n<Policy, EpilogueFor, 16>(block_n, operands, output, grid, stream);
}

template <class Config>
struct SwigluEpilogueFor {
  static SwigluEpilogue<Config> make(const GemmOperands& operands, const SwigluOutput& output) {
    require(operands.n_out % 256 == 0, "n_out", "of the L1 GEMM (2 * intermediate) must be a multiple of 256, got ",
            operands.n_out);
    return SwigluEpilogue<Config>{output.acts, output.scales, output.row_weights, operands.n_out / 2,
                                  output.scale_rows};
  }
};

template <class Destination>
struct StoreEpilogueFor {
  template <class Config>
  struct With {
    static StoreEpilogue<Config, Destination> make(const GemmOperands& operands, const Destination& destination) {
      return StoreEpilogue<Config, Destination>{destination, operands.n_out};
    }
  };
};

}  // namespace megamoe::gemm

namespace megamoe::gemm::detail {
// One translation unit per recipe instantiates its kernels (gemm_fp8.cu, gemm_bf16.cu).
void fp8_swiglu(const GemmOperands&, const SwigluOutput&, int, cudaStream_t);
void fp8_store(const GemmOperands&, const RoutedDestination&, int, cudaStream_t);
void fp8_store(const GemmOperands&, const SharedDestination&, int, cudaStream_t);
void bf16_swiglu(const GemmOperands&, const SwigluOutput&, int, cudaStream_t);
void bf16_store(const GemmOperands&, const RoutedDestination&, int, cudaStream_t);
void bf16_store(const GemmOperands&, const SharedDestination&, int, cudaStream_t);
}  // namespace megamoe::gemm::detail
