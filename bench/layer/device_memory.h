// Device allocations of the CLI's GPU code, freed together when the owner goes away.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megamoe/error.h"

namespace megamoe::bench {

class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* pointer : pointers_) cudaFree(pointer);
  }

  // Room for `count` elements (at least 16 bytes); throws naming `what` when cudaMalloc fails.
  template <typename T>
  T* allocate(uint64_t count, const char* what) {
    void* pointer = nullptr;
    const uint64_t bytes = std::max<uint64_t>(count * sizeof(T), 16);
    const cudaError_t status = cudaMalloc(&pointer, bytes);
    require(status == cudaSuccess, what, "cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(status));
    pointers_.push_back(pointer);
    return static_cast<T*>(pointer);
  }

 private:
  std::vector<void*> pointers_;
};

}  // namespace megamoe::bench
