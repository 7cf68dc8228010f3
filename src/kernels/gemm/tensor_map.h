// TMA descriptors for the grouped GEMM's operands (and the benchmarks' streaming ceiling).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace megamoe::gemm {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so binaries do not link libcuda
// (CI machines without a driver still load them). Throws megamoe::Error naming `what` when the
// tensor cannot be described.
CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, uint64_t inner, uint64_t outer,
                               uint64_t row_stride_bytes, uint32_t box_inner, uint32_t box_outer,
                               CUtensorMapSwizzle swizzle, const char* what);

}  // namespace megamoe::gemm
