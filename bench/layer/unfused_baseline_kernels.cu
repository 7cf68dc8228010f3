#include "bench/layer/unfused_baseline_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "megamoe/config.h"
#include "megamoe/error.h"

namespace megamoe::bench::baseline {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride loops cover the rest

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, kernel, "launch failed: ", cudaGetErrorString(status));
}

int blocks_for(int64_t items, int64_t items_per_block) {
  return static_cast<int>(std::clamp<int64_t>((items + items_per_block - 1) / items_per_block, 1, kMaxBlocks));
}

__device__ __forceinline__ float bf16_low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(uint32_t word) { return __uint_as_float(word & 0xFFFF0000u); }

__device__ __forceinline__ void unpack_bf16x8(const uint4& packed, float (&values)[8]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    values[2 * i] = bf16_low(words[i]);
    values[2 * i + 1] = bf16_high(words[i]);
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&values)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * i], values[2 * i + 1]);
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Sum of `value` over the block; every thread gets it. `scratch` holds one entry per warp.
__device__ int64_t block_sum(int64_t value, int64_t* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xFFFFFFFFu, value, offset);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = value;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused right after
  return total;
}

__global__ void route_layout_kernel(const int32_t* topk_idx, int32_t routes, int32_t num_experts, int32_t* send_counts,
                                    int32_t* route_position) {
  extern __shared__ int32_t counters[];
  int32_t* count = counters;
  int32_t* cursor = counters + num_experts;
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int32_t route = threadIdx.x; route < routes; route += blockDim.x) {
    const int32_t expert = topk_idx[route];
    if (expert >= 0 && expert < num_experts) atomicAdd(&count[expert], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix sum: a few hundred experts, not worth a parallel scan
    int32_t offset = 0;
    for (int32_t e = 0; e < num_experts; ++e) {
      cursor[e] = offset;
      offset += count[e];
    }
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) send_counts[e] = count[e];
  for (int32_t route = threadIdx.x; route < routes; route += blockDim.x) {
    const int32_t expert = topk_idx[route];
    route_position[route] = expert >= 0 && expert < num_experts ? atomicAdd(&cursor[expert], 1) : -1;
  }
}

// A warp per route.
__global__ void gather_rows_kernel(const uint8_t* x, const float* x_scales, const int32_t* route_position,
                                   int32_t routes, int32_t top_k, uint32_t row_vectors, uint32_t scales_per_row,
                                   uint8_t* send_rows, float* send_scales) {
  const uint32_t lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  for (int64_t route = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; route < routes; route += warps) {
    const int32_t position = route_position[route];
    if (position < 0) continue;
    const int64_t token = route / top_k;
    const uint4* from = reinterpret_cast<const uint4*>(x) + token * row_vectors;
    uint4* to = reinterpret_cast<uint4*>(send_rows) + int64_t{position} * row_vectors;
    for (uint32_t v = lane; v < row_vectors; v += 32) to[v] = from[v];
    if (x_scales == nullptr) continue;
    for (uint32_t s = lane; s < scales_per_row; s += 32)
      send_scales[int64_t{position} * scales_per_row + s] = x_scales[token * scales_per_row + s];
  }
}

