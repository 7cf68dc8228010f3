// fp8_fp4 weights for the kernels, shared by DeviceWeights' upload and its on-GPU synthetic weights.
#pragma once

#include <cstdint>

#include "megamoe/device_weights.h"
#include "megamoe/tensor.h"

namespace megamoe {

// Prepares `experts` stacked matrices of rows x cols on the device: `codes` (packed E2M1, already
// in `memory`) repacked in place, and block scales and shifts (kernels/gemm/fp4_scales.h), allocated
// in `memory`, derived from the transformed UE8M0 scales at `mx_scales` (device memory, the
// caller's). Synchronizes the device.
void prepare_fp4_matrices(DeviceWeights::Allocations& memory, char* codes, const uint8_t* mx_scales, int64_t experts,
                          int64_t rows, int64_t cols, TensorView& scales, TensorView& shifts);

}  // namespace megamoe
