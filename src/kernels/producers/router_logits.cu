// The router's logits on the tensor cores (megamoe/producers.h): logits = x · weightᵀ, BF16 in, FP32
// sums. A block of four warps computes 64 tokens x 64 experts, K 32 at a time through shared memory
// (zero-filled past the edges, so any token and expert count works); each warp holds 16 tokens x 64
// experts of accumulators (WMMA 16x16x16 fragments).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <mma.h>

#include <cstdint>

#include "megamoe/error.h"
#include "megamoe/producers.h"

namespace megamoe {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTileTokens = 64, kTileExperts = 64, kTileK = 32, kThreads = 128;
// Rows of kTileK BF16 padded by 8 (16 bytes): WMMA loads need 16-byte aligned rows, and the padding
// spreads a fragment's rows over the banks.
constexpr int kRowStride = kTileK + 8;

__global__ void __launch_bounds__(kThreads) router_logits_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                                 float* logits, int32_t tokens, int32_t hidden,
                                                                 int32_t experts) {
  __shared__ __align__(128) __nv_bfloat16 tile_x[kTileTokens * kRowStride];
  __shared__ __align__(128) __nv_bfloat16 tile_w[kTileExperts * kRowStride];
  __shared__ __align__(128) float tile_out[kTileTokens * kTileExperts];
  const int32_t token0 = static_cast<int32_t>(blockIdx.x) * kTileTokens;
  const int32_t expert0 = static_cast<int32_t>(blockIdx.y) * kTileExperts;
  const int warp = static_cast<int>(threadIdx.x) / 32;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTileExperts / 16];
#pragma unroll
  for (int n = 0; n < kTileExperts / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);

  for (int32_t k0 = 0; k0 < hidden; k0 += kTileK) {
    // 64 rows x 32 values of each operand: 8-value (16-byte) pieces, four per row, two per thread.
    for (int piece = static_cast<int>(threadIdx.x); piece < 2 * kTileTokens * (kTileK / 8); piece += kThreads) {
      const bool is_x = piece < kTileTokens * (kTileK / 8);
      const int local = is_x ? piece : piece - kTileTokens * (kTileK / 8);
      const int row = local / (kTileK / 8), col = (local % (kTileK / 8)) * 8;
      const int32_t global_row = (is_x ? token0 : expert0) + row;
      const bool inside = global_row < (is_x ? tokens : experts) && k0 + col < hidden;
      uint4 values = make_uint4(0, 0, 0, 0);
      if (inside) {
        const __nv_bfloat16* source = (is_x ? x : weight) + static_cast<int64_t>(global_row) * hidden + k0 + col;
        values = *reinterpret_cast<const uint4*>(source);
      }
      *reinterpret_cast<uint4*>((is_x ? tile_x : tile_w) + row * kRowStride + col) = values;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
      wmma::load_matrix_sync(a, tile_x + warp * 16 * kRowStride + kk, kRowStride);
#pragma unroll
      for (int n = 0; n < kTileExperts / 16; ++n) {
        // weight rows are experts: as the K x N operand they are column-major.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
        wmma::load_matrix_sync(b, tile_w + n * 16 * kRowStride + kk, kRowStride);
        wmma::mma_sync(acc[n], a, b, acc[n]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int n = 0; n < kTileExperts / 16; ++n)
    wmma::store_matrix_sync(tile_out + warp * 16 * kTileExperts + n * 16, acc[n], kTileExperts, wmma::mem_row_major);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kTileTokens * kTileExperts; i += kThreads) {
    const int32_t token = token0 + i / kTileExperts, expert = expert0 + i % kTileExperts;
    if (token < tokens && expert < experts) logits[static_cast<int64_t>(token) * experts + expert] = tile_out[i];
  }
}

}  // namespace

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits, cudaStream_t stream) {
  require(x.ndim == 2, "x", "must have 2 dimensions [tokens, hidden], got ", x.ndim);
  require(weight.ndim == 2, "weight", "must have 2 dimensions [num_experts, hidden], got ", weight.ndim);
  const int64_t tokens = x.shape[0], hidden = x.shape[1], experts = weight.shape[0];
  require(hidden > 0 && hidden % 8 == 0, "x", "hidden (its second dimension) must be a positive multiple of 8, got ",
          hidden);
  require(experts >= 1 && experts <= kMaxRouterExperts, "weight", "must have between 1 and ", kMaxRouterExperts,
          " experts (rows), got ", experts);
  require(tokens <= INT32_MAX / kTileTokens * kTileTokens, "x", "holds too many tokens: ", tokens);
  // 16-byte loads: hidden % 8 keeps every row aligned once the start is.
  require(reinterpret_cast<uintptr_t>(x.data) % 16 == 0, "x", "must start on a 16-byte boundary");
  require(reinterpret_cast<uintptr_t>(weight.data) % 16 == 0, "weight", "must start on a 16-byte boundary");
  check_tensor(x, "x", DType::bf16, {tokens, hidden}, Device::cuda);
  check_tensor(weight, "weight", DType::bf16, {experts, hidden}, Device::cuda);
  check_tensor(logits, "logits", DType::f32, {tokens, experts}, Device::cuda);
  if (tokens == 0) return;
  const dim3 grid(static_cast<unsigned>((tokens + kTileTokens - 1) / kTileTokens),
                  static_cast<unsigned>((experts + kTileExperts - 1) / kTileExperts));
  router_logits_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x.data),
                                                      static_cast<const __nv_bfloat16*>(weight.data),
                                                      logits.as<float>(), static_cast<int32_t>(tokens),
                                                      static_cast<int32_t>(hidden), static_cast<int32_t>(experts));
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "router_logits", "launch failed: ", cudaGetErrorString(status));
}

}  // namespace megamoe
