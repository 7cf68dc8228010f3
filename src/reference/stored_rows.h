// Row-by-row FP32 dequantization of a canonical stored matrix (weights.h). Each value is the same
// product dequantize() computes, but only one row is materialized at a time, so the reference
// never holds an expert's dense weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "megamoe/types.h"
#include "megamoe/weights.h"

namespace megamoe {

class StoredRows {
 public:
  // `which` is 1 for w1 ([2I][H]) or 2 for w2 ([H][I]) of `expert`, stored in `recipe`.
  StoredRows(const StoredExpert& expert, Recipe recipe, int which);

  size_t rows() const { return rows_; }
  size_t cols() const { return cols_; }
  // Writes row `r` (cols() values) to `out`.
  void row(size_t r, float* out) const;

 private:
  Recipe recipe_;
  size_t rows_;
  size_t cols_;
  const uint8_t* codes_;
  const float* block_scales_;  // fp8: [rows / 128][cols / 128]
  const uint8_t* mx_scales_;   // fp8_fp4: [rows][cols / 32]
  float e4m3_[256];            // every E4M3 code's value
  float e2m1_[16];             // every E2M1 code's value
};

}  // namespace megamoe
