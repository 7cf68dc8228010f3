// Helpers for programs that start ranks with run_ranks (comm.h).
#pragma once

#include <cstdint>

namespace megamoe {

// Number of Hopper (compute capability 9.x) GPUs, asked of the CUDA runtime in a forked child so
// that this process stays free of CUDA and may still fork ranks (LaunchMode::processes) afterwards.
int32_t count_hopper_gpus_in_child();

}  // namespace megamoe
