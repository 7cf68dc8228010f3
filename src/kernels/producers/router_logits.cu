// The router's logits (megamoe/producers.h): logits = x · weightᵀ, BF16 in, FP32 sums. On the tensor
// cores, a block of four warps computes 64 tokens x 64 experts, K 64 at a time through shared memory
// (zero-filled past the edges, so any token and expert count works; the next step's loads in flight
// during this one's products); each warp holds 16 tokens x 64 experts of accumulators (WMMA 16x16x16
// fragments). Where there are few tiles, a cluster of blocks splits each tile's K range and sums the
// partial tiles through distributed shared memory. A few tokens take a kernel of their own
// (router_logits_few_tokens_kernel).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <mma.h>

#include <cstdint>

#include "kernels/overlapped_launch.cuh"
#include "kernels/producers/producer_checks.h"
#include "kernels/producers/streamed_producers.h"
#include "megamoe/error.h"
#include "megamoe/producers.h"

namespace megamoe {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTileTokens = 64, kTileExperts = 64, kTileK = 64, kThreads = 128;
// 16-byte pieces of one K step of both operands, per thread.
constexpr int kPieces = 2 * kTileTokens * (kTileK / 8) / kThreads;
// Rows of kTileK BF16 padded by 8 (16 bytes): WMMA loads need 16-byte aligned rows, and the padding
// spreads a fragment's rows over the banks.
constexpr int kRowStride = kTileK + 8;

// A 16-byte piece of a K step: 8 values of an x row (token) or a weight row (expert).
struct Piece {
  bool is_x;
  int row;
  int col;
};
__device__ Piece piece_of(int piece) {
  const bool is_x = piece < kTileTokens * (kTileK / 8);
  const int local = is_x ? piece : piece - kTileTokens * (kTileK / 8);
  return {is_x, local / (kTileK / 8), (local % (kTileK / 8)) * 8};
}

// Up to kFewTokens tokens (decode) the tiles above would leave most SMs idle while a few blocks walk
// K: instead one block per expert, its warps splitting K in 16-byte pieces, each thread holding a
// partial sum per token; the warps' sums meet in shared memory in a fixed order (deterministic).
constexpr int kFewTokens = 16;
constexpr int kFewThreads = 256;

__global__ void __launch_bounds__(kFewThreads) router_logits_few_tokens_kernel(const __nv_bfloat16* x,
                                                                               const __nv_bfloat16* weight,
                                                                               float* logits, int32_t tokens,
                                                                               int32_t hidden, int32_t experts) {
  // A streamed call's next producer may start now (detail::router_logits); its inputs predate the call.
  allow_next_kernel();
  __shared__ float warp_sums[kFewThreads / 32][kFewTokens];
  const int32_t expert = static_cast<int32_t>(blockIdx.x);
  const int32_t pieces = hidden / 8;
  float sum[kFewTokens] = {};
  for (int32_t piece = static_cast<int32_t>(threadIdx.x); piece < pieces; piece += kFewThreads) {
    const uint4 w = *reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(expert) * hidden + piece * 8);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int t = 0; t < kFewTokens; ++t) {
      if (t >= tokens) break;
      const uint4 v = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * hidden + piece * 8);
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __bfloat1622float2(v2[j]), b = __bfloat1622float2(w2[j]);
        sum[t] = fmaf(a.x, b.x, fmaf(a.y, b.y, sum[t]));
      }
    }
  }
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int t = 0; t < kFewTokens; ++t) {
    if (t >= tokens) break;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum[t] += __shfl_xor_sync(0xFFFFFFFFu, sum[t], offset);
    if (lane == 0) warp_sums[warp][t] = sum[t];
  }
  __syncthreads();
  if (static_cast<int32_t>(threadIdx.x) < tokens) {
    float total = 0.0f;
    for (int w = 0; w < kFewThreads / 32; ++w) total += warp_sums[w][threadIdx.x];
    logits[static_cast<int64_t>(threadIdx.x) * experts + expert] = total;
  }
}

// Each tile's K range is split over a cluster of `gridDim.z` blocks (1, 2, 4 or 8) when the tiles alone
// would leave most SMs idle: the loop below is bound by its loads' latency, one K step at a time (at
// 128 tokens of DeepSeek-V3, 8 blocks walking 112 steps took about 100 µs).
constexpr int kMaxSplits = 8;
constexpr int kTargetBlocks = 256;   // about two blocks per SM
constexpr int kMinStepsPerSplit = 8;

int k_splits(int64_t tiles, int32_t steps) {
  int splits = 1;
  while (splits < kMaxSplits && tiles * splits * 2 <= kTargetBlocks && steps / (splits * 2) >= kMinStepsPerSplit)
    splits *= 2;
  return splits;
}

