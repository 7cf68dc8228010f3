// A typed device allocation for GPU tests, with upload, download and fill.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace megamoe::testing {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) cuda_check(cudaMalloc(&data_, count_ * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
    other.count_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != count_) throw std::runtime_error("DeviceBuffer::upload: size mismatch");
    cuda_check(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const { return download(count_); }
  // The first `count` elements: what a kernel wrote, where the rest was never written (initcheck
  // reports a copy that reads unwritten bytes).
  std::vector<T> download(size_t count) const {
    if (count > count_) throw std::runtime_error("DeviceBuffer::download: more elements than the buffer holds");
    std::vector<T> host(count);
    if (count > 0) cuda_check(cudaMemcpy(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // Fills every byte with `byte` (poisoning before a kernel proves it wrote what it should).
  void fill_bytes(uint8_t byte) { cuda_check(cudaMemset(data_, byte, count_ * sizeof(T)), "cudaMemset"); }
  // The same in `stream`'s order: a non-blocking stream (a communicator's) does not wait for the
  // legacy default stream's memset.
  void fill_bytes(uint8_t byte, cudaStream_t stream) {
    cuda_check(cudaMemsetAsync(data_, byte, count_ * sizeof(T), stream), "cudaMemsetAsync");
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace megamoe::testing
