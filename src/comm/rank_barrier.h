// A cross-rank barrier as a kernel of its own, for staged work: kernels issued on `stream` before it
// on every rank have finished (and their writes are visible everywhere) before kernels issued after
// it start on any rank. A rank that does not arrive within the timeout leaves a kDeviceTimeout for
// SymmBuffer::check_device_error.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/comm.h"

namespace megamoe {

void launch_rank_barrier(const SymmBuffer& buffer, cudaStream_t stream);

}  // namespace megamoe
