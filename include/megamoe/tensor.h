// A non-owning view of a strided tensor with its dtype and device.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "megamoe/types.h"

namespace megamoe {

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::u8;
  Device device = Device::host;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::host);

  bool empty() const { return data == nullptr; }
  int64_t numel() const;
  int64_t bytes() const { return numel() * element_bytes(dtype); }
  bool is_contiguous() const;
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// Throws megamoe::Error("<name>: ...") unless `view` is a contiguous tensor of this dtype, device
// and shape, with a 16-byte aligned base (what vectorized loads and TMA need).
void check_tensor(const TensorView& view, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  Device device);

}  // namespace megamoe
