// A cross-rank barrier as a kernel of its own, for staged work: kernels issued on `stream` before it
// on every rank have finished (and their writes are visible everywhere) before kernels issued after
// it start on any rank. A rank that does not arrive within the timeout leaves a kDeviceTimeout for
// SymmBuffer::check_device_error; a rank whose call broke does not arrive.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/comm.h"

namespace megamoe {

void launch_rank_barrier(const SymmBuffer& buffer, cudaStream_t stream);

// Whether a rank's kernels are launched overlapped (kernels/overlapped_launch.cuh): not between
// emulated ranks, which share one GPU's SMs: a rank's next kernel, launched early and waiting,
// would hold SMs that the other ranks' kernels need to reach the barriers this rank waits in.
inline bool overlap_launches(const Communicator& comm) { return !comm.emulated(); }

}  // namespace megamoe