__global__ void __launch_bounds__(kThreads) router_logits_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                                 float* logits, int32_t tokens, int32_t hidden,
                                                                 int32_t experts, int32_t split_k) {
  allow_next_kernel();
  __shared__ __align__(128) __nv_bfloat16 tile_x[kTileTokens * kRowStride];
  __shared__ __align__(128) __nv_bfloat16 tile_w[kTileExperts * kRowStride];
  __shared__ __align__(128) float tile_out[kTileTokens * kTileExperts];
  const int32_t token0 = static_cast<int32_t>(blockIdx.x) * kTileTokens;
  const int32_t expert0 = static_cast<int32_t>(blockIdx.y) * kTileExperts;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // This block's part of K: split_k elements (a multiple of kTileK), the last part up to hidden.
  const int32_t k_begin = static_cast<int32_t>(blockIdx.z) * split_k;
  const int32_t k_end = min(hidden, k_begin + split_k);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTileExperts / 16];
#pragma unroll
  for (int n = 0; n < kTileExperts / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);

  // This thread's pieces of a K step; zero past the edges.
  const auto load_step = [&](int32_t k0, uint4 (&values)[kPieces]) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const Piece p = piece_of(static_cast<int>(threadIdx.x) + i * kThreads);
      const int32_t global_row = (p.is_x ? token0 : expert0) + p.row;
      const bool inside = global_row < (p.is_x ? tokens : experts) && k0 + p.col < k_end;
      values[i] = make_uint4(0, 0, 0, 0);
      if (inside) {
        values[i] = *reinterpret_cast<const uint4*>((p.is_x ? x : weight) + static_cast<int64_t>(global_row) * hidden +
                                                    k0 + p.col);
      }
    }
  };
  uint4 next[kPieces];
  load_step(k_begin, next);
  for (int32_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const Piece p = piece_of(static_cast<int>(threadIdx.x) + i * kThreads);
      *reinterpret_cast<uint4*>((p.is_x ? tile_x : tile_w) + p.row * kRowStride + p.col) = next[i];
    }
    __syncthreads();
    // The next step's loads are in flight while the tensor cores work on this one.
    if (k0 + kTileK < k_end) load_step(k0 + kTileK, next);
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
  // Each block of the cluster sums its share of the tile over every block's partial tile, in the
  // blocks' order (deterministic), then waits until its peers have read its own.
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int splits = static_cast<int>(gridDim.z), rank = static_cast<int>(blockIdx.z);
  for (int i = static_cast<int>(threadIdx.x) + rank * kThreads; i < kTileTokens * kTileExperts;
       i += kThreads * splits) {
    const int32_t token = token0 + i / kTileExperts, expert = expert0 + i % kTileExperts;
    float sum = 0.0f;
    for (int part = 0; part < splits; ++part) sum += cluster.map_shared_rank(tile_out, part)[i];
    if (token < tokens && expert < experts) logits[static_cast<int64_t>(token) * experts + expert] = sum;
  }
  cluster.sync();
}

// The tiles' launch: overlapped with the stream's previous kernel or not, with the K split's blocks as
// one cluster.
cudaError_t launch_tiles(const __nv_bfloat16* x, const __nv_bfloat16* weight, float* logits, int32_t tokens,
                         int32_t hidden, int32_t experts, cudaStream_t stream, bool overlapped) {
  const int64_t token_tiles = (tokens + kTileTokens - 1) / kTileTokens;
  const int64_t expert_tiles = (experts + kTileExperts - 1) / kTileExperts;
  const int32_t steps = (hidden + kTileK - 1) / kTileK;
  const int splits = k_splits(token_tiles * expert_tiles, steps);
  const int32_t split_k = (steps + splits - 1) / splits * kTileK;
  return launch_kernel_in_clusters(router_logits_kernel,
                                   dim3(static_cast<unsigned>(token_tiles), static_cast<unsigned>(expert_tiles),
                                        static_cast<unsigned>(splits)),
                                   dim3(1, 1, static_cast<unsigned>(splits)), dim3(kThreads), 0, stream, overlapped, x,
                                   weight, logits, tokens, hidden, experts, split_k);
}

}  // namespace

void detail::check_router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits) {
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
}

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits, cudaStream_t stream) {
  detail::router_logits(x, weight, logits, stream, false);
}

void detail::router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits,
                           cudaStream_t stream, bool overlapped) {
  check_router_logits(x, weight, logits);
  const int64_t tokens = x.shape[0], hidden = x.shape[1], experts = weight.shape[0];
  if (tokens == 0) return;
  const auto* x_data = static_cast<const __nv_bfloat16*>(x.data);
  const auto* weight_data = static_cast<const __nv_bfloat16*>(weight.data);
  const auto t = static_cast<int32_t>(tokens), h = static_cast<int32_t>(hidden), e = static_cast<int32_t>(experts);
  const cudaError_t status =
      tokens <= kFewTokens
          ? launch_kernel(router_logits_few_tokens_kernel, dim3(static_cast<unsigned>(experts)), dim3(kFewThreads), 0,
                          stream, overlapped, x_data, weight_data, logits.as<float>(), t, h, e)
          : launch_tiles(x_data, weight_data, logits.as<float>(), t, h, e, stream, overlapped);
  require(status == cudaSuccess, "router_logits", "launch failed: ", cudaGetErrorString(status));
}

}  // namespace megamoe
