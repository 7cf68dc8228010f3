#include "megamoe/tensor.h"

#include <cstdint>
#include <sstream>

#include "megamoe/error.h"

namespace megamoe {

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  require(shape.size() <= static_cast<size_t>(kMaxDims), "TensorView", "at most ", kMaxDims, " dimensions");
  view.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t extent : shape) view.shape[i++] = extent;
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int d = 0; d < ndim; ++d) count *= shape[d];
  return count;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

namespace {
std::string shape_string(const int64_t* shape, int ndim) {
  std::ostringstream out;
  out << "[";
  for (int d = 0; d < ndim; ++d) out << (d ? ", " : "") << shape[d];
  out << "]";
  return out.str();
}
}  // namespace

void check_tensor(const TensorView& view, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  Device device) {
  require(view.data != nullptr || view.numel() == 0, name, "is missing (null data pointer)");
  require(view.dtype == dtype, name, "must have dtype ", to_string(dtype), ", got ", to_string(view.dtype));
  require(view.device == device, name, "must be in ", to_string(device), " memory, got ", to_string(view.device));
  const int64_t* expected = shape.begin();
  bool same = view.ndim == static_cast<int32_t>(shape.size());
  for (int d = 0; same && d < view.ndim; ++d) same = view.shape[d] == expected[d];
  require(same, name, "must have shape ", shape_string(expected, static_cast<int>(shape.size())), ", got ",
          shape_string(view.shape, view.ndim));
  require(view.is_contiguous(), name, "must be contiguous (row-major), got strides ",
          shape_string(view.strides, view.ndim));
  require(reinterpret_cast<uintptr_t>(view.data) % 16 == 0, name, "must be 16-byte aligned");
}

}  // namespace megamoe
