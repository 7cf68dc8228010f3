#include "reference/stored_rows.h"

#include "megamoe/formats.h"

namespace megamoe {

StoredRows::StoredRows(const StoredExpert& expert, Recipe recipe, int which) : recipe_(recipe) {
  const size_t hidden = static_cast<size_t>(expert.hidden);
  const size_t inter = static_cast<size_t>(expert.intermediate);
  const bool first = which == 1;
  rows_ = first ? 2 * inter : hidden;
  cols_ = first ? hidden : inter;
  codes_ = (first ? expert.w1 : expert.w2).data();
  block_scales_ = (first ? expert.w1_scales : expert.w2_scales).data();
  mx_scales_ = (first ? expert.w1_mx_scales : expert.w2_mx_scales).data();
  for (int code = 0; code < 256; ++code) e4m3_[code] = e4m3_to_float(static_cast<uint8_t>(code));
  for (int code = 0; code < 16; ++code) e2m1_[code] = e2m1_to_float(static_cast<uint8_t>(code));
}

void StoredRows::row(size_t r, float* out) const {
  switch (recipe_) {
    case Recipe::fp8: {
      const uint8_t* codes = codes_ + r * cols_;
      const float* scales = block_scales_ + (r / kScaleBlock) * (cols_ / kScaleBlock);
      for (size_t block = 0; block < cols_ / kScaleBlock; ++block) {
        const float scale = scales[block];
        for (size_t c = block * kScaleBlock; c < (block + 1) * kScaleBlock; ++c) out[c] = e4m3_[codes[c]] * scale;
      }
      break;
    }
    case Recipe::fp8_fp4: {
      const uint8_t* pairs = codes_ + r * (cols_ / 2);
      const uint8_t* scales = mx_scales_ + r * (cols_ / kMxBlock);
      for (size_t group = 0; group < cols_ / kMxBlock; ++group) {
        const float scale = ue8m0_to_float(scales[group]);
        for (size_t p = group * kMxBlock / 2; p < (group + 1) * kMxBlock / 2; ++p) {
          out[2 * p] = e2m1_[pairs[p] & 0xF] * scale;
          out[2 * p + 1] = e2m1_[pairs[p] >> 4] * scale;
        }
      }
      break;
    }
    case Recipe::bf16: {
      const uint8_t* bytes = codes_ + 2 * r * cols_;
      for (size_t c = 0; c < cols_; ++c) {
        out[c] = bf16_to_float(static_cast<uint16_t>(bytes[2 * c] | (bytes[2 * c + 1] << 8)));
      }
      break;
    }
  }
}

}  // namespace megamoe
