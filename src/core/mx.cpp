#include "megamoe/mx.h"

#include <algorithm>

#include "megamoe/error.h"

namespace megamoe {

void convert_mx_activations_host(const uint8_t* x, const uint8_t* scales, int64_t tokens, int64_t hidden,
                                 uint8_t* x_out, float* x_scales) {
  require(tokens >= 0, "tokens", "must not be negative, got ", tokens);
  require(hidden > 0 && hidden % kScaleBlock == 0, "hidden", "must be a positive multiple of ", kScaleBlock, ", got ",
          hidden);
  const int64_t blocks = hidden / kScaleBlock;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = t * hidden + b * kScaleBlock;
      const uint8_t* group_scales = scales + t * (hidden / kMxBlock) + b * (kScaleBlock / kMxBlock);
      int32_t max_key = kMxNoKey;
      for (int c = 0; c < kScaleBlock; ++c)
        max_key = std::max(max_key, mx_magnitude_key(x[first + c], group_scales[c / kMxBlock]));
      const int32_t k = mx_block_exponent(max_key);
      for (int c = 0; c < kScaleBlock; ++c)
        x_out[first + c] = mx_rescale_e4m3(x[first + c], group_scales[c / kMxBlock], k);
      x_scales[t * blocks + b] = mx_block_scale(k);
    }
  }
}

}  // namespace megamoe
