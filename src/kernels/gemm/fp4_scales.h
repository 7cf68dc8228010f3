// The fp8_fp4 GEMM's view of MXFP4 weights (e2m1.cuh explains the expansion), prepared on the device
// from the transformed weights (weights.h):
//   codes        [rows][k / 2] bytes:    repacked in place into the kernels' packing (pack_e2m1_group
//                                        on every group of 32: the A-fragment column order, signs
//                                        interleaved);
// and, from the transformed UE8M0 scales [rows][k / 32] (rows = groups * n_out, every 64-row block
// inside one group):
//   block_scales [rows / 64][k / 128] FP32: 2^(S - 127), S the largest code of the 64 x 128 block,
//                                           used by the mainloop's promotion like fp8's block scales;
//   shifts       [k / 128][rows][4]   u8:   min(S - s, 15) of each group of 32, K-block-major so that
//                                           a tile's shifts for one K block are one contiguous copy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::gemm {

void prepare_fp4_weights(uint8_t* codes, const uint8_t* mx_scales, uint32_t rows, uint32_t k, float* block_scales,
                         uint8_t* shifts, cudaStream_t stream);

// The prepared codes of `num_groups` groups of n_out rows as E4M3 [groups][n_out][k] in the plain
// column order (fp8's weight format), each group of 32 expanded with its shift, so that with
// block_scales as the weight scales fp8's kernels compute the fp8_fp4 product. Groups whose rows in
// group_prefix (device, num_groups + 1 offsets; nullptr: every group has rows) are empty are skipped.
void expand_fp4_weights(const uint8_t* codes, const uint8_t* shifts, uint32_t num_groups, uint32_t n_out, uint32_t k,
                        const uint32_t* group_prefix, uint8_t* expanded, cudaStream_t stream);

}  // namespace megamoe::gemm
