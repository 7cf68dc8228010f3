#include "kernels/gemm/gemm.h"

#include <vector>

#include "kernels/gemm/fp4_scales.h"
#include "kernels/gemm/launch.cuh"
#include "megamoe/error.h"

namespace megamoe::gemm {

void check_launch(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, uint64_t inner, uint64_t outer,
                               uint64_t row_stride_bytes, uint32_t box_inner, uint32_t box_outer,
                               CUtensorMapSwizzle swizzle, const char* what) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_launch(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault,
                                                  &found),
                 "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    require(found == cudaDriverEntryPointSuccess && function != nullptr, "cuTensorMapEncodeTiled",
            "is not available from the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  require(result == CUDA_SUCCESS, what, "cannot be described for TMA (cuTensorMapEncodeTiled error ",
          static_cast<int>(result), "): base ", base, ", ", inner, " x ", outer, " elements, row stride ",
          row_stride_bytes, " bytes");
  return map;
}

namespace {

void validate_operands(const GemmOperands& operands, uint32_t element_bytes, bool scaled) {
  require(operands.num_groups >= 1, "num_groups", "must be at least 1");
  require(operands.groups.num_groups >= 1 && operands.groups.num_groups <= kMaxGroups, "groups",
          "must number 1..", kMaxGroups, ", got ", operands.groups.num_groups);
  require(operands.n_out >= 64 && operands.n_out % 64 == 0, "n_out", "must be a positive multiple of 64, got ",
          operands.n_out);
  require(operands.k >= 128 && operands.k % 128 == 0, "k", "must be a positive multiple of 128, got ", operands.k);
  require(operands.weights != nullptr && reinterpret_cast<uintptr_t>(operands.weights) % 16 == 0, "weights",
          "must be a 16-byte aligned device pointer");
  require(operands.acts != nullptr && reinterpret_cast<uintptr_t>(operands.acts) % 16 == 0, "acts",
          "must be a 16-byte aligned device pointer");
  require(operands.act_rows >= 1 && operands.act_rows % 4 == 0, "act_rows", "must be a positive multiple of 4, got ",
          operands.act_rows);
  require(uint64_t{operands.k} * element_bytes % 16 == 0, "k", "rows must be a multiple of 16 bytes");
  if (scaled) {
    require(operands.weight_scales != nullptr, "weight_scales", "are required by the ", to_string(operands.recipe),
            " recipe");
    require(operands.act_scales != nullptr && reinterpret_cast<uintptr_t>(operands.act_scales) % 16 == 0,
            "act_scales", "must be a 16-byte aligned device pointer for the ", to_string(operands.recipe), " recipe");
  }
  require(operands.timeout_ns > 0, "timeout_ns", "must be positive");
  const TileShape tile = operands.tile;
  require(tile.layout == TileLayout::tokens_on_m ? tile.block_n == 128 : tile.block_n == 16 || tile.block_n == 64,
          "tile", "must be one of choose_tile's shapes (", to_string(tile.layout), " with ", tile.block_n,
          " tokens is not)");
  const SplitWorkspace& workspace = operands.split_workspace;
  require(workspace.data == nullptr || reinterpret_cast<uintptr_t>(workspace.data) % 16 == 0,
          "split_workspace.data", "must be a 16-byte aligned device pointer or nullptr");
  require(workspace.data == nullptr || workspace.bytes > kSplitPartialsOffset, "split_workspace.bytes",
          "must exceed the ", kSplitPartialsOffset, " bytes of its counters, got ", workspace.bytes);
}

}  // namespace

TileShape choose_tile(uint32_t expected_rows_per_group, uint32_t num_groups, Recipe recipe) {
  const bool packed = recipe == Recipe::fp8_fp4;
  if (expected_rows_per_group >= tokens_on_m_rows(recipe))
    return {TileLayout::tokens_on_m, 128, expands_fp4_weights(recipe, expected_rows_per_group)};
  const bool wide = expected_rows_per_group > 16 ||
                    (expected_rows_per_group >= kWideDecodeRows && num_groups >= kWideDecodeGroups && !packed);
  return {TileLayout::weights_on_m, wide ? 64u : 16u};
}

const char* to_string(TileLayout layout) {
  return layout == TileLayout::tokens_on_m ? "tokens_on_m" : "weights_on_m";
}

void validate_jobs(std::span<const GemmOperands* const> operands, uint32_t element_bytes, bool scaled) {
  for (const GemmOperands* job : operands) validate_operands(*job, element_bytes, scaled);
  if (operands.size() > 1) {
    const GemmOperands& second = *operands[1];
    require(second.groups.prefix == nullptr && second.groups.num_groups == 1, "jobs[1].groups",
            "the second job of a launch must be one group of host-known rows (prefix nullptr)");
    require(second.recipe == operands[0]->recipe, "jobs[1].recipe", "must match the first job's");
  }
}

