// A kernel that keeps half the multiprocessors busy, for tests of work that must complete with the
// SMs it gets.
#pragma once

#include <cuda_runtime_api.h>

namespace megamoe::layer_test {

// Launches on `stream` one block on each of half the multiprocessors, each holding its SM (half the
// shared memory: no layer CTA fits beside it) for 50 ms. Throws megamoe::Error if the launch fails.
void hold_half_the_sms(cudaStream_t stream);

}  // namespace megamoe::layer_test
