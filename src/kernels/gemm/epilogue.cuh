// Epilogues of the grouped GEMM. Both receive a math warpgroup's accumulators for one tile —
// acc[j][4i + q] holds weight row 128w + 64j + 16*warp + lane/4 + 8*(q/2) and token column
// 8i + 2*(lane%4) + q%2 — transpose them through shared memory into token-major rows, and store
// whole 16-byte chunks of each valid token's row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layout.h"

namespace megamoe::gemm {

// Where one math thread's accumulators sit in the tile.
struct FragmentCoords {
  uint32_t row0;  // weight row within the warpgroup's m64 block for q < 2; row0 + 8 for q >= 2
  uint32_t lane;
  __device__ static uint32_t column(uint32_t i, uint32_t lane) { return 8 * (i / 4) + 2 * (lane % 4) + (i % 2); }
  __device__ uint32_t row(uint32_t i) const { return row0 + 8 * ((i % 4) / 2); }
};

__device__ __forceinline__ uint8_t to_e4m3(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  const __nv_bfloat16 rounded = __float2bfloat16_rn(value);
  return *reinterpret_cast<const uint16_t*>(&rounded);
}

// L1: the tile's 256 rows are gate and up of 128 intermediate channels (weights.h: warpgroup w holds
// gate rows of channels 64w..64w+63 in m64 block 0 and their up rows in block 1). Computes
// SiLU(gate) * up * route weight, then per token either one E4M3 block of 128 channels with its FP32
// scale (fp8 recipes) or BF16, and writes it to row `row_begin + token` of the L2 pool at channel
// 128 * m_tile.
template <class Config>
struct SwigluEpilogue {
  void* out;                 // [rows][n_out / 2] activation elements
  float* out_scales;         // scaled recipes: [n_out / 2 / 128][scale_rows]
  const float* row_weights;  // route weight per row, or nullptr for weight 1 (shared experts)
  uint32_t out_row_elements;
  uint32_t scale_rows;

  __device__ void apply(const SharedStorage<Config>& smem, const Tile& tile, float (&acc)[2][Config::kAccRegs],
                        uint32_t warpgroup, uint32_t warp, uint32_t lane, uint32_t math_thread) const {
    using Policy = typename Config::Policy;
    constexpr uint32_t kBlockN = Config::kBlockN;
    const FragmentCoords frag{16 * warp + lane / 4, lane};

    float route_weight[Config::kAccRegs / 2];  // per column this thread holds (two per 8-column group)
#pragma unroll
    for (uint32_t c = 0; c < Config::kAccRegs / 2; ++c) {
      const uint32_t column = FragmentCoords::column(2 * (c / 2) * 2 + (c % 2), lane);
      route_weight[c] = (row_weights != nullptr && column < tile.rows) ? row_weights[tile.row_begin + column] : 1.0f;
    }
#pragma unroll
    for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
      const float gate = acc[0][i];
      const float up = acc[1][i];
      acc[0][i] = gate / (1.0f + expf(-gate)) * up * route_weight[(i / 4) * 2 + (i % 2)];
    }

    uint8_t* staging = smem.staging();
    const uint32_t channel_base = 64 * warpgroup;
    if constexpr (Policy::kScaled) {
      // Per-token amax over the tile's 128 channels: registers -> warp shuffle -> both warpgroups.
      float* amax_parts = smem.exchange();  // [8 warps][kBlockN]
      float* inverse_scales = amax_parts + 8 * kBlockN;
#pragma unroll
      for (uint32_t i = 0; i < Config::kAccRegs; i += 4) {
#pragma unroll
        for (uint32_t q = 0; q < 2; ++q) {
          float amax = fmaxf(fabsf(acc[0][i + q]), fabsf(acc[0][i + q + 2]));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 4));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 8));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 16));
          if (lane < 4) amax_parts[(4 * warpgroup + warp) * kBlockN + FragmentCoords::column(i + q, lane)] = amax;
        }
      }
      math_barrier<Config>();
      if (math_thread < kBlockN) {
        float amax = 0.0f;
#pragma unroll
        for (uint32_t w = 0; w < 8; ++w) amax = fmaxf(amax, amax_parts[w * kBlockN + math_thread]);
        const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
        inverse_scales[math_thread] = quantizer.inverse_scale;
        if (math_thread < tile.rows)
          out_scales[static_cast<uint64_t>(tile.m_tile) * scale_rows + tile.row_begin + math_thread] = quantizer.scale;
      }
      math_barrier<Config>();
