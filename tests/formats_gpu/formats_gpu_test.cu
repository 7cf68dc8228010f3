// The device's hardware conversions (what the epilogues use) against the host formats that the CPU
// reference uses: they must give the same bits on every input.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "device_buffer.h"
#include "gpu_test_util.h"
#include "test_seed.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

__global__ void convert_kernel(const float* input, uint8_t* e4m3, uint16_t* bf16, uint32_t count) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  e4m3[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(input[i], __NV_SATFINITE, __NV_E4M3));
  const __nv_bfloat16 rounded = __float2bfloat16_rn(input[i]);
  bf16[i] = *reinterpret_cast<const uint16_t*>(&rounded);
}

// Every E4M3 value, the midpoints between neighbours and their float neighbours (ties and
// near-ties), the saturation edge, specials, and random floats over the whole exponent range.
std::vector<float> interesting_inputs() {
  std::vector<float> inputs;
  for (int code = 0; code < 256; ++code) {
    const float value = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(value)) continue;
    const float next = e4m3_to_float(static_cast<uint8_t>((code & 0x80) | ((code & 0x7F) + 1)));
    inputs.push_back(value);
    if ((code & 0x7F) < 0x7E && !std::isnan(next)) {
      const float mid = 0.5f * (value + next);
      inputs.push_back(mid);
      inputs.push_back(std::nextafter(mid, 0.0f));
      inputs.push_back(std::nextafter(mid, 1e30f * (code & 0x80 ? -1.0f : 1.0f)));
    }
  }
  for (float edge : {448.0f, 449.0f, 464.0f, 465.0f, 1e30f, INFINITY, NAN, 1e-40f, 2e-3f, 1.953125e-3f})
    for (float sign : {1.0f, -1.0f}) inputs.push_back(sign * edge);
  std::mt19937_64 rng(testing::announced_test_seed("random bit patterns"));
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) inputs.push_back(bits_float(bits(rng)));
  return inputs;
}

TEST(FormatsGpu, HardwareConversionsMatchHostFormats) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const std::vector<float> inputs = interesting_inputs();
  const uint32_t count = static_cast<uint32_t>(inputs.size());
  testing::DeviceBuffer<float> d_inputs(inputs);
  testing::DeviceBuffer<uint8_t> d_e4m3(count);
  testing::DeviceBuffer<uint16_t> d_bf16(count);
  convert_kernel<<<(count + 255) / 256, 256>>>(d_inputs.get(), d_e4m3.get(), d_bf16.get(), count);
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> e4m3 = d_e4m3.download();
  const std::vector<uint16_t> bf16 = d_bf16.download();
  int e4m3_mismatches = 0, bf16_mismatches = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const float x = inputs[i];
    if (e4m3[i] != float_to_e4m3(x) && ++e4m3_mismatches <= 10)
      ADD_FAILURE() << "E4M3 of " << x << " (bits 0x" << std::hex << float_bits(x) << "): device 0x"
                    << int(e4m3[i]) << ", host 0x" << int(float_to_e4m3(x));
    if (bf16[i] != float_to_bf16(x) && ++bf16_mismatches <= 10)
      ADD_FAILURE() << "BF16 of " << x << " (bits 0x" << std::hex << float_bits(x) << "): device 0x" << bf16[i]
                    << ", host 0x" << float_to_bf16(x);
  }
  EXPECT_EQ(e4m3_mismatches, 0);
  EXPECT_EQ(bf16_mismatches, 0);
}

}  // namespace
}  // namespace megamoe
