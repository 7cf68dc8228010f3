// How rows pass through a shared-memory bounce area in two halves (host and device; CPU-tested): one
// half's loads land while the other's store drains (dispatch.cuh, pull_rows_bulk). A batch is as
// many whole rows as fit half the area (up to one per lane of a warp), or, when a row does not fit,
// one piece of a row.
#pragma once

#include <cstdint>

#include "megamoe/config.h"

namespace megamoe::comm {

struct BounceBatch {
  uint32_t first;  // rows [first, first + rows), counted from the first row pulled
  uint32_t rows;
  uint32_t offset;  // bytes [offset, offset + bytes) of each of those rows
  uint32_t bytes;
  bool completes_rows;  // the rows' last piece
};

struct BouncePlan {
  uint32_t half;  // bytes per half, a multiple of 16
  uint32_t row_bytes;
  uint32_t rows;
  uint32_t pieces;  // per row
  uint32_t rows_per_batch;

  // area_bytes of at least 32; row_bytes a positive multiple of 16.
  MEGAMOE_HD static BouncePlan make(uint32_t area_bytes, uint32_t row_bytes, uint32_t rows) {
    const uint32_t half = area_bytes / 2 / 16 * 16;
    const uint32_t pieces = (row_bytes + half - 1) / half;
    uint32_t rows_per_batch = pieces > 1 ? 1 : half / row_bytes;
    if (rows_per_batch > 32) rows_per_batch = 32;
    return {half, row_bytes, rows, pieces, rows_per_batch};
  }
  MEGAMOE_HD uint32_t batches() const { return (rows + rows_per_batch - 1) / rows_per_batch * pieces; }
  // Batch b goes through half b % 2.
  MEGAMOE_HD BounceBatch batch(uint32_t b) const {
    const uint32_t first = b / pieces * rows_per_batch;
    const uint32_t offset = b % pieces * half;
    const uint32_t left = rows - first, rest = row_bytes - offset;
    const uint32_t bytes = rest < half ? rest : half;
    return {first, left < rows_per_batch ? left : rows_per_batch, offset, bytes, offset + bytes == row_bytes};
  }
};

}  // namespace megamoe::comm
