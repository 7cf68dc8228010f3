#include "megamoe/device_weights.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "megamoe/error.h"
#include "megamoe/weights.h"

namespace megamoe {

struct DeviceWeights::Allocations {
  std::vector<void*> pointers;
  ~Allocations() {
    for (void* pointer : pointers) cudaFree(pointer);
  }
  char* allocate(uint64_t bytes) {
    void* pointer = nullptr;
    const cudaError_t status = cudaMalloc(&pointer, bytes > 0 ? bytes : 1);
    require(status == cudaSuccess, "DeviceWeights", "cudaMalloc of ", bytes, " bytes failed: ",
            cudaGetErrorString(status));
    pointers.push_back(pointer);
    return static_cast<char*>(pointer);
  }
};

namespace {

void upload(char* destination, const void* data, uint64_t bytes) {
  const cudaError_t status = cudaMemcpy(destination, data, bytes, cudaMemcpyHostToDevice);
  require(status == cudaSuccess, "DeviceWeights", "upload failed: ", cudaGetErrorString(status));
}

struct Stacked {
  TensorView w1, w1_scales, w2, w2_scales;
};

// Transforms `count` experts (fetched by `fetch(i)`) and stacks them into four device tensors.
template <typename Fetch>
Stacked stack(DeviceWeights::Allocations& memory, Recipe recipe, int32_t hidden, int32_t intermediate, int32_t count,
              const Fetch& fetch) {
  const StoredExpertSizes sizes = transformed_sizes(recipe, hidden, intermediate);
  const bool scaled = recipe == Recipe::fp8;
  char* w1 = memory.allocate(sizes.w1 * count);
  char* w2 = memory.allocate(sizes.w2 * count);
  char* w1_scales = scaled ? memory.allocate(sizes.w1_scales * count) : nullptr;
  char* w2_scales = scaled ? memory.allocate(sizes.w2_scales * count) : nullptr;
  for (int32_t e = 0; e < count; ++e) {
    const StoredExpert expert = transform_weights(fetch(e), recipe);
    upload(w1 + sizes.w1 * e, expert.w1.data(), sizes.w1);
    upload(w2 + sizes.w2 * e, expert.w2.data(), sizes.w2);
    if (scaled) {
      upload(w1_scales + sizes.w1_scales * e, expert.w1_scales.data(), sizes.w1_scales);
      upload(w2_scales + sizes.w2_scales * e, expert.w2_scales.data(), sizes.w2_scales);
    }
  }
  const DType act = activation_dtype(recipe);
  const int64_t n = count, h = hidden, i = intermediate;
  Stacked s;
  s.w1 = TensorView::contiguous(w1, act, {n, 2 * i, h}, Device::cuda);
  s.w2 = TensorView::contiguous(w2, act, {n, h, i}, Device::cuda);
  if (scaled) {
    s.w1_scales = TensorView::contiguous(w1_scales, DType::f32, {n, 2 * i / 64, h / 128}, Device::cuda);
    s.w2_scales = TensorView::contiguous(w2_scales, DType::f32, {n, h / 64, i / 128}, Device::cuda);
  }
  return s;
}

}  // namespace

DeviceWeights::DeviceWeights(const Problem& problem, const WeightSource& source)
    : allocations_(std::make_unique<Allocations>()) {
  validate(problem);
  require(problem.recipe != Recipe::fp8_fp4, "recipe", "fp8_fp4 has no GPU kernels yet (CPU reference only)");
  const int32_t local_experts = problem.experts_per_rank();
  const int32_t first_expert = problem.rank * local_experts;
  const Stacked routed = stack(*allocations_, problem.recipe, problem.hidden, problem.intermediate, local_experts,
                               [&](int32_t e) { return source.routed_expert(first_expert + e); });
  view_.w1 = routed.w1;
  view_.w1_scales = routed.w1_scales;
  view_.w2 = routed.w2;
  view_.w2_scales = routed.w2_scales;
  if (problem.num_shared_experts == 0) return;
  std::vector<StoredExpert> shared;
  for (int32_t s = 0; s < problem.num_shared_experts; ++s) shared.push_back(source.shared_expert(s));
  const StoredExpert concatenated = concat_shared_experts(shared, problem.recipe);
  const Stacked stacked = stack(*allocations_, problem.recipe, problem.hidden,
                                problem.num_shared_experts * problem.intermediate, 1,
                                [&](int32_t) { return concatenated; });
  view_.shared_w1 = stacked.w1;
  view_.shared_w1_scales = stacked.w1_scales;
  view_.shared_w2 = stacked.w2;
  view_.shared_w2_scales = stacked.w2_scales;
}

DeviceWeights::DeviceWeights() : allocations_(std::make_unique<Allocations>()) {}

char* DeviceWeights::allocate(uint64_t bytes) { return allocations_->allocate(bytes); }

DeviceWeights::~DeviceWeights() = default;

}  // namespace megamoe
