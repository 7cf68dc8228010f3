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

// Where row i comes from and goes to.
struct RowPair {
  const char* src;
  char* dst;
};

// Rows laid out back to back in both buffers: row i is at src + i * row_bytes and dst + i * row_bytes.
struct ContiguousRows {
  const char* src;
  char* dst;
  uint32_t row_bytes;
  MEGAMOE_DEVICE RowPair operator()(uint32_t row) const {
    const uint64_t offset = static_cast<uint64_t>(row) * row_bytes;
    return {src + offset, dst + offset};
  }
};

// One warp copies one row, each lane moving 16 bytes at a time, kUnroll loads in flight before their
// stores.
template <int kUnroll>
MEGAMOE_DEVICE void copy_row_vector(const char* src_row, char* dst_row, uint32_t row_bytes, uint32_t lane) {
  const uint32_t vectors = row_bytes / 16;
  const auto* src = reinterpret_cast<const int4*>(src_row);
  auto* dst = reinterpret_cast<int4*>(dst_row);
  for (uint32_t base = lane; base < vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t index = base + 32 * u;
      if (index < vectors) values[u] = cuda::ptx::ld_L1_no_allocate_L2_256B(cuda::ptx::space_global, src + index);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t index = base + 32 * u;
      if (index < vectors) dst[index] = values[u];
    }
  }
}

// One warp copies rows first, first + stride, ... below `count`.
template <int kUnroll, typename RowMap>
MEGAMOE_DEVICE void pull_rows_vector(const RowMap& rows, uint32_t first, uint32_t count, uint32_t stride,
                                     uint32_t row_bytes, uint32_t lane) {
  for (uint32_t row = first; row < count; row += stride) {
    const RowPair pair = rows(row);
    copy_row_vector<kUnroll>(pair.src, pair.dst, row_bytes, lane);
  }
}

// One thread streams rows first, first + stride, ... below `count` through `stages` shared-memory
// slots of row_bytes each (`slots`, 16-byte aligned) with one mbarrier per slot (`full`): a bulk load
// fills a slot, a bulk store empties it, and the slot is refilled once that store has read it.
// kStoresInFlight stores may still be reading their slots while later loads are issued; `stages`
// must exceed it.
template <int kStoresInFlight, typename RowMap>
MEGAMOE_DEVICE void pull_rows_bulk(const RowMap& rows, uint32_t first, uint32_t count, uint32_t stride,
                                   uint32_t row_bytes, char* slots, uint64_t* full, uint32_t stages) {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  for (uint32_t s = 0; s < stages; ++s) cuda::ptx::mbarrier_init(&full[s], 1);
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);

  const uint32_t items = first < count ? (count - first + stride - 1) / stride : 0;
  auto load = [&](uint32_t item) {
    const uint32_t slot = item % stages;
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         &full[slot], row_bytes);
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, slots + slot * row_bytes,
                             rows(first + item * stride).src, row_bytes, &full[slot]);
  };
  for (uint32_t item = 0; item < items && item < stages; ++item) load(item);
  for (uint32_t item = 0; item < items; ++item) {
    const uint32_t slot = item % stages;
    // TMA always completes the transfer it was given, so this wait needs no timeout.
    while (!cuda::ptx::mbarrier_try_wait_parity(&full[slot], (item / stages) & 1)) {
    }
    cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, rows(first + item * stride).dst,
                             slots + slot * row_bytes, row_bytes);
    cuda::ptx::cp_async_bulk_commit_group();
    // The store of item - kStoresInFlight has now read its slot: refill that slot.
    if (item >= kStoresInFlight && item - kStoresInFlight + stages < items) {
      cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kStoresInFlight>{});
      load(item - kStoresInFlight + stages);
    }
  }
  cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
}

}  // namespace megamoe::device
