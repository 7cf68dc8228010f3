// Expert weights: the canonical layout a model stores, and the layout the kernels read.
//
// Canonical (per expert, row-major):
//   w1 [2I][H]  rows 0..I-1 are gate_proj, rows I..2I-1 are up_proj
//   w2 [H][I]   down_proj
//   fp8:      E4M3 codes, FP32 scales per 128x128 block: w1_scales [2I/128][H/128], w2_scales [H/128][I/128]
//   fp8_fp4:  E2M1 codes packed two per byte (low nibble = even column), UE8M0 scale per 32 columns:
//             w1 [2I][H/2] bytes, w1_scales [2I][H/32]; w2 [H][I/2], w2_scales [H][I/32]
//   bf16:     BF16 values, no scales
//
// Transformed (what the kernels read; transform_weights below writes it):
//   w1 rows are regrouped so that one 256-row tile of the L1 GEMM holds the gate and up rows of 128
//   consecutive intermediate channels, interleaved in runs of 64:
//       tile t = [gate 128t+0..63][up 128t+0..63][gate 128t+64..127][up 128t+64..127]
//   so the SwiGLU epilogue finds gate and up of a channel in the same thread, and the 128 outputs of
//   a tile form exactly one 1x128 block of the L1 output's scales.
//   fp8 weight scales are stored per 64 rows x 128 columns (each 64-row run lies in one canonical
//   128x128 block): w1_scales [2I/64][H/128], w2_scales [H/64][I/128]. The kernel then sees one scale
//   per wgmma m64 block and K block, for both linears.
//   fp8_fp4 scales follow their rows through the same permutation ([2I][H/32] and [H][I/32]).
//   w2 values are unchanged.
//
// Shared experts are computed as one expert of intermediate S*I (the sum of S SwiGLU MLPs equals one
// MLP over their concatenated channels): concat_shared_experts concatenates them.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/problem.h"
#include "megamoe/types.h"

namespace megamoe {

// Canonical row of transformed W1 row `row` (intermediate = I; rows count 2I).
MEGAMOE_HD int32_t l1_canonical_row(int32_t row, int32_t intermediate) {
  const int32_t tile = row / (4 * kGateUpInterleave);
  const int32_t run = (row / kGateUpInterleave) % 4;  // 0 gate, 1 up, 2 gate, 3 up
  const int32_t channel = tile * 2 * kGateUpInterleave + (run / 2) * kGateUpInterleave + row % kGateUpInterleave;
  return (run % 2 == 0) ? channel : intermediate + channel;
}

// One expert in its stored format. Which fields are used depends on the recipe (see above); the
// byte vectors hold E4M3 codes, packed E2M1 pairs or little-endian BF16.
struct StoredExpert {
  int32_t intermediate = 0;  // I of this expert (S*I for the concatenated shared expert)
  int32_t hidden = 0;
  std::vector<uint8_t> w1, w2;
  std::vector<float> w1_scales, w2_scales;          // fp8
  std::vector<uint8_t> w1_mx_scales, w2_mx_scales;  // fp8_fp4
};

// Sizes in bytes of one expert's stored arrays, canonical or transformed.
struct StoredExpertSizes {
  uint64_t w1 = 0, w2 = 0, w1_scales = 0, w2_scales = 0;  // scales in bytes (f32 or ue8m0)
};
StoredExpertSizes canonical_sizes(Recipe recipe, int32_t hidden, int32_t intermediate);
StoredExpertSizes transformed_sizes(Recipe recipe, int32_t hidden, int32_t intermediate);

// Throws megamoe::Error naming the field when the vectors' sizes do not match the recipe's canonical
// layout, or when a scale is NaN, infinite, zero or negative.
void check_canonical(const StoredExpert& expert, Recipe recipe, const char* name);

// Canonical -> transformed, and its inverse (used by tests and by --dump).
StoredExpert transform_weights(const StoredExpert& canonical, Recipe recipe);
StoredExpert untransform_weights(const StoredExpert& transformed, Recipe recipe);

// Concatenates S canonical shared experts into one canonical expert of intermediate S*I.
StoredExpert concat_shared_experts(const std::vector<StoredExpert>& experts, Recipe recipe);

// Dequantized canonical weights in FP32: w1 [2I][H], w2 [H][I].
struct DenseExpert {
  int32_t intermediate = 0;
  int32_t hidden = 0;
  std::vector<float> w1, w2;
};
DenseExpert dequantize(const StoredExpert& canonical, Recipe recipe);

// Quantizes FP32 canonical weights into the recipe's stored format (block amax scales for fp8,
// mxfp4_scale_for_amax per 32 for fp8_fp4, round-to-nearest-even BF16). NaN weights are rejected.
StoredExpert quantize(const DenseExpert& dense, Recipe recipe);

}  // namespace megamoe
