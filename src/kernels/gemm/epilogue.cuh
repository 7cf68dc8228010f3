// Epilogues of the grouped GEMM. Both receive a math warpgroup's accumulators for one tile in the
// config's layout (pipeline.cuh), write them token-major into shared memory, and then store whole
// 16-byte chunks of each valid token's row.
//
// weights_on_m: acc[j][4i + q] holds weight row 128w + 64j + 16 warp + lane/4 + 8 (q/2) and token
//   8i + 2 (lane%4) + q%2.
// tokens_on_m:  acc[h][4i + q] holds token 64w + 16 warp + lane/4 + 8 (q/2) and weight row
//   128h + 8i + 2 (lane%4) + q%2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline_primitives.h>

#include <cstdint>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "megamoe/activation.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layout.h"

namespace megamoe::gemm {

// Where one math thread's accumulators sit in the tile (weights_on_m).
struct FragmentCoords {
  uint32_t row0;  // weight row within the warpgroup's m64 block for q < 2; row0 + 8 for q >= 2
  uint32_t lane;
  __device__ static uint32_t column(uint32_t i, uint32_t lane) { return 8 * (i / 4) + 2 * (lane % 4) + (i % 2); }
  __device__ uint32_t row(uint32_t i) const { return row0 + 8 * ((i % 4) / 2); }
};

// The accumulator column pair (i, i + 1) of register i (even) in an n128 block, and its row.
__device__ __forceinline__ uint32_t pair_column(uint32_t i, uint32_t lane) { return 8 * (i / 4) + 2 * (lane % 4); }
__device__ __forceinline__ uint32_t pair_row_select(uint32_t i) { return (i % 4) / 2; }

__device__ __forceinline__ uint8_t to_e4m3(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

// SiLU(g) = g / (1 + e^-g) with the hardware exp2 and reciprocal: a few instructions per element
// instead of the dozens of expf and IEEE division (with its slow-path branch). Their error, a few
// ulp (about 1e-6 relative for |g| < 10), is far below the E4M3 or BF16 rounding that follows.
// Below g = -87 the denominator passes 2^126 and the result is 0 (the true one is < 1e-35).
__device__ __forceinline__ float silu(float gate) { return __fdividef(gate, 1.0f + __expf(-gate)); }

__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  const __nv_bfloat16 rounded = __float2bfloat16_rn(value);
  return *reinterpret_cast<const uint16_t*>(&rounded);
}

__device__ __forceinline__ uint32_t to_bf16x2_bits(float low, float high) {
  return uint32_t{to_bf16_bits(low)} | (uint32_t{to_bf16_bits(high)} << 16);
}

// Copies staged rows [first_token, first_token + kTokens) of the tile's valid tokens (< rows) out in
// 16-byte chunks, thread `thread` of kThreads: `destination(token, part)` gives the address of chunk
// `part` of that token's row, or nullptr to skip it.
template <uint32_t kTokens, uint32_t kThreads, uint32_t kRowBytes, class Destination>
__device__ __forceinline__ void store_staged_rows(const uint8_t* staging, uint32_t stride, uint32_t first_token,
                                                  uint32_t rows, uint32_t thread, const Destination& destination) {
  constexpr uint32_t kChunksPerRow = kRowBytes / 16;
  for (uint32_t chunk = thread; chunk < kTokens * kChunksPerRow; chunk += kThreads) {
    const uint32_t token = first_token + chunk / kChunksPerRow;
    const uint32_t part = chunk % kChunksPerRow;
    if (token >= rows) continue;
    uint4* address = destination(token, part);
    if (address != nullptr) *address = *reinterpret_cast<const uint4*>(staging + token * stride + part * 16);
  }
}

// L1: the tile's 256 rows are gate and up of 128 intermediate channels (weights.h: rows [128c, 128c + 64)
// are gate of channels 64c..64c+63 and the next 64 rows their up). Computes SiLU(gate) * up * route
// weight, then per token either one E4M3 block of 128 channels with its FP32 scale (fp8 recipes) or
// BF16, and writes it to row `row_begin + token` of the L2 pool at channel 128 * m_tile.
template <class Config>
struct SwigluEpilogue {
  void* out;                 // [rows][n_out / 2] activation elements
  float* out_scales;         // scaled recipes: [n_out / 2 / 128][scale_rows]
  const float* row_weights;  // route weight per row, or nullptr for weight 1 (shared experts)
  uint32_t out_row_elements;
  uint32_t scale_rows;
  float activation_clamp;  // before SwiGLU: gate <= c, |up| <= c (activation.h); +infinity: none

