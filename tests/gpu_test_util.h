// Helpers for GPU tests: skip cleanly without a Hopper GPU, check CUDA calls, read a device error.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe::testing {

// True when a compute-capability 9.x GPU is present.
inline bool has_hopper_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9;
}

inline int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// The message of the megamoe::Error that `call` throws, or "no error".
template <class Call>
std::string error_message(const Call& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// What check_device_error reports for `buffer`, or "no device error".
inline std::string device_failure(SymmBuffer& buffer, cudaStream_t stream) {
  try {
    buffer.check_device_error(stream);
  } catch (const DeviceFailure& e) {
    return e.what();
  }
  return "no device error";
}

}  // namespace megamoe::testing

#define MEGAMOE_SKIP_WITHOUT_GPU()                                                 \
  do {                                                                             \
    if (!::megamoe::testing::has_hopper_gpu()) GTEST_SKIP() << "no Hopper GPU";    \
  } while (0)

#define MEGAMOE_CUDA_OK(call)                                                      \
  do {                                                                             \
    cudaError_t megamoe_status_ = (call);                                          \
    ASSERT_EQ(megamoe_status_, cudaSuccess) << #call << ": " << cudaGetErrorString(megamoe_status_); \
  } while (0)