void validate_packed_weights(const GemmOperands& operands) {
  require(operands.weight_shifts != nullptr && reinterpret_cast<uintptr_t>(operands.weight_shifts) % 16 == 0,
          "weight_shifts", "must be a 16-byte aligned device pointer for the fp8_fp4 recipe");
  require(uint64_t{operands.num_groups} * operands.n_out <= UINT32_MAX / 4, "num_groups * n_out",
          "weight rows must stay below 2^30 for the fp8_fp4 recipe");
}

namespace {

// Tiles that expand their weights (fp8_fp4 prefill): each job's weights expanded once into its
// scratch, then the jobs as fp8's, whose block scales are the fp8_fp4 block scales. Empty otherwise.
template <class Job>
std::vector<Job> expanded_fp8_jobs(std::span<const Job> jobs, cudaStream_t stream) {
  const GemmOperands& first = jobs[0].operands;
  if (!first.tile.expand_weights) return {};
  std::vector<Job> fp8_jobs(jobs.begin(), jobs.end());
  for (Job& job : fp8_jobs) {
    GemmOperands& o = job.operands;
    require(o.recipe == Recipe::fp8_fp4 && o.tile.layout == TileLayout::tokens_on_m, "tile",
            "expand_weights is for fp8_fp4 tokens_on_m tiles");
    require(o.expanded_weights != nullptr, "expanded_weights",
            "must be scratch of expanded_weight_bytes() for a tile that expands its weights (choose_tile: from ",
            kExpandFp4Rows, " expected rows)");
    validate_packed_weights(o);
    expand_fp4_weights(static_cast<const uint8_t*>(o.weights), o.weight_shifts, o.num_groups, o.n_out, o.k,
                       o.groups.prefix, static_cast<uint8_t*>(o.expanded_weights), stream);
    o.recipe = Recipe::fp8;
    o.tile.expand_weights = false;
    o.weights = o.expanded_weights;
    o.weight_shifts = nullptr;
    o.expanded_weights = nullptr;
  }
  return fp8_jobs;
}

}  // namespace

void grouped_gemm_swiglu(std::span<const SwigluJob> jobs, int grid, cudaStream_t stream) {
  require(!jobs.empty(), "jobs", "must not be empty");
  if (const auto fp8_jobs = expanded_fp8_jobs(jobs, stream); !fp8_jobs.empty())
    return detail::fp8_swiglu(fp8_jobs, grid, stream);
  switch (jobs[0].operands.recipe) {
    case Recipe::fp8: return detail::fp8_swiglu(jobs, grid, stream);
    case Recipe::fp8_fp4: return detail::fp8_fp4_swiglu(jobs, grid, stream);
    case Recipe::bf16: return detail::bf16_swiglu(jobs, grid, stream);
  }
}

void grouped_gemm_store(std::span<const StoreJob> jobs, int grid, cudaStream_t stream) {
  require(!jobs.empty(), "jobs", "must not be empty");
  if (const auto fp8_jobs = expanded_fp8_jobs(jobs, stream); !fp8_jobs.empty())
    return detail::fp8_store(fp8_jobs, grid, stream);
  switch (jobs[0].operands.recipe) {
    case Recipe::fp8: return detail::fp8_store(jobs, grid, stream);
    case Recipe::fp8_fp4: return detail::fp8_fp4_store(jobs, grid, stream);
    case Recipe::bf16: return detail::bf16_store(jobs, grid, stream);
  }
}

void grouped_gemm_swiglu(const GemmOperands& operands, const SwigluOutput& output, int grid, cudaStream_t stream) {
  const SwigluJob job{operands, output};
  grouped_gemm_swiglu(std::span<const SwigluJob>(&job, 1), grid, stream);
}

void grouped_gemm_store(const GemmOperands& operands, const RoutedDestination& destination, int grid,
                        cudaStream_t stream) {
  const StoreJob job{operands, SlotDestination{destination, {}, false}};
  grouped_gemm_store(std::span<const StoreJob>(&job, 1), grid, stream);
}

void grouped_gemm_store(const GemmOperands& operands, const SharedDestination& destination, int grid,
                        cudaStream_t stream) {
  const StoreJob job{operands, SlotDestination{{}, destination, true}};
  grouped_gemm_store(std::span<const StoreJob>(&job, 1), grid, stream);
}

}  // namespace megamoe::gemm
