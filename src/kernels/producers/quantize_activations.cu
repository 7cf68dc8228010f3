// BF16 activations to E4M3 with one FP32 scale per 1x128 block (megamoe/producers.h). One warp per
// block: lane l holds values 4l..4l+3 (8 bytes), the block's largest magnitude is a warp maximum.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "kernels/streaming/ring_producer.cuh"
#include "megamoe/producers.h"

namespace megamoe {
namespace {

// One 1x128 block by one warp: lane l converts values 4l..4l+3 (`bits`, loaded by the caller, so that
// it may have several blocks' loads in flight). Written to x_out and x_scale, and to also_out and
// also_scale unless they are null.
__device__ void quantize_block(uint2 bits, uint32_t* x_out, float* x_scale, uint32_t* also_out = nullptr,
                               float* also_scale = nullptr) {
  const uint32_t lane = threadIdx.x % 32;
  const uint16_t halves[4] = {static_cast<uint16_t>(bits.x), static_cast<uint16_t>(bits.x >> 16),
                              static_cast<uint16_t>(bits.y), static_cast<uint16_t>(bits.y >> 16)};
  float values[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    values[i] = bf16_to_float(halves[i]);
    amax = fmaxf(amax, fabsf(values[i]));  // fmaxf skips NaN, as the reference's std::fmax
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
  uint32_t codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) codes |= uint32_t{quantizer.quantize(values[i])} << (8 * i);
  x_out[lane] = codes;
  if (lane == 0) *x_scale = quantizer.scale;
  if (also_out != nullptr) {
    also_out[lane] = codes;
    if (lane == 0) *also_scale = quantizer.scale;
  }
}

__global__ void quantize_activations_kernel(const uint2* x, uint64_t blocks, uint32_t* x_out, float* x_scales) {
  const uint64_t warps = uint64_t{gridDim.x} * (blockDim.x / 32);
  for (uint64_t block = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; block < blocks; block += warps) {
    quantize_block(x[block * 32 + threadIdx.x % 32], x_out + block * 32, x_scales + block);
  }
}

// The layout half published chunk by chunk into the front ring: a part is up to kRingPartTokens tokens
// of one chunk (front_tokens_per_part: one while the call's tokens fit the launch's blocks). fp8
// recipes quantize each 1x128 block into the slot; bf16 copies the rows as they are. With own_x (a
// problem with shared experts), each row and its scales also go to the buffer's x and x_scales regions
// at the token's row, where this rank's shared experts read them in a streamed call: written once
// here rather than copied out of the ring by the layer.
constexpr uint32_t kRingPartTokens = 4;
constexpr int kThreads = 256;
// A warp's 1x128 blocks of a part (seven per token of DeepSeek-V3) are loaded this many at once:
// one load's round trip per block bounded a part's time.
constexpr uint32_t kRingLoadsInFlight = 4;

__global__ void __launch_bounds__(kThreads) quantize_activations_ring_kernel(const uint2* x, uint32_t hidden,
                                                                             const device::FrontProducer p,
                                                                             uint8_t* own_x, float* own_scales) {
  const uint32_t blocks_per_token = hidden / kScaleBlock;
  device::front_produce(p, [&](uint32_t slot, const FrontSlotMeta& meta, uint32_t begin, uint32_t end) {
    uint8_t* slot_x = p.ring.slot_x(p.own_ring, slot);
    if (p.ring.scale_blocks == 0) {
      const uint32_t vectors_per_token = p.ring.row_bytes / 16;  // BF16 rows: 16-byte copies
      const uint4* in = reinterpret_cast<const uint4*>(x) + uint64_t{meta.token_base} * vectors_per_token;
      uint4* out = reinterpret_cast<uint4*>(slot_x);
      uint4* own = own_x != nullptr ? reinterpret_cast<uint4*>(own_x) + uint64_t{meta.token_base} * vectors_per_token
                                    : nullptr;
      for (uint32_t v = begin * vectors_per_token + threadIdx.x; v < end * vectors_per_token; v += kThreads) {
        const uint4 value = in[v];
        out[v] = value;
        if (own != nullptr) own[v] = value;
      }
      return;
    }
    float* slot_scales = p.ring.slot_x_scales(p.own_ring, slot);
    const uint64_t first_block = uint64_t{meta.token_base} * blocks_per_token;
    constexpr uint32_t kWarps = kThreads / 32;
    const uint32_t lane = threadIdx.x % 32, last = end * blocks_per_token;
    for (uint32_t b0 = begin * blocks_per_token + threadIdx.x / 32; b0 < last; b0 += kWarps * kRingLoadsInFlight) {
      uint2 bits[kRingLoadsInFlight];
#pragma unroll
      for (uint32_t i = 0; i < kRingLoadsInFlight; ++i) {
        const uint32_t b = b0 + i * kWarps;
        if (b < last) bits[i] = x[(first_block + b) * 32 + lane];
      }
#pragma unroll
      for (uint32_t i = 0; i < kRingLoadsInFlight; ++i) {
        const uint32_t b = b0 + i * kWarps;
        if (b >= last) break;
        quantize_block(bits[i], reinterpret_cast<uint32_t*>(slot_x) + uint64_t{b} * 32, slot_scales + b,
                       own_x != nullptr ? reinterpret_cast<uint32_t*>(own_x) + (first_block + b) * 32 : nullptr,
                       own_x != nullptr ? own_scales + first_block + b : nullptr);
      }
    }
  });
}

}  // namespace

void quantize_activations_host(const uint16_t* x, int64_t tokens, int64_t hidden, uint8_t* x_out, float* x_scales) {
  for (int64_t block = 0; block < tokens * (hidden / kScaleBlock); ++block) {
    const uint16_t* in = x + block * kScaleBlock;
    float amax = 0.0f;
    for (int c = 0; c < kScaleBlock; ++c) amax = std::fmax(amax, std::fabs(bf16_to_float(in[c])));
    const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
    for (int c = 0; c < kScaleBlock; ++c) x_out[block * kScaleBlock + c] = quantizer.quantize(bf16_to_float(in[c]));
    x_scales[block] = quantizer.scale;
  }
}

void quantize_activations(const TensorView& x, const TensorView& x_out, const TensorView& x_scales,
                          cudaStream_t stream) {
  require(x.ndim == 2, "x", "must have 2 dimensions [tokens, hidden], got ", x.ndim);
  const int64_t tokens = x.shape[0], hidden = x.shape[1];
  require(hidden > 0 && hidden % kScaleBlock == 0, "x", "hidden (its second dimension) must be a positive multiple of ",
          kScaleBlock, ", got ", hidden);
  // Each lane moves four values: 8-byte loads, 4-byte stores.
  require(reinterpret_cast<uintptr_t>(x.data) % 8 == 0, "x", "must start on an 8-byte boundary");
  require(reinterpret_cast<uintptr_t>(x_out.data) % 4 == 0, "x_out", "must start on a 4-byte boundary");
  check_tensor(x, "x", DType::bf16, {tokens, hidden}, Device::cuda);
  check_tensor(x_out, "x_out", DType::e4m3, {tokens, hidden}, Device::cuda);
  check_tensor(x_scales, "x_scales", DType::f32, {tokens, hidden / kScaleBlock}, Device::cuda);
  const uint64_t blocks = static_cast<uint64_t>(tokens) * static_cast<uint64_t>(hidden / kScaleBlock);
  if (blocks == 0) return;
  const uint64_t grid = (blocks + kThreads / 32 - 1) / (kThreads / 32);
  quantize_activations_kernel<<<static_cast<unsigned>(grid < 65536 ? grid : 65536), kThreads, 0, stream>>>(
      static_cast<const uint2*>(x.data), blocks, static_cast<uint32_t*>(x_out.data), x_scales.as<float>());
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "quantize_activations", "launch failed: ", cudaGetErrorString(status));
}

