#include "megamoe/device_batch.h"

#include "megamoe/error.h"

namespace megamoe {

struct DeviceBatch::Memory {
  void* x = nullptr;
  void* x_scales = nullptr;
  void* topk_idx = nullptr;
  void* topk_weights = nullptr;
  ~Memory() {
    for (void* pointer : {x, x_scales, topk_idx, topk_weights}) cudaFree(pointer);
  }
};

namespace {

void* allocate(uint64_t bytes) {
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes > 0 ? bytes : 16);
  require(status == cudaSuccess, "DeviceBatch", "cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(status));
  return pointer;
}

void copy_in(void* destination, const void* source, uint64_t bytes, uint64_t expected, const char* name,
             cudaStream_t stream) {
  require(bytes == expected, name, "holds ", bytes, " bytes, the batch's token count needs ", expected);
  if (bytes == 0) return;
  const cudaError_t status = cudaMemcpyAsync(destination, source, bytes, cudaMemcpyHostToDevice, stream);
  require(status == cudaSuccess, name, "upload failed: ", cudaGetErrorString(status));
}

}  // namespace

DeviceBatch::DeviceBatch(const Problem& p, int32_t num_tokens) : memory_(std::make_unique<Memory>()) {
  require(num_tokens >= 0, "num_tokens", "must not be negative, got ", num_tokens);
  const int64_t t = num_tokens;
  const DType act = activation_dtype(p.recipe);
  memory_->x = allocate(uint64_t(t) * p.hidden * element_bytes(act));
  memory_->x_scales = allocate(uint64_t(t) * (p.hidden / 128) * sizeof(float));
  memory_->topk_idx = allocate(uint64_t(t) * p.top_k * sizeof(int32_t));
  memory_->topk_weights = allocate(uint64_t(t) * p.top_k * sizeof(float));
  inputs_.num_tokens = num_tokens;
  inputs_.x = TensorView::contiguous(memory_->x, act, {t, p.hidden}, Device::cuda);
  if (p.recipe != Recipe::bf16)
    inputs_.x_scales = TensorView::contiguous(memory_->x_scales, DType::f32, {t, p.hidden / 128}, Device::cuda);
  inputs_.topk_idx = TensorView::contiguous(memory_->topk_idx, DType::i32, {t, p.top_k}, Device::cuda);
  inputs_.topk_weights = TensorView::contiguous(memory_->topk_weights, DType::f32, {t, p.top_k}, Device::cuda);
}

DeviceBatch::~DeviceBatch() = default;

void DeviceBatch::fill(const RankBatch& batch, cudaStream_t stream) {
  require(batch.num_tokens == inputs_.num_tokens, "batch.num_tokens", "must be ", inputs_.num_tokens, ", got ",
          batch.num_tokens);
  copy_in(memory_->x, batch.x.data(), batch.x.size(), inputs_.x.bytes(), "batch.x", stream);
  if (!inputs_.x_scales.empty())
    copy_in(memory_->x_scales, batch.x_scales.data(), batch.x_scales.size() * sizeof(float), inputs_.x_scales.bytes(),
            "batch.x_scales", stream);
  copy_in(memory_->topk_idx, batch.topk_idx.data(), batch.topk_idx.size() * sizeof(int32_t), inputs_.topk_idx.bytes(),
          "batch.topk_idx", stream);
  copy_in(memory_->topk_weights, batch.topk_weights.data(), batch.topk_weights.size() * sizeof(float),
          inputs_.topk_weights.bytes(), "batch.topk_weights", stream);
  const cudaError_t status = cudaStreamSynchronize(stream);
  require(status == cudaSuccess, "DeviceBatch::fill", "failed: ", cudaGetErrorString(status));
}

}  // namespace megamoe