  using Policy = typename Config::Policy;

  __device__ float route_weight(const Tile& tile, uint32_t token) const {
    return (row_weights != nullptr && token < tile.rows) ? row_weights[tile.row_begin + token] : 1.0f;
  }
  __device__ void store_scale(const Tile& tile, uint32_t token, float scale) const {
    if (token < tile.rows) out_scales[static_cast<uint64_t>(tile.m_tile) * scale_rows + tile.row_begin + token] = scale;
  }

  // What apply needs from global memory, loaded before the tile's mainloop so its latency hides there:
  // the route weights of the thread's two tokens (tokens_on_m).
  struct Prefetched {
    float route_weights[2];
  };
  __device__ Prefetched prefetch(const SharedStorage<Config>& smem, const Tile& tile, uint32_t warpgroup, uint32_t warp,
                                 uint32_t lane) const {
    if constexpr (Config::kLayout == TileLayout::weights_on_m) return {{1.0f, 1.0f}};
    const uint32_t token0 = 64 * warpgroup + 16 * warp + lane / 4;
    return {{route_weight(tile, token0), route_weight(tile, token0 + 8)}};
  }

  __device__ void apply(const SharedStorage<Config>& smem, const Tile& tile, float (&acc)[2][Config::kAccRegs],
                        const Prefetched& prefetched, uint32_t warpgroup, uint32_t warp, uint32_t lane,
                        uint32_t math_thread) const {
    if constexpr (Config::kLayout == TileLayout::weights_on_m) {
      stage_weights_on_m(smem, tile, acc, warpgroup, warp, lane, math_thread);
      math_barrier<Config>();
      store_staged_channels<Config::kBlockN, Config::kMathThreads>(smem, tile, 0, math_thread, 0);
      math_barrier<Config>();  // staging is free for the next tile
    } else {
      float inverse_scales[2];
      activate_tokens_on_m(tile, acc, prefetched.route_weights, warpgroup, warp, lane, inverse_scales);
      constexpr uint32_t kHalvesPerPass = Config::kL1StagingChannels / 64;  // E4M3: both halves at once
#pragma unroll
      for (uint32_t pass = 0; pass < 2 / kHalvesPerPass; ++pass) {
#pragma unroll
        for (uint32_t q = 0; q < kHalvesPerPass; ++q)
          stage_tokens_on_m(smem, acc[pass * kHalvesPerPass + q], 64 * q, warpgroup, warp, lane, inverse_scales);
        warpgroup_barrier(warpgroup);
        store_staged_channels<64, 128>(smem, tile, 64 * warpgroup, math_thread % 128,
                                       Config::kL1StagingChannels * pass);
        warpgroup_barrier(warpgroup);
      }
    }
  }

  // Stores the staged channels [first, first + kL1StagingChannels) of valid tokens [first_token,
  // first_token + kTokens)'s output rows, thread `thread` of kThreads.
  template <uint32_t kTokens, uint32_t kThreads>
  __device__ void store_staged_channels(const SharedStorage<Config>& smem, const Tile& tile, uint32_t first_token,
                                        uint32_t thread, uint32_t first_channel) const {
    constexpr uint32_t kBytes = Config::kL1StagingChannels * Policy::kElementBytes;
    store_staged_rows<kTokens, kThreads, kBytes>(smem.staging(), Config::kL1StagingStride, first_token, tile.rows,
                                                 thread, [&](uint32_t token, uint32_t part) {
                                        const uint64_t row = tile.row_begin + token;
                                        return reinterpret_cast<uint4*>(
                                            static_cast<uint8_t*>(out) +
                                            (row * out_row_elements + tile.m_tile * 128ull + first_channel) *
                                                Policy::kElementBytes +
                                            part * 16);
                                      });
  }

