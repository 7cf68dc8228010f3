// Tile scheduler of the grouped GEMM over the expert-major pool.
//
// Group g (a local expert) owns pool rows [rows[g], rows[g+1]); its tiles are (m tile of the weight
// rows, n tile of BLOCK_N tokens), m-major so that consecutive tiles reuse one weight tile from L2.
// A large group is walked in bands of kBandTokenTiles token tiles (all m tiles of one band, then the
// next band): the band's tokens stay in L2 while its weight tiles go by, instead of every token
// tile being evicted and fetched again for each m tile.
// Empty groups have no tiles. Every CTA builds the per-group tile prefix in shared memory from the
// device-side row offsets (the host never reads them); which units a CTA runs is mainloop.cuh's
// UnitClaims (blockIdx.x first, then claimed in order).
//
// A launch may carry a second job of one group with host-known rows (the shared experts next to the
// routed ones): its tiles follow the first job's, so one persistent grid balances both.
//
// Split K (decode tiles only): when the last wave's tiles would leave most of the grid idle (few
// active experts, or a few tiles past a whole wave), each of those tiles' K range is cut into
// `splits` work units (consecutive indices after the whole tiles), so that more SMs stream the
// weights. Each unit publishes its FP32 partial sums; the tile's last unit to finish adds them up
// in split order and runs the epilogue (split_k.cuh).
#pragma once

#include <cstdint>

#include "kernels/gemm/split_plan.h"
#include "kernels/warp_scan.cuh"
#include "megamoe/config.h"

namespace megamoe::gemm {

inline constexpr uint32_t kMaxGroups = 1024;
inline constexpr uint32_t kBandTokenTiles = 8;

// Where tile `local` of a group with n_tiles token tiles and m_tiles weight tiles lies: bands of
// kBandTokenTiles token tiles, each walked m-major (the last band may hold fewer token tiles).
struct TileCoords {
  uint32_t m_tile;
  uint32_t n_tile;
};
__host__ __device__ constexpr TileCoords banded_tile(uint32_t local, uint32_t n_tiles, uint32_t m_tiles) {
  const uint32_t band = local / (m_tiles * kBandTokenTiles);
  const uint32_t band_tiles =
      n_tiles - band * kBandTokenTiles < kBandTokenTiles ? n_tiles - band * kBandTokenTiles : kBandTokenTiles;
  const uint32_t in_band = local - band * m_tiles * kBandTokenTiles;
  return {in_band / band_tiles, band * kBandTokenTiles + in_band % band_tiles};
}

// How many of a weights_on_m tile's tokens its wgmmas cover. A group's only token tile narrows them to
// its rows (16, 32 or 64 wide: no tensor-core time or promotion for tokens it does not have). A group
// of several token tiles keeps all of them at BLOCK_N: its tiles stream one weight tile side by side
// and share its lines in L2 only while they run at one speed (a narrower last tile runs ahead).
__host__ __device__ constexpr uint32_t wgmma_rows(uint32_t group_rows, uint32_t tile_rows, uint32_t block_n) {
  return group_rows <= block_n ? tile_rows : block_n;
}

// The group of first-job tile `index`: the last group whose first tile is <= index (empty groups
// share their successor's start), given tile_prefix[0..num_groups]. A walker visits increasing
// indices and keeps `cursor` (0 at its start), the group of its last tile, between calls: a prefill
// walker mostly stays in one group, which then costs one load instead of a binary search whose
// dependent shared-memory loads the math warpgroups waited on at every tile. Host and device (CPU-tested).
__host__ __device__ inline uint32_t group_of_tile(const uint32_t* tile_prefix, uint32_t num_groups, uint32_t index,
                                                  uint32_t& cursor) {
  if (cursor + 1 < num_groups && tile_prefix[cursor + 1] <= index) {
    uint32_t low = cursor + 1, high = num_groups - 1;
    while (low < high) {
      const uint32_t mid = (low + high + 1) / 2;
      if (tile_prefix[mid] <= index) low = mid;
      else high = mid - 1;
    }
    cursor = low;
  }
  return cursor;
}

// Where a grouped GEMM finds its groups' rows: a device prefix array of num_groups + 1 offsets, or
// (prefix == nullptr) a single group of `fixed_rows` rows starting at row 0.
struct GroupRows {
  const uint32_t* prefix = nullptr;
  uint32_t num_groups = 1;
  uint32_t fixed_rows = 0;
};

struct Tile {
  uint32_t job;        // 0, or 1 for the second job of the launch
  uint32_t group;
  uint32_t m_tile;     // weight rows [m_tile * BLOCK_M, +BLOCK_M)
  uint32_t row_begin;  // first pool row of the token tile
  uint32_t rows;       // valid tokens in the tile, 1..BLOCK_N
  uint32_t mma_rows;   // tokens its wgmmas cover (weights_on_m): wgmma_rows
};

// One work unit: a tile, or one split of its K range.
struct WorkUnit {
  Tile tile;
  uint32_t split_tile;  // split tiles: which of them (its counter and slots)
  uint32_t split;
  uint32_t splits;      // 1 for a whole tile
  KRange k_blocks;
};

// Tile `local` of group `group` of job `job`, a group of `rows` rows from pool row `row_begin` with
// `m_tiles` weight tiles (banded_tile's order). Both schedules' schedulers walk tiles through it.
template <uint32_t kBlockN>
__device__ Tile tile_of_group(uint32_t job, uint32_t group, uint32_t local, uint32_t row_begin, uint32_t rows,
                              uint32_t m_tiles) {
  const TileCoords coords = banded_tile(local, (rows + kBlockN - 1) / kBlockN, m_tiles);
  Tile tile;
  tile.job = job;
  tile.group = group;
  tile.m_tile = coords.m_tile;
  const uint32_t n_tile = coords.n_tile;
  tile.row_begin = row_begin + n_tile * kBlockN;
  const uint32_t remaining = rows - n_tile * kBlockN;
  tile.rows = remaining < kBlockN ? remaining : kBlockN;
  tile.mma_rows = wgmma_rows(rows, tile.rows, kBlockN);
  return tile;
}

template <uint32_t kBlockN>
struct TileScheduler {
  uint32_t* tile_prefix;  // shared memory, num_groups + 1 entries (the first job)
  uint32_t* group_begin;  // shared memory, num_groups + 1 entries
  uint32_t num_groups;
  uint32_t m_tiles;
  uint32_t second_rows;     // the second job's rows (0: no second job)
  uint32_t second_m_tiles;
  SplitPlan split_plan;     // plan_splits
  uint32_t first_k_blocks, second_k_blocks;

