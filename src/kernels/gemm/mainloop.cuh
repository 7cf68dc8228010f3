// The grouped GEMM's mainloop: one producer thread streams weight tiles, token tiles and activation
// scales with TMA into the stage ring; two math warpgroups run wgmma over them into FP32 registers.
//
// D[weight rows x tokens] = W[group] . X^T: weights are the wgmma A operand (M = weight rows, 64 per
// instruction), tokens are B (N = BLOCK_N). Few tokens per expert then cost a narrow N, not a padded
// M, and the kernel streams weights. Math warpgroup w owns rows [128w, 128w + 128) of the tile as two
// m64 blocks.
#pragma once

#include <cuda.h>
#include <cuda/ptx>

#include <cstdint>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace megamoe::gemm {

struct MainloopArgs {
  uint32_t n_out;      // weight rows per group
  uint32_t k;          // reduction length
  uint32_t k_blocks;   // k / kBlockK
  uint32_t m_tiles;    // ceil(n_out / 256)
  GroupRows groups;
  const float* weight_scales;  // scaled recipes: [groups][n_out / 64][k / 128]
  PipelineWatch watch;
};

template <class Config>
__device__ void produce(const SharedStorage<Config>& smem, const TileScheduler<Config::kBlockN>& scheduler,
                        const CUtensorMap* weights_map, const CUtensorMap* acts_map,
                        const CUtensorMap* act_scales_map, const MainloopArgs& args) {
  RingPosition<Config::kStages> ring;
  const uint32_t num_tiles = scheduler.num_tiles();
  for (uint32_t index = blockIdx.x; index < num_tiles; index += gridDim.x) {
    const Tile tile = scheduler.tile(index);
    const int32_t weight_row = static_cast<int32_t>(tile.group * args.n_out + tile.m_tile * Config::kBlockM);
    for (uint32_t kb = 0; kb < args.k_blocks; ++kb) {
      wait_barrier(smem.empty(ring.stage), ring.phase ^ 1, args.watch, ring.stage);
      uint64_t* full = smem.full(ring.stage);
      const uint32_t stage_bytes = Config::kStageTxBytes;  // by value: the wrapper takes a reference
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           full, stage_bytes);
      const int32_t k_coord = static_cast<int32_t>(kb * Config::kBlockK);
      const int32_t a_coords[2] = {k_coord, weight_row};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem.a(ring.stage),
                                      weights_map, a_coords, full);
      const int32_t b_coords[2] = {k_coord, static_cast<int32_t>(tile.row_begin)};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem.b(ring.stage),
                                      acts_map, b_coords, full);
      if constexpr (Config::Policy::kScaled) {
        const int32_t s_coords[2] = {static_cast<int32_t>(tile.row_begin & ~(Config::kScaleAlignRows - 1)),
                                     static_cast<int32_t>(kb)};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                        smem.act_scales(ring.stage), act_scales_map, s_coords, full);
      }
      ring.advance();
    }
  }
}

// Accumulates one tile into acc[j] (m64 block j of this warpgroup's 128 rows), FP32.
template <class Config>
__device__ void consume_tile(const SharedStorage<Config>& smem, RingPosition<Config::kStages>& ring,
                             const Tile& tile, const MainloopArgs& args, uint32_t warpgroup, uint32_t lane,
                             float (&acc)[2][Config::kAccRegs]) {
  using Policy = typename Config::Policy;
  using Mma = typename Policy::template Mma<Config::kBlockN>;
  constexpr uint32_t kMmasPerBlock = Config::kBlockK / Policy::kMmaK;
  constexpr uint32_t kM64Bytes = 64 * Config::kRowBytes;
  constexpr uint64_t kDescKStep = 32 >> 4;  // 32 bytes of K, in descriptor units of 16 bytes

#pragma unroll
  for (uint32_t j = 0; j < 2; ++j)
#pragma unroll
    for (uint32_t i = 0; i < Config::kAccRegs; ++i) acc[j][i] = 0.0f;

  // Weight scales of this warpgroup's two m64 blocks: rows past the group's end (a partial last
  // tile) read none and contribute zero.
  const uint32_t first_row_block = (tile.group * args.n_out + tile.m_tile * Config::kBlockM) / 64 + 2 * warpgroup;
  const uint32_t group_row_blocks_end = (tile.group + 1) * args.n_out / 64;

  for (uint32_t kb = 0; kb < args.k_blocks; ++kb) {
    wait_barrier(smem.full(ring.stage), ring.phase, args.watch, ring.stage);
    const uint64_t desc_b = ptx::smem_desc_sw128(smem.b(ring.stage));
    if constexpr (Policy::kScaled) {
      const float* act_scales = smem.act_scales(ring.stage) + (tile.row_begin & (Config::kScaleAlignRows - 1));
      float partial[Config::kAccRegs];
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        const uint64_t desc_a = ptx::smem_desc_sw128(smem.a(ring.stage) + (2 * warpgroup + j) * kM64Bytes);
        ptx::fence_registers(partial);
        ptx::wgmma_fence();
#pragma unroll
        for (uint32_t kk = 0; kk < kMmasPerBlock; ++kk)
          Mma::mma(desc_a + kk * kDescKStep, desc_b + kk * kDescKStep, partial, kk > 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        ptx::fence_registers(partial);
        const uint32_t row_block = first_row_block + j;
        const float weight_scale =
            row_block < group_row_blocks_end ? __ldg(args.weight_scales + row_block * args.k_blocks + kb) : 0.0f;
        // Scales are re-read per use (volatile): kept live across both m64 blocks they would cost
        // BLOCK_N / 4 registers and make the 128-token tile spill.
#pragma unroll
        for (uint32_t i = 0; i < Config::kAccRegs; i += 2) {
          const volatile float* scales = act_scales + 8 * (i / 4) + 2 * (lane % 4);
          acc[j][i] += partial[i] * (weight_scale * scales[0]);
          acc[j][i + 1] += partial[i + 1] * (weight_scale * scales[1]);
        }
      }
    } else {
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        const uint64_t desc_a = ptx::smem_desc_sw128(smem.a(ring.stage) + (2 * warpgroup + j) * kM64Bytes);
        ptx::fence_registers(acc[j]);
        ptx::wgmma_fence();
#pragma unroll
        for (uint32_t kk = 0; kk < kMmasPerBlock; ++kk)
          Mma::mma(desc_a + kk * kDescKStep, desc_b + kk * kDescKStep, acc[j], kb > 0 || kk > 0);
        ptx::wgmma_commit();
      }
      ptx::wgmma_wait<0>();
      ptx::fence_registers(acc[0]);
      ptx::fence_registers(acc[1]);
    }
    // Every math warp releases the stage once its wgmmas (which read it asynchronously) are done.
    __syncwarp();
    if (lane == 0) cuda::ptx::mbarrier_arrive(smem.empty(ring.stage));
    ring.advance();
  }
}

}  // namespace megamoe::gemm
