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
  static constexpr bool kPackedWeights = false;
  template <int N>
  using Mma = ptx::WgmmaFp8<N>;
};

// E4M3 activations x MXFP4 weights. The weights stay packed (E2M1 pairs) in global memory, halving
// the bytes a decode step streams; converter warps expand each stage to E4M3 in shared memory
// (e2m1.cuh), after which the stage is exactly an fp8 one: the same wgmma and promotion, with the
// 64-row x 128-K block scales derived from the UE8M0 scales (fp4_scales.h).
struct Fp8Fp4Policy {
  static constexpr Recipe kRecipe = Recipe::fp8_fp4;
  static constexpr uint32_t kElementBytes = 1;  // activations, and the weights once expanded
  static constexpr uint32_t kBlockK = 128;
  static constexpr uint32_t kMmaK = 32;
  static constexpr bool kScaled = true;
  static constexpr bool kPackedWeights = true;
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
  static constexpr bool kPackedWeights = false;
  template <int N>
  using Mma = ptx::WgmmaBf16<N>;
};

}  // namespace megamoe::gemm