// Block x = one (source, expert) chunk, in source-major numbering; blocks y split its rows.
__global__ void regroup_rows_kernel(const RegroupRows a) {
  __shared__ int64_t scratch[kWarpsPerBlock];
  const int32_t chunk = static_cast<int32_t>(blockIdx.x);
  const int32_t source = chunk / a.experts;
  const int32_t expert = chunk % a.experts;
  // Rows before this chunk in either order.
  int64_t before_source_major = 0, before_expert_major = 0;
  for (int32_t i = threadIdx.x; i < a.sources * a.experts; i += blockDim.x) {
    const int32_t s = i / a.experts, e = i % a.experts;
    const int64_t rows = a.counts[i];
    if (i < chunk) before_source_major += rows;
    if (e < expert || (e == expert && s < source)) before_expert_major += rows;
  }
  before_source_major = block_sum(before_source_major, scratch);
  before_expert_major = block_sum(before_expert_major, scratch);
  const int64_t rows = a.counts[chunk];
  const int64_t from_row = a.to_expert_major ? before_source_major : before_expert_major;
  const int64_t to_row = a.to_expert_major ? before_expert_major : before_source_major;

  const uint32_t row_vectors = a.row_bytes / 16;
  const uint4* from = reinterpret_cast<const uint4*>(a.from) + from_row * row_vectors;
  uint4* to = reinterpret_cast<uint4*>(a.to) + to_row * row_vectors;
  const int64_t stride = int64_t{gridDim.y} * blockDim.x;
  for (int64_t v = int64_t{blockIdx.y} * blockDim.x + threadIdx.x; v < rows * row_vectors; v += stride) to[v] = from[v];
  if (a.from_scales == nullptr) return;
  const float* from_scales = a.from_scales + from_row * a.scales_per_row;
  float* to_scales = a.to_scales + to_row * a.scales_per_row;
  for (int64_t s = int64_t{blockIdx.y} * blockDim.x + threadIdx.x; s < rows * a.scales_per_row; s += stride)
    to_scales[s] = from_scales[s];
}

// A thread per 8 channels of one row.
template <bool kFp8>
__global__ void swiglu_kernel(const uint16_t* h, int64_t rows, int32_t intermediate, float inverse_scale, void* out) {
  const int32_t groups = intermediate / 8;
  const int64_t total = rows * groups;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / groups;
    const int32_t channel = static_cast<int32_t>(i % groups) * 8;
    const int32_t gate_column = 256 * (channel / 128) + 128 * (channel % 128 / 64) + channel % 64;
    const uint16_t* h_row = h + row * 2 * intermediate;
    float gate[8], up[8], a[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(h_row + gate_column), gate);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(h_row + gate_column + kGateUpInterleave), up);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = gate[j] / (1.0f + __expf(-gate[j])) * up[j];
    if constexpr (kFp8) {
      uint32_t words[2];
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const __nv_fp8x2_storage_t low = __nv_cvt_float2_to_fp8x2(
            make_float2(a[4 * w] * inverse_scale, a[4 * w + 1] * inverse_scale), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t high = __nv_cvt_float2_to_fp8x2(
            make_float2(a[4 * w + 2] * inverse_scale, a[4 * w + 3] * inverse_scale), __NV_SATFINITE, __NV_E4M3);
        words[w] = static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
      }
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out) + row * intermediate + channel) =
          make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + row * intermediate + channel) = pack_bf16x8(a);
    }
  }
}

// A warp per token; each lane sums 8 features (16 bytes) of every row at a time.
__global__ void combine_kernel(const uint16_t* results, const int32_t* route_position, const float* topk_weights,
                               const uint16_t* shared, int32_t tokens, int32_t top_k, int32_t hidden, uint16_t* y) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t vectors = static_cast<uint32_t>(hidden) / 8;
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  for (int64_t token = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; token < tokens; token += warps) {
    int32_t position[kMaxTopK];
    float weight[kMaxTopK];
    for (int32_t k = 0; k < top_k; ++k) {
      position[k] = route_position[token * top_k + k];
      weight[k] = topk_weights[token * top_k + k];
    }
    for (uint32_t v = lane; v < vectors; v += 32) {
      float sum[8] = {};
      for (int32_t k = 0; k < top_k; ++k) {
        if (position[k] < 0) continue;
        float row[8];
        unpack_bf16x8(reinterpret_cast<const uint4*>(results)[int64_t{position[k]} * vectors + v], row);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum[j] += weight[k] * row[j];
      }
      if (shared != nullptr) {
        float row[8];
        unpack_bf16x8(reinterpret_cast<const uint4*>(shared)[token * vectors + v], row);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum[j] += row[j];
      }
      reinterpret_cast<uint4*>(y)[token * vectors + v] = pack_bf16x8(sum);
    }
  }
}

}  // namespace

