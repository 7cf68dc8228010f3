// Ceilings measured in the same run as a benchmark: what its ratios are taken against.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace megamoe::bench {

// Fills `count` elements with random finite values (never zeros: they hide unwritten outputs and run
// faster than real data): E4M3 codes of uniform [-448, 448), or BF16 of uniform [-magnitude, magnitude).
void fill_random(void* data, uint64_t count, bool bf16, float bf16_magnitude, uint64_t seed, cudaStream_t stream);

// Median time in microseconds of `work` on `stream` over `repeats` runs after `warmups`, with events.
double time_us(const std::function<void()>& work, cudaStream_t stream, int repeats = 10, int warmups = 2);

// Device-to-device copy of 1 GiB, counting bytes read plus written.
double hbm_copy_gbps();
// Dense 8192^3 matrix products through cuBLASLt: FP8 E4M3 (per-tensor scales, FP32 accumulation,
// BF16 output) and BF16.
double fp8_dense_tflops();
double bf16_dense_tflops();

}  // namespace megamoe::bench
