#include "megamoe/device_weights.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "kernels/gemm/fp4_scales.h"
#include "layer/prepare_fp4.h"
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

// fp8_fp4: uploads the transformed UE8M0 scales of `experts` stacked matrices and prepares them.
void prepare_fp4(DeviceWeights::Allocations& memory, char* codes, const std::vector<uint8_t>& mx_scales,
                 int64_t experts, int64_t rows, int64_t cols, TensorView& scales, TensorView& shifts) {
  void* staged = nullptr;
  require(cudaMalloc(&staged, mx_scales.size()) == cudaSuccess, "DeviceWeights", "cudaMalloc of ", mx_scales.size(),
          " bytes of UE8M0 scales failed");
  upload(static_cast<char*>(staged), mx_scales.data(), mx_scales.size());
  struct FreeStaged {
    void* pointer;
    ~FreeStaged() { cudaFree(pointer); }
  } free_staged{staged};
  prepare_fp4_matrices(memory, codes, static_cast<const uint8_t*>(staged), experts, rows, cols, scales, shifts);
}

// Transforms `count` experts (fetched by `fetch(i)`) and stacks them into device tensors.
template <typename Fetch>
ExpertGroupWeights stack(DeviceWeights::Allocations& memory, Recipe recipe, int32_t hidden, int32_t intermediate, int32_t count,
              const Fetch& fetch) {
  const StoredExpertSizes sizes = transformed_sizes(recipe, hidden, intermediate);
  const bool f32_scales = recipe == Recipe::fp8;
  const bool packed = recipe == Recipe::fp8_fp4;
  char* w1 = memory.allocate(sizes.w1 * count);
  char* w2 = memory.allocate(sizes.w2 * count);
  char* w1_scales = f32_scales ? memory.allocate(sizes.w1_scales * count) : nullptr;
  char* w2_scales = f32_scales ? memory.allocate(sizes.w2_scales * count) : nullptr;
  std::vector<uint8_t> w1_mx, w2_mx;  // fp8_fp4: all experts' transformed UE8M0 scales
  for (int32_t e = 0; e < count; ++e) {
    const StoredExpert expert = transform_weights(fetch(e), recipe);
    upload(w1 + sizes.w1 * e, expert.w1.data(), sizes.w1);
    upload(w2 + sizes.w2 * e, expert.w2.data(), sizes.w2);
    if (f32_scales) {
      upload(w1_scales + sizes.w1_scales * e, expert.w1_scales.data(), sizes.w1_scales);
      upload(w2_scales + sizes.w2_scales * e, expert.w2_scales.data(), sizes.w2_scales);
    } else if (packed) {
      w1_mx.insert(w1_mx.end(), expert.w1_mx_scales.begin(), expert.w1_mx_scales.end());
      w2_mx.insert(w2_mx.end(), expert.w2_mx_scales.begin(), expert.w2_mx_scales.end());
    }
  }
  const int64_t n = count, h = hidden, i = intermediate;
  ExpertGroupWeights s;
  const DType codes = packed ? DType::e2m1x2 : activation_dtype(recipe);
  s.w1.values = TensorView::contiguous(w1, codes, {n, 2 * i, packed ? h / 2 : h}, Device::cuda);
  s.w2.values = TensorView::contiguous(w2, codes, {n, h, packed ? i / 2 : i}, Device::cuda);
  if (f32_scales) {
    s.w1.scales = TensorView::contiguous(w1_scales, DType::f32, {n, 2 * i / 64, h / 128}, Device::cuda);
    s.w2.scales = TensorView::contiguous(w2_scales, DType::f32, {n, h / 64, i / 128}, Device::cuda);
  } else if (packed) {
    prepare_fp4(memory, w1, w1_mx, n, 2 * i, h, s.w1.scales, s.w1.shifts);
    prepare_fp4(memory, w2, w2_mx, n, h, i, s.w2.scales, s.w2.shifts);
  }
  return s;
}

}  // namespace

void prepare_fp4_matrices(DeviceWeights::Allocations& memory, char* codes, const uint8_t* mx_scales, int64_t experts,
                          int64_t rows, int64_t cols, TensorView& scales, TensorView& shifts) {
  const uint64_t all_rows = static_cast<uint64_t>(experts * rows);
  char* block_scales = memory.allocate(sizeof(float) * all_rows / 64 * (cols / 128));
  char* group_shifts = memory.allocate(all_rows * (cols / kMxBlock));
  gemm::prepare_fp4_weights(reinterpret_cast<uint8_t*>(codes), mx_scales, static_cast<uint32_t>(all_rows),
                            static_cast<uint32_t>(cols), reinterpret_cast<float*>(block_scales),
                            reinterpret_cast<uint8_t*>(group_shifts), nullptr);
  const cudaError_t status = cudaDeviceSynchronize();
  require(status == cudaSuccess, "DeviceWeights", "preparing fp8_fp4 weights failed: ", cudaGetErrorString(status));
  scales = TensorView::contiguous(block_scales, DType::f32, {experts, rows / 64, cols / 128}, Device::cuda);
  shifts = TensorView::contiguous(group_shifts, DType::u8, {cols / 128, experts * rows, 4}, Device::cuda);
}

DeviceWeights::DeviceWeights(const Problem& problem, const WeightSource& source)
    : allocations_(std::make_unique<Allocations>()) {
  validate(problem);
  const int32_t local_experts = problem.experts_per_rank();
  const int32_t first_expert = problem.rank * local_experts;
  view_.routed = stack(*allocations_, problem.recipe, problem.hidden, problem.intermediate, local_experts,
                       [&](int32_t e) { return source.routed_expert(first_expert + e); });
  if (problem.num_shared_experts == 0) return;
  std::vector<StoredExpert> shared;
  for (int32_t s = 0; s < problem.num_shared_experts; ++s) shared.push_back(source.shared_expert(s));
  const StoredExpert concatenated = concat_shared_experts(shared, problem.recipe);
  view_.shared = stack(*allocations_, problem.recipe, problem.hidden, problem.num_shared_experts * problem.intermediate,
                       1, [&](int32_t) { return concatenated; });
}

DeviceWeights::DeviceWeights() : allocations_(std::make_unique<Allocations>()) {}

char* DeviceWeights::allocate(uint64_t bytes) { return allocations_->allocate(bytes); }

DeviceWeights::~DeviceWeights() = default;

}  // namespace megamoe
