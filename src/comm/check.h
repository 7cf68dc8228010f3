// Return-code checks for CUDA and NCCL calls: every failure becomes a megamoe::Error naming the call.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace megamoe::comm_detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call);

inline void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw_cuda_error(status, call);
}

// `comm` (may be null) adds NCCL's last error text; a non-blocking communicator's ncclInProgress is
// waited out, so callers see only success or a real failure.
void check_nccl(ncclResult_t status, const char* call, ncclComm_t comm);

// The device API (ncclWindow_t, ncclGetLsaPointer) is compiled in from NCCL's headers, so the library
// loaded at run time must be the same release: another one lays its windows out differently and the
// kernels that read them fault with an illegal address. Empty when the versions agree, else the
// error's text, naming both versions and where the loaded library came from.
std::string nccl_version_mismatch(int compiled_code, int loaded_code, const std::string& loaded_path);

// Throws megamoe::Error with nccl_version_mismatch's text for this process's libnccl.
void check_nccl_runtime_version();

}  // namespace megamoe::comm_detail

#define MEGAMOE_CHECK_CUDA(call) ::megamoe::comm_detail::check_cuda((call), #call)
#define MEGAMOE_CHECK_NCCL(call, comm) ::megamoe::comm_detail::check_nccl((call), #call, (comm))