  // Warpgroup w holds gate rows of channels 64w.. in acc[0] and their up rows in acc[1]; a token's
  // channels are spread over all 8 math warps, so the amax goes through shared memory.
  __device__ void stage_weights_on_m(const SharedStorage<Config>& smem, const Tile& tile,
                                     float (&acc)[2][Config::kAccRegs], uint32_t warpgroup, uint32_t warp,
                                     uint32_t lane, uint32_t math_thread) const {
    constexpr uint32_t kBlockN = Config::kBlockN;
    const FragmentCoords frag{16 * warp + lane / 4, lane};
    float weights[Config::kAccRegs / 2];  // per column this thread holds (two per 8-column group)
#pragma unroll
    for (uint32_t c = 0; c < Config::kAccRegs / 2; ++c)
      weights[c] = route_weight(tile, FragmentCoords::column(2 * (c / 2) * 2 + (c % 2), lane));
#pragma unroll
    for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
      const float gate = clamp_gate(acc[0][i], activation_clamp);
      acc[0][i] = silu(gate) * clamp_up(acc[1][i], activation_clamp) * weights[(i / 4) * 2 + (i % 2)];
    }

    uint8_t* staging = smem.staging();
    const uint32_t channel_base = 64 * warpgroup;
    if constexpr (Policy::kScaled) {
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
        store_scale(tile, math_thread, quantizer.scale);
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
  }