void quantize_activations(const TensorView& x, SymmBuffer& buffer, cudaStream_t stream) {
  const Problem& p = buffer.problem();
  require(x.ndim == 2, "x", "must have 2 dimensions [tokens, hidden], got ", x.ndim);
  const int64_t tokens = x.shape[0];
  check_tensor(x, "x", DType::bf16, {tokens, p.hidden}, Device::cuda);
  require(reinterpret_cast<uintptr_t>(x.data) % 16 == 0, "x", "must start on a 16-byte boundary");
  const device::FrontProducer ring =
      device::make_front_producer(buffer, FrontHalf::layout, tokens, 1, kRingPartTokens, "x");
  // A streamed call's shared experts read this rank's rows from the buffer's regions (a buffer whose
  // wave holds every token: the ones streamed calls take, CallOptions::streamed).
  const BufferLayout& l = buffer.layout();
  const bool own_rows = p.num_shared_experts > 0 && tokens_per_wave(p) >= p.max_tokens_per_rank;
  uint8_t* own_x = own_rows ? BufferLayout::at<uint8_t>(buffer.local(), l.x) : nullptr;
  float* own_scales = own_rows && p.recipe != Recipe::bf16 ? BufferLayout::at<float>(buffer.local(), l.x_scales) : nullptr;
  // Even a call with no tokens publishes its one empty chunk.
  quantize_activations_ring_kernel<<<device::front_producer_grid(ring, buffer), kThreads, 0, stream>>>(
      static_cast<const uint2*>(x.data), static_cast<uint32_t>(p.hidden), ring, own_x, own_scales);
  const cudaError_t status = cudaGetLastError();
  require(status == cudaSuccess, "quantize_activations", "launch failed: ", cudaGetErrorString(status));
  ++buffer.front_calls().layout;
}

}  // namespace megamoe
