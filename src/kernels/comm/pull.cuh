// Pulling token rows from a peer's buffer into this rank's, two ways: TMA bulk copies (peer global ->
// shared -> local global, driven by one thread) and 16-byte vector loads (a warp per row). Rows must
// be 16-byte aligned and a multiple of 16 bytes long.
//
// The data pulled must have been published to this rank (flag acquired) before the pull starts. Bulk
// copies read through the async proxy, so pull_rows_bulk first fences generic-proxy writes to global
// memory against it.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "megamoe/config.h"

namespace megamoe::device {

// 16-byte loads in flight per lane while a warp pulls a row: 16 cover a 7 KiB E4M3 row (DeepSeek-V3's
// hidden size) and its scales in one round trip; at decode each row's round trips are the pull's time.
inline constexpr int kPullRowUnroll = 16;

// Rows laid out back to back in both buffers: row i is at src + i * row_bytes and dst + i * row_bytes.
struct ContiguousRows {
  const char* src;
  char* dst;
  uint32_t row_bytes;
  MEGAMOE_DEVICE const char* source(uint32_t row) const { return src + uint64_t{row} * row_bytes; }
  MEGAMOE_DEVICE char* destination(uint32_t row) const { return dst + uint64_t{row} * row_bytes; }
};

// What one pulled item is: row i of `main`, and row i of `side` when side.row_bytes > 0. The layer
// keeps an E4M3 token row and its 1x128 scales in separate regions, so that every row stays 128-byte
// aligned; a pull moves both as one item.
struct PulledRows {
  ContiguousRows main;
  ContiguousRows side;
  MEGAMOE_HD uint32_t item_bytes() const { return main.row_bytes + side.row_bytes; }
};

// One warp copies item `item`: every lane's 16-byte loads (of the row and of its side row) are issued
// before any store, kUnroll per lane per round.
template <int kUnroll>
MEGAMOE_DEVICE void copy_item_vector(const PulledRows& rows, uint32_t item, uint32_t lane) {
  const uint32_t main_vectors = rows.main.row_bytes / 16;
  const uint32_t vectors = main_vectors + rows.side.row_bytes / 16;
  const auto* main_src = reinterpret_cast<const int4*>(rows.main.source(item));
  const auto* side_src = reinterpret_cast<const int4*>(rows.side.source(item));
  auto* main_dst = reinterpret_cast<int4*>(rows.main.destination(item));
  auto* side_dst = reinterpret_cast<int4*>(rows.side.destination(item));
  for (uint32_t base = lane; base < vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t index = base + 32 * u;
      if (index < vectors) {
        values[u] = cuda::ptx::ld_L1_no_allocate_L2_256B(
            cuda::ptx::space_global, index < main_vectors ? main_src + index : side_src + (index - main_vectors));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t index = base + 32 * u;
      if (index < vectors) *(index < main_vectors ? main_dst + index : side_dst + (index - main_vectors)) = values[u];
    }
  }
}

// One warp copies one row (no side row).
template <int kUnroll>
MEGAMOE_DEVICE void copy_row_vector(const char* src_row, char* dst_row, uint32_t row_bytes, uint32_t lane) {
  const PulledRows row{{src_row, dst_row, row_bytes}, {nullptr, nullptr, 0}};
  copy_item_vector<kUnroll>(row, 0, lane);
}

// One warp copies items first, first + stride, ... below `count`.
template <int kUnroll>
MEGAMOE_DEVICE void pull_rows_vector(const PulledRows& rows, uint32_t first, uint32_t count, uint32_t stride,
                                     uint32_t lane) {
  for (uint32_t item = first; item < count; item += stride) copy_item_vector<kUnroll>(rows, item, lane);
}

// One thread streams items first, first + stride, ... below `count` through `stages` shared-memory
// slots of rows.item_bytes() each (`slots`, 16-byte aligned) with one mbarrier per slot (`full`): bulk
// loads fill a slot (the row, then its side row), bulk stores empty it, and the slot is refilled once
// those stores have read it. kStoresInFlight items' stores may still be reading their slots while
// later loads are issued; `stages` must exceed it.
template <int kStoresInFlight>
MEGAMOE_DEVICE void pull_rows_bulk(const PulledRows& rows, uint32_t first, uint32_t count, uint32_t stride,
                                   char* slots, uint64_t* full, uint32_t stages) {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  for (uint32_t s = 0; s < stages; ++s) cuda::ptx::mbarrier_init(&full[s], 1);
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);

  const uint32_t slot_bytes = rows.item_bytes();
  const uint32_t items = first < count ? (count - first + stride - 1) / stride : 0;
  auto load = [&](uint32_t item) {
    const uint32_t slot = item % stages;
    const uint32_t row = first + item * stride;
    char* slot_data = slots + slot * slot_bytes;
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         &full[slot], slot_bytes);
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, slot_data, rows.main.source(row),
                             rows.main.row_bytes, &full[slot]);
    if (rows.side.row_bytes > 0) {
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, slot_data + rows.main.row_bytes,
                               rows.side.source(row), rows.side.row_bytes, &full[slot]);
    }
  };
  for (uint32_t item = 0; item < items && item < stages; ++item) load(item);
  for (uint32_t item = 0; item < items; ++item) {
    const uint32_t slot = item % stages;
    const uint32_t row = first + item * stride;
    char* slot_data = slots + slot * slot_bytes;
    // TMA always completes the transfer it was given, so this wait needs no timeout.
    while (!cuda::ptx::mbarrier_try_wait_parity(&full[slot], (item / stages) & 1)) {
    }
    cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, rows.main.destination(row), slot_data,
                             rows.main.row_bytes);
    if (rows.side.row_bytes > 0) {
      cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, rows.side.destination(row),
                               slot_data + rows.main.row_bytes, rows.side.row_bytes);
    }
    cuda::ptx::cp_async_bulk_commit_group();
    // The stores of item - kStoresInFlight have now read their slot: refill that slot.
    if (item >= kStoresInFlight && item - kStoresInFlight + stages < items) {
      cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kStoresInFlight>{});
      load(item - kStoresInFlight + stages);
    }
  }
  cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
}

}  // namespace megamoe::device
