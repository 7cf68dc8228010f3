// TensorView construction and check_tensor's errors, each naming the argument.
#include "megamoe/tensor.h"

#include <gtest/gtest.h>

#include <string>

#include "megamoe/error.h"

namespace megamoe {
namespace {

// A 16-byte aligned host buffer big enough for the views below.
struct alignas(16) Storage {
  float values[4 * 8 * 2] = {};
};

std::string check_error(const TensorView& view, DType dtype, std::initializer_list<int64_t> shape,
                        Device device = Device::host) {
  try {
    check_tensor(view, "x_scales", dtype, shape, device);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

void expect_error(const std::string& message, const std::string& piece) {
  ASSERT_FALSE(message.empty()) << "check_tensor accepted a view it should reject (" << piece << ")";
  EXPECT_EQ(message.rfind("x_scales:", 0), 0u) << message;
  EXPECT_NE(message.find(piece), std::string::npos) << message;
}

TEST(TensorView, ContiguousStridesAndSizes) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values, DType::f32, {4, 8, 2});
  EXPECT_EQ(view.ndim, 3);
  EXPECT_EQ(view.strides[0], 16);
  EXPECT_EQ(view.strides[1], 2);
  EXPECT_EQ(view.strides[2], 1);
  EXPECT_EQ(view.numel(), 64);
  EXPECT_EQ(view.bytes(), 256);
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_FALSE(view.empty());
  EXPECT_EQ(view.as<float>(), storage.values);
  EXPECT_EQ(TensorView::contiguous(storage.values, DType::e2m1x2, {4, 8}).bytes(), 32);
}

TEST(TensorView, RejectsTooManyDimensions) {
  Storage storage;
  EXPECT_THROW(TensorView::contiguous(storage.values, DType::u8, {1, 2, 3, 4, 5}), Error);
}

TEST(CheckTensor, AcceptsAMatchingView) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values, DType::f32, {4, 16});
  EXPECT_EQ(check_error(view, DType::f32, {4, 16}), "");
  // An empty tensor may have no storage.
  const TensorView empty = TensorView::contiguous(nullptr, DType::f32, {0, 16});
  EXPECT_EQ(check_error(empty, DType::f32, {0, 16}), "");
}

TEST(CheckTensor, WrongDtype) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values, DType::bf16, {4, 16});
  expect_error(check_error(view, DType::f32, {4, 16}), "dtype f32, got bf16");
}

TEST(CheckTensor, WrongDevice) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values, DType::f32, {4, 16}, Device::host);
  expect_error(check_error(view, DType::f32, {4, 16}, Device::cuda), "cuda memory, got host");
}

TEST(CheckTensor, WrongShape) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values, DType::f32, {4, 16});
  expect_error(check_error(view, DType::f32, {4, 8}), "shape [4, 8], got [4, 16]");
  expect_error(check_error(view, DType::f32, {4, 16, 1}), "shape [4, 16, 1], got [4, 16]");
}

TEST(CheckTensor, NonContiguousStrides) {
  Storage storage;
  TensorView view = TensorView::contiguous(storage.values, DType::f32, {4, 8});
  view.strides[0] = 1;  // a transposed view of an [8][4] array
  view.strides[1] = 4;
  EXPECT_FALSE(view.is_contiguous());
  expect_error(check_error(view, DType::f32, {4, 8}), "contiguous");
  // Padded rows are not contiguous either.
  view.strides[0] = 16;
  view.strides[1] = 1;
  expect_error(check_error(view, DType::f32, {4, 8}), "strides [16, 1]");
  // The stride of an extent-1 dimension does not matter.
  TensorView row = TensorView::contiguous(storage.values, DType::f32, {1, 8});
  row.strides[0] = 1000;
  EXPECT_EQ(check_error(row, DType::f32, {1, 8}), "");
}

TEST(CheckTensor, MisalignedPointer) {
  Storage storage;
  const TensorView view = TensorView::contiguous(storage.values + 1, DType::f32, {4, 8});
  expect_error(check_error(view, DType::f32, {4, 8}), "16-byte aligned");
}

TEST(CheckTensor, NullData) {
  const TensorView view = TensorView::contiguous(nullptr, DType::f32, {4, 8});
  EXPECT_TRUE(view.empty());
  expect_error(check_error(view, DType::f32, {4, 8}), "missing");
}

}  // namespace
}  // namespace megamoe
