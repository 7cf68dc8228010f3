// An array in anonymous shared memory, mapped before rank processes fork, so that what they (or
// emulated rank threads) write is seen by the launching process: the benchmarks' and the soak
// tool's per-rank results.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "megamoe/error.h"

namespace megamoe::bench {

template <typename T>
class SharedArray {
  static_assert(std::is_trivially_copyable_v<T>, "rank processes write the elements as bytes");

 public:
  // `tool` names the caller in the error a failed mapping raises.
  SharedArray(size_t count, const T& initial, const char* tool) : bytes_(std::max<size_t>(count, 1) * sizeof(T)) {
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    require(base != MAP_FAILED, tool, "could not map ", bytes_, " bytes of shared memory: ", std::strerror(errno));
    data_ = static_cast<T*>(base);
    std::fill_n(data_, count, initial);
  }
  ~SharedArray() { munmap(data_, bytes_); }
  SharedArray(const SharedArray&) = delete;
  SharedArray& operator=(const SharedArray&) = delete;

  T& operator[](size_t index) const { return data_[index]; }

 private:
  size_t bytes_;
  T* data_ = nullptr;
};

}  // namespace megamoe::bench