  // All threads of the CTA call this (it holds a CTA-wide barrier), followed by a CTA-wide barrier.
  // `second` must be a single group of fixed rows.
  __device__ void build(const GroupRows& groups, uint32_t m_tiles_per_group, const GroupRows& second,
                        uint32_t second_m_tiles_per_group, uint32_t* smem, uint32_t thread, uint32_t num_threads) {
    num_groups = groups.num_groups;
    m_tiles = m_tiles_per_group;
    second_rows = second.fixed_rows;
    second_m_tiles = second_m_tiles_per_group;
    tile_prefix = smem;
    group_begin = smem + kMaxGroups + 1;
    if (groups.prefix == nullptr) {
      if (thread == 0) {
        group_begin[0] = 0;
        group_begin[1] = groups.fixed_rows;
        tile_prefix[0] = 0;
        tile_prefix[1] = m_tiles * ((groups.fixed_rows + kBlockN - 1) / kBlockN);
      }
      return;
    }
    // The row offsets come to shared memory first, every thread's loads in flight at once; then one
    // warp scans the tile counts from there. (Scanning straight from global memory waited one round
    // trip per 32 groups: 8 at the layer's 256 experts on one GPU.)
#pragma unroll 4
    for (uint32_t g = thread; g <= num_groups; g += num_threads) group_begin[g] = groups.prefix[g];
    __syncthreads();
    if (thread < 32)
      device::warp_exclusive_prefix(num_groups, thread, tile_prefix, [&](uint32_t g) {
        return m_tiles * ((group_begin[g + 1] - group_begin[g] + kBlockN - 1) / kBlockN);
      });
  }

  __device__ uint32_t first_job_tiles() const { return tile_prefix[num_groups]; }
  __device__ uint32_t num_tiles() const {
    return first_job_tiles() + second_m_tiles * ((second_rows + kBlockN - 1) / kBlockN);
  }

  // After build's barrier: every thread derives the same plan from the tile count.
  // capacity_units = 0 keeps every tile whole.
  __device__ void plan_splits(uint32_t first_job_k_blocks, uint32_t second_job_k_blocks, uint32_t capacity_units) {
    first_k_blocks = first_job_k_blocks;
    second_k_blocks = second_job_k_blocks;
    const uint32_t min_k_blocks = second_rows > 0 && second_k_blocks < first_k_blocks ? second_k_blocks : first_k_blocks;
    split_plan = plan_split_k(num_tiles(), gridDim.x, min_k_blocks, capacity_units);
  }
  __device__ uint32_t num_units() const { return split_units(num_tiles(), split_plan); }
  // Work unit `index`. Each walker (producer, converters, math warpgroups) visits increasing
  // indices and keeps `group_cursor` (0 at its start) between calls (group_of_tile).
  __device__ WorkUnit unit(uint32_t index, uint32_t& group_cursor) const {
    const SplitUnit split = split_unit(index, split_plan);
    WorkUnit work;
    work.tile = tile(split.tile, group_cursor);
    work.split_tile = split.split_tile;
    work.split = split.split;
    work.splits = split.splits;
    work.k_blocks = split_k_range(work.tile.job == 0 ? first_k_blocks : second_k_blocks, split.split, split.splits);
    return work;
  }

  __device__ Tile tile(uint32_t index, uint32_t& group_cursor) const {
    const uint32_t first_tiles = first_job_tiles();
    if (index >= first_tiles) return split(1, 0, index - first_tiles, 0, second_rows, second_m_tiles);
    const uint32_t group = group_of_tile(tile_prefix, num_groups, index, group_cursor);
    return split(0, group, index - tile_prefix[group], group_begin[group], group_begin[group + 1] - group_begin[group],
                 m_tiles);
  }

  __device__ static Tile split(uint32_t job, uint32_t group, uint32_t local, uint32_t row_begin, uint32_t rows,
                               uint32_t m_tiles) {
    return tile_of_group<kBlockN>(job, group, local, row_begin, rows, m_tiles);
  }
};

}  // namespace megamoe::gemm
