// The decode ceiling of a weight-streaming GEMM with our tile shape (ceilings.h, tile_stream_us).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cuda/ptx>

#include <cstdint>
#include <cstdio>

#include "bench/common/ceilings.h"
#include "kernels/gemm/tensor_map.h"
#include "megamoe/error.h"

namespace megamoe::bench {
namespace {

// The weights_on_m decode configs' stage: 256 weight rows x a box of K bytes (128 for fp8 and BF16's K
// blocks, 64 for fp8_fp4's packed ones), through a ring of 192 KiB (the fp8 decode configs' six
// 32 KiB stages), so that both box widths keep the same bytes in flight.
constexpr uint32_t kTileRows = 256;
constexpr uint32_t kRingBytes = 6 * kTileRows * 128;
constexpr uint64_t kWaitTimeoutNs = 5'000'000'000ull;

struct StreamParams {
  CUtensorMap weights;
  const uint32_t* tile_rows;  // first weight row of each tile
  uint32_t tiles;
  uint32_t k_blocks;  // 128-byte boxes per row
};

// Waits for a phase of `barrier`; after kWaitTimeoutNs it reports what it waited for and traps.
__device__ __forceinline__ void wait_phase(uint64_t* barrier, uint32_t parity, const char* what, uint32_t stage) {
  if (cuda::ptx::mbarrier_try_wait_parity(barrier, parity)) return;
  const uint64_t start = cuda::ptx::get_sreg_globaltimer();
  while (!cuda::ptx::mbarrier_try_wait_parity(barrier, parity)) {
    if (cuda::ptx::get_sreg_globaltimer() - start > kWaitTimeoutNs) {
      printf("tile_stream: block %d timed out waiting for the %s barrier of stage %u (parity %u)\n", blockIdx.x, what,
             stage, parity);
      __trap();
    }
  }
}

// Warp 0's lane 0 streams this CTA's share of the (tile, K block) boxes into the ring; warp 1 releases
// each stage once it is full. The boxes are split evenly over the grid, across tile boundaries.
template <uint32_t kBoxBytes>
__global__ void __launch_bounds__(64, 1) tile_stream_kernel(const __grid_constant__ StreamParams params) {
  constexpr uint32_t kStageBytes = kTileRows * kBoxBytes;
  constexpr uint32_t kStages = kRingBytes / kStageBytes;
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ uint64_t full[kStages], empty[kStages];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (uint32_t stage = 0; stage < kStages; ++stage) {
      cuda::ptx::mbarrier_init(&full[stage], 1);
      cuda::ptx::mbarrier_init(&empty[stage], 1);
    }
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  const uint64_t boxes = uint64_t{params.tiles} * params.k_blocks;
  const uint64_t begin = boxes * blockIdx.x / gridDim.x, end = boxes * (blockIdx.x + 1) / gridDim.x;
  uint32_t stage = 0, phase = 0;
  for (uint64_t box = begin; box < end; ++box) {
    if (warp == 0) {
      if (lane == 0) {
        wait_phase(&empty[stage], phase ^ 1, "empty", stage);
        const uint32_t bytes = kStageBytes;  // by value: the wrapper takes a reference
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &full[stage], bytes);
        const uint32_t tile = static_cast<uint32_t>(box / params.k_blocks);
        const uint32_t k_block = static_cast<uint32_t>(box % params.k_blocks);
        const int32_t coords[2] = {static_cast<int32_t>(k_block * kBoxBytes),
                                   static_cast<int32_t>(params.tile_rows[tile])};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, ring + stage * kStageBytes,
                                        &params.weights, coords, &full[stage]);
      }
    } else {
      wait_phase(&full[stage], phase, "full", stage);
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(&empty[stage]);
    }
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
}

}  // namespace

double tile_stream_us(const void* weights, uint64_t rows, uint64_t row_bytes, std::span<const uint32_t> tile_rows,
                      cudaStream_t stream, const L2Flush& flush, int repeats, int warmups, uint32_t box_bytes) {
  require(box_bytes == 128 || box_bytes == 64, "box_bytes", "must be 128 or 64, got ", box_bytes);
  require(row_bytes % box_bytes == 0, "row_bytes", "must be a multiple of ", box_bytes, ", got ", row_bytes);
  require(!tile_rows.empty(), "tile_rows", "must name at least one tile");
  for (const uint32_t first : tile_rows)
    require(first + uint64_t{kTileRows} <= rows, "tile_rows", "tile at row ", first, " ends past the ", rows, " rows");
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  StreamParams params{};
  params.weights = gemm::make_tensor_map_2d(weights, CU_TENSOR_MAP_DATA_TYPE_UINT8, row_bytes, rows, row_bytes,
                                            box_bytes, kTileRows,
                                            box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                                            "tile_stream weights");
  uint32_t* device_tile_rows = nullptr;
  cuda_ok(cudaMalloc(&device_tile_rows, tile_rows.size_bytes()), "cudaMalloc(tile rows)");
  cuda_ok(cudaMemcpy(device_tile_rows, tile_rows.data(), tile_rows.size_bytes(), cudaMemcpyHostToDevice),
          "copy tile rows");
  params.tile_rows = device_tile_rows;
  params.tiles = static_cast<uint32_t>(tile_rows.size());
  params.k_blocks = static_cast<uint32_t>(row_bytes / box_bytes);
  const auto kernel = box_bytes == 128 ? tile_stream_kernel<128> : tile_stream_kernel<64>;
  cuda_ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes),
          "cudaFuncSetAttribute(tile_stream shared memory)");
  const double us = time_cold_us(
      [&] {
        kernel<<<sms, 64, kRingBytes, stream>>>(params);
        cuda_ok(cudaGetLastError(), "tile_stream launch");
      },
      stream, flush, repeats, warmups);
  cuda_ok(cudaFree(device_tile_rows), "cudaFree(tile rows)");
  return us;
}

}  // namespace megamoe::bench