#pragma unroll
      for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
        const uint32_t column = FragmentCoords::column(i, lane);
        staging[column * Config::kL1StagingStride + channel_base + frag.row(i)] =
            to_e4m3(acc[0][i] * inverse_scales[column]);
      }
    } else {
#pragma unroll
      for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
        const uint32_t column = FragmentCoords::column(i, lane);
        reinterpret_cast<uint16_t*>(staging + column * Config::kL1StagingStride)[channel_base + frag.row(i)] =
            to_bf16_bits(acc[0][i]);
      }
    }
    math_barrier<Config>();

    constexpr uint32_t kRowBytes = 128 * Policy::kElementBytes;
    constexpr uint32_t kChunksPerRow = kRowBytes / 16;
    for (uint32_t chunk = math_thread; chunk < kBlockN * kChunksPerRow; chunk += Config::kMathThreads) {
      const uint32_t column = chunk / kChunksPerRow;
      const uint32_t part = chunk % kChunksPerRow;
      if (column >= tile.rows) continue;
      const uint64_t row = tile.row_begin + column;
      uint8_t* destination = static_cast<uint8_t*>(out) +
                             (row * out_row_elements + tile.m_tile * 128ull) * Policy::kElementBytes + part * 16;
      *reinterpret_cast<uint4*>(destination) =
          *reinterpret_cast<const uint4*>(staging + column * Config::kL1StagingStride + part * 16);
    }
    math_barrier<Config>();  // staging is free for the next tile
  }
};

// L2 destinations: where the BF16 result row of a pool row goes.
// Routed experts: the combine slot (token, k) on the source rank, possibly a peer GPU.
struct RoutedDestination {
  SymmView view;
  uint64_t combine_offset;  // BufferLayout::combine.offset
  const PoolSource* sources;
  uint32_t top_k;
  uint32_t hidden;
  __device__ uint16_t* row(uint32_t pool_row) const {
    const PoolSource source = sources[pool_row];
    const uint64_t token = source.token_topk / top_k;
    const uint64_t k = source.token_topk % top_k;
    return reinterpret_cast<uint16_t*>(view.peers[source.rank] + combine_offset) + (token * (top_k + 1) + k) * hidden;
  }
};

// Shared experts: row r is local token r; its slot is the last one (top_k).
struct SharedDestination {
  uint16_t* combine;  // this rank's combine region
  uint32_t top_k;
  uint32_t hidden;
  __device__ uint16_t* row(uint32_t token) const {
    return combine + (static_cast<uint64_t>(token) * (top_k + 1) + top_k) * hidden;
  }
};

// L2: BF16 rows of 256 output features per token, stored to destination.row(pool row) + 256 * m_tile.
template <class Config, class Destination>
struct StoreEpilogue {
  Destination destination;
  uint32_t n_out;  // features per row (hidden); a last partial tile stores only the valid ones

  __device__ void apply(const SharedStorage<Config>& smem, const Tile& tile, float (&acc)[2][Config::kAccRegs],
                        uint32_t warpgroup, uint32_t warp, uint32_t lane, uint32_t math_thread) const {
    constexpr uint32_t kBlockN = Config::kBlockN;
    const FragmentCoords frag{16 * warp + lane / 4, lane};
    uint8_t* staging = smem.staging();
#pragma unroll
    for (uint32_t j = 0; j < 2; ++j) {
#pragma unroll
      for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
        const uint32_t feature = 128 * warpgroup + 64 * j + frag.row(i);
        reinterpret_cast<uint16_t*>(staging + FragmentCoords::column(i, lane) * Config::kL2StagingStride)[feature] =
            to_bf16_bits(acc[j][i]);
      }
    }
    math_barrier<Config>();

    constexpr uint32_t kChunksPerRow = Config::kBlockM * 2 / 16;
    const uint32_t first_feature = tile.m_tile * Config::kBlockM;
    for (uint32_t chunk = math_thread; chunk < kBlockN * kChunksPerRow; chunk += Config::kMathThreads) {
      const uint32_t column = chunk / kChunksPerRow;
      const uint32_t part = chunk % kChunksPerRow;
      if (column >= tile.rows || first_feature + part * 8 >= n_out) continue;
      uint16_t* row = destination.row(tile.row_begin + column);
      *reinterpret_cast<uint4*>(row + first_feature + part * 8) =
          *reinterpret_cast<const uint4*>(staging + column * Config::kL2StagingStride + part * 16);
    }
    math_barrier<Config>();
  }
};

}  // namespace megamoe::gemm
