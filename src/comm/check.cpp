#include "comm/check.h"

#include <string>
#include <thread>

#include "megamoe/error.h"

namespace megamoe::comm_detail {

void throw_cuda_error(cudaError_t status, const char* call) {
  // Clear a non-sticky error so that later, unrelated checks do not report it again.
  cudaGetLastError();
  throw DeviceFailure(detail::concat(call, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status)));
}

void check_nccl(ncclResult_t status, const char* call, ncclComm_t comm) {
  while (status == ncclInProgress && comm != nullptr) {
    ncclResult_t async_status = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &async_status);
    status = query != ncclSuccess ? query : async_status;
    if (status == ncclInProgress) std::this_thread::yield();
  }
  if (status == ncclSuccess) return;
  std::string message = detail::concat(call, " failed: ", ncclGetErrorString(status));
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') message += detail::concat(" (", last, ")");
  }
  throw DeviceFailure(message);
}

}  // namespace megamoe::comm_detail
