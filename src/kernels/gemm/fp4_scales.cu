#include "kernels/gemm/fp4_scales.h"

#include <algorithm>

#include "kernels/gemm/e2m1.cuh"
#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe::gemm {
namespace {

// One warp per (64-row block, K block): each lane reads the four codes of two rows.
__global__ void derive_fp4_weight_scales_kernel(const uint8_t* mx_scales, uint32_t rows, uint32_t k,
                                                float* block_scales, uint8_t* shifts) {
  const uint32_t k_blocks = k / 128;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t lane = threadIdx.x % 32;
  if (warp >= rows / 64 * k_blocks) return;
  const uint32_t row_block = warp / k_blocks, kb = warp % k_blocks;
  uint32_t codes[2];
  uint32_t largest = 0;
  for (uint32_t i = 0; i < 2; ++i) {
    const uint64_t row = uint64_t{row_block} * 64 + 2 * lane + i;
    codes[i] = *reinterpret_cast<const uint32_t*>(mx_scales + row * (k / 32) + 4 * kb);
    for (uint32_t g = 0; g < 4; ++g) largest = max(largest, (codes[i] >> (8 * g)) & 0xFFu);
  }
  for (int offset = 16; offset > 0; offset /= 2) largest = max(largest, __shfl_xor_sync(0xFFFFFFFFu, largest, offset));
  if (lane == 0) block_scales[uint64_t{row_block} * k_blocks + kb] = ue8m0_to_float(static_cast<uint8_t>(largest));
  for (uint32_t i = 0; i < 2; ++i) {
    const uint64_t row = uint64_t{row_block} * 64 + 2 * lane + i;
    uint32_t packed_shifts = 0;
    for (uint32_t g = 0; g < 4; ++g)
      packed_shifts |= min(largest - ((codes[i] >> (8 * g)) & 0xFFu), kMaxE2M1Shift) << (8 * g);
    *reinterpret_cast<uint32_t*>(shifts + (uint64_t{kb} * rows + row) * 4) = packed_shifts;
  }
}

// In place, one group of 32 codes (four words) per thread.
__global__ void pack_groups_kernel(uint32_t* words, uint64_t groups) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < groups; i += uint64_t{gridDim.x} * blockDim.x) {
    uint32_t plain[4], packed[4];
    for (uint32_t w = 0; w < 4; ++w) plain[w] = words[4 * i + w];
    pack_e2m1_group(plain, packed);
    for (uint32_t w = 0; w < 4; ++w) words[4 * i + w] = packed[w];
  }
}

// One group of 32 codes per thread per step; blockIdx.y is the group (expert), so an empty one costs
// its blocks one load. The sixteen shifts' tables are built once per block.
__global__ void expand_fp4_weights_kernel(const uint4* codes, const uint8_t* shifts, uint32_t n_out, uint32_t k,
                                          uint32_t total_rows, const uint32_t* group_prefix, uint4* expanded) {
  const uint32_t group = blockIdx.y;
  if (group_prefix != nullptr && group_prefix[group + 1] == group_prefix[group]) return;
  __shared__ E2M1Table tables[kMaxE2M1Shift + 1];
  if (threadIdx.x <= kMaxE2M1Shift) tables[threadIdx.x] = e2m1_table(threadIdx.x);
  __syncthreads();
  const uint32_t groups_per_row = k / 32;
  const uint64_t first = uint64_t{group} * n_out * groups_per_row, count = uint64_t{n_out} * groups_per_row;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t row = uint64_t{group} * n_out + i / groups_per_row;
    const uint32_t column_group = static_cast<uint32_t>(i % groups_per_row);
    const E2M1Table table = tables[shifts[(uint64_t{column_group / 4} * total_rows + row) * 4 + column_group % 4]];
    const uint4 words = codes[first + i];
    // Word w holds columns 4w..4w+3 (its low codes) and 16+4w..16+4w+3 (its high ones): e2m1.cuh.
    expanded[2 * (first + i)] = make_uint4(expand_e2m1_low(words.x, table), expand_e2m1_low(words.y, table),
                                           expand_e2m1_low(words.z, table), expand_e2m1_low(words.w, table));
    expanded[2 * (first + i) + 1] = make_uint4(expand_e2m1_high(words.x, table), expand_e2m1_high(words.y, table),
                                               expand_e2m1_high(words.z, table), expand_e2m1_high(words.w, table));
  }
}

}  // namespace

void expand_fp4_weights(const uint8_t* codes, const uint8_t* shifts, uint32_t num_groups, uint32_t n_out, uint32_t k,
                        const uint32_t* group_prefix, uint8_t* expanded, cudaStream_t stream) {
  require(num_groups >= 1 && num_groups <= 65535, "num_groups", "must be 1..65535, got ", num_groups);
  require(n_out >= 64 && n_out % 64 == 0, "n_out", "must be a positive multiple of 64, got ", n_out);
  require(k >= 128 && k % 128 == 0, "k", "must be a positive multiple of 128, got ", k);
  require(uint64_t{num_groups} * n_out <= UINT32_MAX, "num_groups * n_out", "must stay below 2^32");
  require(codes != nullptr && reinterpret_cast<uintptr_t>(codes) % 16 == 0, "codes",
          "must be a 16-byte aligned device pointer");
  require(shifts != nullptr, "shifts", "must be a device pointer");
  require(expanded != nullptr && reinterpret_cast<uintptr_t>(expanded) % 16 == 0, "expanded_weights",
          "must be a 16-byte aligned device pointer");
  constexpr uint32_t kThreads = 256;
  const uint64_t per_group = uint64_t{n_out} * (k / 32);
  const uint32_t blocks = static_cast<uint32_t>(std::min<uint64_t>((per_group + kThreads - 1) / kThreads, 64));
  expand_fp4_weights_kernel<<<dim3(blocks, num_groups), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(codes), shifts, n_out, k, num_groups * n_out, group_prefix,
      reinterpret_cast<uint4*>(expanded));
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "expand_fp4_weights", "launch failed: ", cudaGetErrorString(status));
}

void prepare_fp4_weights(uint8_t* codes, const uint8_t* mx_scales, uint32_t rows, uint32_t k, float* block_scales,
                         uint8_t* shifts, cudaStream_t stream) {
  require(rows % 64 == 0, "rows", "must be a multiple of 64, got ", rows);
  require(k >= 128 && k % 128 == 0, "k", "must be a positive multiple of 128, got ", k);
  require(codes != nullptr && reinterpret_cast<uintptr_t>(codes) % 4 == 0, "codes",
          "must be a 4-byte aligned device pointer");
  require(mx_scales != nullptr && reinterpret_cast<uintptr_t>(mx_scales) % 4 == 0, "mx_scales",
          "must be a 4-byte aligned device pointer");
  require(block_scales != nullptr && shifts != nullptr && reinterpret_cast<uintptr_t>(shifts) % 4 == 0,
          "block_scales/shifts", "must be device pointers (shifts 4-byte aligned)");
  if (rows == 0) return;
  const uint64_t warps = uint64_t{rows} / 64 * (k / 128);
  constexpr uint32_t kThreads = 256;
  const uint64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  derive_fp4_weight_scales_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(mx_scales, rows, k,
                                                                                         block_scales, shifts);
  pack_groups_kernel<<<1024, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(codes), uint64_t{rows} * k / 32);
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "prepare_fp4_weights", "launch failed: ", cudaGetErrorString(status));
}

}  // namespace megamoe::gemm