  // acc[h] columns [0, 64) are gate of channels 64h.., [64, 128) their up: register i (< 32) pairs with
  // i + 32 in the same thread. A token's 128 channels sit in the 4 lanes of a quad. Leaves the
  // activations in acc[h][0, 32) and, for fp8, the inverse scales of the thread's two tokens.
  __device__ void activate_tokens_on_m(const Tile& tile, float (&acc)[2][Config::kAccRegs], const float (&weights)[2],
                                       uint32_t warpgroup, uint32_t warp, uint32_t lane,
                                       float (&inverse_scales)[2]) const {
    const uint32_t token0 = 64 * warpgroup + 16 * warp + lane / 4;
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h)
#pragma unroll
      for (uint32_t i = 0; i < 32; ++i) {
        const float gate = clamp_gate(acc[h][i], activation_clamp);
        acc[h][i] = silu(gate) * clamp_up(acc[h][i + 32], activation_clamp) * weights[pair_row_select(i)];
      }
    if constexpr (Policy::kScaled) {
      float amax[2] = {0.0f, 0.0f};
#pragma unroll
      for (uint32_t h = 0; h < 2; ++h)
#pragma unroll
        for (uint32_t i = 0; i < 32; ++i) amax[pair_row_select(i)] = fmaxf(amax[pair_row_select(i)], fabsf(acc[h][i]));
#pragma unroll
      for (uint32_t r = 0; r < 2; ++r) {
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xFFFFFFFFu, amax[r], 1));
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xFFFFFFFFu, amax[r], 2));
        const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax[r]);
        inverse_scales[r] = quantizer.inverse_scale;
        if (lane % 4 == 0) store_scale(tile, token0 + 8 * r, quantizer.scale);
      }
    }
  }

  // Writes the 64 activations of acc_half token-major into the staging rows, from channel `first`.
  __device__ void stage_tokens_on_m(const SharedStorage<Config>& smem, const float (&acc_half)[Config::kAccRegs],
                                    uint32_t first, uint32_t warpgroup, uint32_t warp, uint32_t lane,
                                    const float (&inverse_scales)[2]) const {
    uint8_t* staging = smem.staging() + first * Policy::kElementBytes;
    const uint32_t token0 = 64 * warpgroup + 16 * warp + lane / 4;
#pragma unroll
    for (uint32_t i = 0; i < 32; i += 2) {
      const uint32_t r = pair_row_select(i);
      uint8_t* row = staging + (token0 + 8 * r) * Config::kL1StagingStride;
      if constexpr (Policy::kScaled) {
        const uint16_t pair = uint16_t{to_e4m3(acc_half[i] * inverse_scales[r])} |
                              static_cast<uint16_t>(uint16_t{to_e4m3(acc_half[i + 1] * inverse_scales[r])} << 8);
        *reinterpret_cast<uint16_t*>(row + pair_column(i, lane)) = pair;
      } else {
        *reinterpret_cast<uint32_t*>(row + 2 * pair_column(i, lane)) = to_bf16x2_bits(acc_half[i], acc_half[i + 1]);
      }
    }
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
  __device__ uint16_t* row(const PoolSource& source) const {
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

// Either kind of destination: a launch may carry routed and shared jobs with one epilogue type.
struct SlotDestination {
  RoutedDestination routed;
  SharedDestination shared;
  bool is_shared;
  // What finding a row reads from global memory: a routed row's pool source (shared rows need
  // none), so that it can be loaded early and the row computed later without waiting on the load.
  __device__ const PoolSource* source_address(uint32_t pool_row) const {
    return is_shared ? nullptr : routed.sources + pool_row;
  }
  __device__ PoolSource lookup(uint32_t pool_row) const {
    return is_shared ? PoolSource{} : *source_address(pool_row);
  }
  __device__ uint16_t* row(uint32_t pool_row, const PoolSource& source) const {
    return is_shared ? shared.row(pool_row) : routed.row(source);
  }
  __device__ uint16_t* row(uint32_t pool_row) const { return row(pool_row, lookup(pool_row)); }
};

// L2: BF16 rows of 256 output features per token, stored to destination.row(pool row) + 256 * m_tile.
template <class Config>
struct StoreEpilogue {
  SlotDestination destination;
  uint32_t n_out;  // features per row (hidden); a last partial tile stores only the valid ones

  // tokens_on_m: warp `warp` of a math warpgroup holds every feature of its 16 tokens, so it stages
  // and stores them alone, with no barrier beyond the warp: lane l copies 16-byte chunk l % 8 of
  // tokens 16 warp + l / 8 + 4j. Finding a routed row reads its pool source: lane t < 16 copies
  // token 16 warp + t's (cp.async) into the free end of the token's staging row before the tile's
  // mainloop, so that nothing waits on the load and no register holds the sources through the
  // mainloop.
  //
  // With store warps (Config::kStoreWarps, fp8 and bf16) the math warpgroup instead stages its
  // tokens' whole rows and goes back to its wgmmas; store warp w copies them out (store_staged_tiles).
  static constexpr uint32_t kCopyTokens = 16 * (Config::kPassBytes / 16) / 32;
  static constexpr uint32_t kSourceOffset = Config::kPassBytes;  // in a staging row, past its data
  __device__ static uint32_t copy_token(uint32_t warpgroup, uint32_t warp, uint32_t lane, uint32_t j) {
    return 64 * warpgroup + 16 * warp + lane / 8 + 4 * j;
  }
  struct Prefetched {};
  __device__ Prefetched prefetch(const SharedStorage<Config>& smem, const Tile& tile, uint32_t warpgroup, uint32_t warp,
                                 uint32_t lane) const {
    if constexpr (Config::kLayout == TileLayout::tokens_on_m && !Config::kStoreWarps) {
      static_assert(Config::kL2StagingStride >= kSourceOffset + sizeof(PoolSource), "no room for the pool source");
      const uint32_t token = 64 * warpgroup + 16 * warp + lane;
      if (lane < 16 && token < tile.rows && !destination.is_shared) {
        __pipeline_memcpy_async(smem.staging() + token * Config::kL2StagingStride + kSourceOffset,
                                destination.source_address(tile.row_begin + token), sizeof(PoolSource));
        __pipeline_commit();
      }
    }
    return {};
  }

  __device__ void apply(const SharedStorage<Config>& smem, const Tile& tile, float (&acc)[2][Config::kAccRegs],
                        const Prefetched& prefetched, uint32_t warpgroup, uint32_t warp, uint32_t lane,
                        uint32_t math_thread) const {
    if constexpr (Config::kLayout == TileLayout::weights_on_m) {
      uint8_t* staging = smem.staging();
      const FragmentCoords frag{16 * warp + lane / 4, lane};
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j)
#pragma unroll
        for (uint32_t i = 0; i < Config::kAccRegs; ++i) {
          const uint32_t feature = 128 * warpgroup + 64 * j + frag.row(i);
          reinterpret_cast<uint16_t*>(staging + FragmentCoords::column(i, lane) * Config::kL2StagingStride)[feature] =
              to_bf16_bits(acc[j][i]);
        }
      math_barrier<Config>();
      const uint32_t first_feature = tile.m_tile * Config::kBlockM;
      store_staged_rows<Config::kBlockN, Config::kMathThreads, Config::kBlockM * 2>(
          staging, Config::kL2StagingStride, 0, tile.rows, math_thread,
                                                     [&](uint32_t token, uint32_t part) -> uint4* {
                                                       if (first_feature + part * 8 >= n_out) return nullptr;
                                                       return reinterpret_cast<uint4*>(
                                                           destination.row(tile.row_begin + token) + first_feature +
                                                           part * 8);
                                                     });
      math_barrier<Config>();
    } else {
      const uint32_t warp_token = 64 * warpgroup + 16 * warp;
      const uint32_t valid_features = n_out - tile.m_tile * Config::kBlockM;
      const uint32_t stmatrix_row = stmatrix_address(smem, warp_token, lane);
      if constexpr (Config::kStoreWarps) {
        handoff_wait(rows_stored_barrier(warpgroup));
#pragma unroll
        for (uint32_t pass = 0; pass < 4; ++pass) {
          if (64 * pass >= valid_features) break;  // the same for every thread
          stage_pass(stmatrix_row + Config::kPassBytes * pass, acc, pass);
        }
        if (math_thread % 128 == 0)
          *smem.staged_tile(warpgroup) = StagedTile{tile.job, tile.row_begin, tile.rows, tile.m_tile};
        handoff_arrive(rows_staged_barrier(warpgroup));
      } else {
        const uint8_t* staging = smem.staging();
        // The rows this lane copies, found once for all four passes from the sources its warp's lanes
        // copied in (the first pass's stmatrix leaves the rows' last 16 bytes alone).
        if (lane < 16 && warp_token + lane < tile.rows && !destination.is_shared) __pipeline_wait_prior(0);
        __syncwarp();
        uint16_t* rows[kCopyTokens];
#pragma unroll
        for (uint32_t j = 0; j < kCopyTokens; ++j) {
          const uint32_t token = copy_token(warpgroup, warp, lane, j);
          const PoolSource source =
              destination.is_shared
                  ? PoolSource{}
                  : *reinterpret_cast<const PoolSource*>(staging + token * Config::kL2StagingStride + kSourceOffset);
          rows[j] = token < tile.rows ? destination.row(tile.row_begin + token, source) + tile.m_tile * Config::kBlockM
                                      : nullptr;
        }
        const uint32_t part = lane % 8;
#pragma unroll
        for (uint32_t pass = 0; pass < 4; ++pass) {
          if (64 * pass >= valid_features) break;  // the same for every thread
          stage_pass(stmatrix_row, acc, pass);
          __syncwarp();
#pragma unroll
          for (uint32_t j = 0; j < kCopyTokens; ++j) {
            if (rows[j] == nullptr) continue;
            const uint32_t token = copy_token(warpgroup, warp, lane, j);
            *reinterpret_cast<uint4*>(rows[j] + 64 * pass + 8 * part) =
                *reinterpret_cast<const uint4*>(staging + token * Config::kL2StagingStride + 16 * part);
          }
          __syncwarp();  // the staging rows are free for the next pass
        }
      }
    }
  }

  // tokens_on_m: features are staged in passes of 64: acc[p / 2] registers [32 (p % 2), +32) hold
  // features 64p... Each stmatrix stages 16 features of the warp's 16 tokens (two 8-feature groups,
  // matrices 0 and 2 their first 8 tokens, 1 and 3 the next 8): lane l addresses token
  // l % 8 + 8 ((l / 8) % 2), group l / 16.
  __device__ static uint32_t stmatrix_address(const SharedStorage<Config>& smem, uint32_t warp_token, uint32_t lane) {
    return smem.staging_address() + (warp_token + lane % 8 + 8 * ((lane / 8) % 2)) * Config::kL2StagingStride +
           16 * (lane / 16);
  }
  __device__ static void stage_pass(uint32_t address, const float (&acc)[2][Config::kAccRegs], uint32_t pass) {
    const uint32_t h = pass / 2, first = 32 * (pass % 2);
#pragma unroll
    for (uint32_t i = first; i < first + 32; i += 8)
      ptx::stmatrix_x4(address + 4 * (i - first), to_bf16x2_bits(acc[h][i], acc[h][i + 1]),
                       to_bf16x2_bits(acc[h][i + 2], acc[h][i + 3]), to_bf16x2_bits(acc[h][i + 4], acc[h][i + 5]),
                       to_bf16x2_bits(acc[h][i + 6], acc[h][i + 7]));
  }

  // Store warp w (Config::kStoreWarps) copies out math warpgroup w's staged rows, tile by tile, until
  // the warpgroup says it has no more (finish_staging). Each warp store is one token's 512-byte row.
  template <class Jobs>
  __device__ static void store_staged_tiles(const SharedStorage<Config>& smem, const Jobs& jobs, uint32_t warpgroup,
                                            uint32_t lane) {
    const uint8_t* staging = smem.staging();
    const uint32_t first_token = 64 * warpgroup;
    handoff_arrive(rows_stored_barrier(warpgroup));  // the staging rows start free
    for (;;) {
      handoff_wait(rows_staged_barrier(warpgroup));
      const StagedTile staged = *smem.staged_tile(warpgroup);
      if (staged.job == kNoStagedTile) break;
      const StoreEpilogue& epilogue = jobs.job[staged.job].epilogue;
      const uint32_t tokens = staged.rows > first_token ? min(staged.rows - first_token, 64u) : 0u;
      const uint32_t first_row = staged.row_begin + first_token;
      const uint32_t feature = staged.m_tile * Config::kBlockM;
      const bool lane_stores = 8 * lane < epilogue.n_out - feature;
      // Lane l finds the rows of tokens l and l + 32 (their pool-source loads in flight together);
      // each token's row address then comes from its lane. (Finding each row inside the loop, a
      // dependent load and a division by top-k per token, leaves the store warp behind its warpgroup.)
      uint16_t* const low = lane < tokens ? epilogue.destination.row(first_row + lane) + feature : nullptr;
      uint16_t* const high = lane + 32 < tokens ? epilogue.destination.row(first_row + lane + 32) + feature : nullptr;
      const uint8_t* staged_row = staging + first_token * Config::kL2StagingStride + 16 * lane;
#pragma unroll 8
      for (uint32_t token = 0; token < tokens; ++token, staged_row += Config::kL2StagingStride) {
        const uint64_t row = __shfl_sync(0xFFFFFFFFu, reinterpret_cast<uint64_t>(token < 32 ? low : high), token % 32);
        if (lane_stores)
          *(reinterpret_cast<uint4*>(row) + lane) = *reinterpret_cast<const uint4*>(staged_row);
      }
      handoff_arrive(rows_stored_barrier(warpgroup));
    }
    // Results may have gone to peers' buffers: as the math threads' fence at the kernel's end.
    __threadfence_system();
  }

  // After a math warpgroup's last tile: tells its store warp there are no more.
  __device__ static void finish_staging(const SharedStorage<Config>& smem, uint32_t warpgroup, uint32_t math_thread) {
    handoff_wait(rows_stored_barrier(warpgroup));
    if (math_thread % 128 == 0) smem.staged_tile(warpgroup)->job = kNoStagedTile;
    handoff_arrive(rows_staged_barrier(warpgroup));
  }
};

}  // namespace megamoe::gemm
