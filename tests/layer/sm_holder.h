// A kernel that keeps half the multiprocessors busy, for tests of work that must complete with the
// SMs it gets.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::layer_test {

// Launches on `stream` one block on each of half the multiprocessors, each holding its SM (all the
// shared memory a block may take: no layer CTA fits beside it) for `milliseconds`. Throws
// megamoe::Error if the launch fails.
void hold_half_the_sms(cudaStream_t stream, uint64_t milliseconds = 50);

// The same on all multiprocessors but `free_sms`: a persistent grid of more CTAs than fit there (two
// small layer CTAs may share an SM) must have some start after the holder ends.
void hold_all_but_sms(cudaStream_t stream, uint64_t milliseconds, int free_sms);

}  // namespace megamoe::layer_test
