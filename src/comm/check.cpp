#include "comm/check.h"

#include <dlfcn.h>

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

namespace {
// NCCL_VERSION_CODE is major * 10000 + minor * 100 + patch from 2.9 on.
std::string version_text(int code) {
  return detail::concat(code / 10000, ".", code / 100 % 100, ".", code % 100);
}
}  // namespace

std::string nccl_version_mismatch(int compiled_code, int loaded_code, const std::string& loaded_path) {
  if (compiled_code == loaded_code) return {};
  return detail::concat("this build of megamoe was compiled against NCCL ", version_text(compiled_code),
                        " (its device API is compiled in), but this process loaded NCCL ", version_text(loaded_code),
                        " from ", loaded_path.empty() ? "an unknown path" : loaded_path,
                        "; run with that release's libnccl.so.2 first on the library path (e.g. LD_LIBRARY_PATH "
                        "set to the lib directory of the NCCL the build found), or rebuild against the loaded one");
}

void check_nccl_runtime_version() {
  int loaded = 0;
  check_nccl(ncclGetVersion(&loaded), "ncclGetVersion(&loaded)", nullptr);
  Dl_info info{};
  const std::string path = dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) != 0 && info.dli_fname != nullptr
                               ? info.dli_fname
                               : "";
  const std::string mismatch = nccl_version_mismatch(NCCL_VERSION_CODE, loaded, path);
  if (!mismatch.empty()) throw Error("NCCL: " + mismatch);
}

}  // namespace megamoe::comm_detail