void route_layout(const int32_t* topk_idx, int32_t routes, int32_t num_experts, int32_t* send_counts,
                  int32_t* route_position, cudaStream_t stream) {
  require(num_experts >= 1 && num_experts <= kMaxLayoutExperts, "baseline route_layout", "handles 1 to ",
          kMaxLayoutExperts, " experts, got ", num_experts);
  const size_t shared_bytes = sizeof(int32_t) * 2 * static_cast<size_t>(num_experts);
  route_layout_kernel<<<1, 1024, shared_bytes, stream>>>(topk_idx, routes, num_experts, send_counts, route_position);
  check_launch("baseline route_layout");
}

void gather_rows(const uint8_t* x, const float* x_scales, const int32_t* route_position, int32_t routes, int32_t top_k,
                 uint32_t row_bytes, uint32_t scales_per_row, uint8_t* send_rows, float* send_scales,
                 cudaStream_t stream) {
  require(row_bytes % 16 == 0, "baseline gather_rows", "row_bytes must be a multiple of 16, got ", row_bytes);
  if (routes == 0) return;
  gather_rows_kernel<<<blocks_for(routes, kWarpsPerBlock), kThreads, 0, stream>>>(
      x, x_scales, route_position, routes, top_k, row_bytes / 16, scales_per_row, send_rows, send_scales);
  check_launch("baseline gather_rows");
}

void regroup_rows(const RegroupRows& args, int64_t total_rows, cudaStream_t stream) {
  require(args.row_bytes % 16 == 0, "baseline regroup_rows", "row_bytes must be a multiple of 16, got ",
          args.row_bytes);
  if (total_rows == 0) return;
  const int64_t chunks = int64_t{args.sources} * args.experts;
  // Enough slices that an average chunk gives each thread about 8 vectors.
  const int64_t vectors_per_chunk = total_rows * (args.row_bytes / 16) / chunks;
  const dim3 grid(static_cast<uint32_t>(chunks),
                  static_cast<uint32_t>(std::clamp<int64_t>(vectors_per_chunk / (kThreads * 8), 1, 64)));
  regroup_rows_kernel<<<grid, kThreads, 0, stream>>>(args);
  check_launch("baseline regroup_rows");
}

void swiglu(const uint16_t* h, int64_t rows, int32_t intermediate, bool fp8, float out_scale, void* a,
            cudaStream_t stream) {
  require(intermediate % kScaleBlock == 0, "baseline swiglu", "intermediate must be a multiple of ", kScaleBlock,
          ", got ", intermediate);
  if (rows == 0) return;
  const int blocks = blocks_for(rows * (intermediate / 8), kThreads);
  if (fp8)
    swiglu_kernel<true><<<blocks, kThreads, 0, stream>>>(h, rows, intermediate, 1.0f / out_scale, a);
  else
    swiglu_kernel<false><<<blocks, kThreads, 0, stream>>>(h, rows, intermediate, 1.0f, a);
  check_launch("baseline swiglu");
}

void combine(const uint16_t* results, const int32_t* route_position, const float* topk_weights, const uint16_t* shared,
             int32_t tokens, int32_t top_k, int32_t hidden, uint16_t* y, cudaStream_t stream) {
  require(top_k >= 1 && top_k <= kMaxTopK, "baseline combine", "top_k must be in [1, ", kMaxTopK, "], got ", top_k);
  require(hidden % 8 == 0, "baseline combine", "hidden must be a multiple of 8, got ", hidden);
  if (tokens == 0) return;
  combine_kernel<<<blocks_for(tokens, kWarpsPerBlock), kThreads, 0, stream>>>(results, route_position, topk_weights,
                                                                              shared, tokens, top_k, hidden, y);
  check_launch("baseline combine");
}

}  // namespace megamoe::bench::baseline
