// Precision recipes as policies of the one grouped-GEMM mainloop: operand type, K block, the wgmma
// that consumes it, and whether partial sums are promoted with block scales.
#pragma once

#include <cstdint>

#include "kernels/ptx/wgmma.cuh"
#include "megamoe/types.h"

namespace megamoe::gemm {

// E4M3 x E4M3 with 1x128 activation scales and per-(64 rows x 128 K) weight scales. Hopper's FP8
// wgmma accumulates without scales, so each 128-wide K block runs into a temporary accumulator that
// is then added to the FP32 result times (weight scale * activation scale) on the CUDA cores.
struct Fp8Policy {
  static constexpr Recipe kRecipe = Recipe::fp8;
  static constexpr uint32_t kElementBytes = 1;
  static constexpr uint32_t kBlockK = 128;  // elements per K block: one 128-byte swizzled row slice
  static constexpr uint32_t kMmaK = 32;     // elements per wgmma
  static constexpr bool kScaled = true;
  template <int N>
  using Mma = ptx::WgmmaFp8<N>;
};

// BF16 x BF16: the wgmma accumulates in FP32 across all of K, no promotion.
struct Bf16Policy {
  static constexpr Recipe kRecipe = Recipe::bf16;
  static constexpr uint32_t kElementBytes = 2;
  static constexpr uint32_t kBlockK = 64;
  static constexpr uint32_t kMmaK = 16;
  static constexpr bool kScaled = false;
  template <int N>
  using Mma = ptx::WgmmaBf16<N>;
};

}  // namespace megamoe::gemm
