// The device's MX activation conversion (megamoe/mx.h) against the host's, bit for bit, in place and
// out of place, with NaN codes, NaN scales and scales spread over the whole UE8M0 range.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.h"
#include "gpu_test_util.h"
#include "megamoe/error.h"
#include "megamoe/mx.h"

namespace megamoe {
namespace {

TEST(MxGpu, DeviceConversionMatchesTheHost) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t tokens = 301, hidden = 1024;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255), narrow(118, 136);
  std::vector<uint8_t> x(tokens * hidden), sf(tokens * hidden / 32);
  for (auto& c : x) c = static_cast<uint8_t>(byte(rng));
  for (size_t i = 0; i < sf.size(); ++i) sf[i] = static_cast<uint8_t>(i % 7 == 0 ? byte(rng) : narrow(rng));
  std::vector<uint8_t> want(x.size());
  std::vector<float> want_scales(tokens * hidden / 128);
  convert_mx_activations_host(x.data(), sf.data(), tokens, hidden, want.data(), want_scales.data());

  testing::DeviceBuffer<uint8_t> d_x(x), d_sf(sf), d_out(x.size());
  testing::DeviceBuffer<float> d_scales(want_scales.size());
  auto view = [](void* data, DType dtype, int64_t rows, int64_t cols) {
    return TensorView::contiguous(data, dtype, {rows, cols}, Device::cuda);
  };
  convert_mx_activations(view(d_x.get(), DType::e4m3, tokens, hidden), view(d_sf.get(), DType::u8, tokens, hidden / 32),
                         view(d_out.get(), DType::e4m3, tokens, hidden),
                         view(d_scales.get(), DType::f32, tokens, hidden / 128), nullptr);
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_out.download(), want);
  const std::vector<float> scales = d_scales.download();
  for (size_t i = 0; i < scales.size(); ++i) ASSERT_EQ(float_bits(scales[i]), float_bits(want_scales[i])) << i;

  // In place: x_out may be x.
  convert_mx_activations(view(d_x.get(), DType::u8, tokens, hidden), view(d_sf.get(), DType::ue8m0, tokens, hidden / 32),
                         view(d_x.get(), DType::u8, tokens, hidden),
                         view(d_scales.get(), DType::f32, tokens, hidden / 128), nullptr);
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_x.download(), want);
}

TEST(MxGpu, ArgumentErrorsNameTheArgument) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  testing::DeviceBuffer<uint8_t> d_x(4 * 128), d_sf(4 * 4);
  testing::DeviceBuffer<float> d_scales(4);
  const TensorView x = TensorView::contiguous(d_x.get(), DType::e4m3, {4, 128}, Device::cuda);
  const TensorView scales = TensorView::contiguous(d_scales.get(), DType::f32, {4, 1}, Device::cuda);
  const TensorView wrong_sf = TensorView::contiguous(d_sf.get(), DType::u8, {4, 2}, Device::cuda);
  try {
    convert_mx_activations(x, wrong_sf, x, scales, nullptr);
    FAIL() << "expected megamoe::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scales"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megamoe
