// Host entry points of the grouped GEMM engine (CUDA translation units only).
//
// Y[g] = W[g] . X[rows of g]^T for every group g (a local expert), where W is [groups][n_out][k]
// (transformed weights, weights.h), X is [act_rows][k] (an expert-major pool, or the tokens
// themselves for the shared experts) and the group row ranges live on the device (GroupRows).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <span>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "megamoe/layout.h"
#include "megamoe/types.h"

namespace megamoe::gemm {

// Scratch for split K (decode launches whose tiles would leave most of the grid idle; scheduler.cuh,
// split_k.cuh): zeroed once by its owner, then left at zero by every launch. One launch at a time
// may use it. Without it (data nullptr) tiles are never split. The layer's buffer holds one of
// kGemmSplitWorkspaceBytes (layout.h).
struct SplitWorkspace {
  void* data = nullptr;  // 16-byte aligned
  uint64_t bytes = 0;
};

// The tile the heuristic picks for a launch of `num_groups` groups of about this many rows each:
// weights_on_m (weight streaming) with 16 or 64 tokens, and tokens_on_m with 128 from
// tokens_on_m_rows(recipe). 16-token tiles have six stages and split K for launches of
// few tiles; in 64-token tiles a group that fits one tile narrows its wgmmas to 16 or 32 tokens, and
// a group of many rows streams its weight tiles a quarter as often. So 16-token tiles take up to 3
// expected rows, and up to 16 rows for launches of fewer than kWideDecodeGroups groups (split K) or
// with packed weights (fp8_fp4: its raw ring keeps a fourth stage only in 16-token tiles). From 4
// rows the 64-token tile helps skewed routing (a few groups hold tens of rows) and costs the others
// nothing; below that it did not pay (docs/experiments.md, "Decode tile widths").
inline constexpr uint32_t kWideDecodeRows = 4;
inline constexpr uint32_t kWideDecodeGroups = 32;
// tokens_on_m from 40 expected rows (fp8, fp8_fp4) or 49 (bf16): a group of up to 128 rows is then
// one token tile, which reads each weight tile once. In 64-token weights_on_m tiles the many groups
// past 64 rows (random routing around 64) streamed each weight tile twice, in two CTAs that did not
// stay close enough to share it in L2. Below the thresholds weights_on_m measured faster or even
// (docs/experiments.md, "Where tokens go on M").
__host__ __device__ constexpr uint32_t tokens_on_m_rows(Recipe recipe) { return recipe == Recipe::bf16 ? 49u : 40u; }
struct TileShape {
  TileLayout layout;
  uint32_t block_n;
  // fp8_fp4 tokens_on_m launches from kExpandFp4Rows expected rows (layout.h): the weights are
  // expanded once into GemmOperands::expanded_weights and fp8's kernel runs on them.
  bool expand_weights = false;
};
TileShape choose_tile(uint32_t expected_rows_per_group, uint32_t num_groups, Recipe recipe);
const char* to_string(TileLayout layout);

struct GemmOperands {
  Recipe recipe = Recipe::fp8;
  uint32_t num_groups = 0;  // groups the weight tensor holds (TMA bounds)
  uint32_t n_out = 0;       // weight rows per group: 2 * intermediate for L1, hidden for L2
  uint32_t k = 0;           // hidden for L1, intermediate for L2
  const void* weights = nullptr;         // fp8_fp4: packed E2M1 pairs, [groups][n_out][k / 2] bytes
  const float* weight_scales = nullptr;  // fp8: [groups][n_out / 64][k / 128]; fp8_fp4: derived (fp4_scales.h)
  const uint8_t* weight_shifts = nullptr;  // fp8_fp4: [k / 128][groups * n_out][4] (fp4_scales.h)
  const void* acts = nullptr;            // [act_rows][k]
  const float* act_scales = nullptr;     // fp8: [k / 128][act_rows]
  uint32_t act_rows = 0;                 // a multiple of 4
  GroupRows groups;
  TileShape tile{TileLayout::weights_on_m, 0};  // the caller's choose_tile (the first job's serves the launch)
  uint64_t timeout_ns = 0;
  ControlBlock* control = nullptr;  // where a stuck pipeline is recorded (nullable)
  uint32_t rank = 0;             // for that record
  SplitWorkspace split_workspace;  // the first job's serves the launch
  // The first job's: launch while the stream's previous kernel runs (kernels/overlapped_launch.cuh).
  bool overlapped_launch = false;
  // Tiles that expand_weights: scratch of expanded_weight_bytes(), into which the launch expands the
  // weights of the groups with rows (E4M3, fp4_scales.h) before fp8's kernel runs on them. Other
  // fp8_fp4 launches expand each weight tile in converter warps, once per token tile.
  void* expanded_weights = nullptr;
};

// Bytes of the scratch GemmOperands::expanded_weights needs: the weights as E4M3.
__host__ __device__ constexpr uint64_t expanded_weight_bytes(uint32_t num_groups, uint32_t n_out, uint32_t k) {
  return uint64_t{num_groups} * n_out * k;
}

// L1 output: SiLU(gate) * up * route weight, re-quantized per 1x128 (fp8) or BF16, into `acts`
// [rows][n_out / 2] and `scales` [n_out / 2 / 128][scale_rows].
struct SwigluOutput {
  void* acts = nullptr;
  float* scales = nullptr;
  const float* row_weights = nullptr;  // nullptr: weight 1
  uint32_t scale_rows = 0;
  float activation_clamp = INFINITY;  // before SwiGLU (megamoe/activation.h); +infinity: no clamp
};


// One GEMM of a launch and where its results go. A launch runs one job, or two when the second is
// a single group of host-known rows (the shared experts beside the routed ones): one persistent
// grid then balances both. The tile shape is the first job's.
struct SwigluJob {
  GemmOperands operands;
  SwigluOutput output;
};
struct StoreJob {
  GemmOperands operands;
  SlotDestination output;
};

void grouped_gemm_swiglu(std::span<const SwigluJob> jobs, int grid, cudaStream_t stream);
void grouped_gemm_store(std::span<const StoreJob> jobs, int grid, cudaStream_t stream);

void grouped_gemm_swiglu(const GemmOperands& operands, const SwigluOutput& output, int grid, cudaStream_t stream);
void grouped_gemm_store(const GemmOperands& operands, const RoutedDestination& destination, int grid,
                        cudaStream_t stream);
void grouped_gemm_store(const GemmOperands& operands, const SharedDestination& destination, int grid,
                        cudaStream_t stream);

}  // namespace megamoe::gemm
