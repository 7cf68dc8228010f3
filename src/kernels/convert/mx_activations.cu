// MX activations (E4M3 + UE8M0 per 32) to 1x128 blocks (E4M3 + FP32 per 128) on the device; the rule
// and its exactness are in megamoe/mx.h. One warp per 128-value block: lane l holds codes 4l..4l+3
// (one 32-bit word) of MX group l / 8.
#include <cuda_runtime_api.h>

#include "megamoe/error.h"
#include "megamoe/mx.h"

namespace megamoe {
namespace {

__global__ void convert_mx_kernel(const uint32_t* x, const uint8_t* scales, uint64_t blocks, uint32_t* x_out,
                                  float* x_scales) {
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t warps = uint64_t{gridDim.x} * (blockDim.x / 32);
  for (uint64_t block = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; block < blocks; block += warps) {
    const uint32_t word = x[block * 32 + lane];
    const uint8_t scale = scales[block * 4 + lane / 8];
    int32_t key = kMxNoKey;
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) key = max(key, mx_magnitude_key(static_cast<uint8_t>(word >> (8 * i)), scale));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, offset));
    const int32_t k = mx_block_exponent(key);
    uint32_t out = 0;
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i)
      out |= uint32_t{mx_rescale_e4m3(static_cast<uint8_t>(word >> (8 * i)), scale, k)} << (8 * i);
    x_out[block * 32 + lane] = out;
    if (lane == 0) x_scales[block] = mx_block_scale(k);
  }
}

void check_codes(const TensorView& view, const char* name, DType alternative, int64_t rows, int64_t cols) {
  const DType dtype = view.dtype == DType::u8 ? DType::u8 : alternative;
  check_tensor(view, name, dtype, {rows, cols}, Device::cuda);
}

}  // namespace

void convert_mx_activations(const TensorView& x, const TensorView& scales, const TensorView& x_out,
                            const TensorView& x_scales, cudaStream_t stream) {
  require(x.ndim == 2, "x", "must have 2 dimensions [tokens, hidden], got ", x.ndim);
  const int64_t tokens = x.shape[0], hidden = x.shape[1];
  require(hidden > 0 && hidden % kScaleBlock == 0, "x", "hidden (its second dimension) must be a positive multiple of ",
          kScaleBlock, ", got ", hidden);
  check_codes(x, "x", DType::e4m3, tokens, hidden);
  check_codes(scales, "scales", DType::ue8m0, tokens, hidden / kMxBlock);
  check_codes(x_out, "x_out", DType::e4m3, tokens, hidden);
  check_tensor(x_scales, "x_scales", DType::f32, {tokens, hidden / kScaleBlock}, Device::cuda);
  const uint64_t blocks = static_cast<uint64_t>(tokens) * static_cast<uint64_t>(hidden / kScaleBlock);
  if (blocks == 0) return;
  constexpr uint32_t kThreads = 256;
  const uint64_t wanted = (blocks * 32 + kThreads - 1) / kThreads;
  const uint32_t grid = static_cast<uint32_t>(wanted < 4096 ? wanted : 4096);
  convert_mx_kernel<<<grid, kThreads, 0, stream>>>(x.as<const uint32_t>(), scales.as<const uint8_t>(), blocks,
                                                   x_out.as<uint32_t>(), x_scales.as<float>());
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "convert_mx_activations", "launch failed: ", cudaGetErrorString(status));
}

}  // namespace megamoe
