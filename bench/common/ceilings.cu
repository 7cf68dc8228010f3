#include "bench/common/ceilings.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe::bench {

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

namespace {

void cublas_ok(cublasStatus_t status, const char* what) {
  require(status == CUBLAS_STATUS_SUCCESS, what, "failed with cuBLAS status ", static_cast<int>(status));
}

__global__ void fill_random_kernel(uint8_t* data, uint64_t count, bool bf16, float bf16_magnitude, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float uniform = static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    if (bf16) reinterpret_cast<uint16_t*>(data)[i] = float_to_bf16(uniform * bf16_magnitude);
    else data[i] = float_to_e4m3(uniform * 448.0f);
  }
}

constexpr size_t kDenseWorkspace = 64ull << 20;

__global__ void fill_value_kernel(float* data, uint64_t count, float value) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x)
    data[i] = value;
}

// Where read_kernel's sum goes if it hits a value random data never gives: never in practice, but
// the loads cannot be dropped, and nothing is written back.
__device__ uint32_t read_sink;

// Reads `vectors` 16-byte vectors as fast as one launch can (read_grid: every SM full of threads),
// each thread with four independent loads in flight: the L2 flush, and the same-bytes read.
constexpr uint32_t kReadThreads = 512;
__global__ void __launch_bounds__(kReadThreads) read_kernel(const uint4* data, uint64_t vectors) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  uint32_t sum = 0;
  uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < vectors; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) v[j] = data[i + j * stride];
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) sum += v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < vectors; i += stride) {
    const uint4 v = data[i];
    sum += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (sum == 0x9E3779B9u) read_sink = sum;
}

int read_grid() {
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  return sms * (2048 / static_cast<int>(kReadThreads));
}

}  // namespace

struct DenseGemm::State {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  uint8_t *a = nullptr, *b = nullptr, *d = nullptr, *workspace = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;  // DenseScaling::blocks
};

DenseGemm::DenseGemm(uint64_t max_m, uint32_t n, uint32_t k, bool fp8, DenseScaling scaling)
    : state_(new State), max_m_(max_m), n_(n), k_(k), fp8_(fp8), scaling_(scaling) {
  require(fp8 || scaling == DenseScaling::per_tensor, "DenseGemm", "block scales are for FP8 operands");
  const int in_bytes = fp8 ? 1 : 2;
  cuda_ok(cudaMalloc(&state_->a, max_m * k * in_bytes), "cudaMalloc(dense A)");
  cuda_ok(cudaMalloc(&state_->b, uint64_t{n} * k * in_bytes), "cudaMalloc(dense B)");
  cuda_ok(cudaMalloc(&state_->d, max_m * n * 2), "cudaMalloc(dense D)");
  cuda_ok(cudaMalloc(&state_->workspace, kDenseWorkspace), "cudaMalloc(dense workspace)");
  fill_random(state_->a, max_m * k, !fp8, 1.0f, 1, nullptr);
  fill_random(state_->b, uint64_t{n} * k, !fp8, 1.0f, 2, nullptr);
  cublas_ok(cublasLtCreate(&state_->handle), "cublasLtCreate");
  cublas_ok(cublasLtMatmulDescCreate(&state_->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // D (m x n, column-major) = A^T B with A and B stored K-major, as tokens and weights are; FP8 needs this TN form.
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
            "TRANSA");
  cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)), "TRANSB");
  if (scaling == DenseScaling::blocks) {
    // Scales of 1 (timing only: their layout does not matter), sized with room to spare.
    const uint64_t a_count = (max_m + 128) * (k / 128 + 1), b_count = uint64_t{n / 128 + 1} * (k / 128 + 1);
    cuda_ok(cudaMalloc(&state_->a_scales, a_count * 4), "cudaMalloc(dense A scales)");
    cuda_ok(cudaMalloc(&state_->b_scales, b_count * 4), "cudaMalloc(dense B scales)");
    fill_value(state_->a_scales, a_count, 1.0f, nullptr);
    fill_value(state_->b_scales, b_count, 1.0f, nullptr);
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                                      b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
              "A_SCALE_MODE");
    cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)),
              "B_SCALE_MODE");
    cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &state_->a_scales,
                                             sizeof(state_->a_scales)),
              "A_SCALE_POINTER");
    cublas_ok(cublasLtMatmulDescSetAttribute(state_->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &state_->b_scales,
                                             sizeof(state_->b_scales)),
              "B_SCALE_POINTER");
  }
}

DenseGemm::~DenseGemm() {
  cublasLtMatmulDescDestroy(state_->desc);
  cublasLtDestroy(state_->handle);
  for (uint8_t* pointer : {state_->a, state_->b, state_->d, state_->workspace}) cudaFree(pointer);
  for (float* pointer : {state_->a_scales, state_->b_scales}) cudaFree(pointer);
}

std::function<void()> DenseGemm::launcher(uint64_t m, cudaStream_t stream) const {
  require(m > 0 && m <= max_m_, "DenseGemm::launcher", "m must be in [1, ", max_m_, "], got ", m);
  // The layouts and the chosen algorithm live as long as the returned function.
  struct Plan {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulHeuristicResult_t heuristic{};
    ~Plan() {
      for (cublasLtMatrixLayout_t layout : {a, b, d})
        if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
    }
  };
  auto plan = std::make_shared<Plan>();
  const cudaDataType_t in_type = fp8_ ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublas_ok(cublasLtMatrixLayoutCreate(&plan->a, in_type, k_, m, k_), "layout A");
  cublas_ok(cublasLtMatrixLayoutCreate(&plan->b, in_type, k_, n_, k_), "layout B");
  cublas_ok(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_16BF, m, n_, m), "layout D");
  cublasLtMatmulPreference_t preference;
  cublas_ok(cublasLtMatmulPreferenceCreate(&preference), "preference");
  cublas_ok(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kDenseWorkspace,
                                                 sizeof(kDenseWorkspace)),
            "preference workspace");
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(state_->handle, state_->desc, plan->a, plan->b, plan->d,
                                                               plan->d, preference, 1, &plan->heuristic, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (scaling_ == DenseScaling::blocks && (status != CUBLAS_STATUS_SUCCESS || found == 0)) return {};
  cublas_ok(status, "cublasLtMatmulAlgoGetHeuristic");
  require(found > 0, "cuBLASLt", "found no algorithm for the dense product");
  const State* state = state_.get();
  return [state, plan, stream] {
    const float alpha = 1.0f, beta = 0.0f;
    cublas_ok(cublasLtMatmul(state->handle, state->desc, &alpha, state->a, plan->a, state->b, plan->b, &beta, state->d,
                             plan->d, state->d, plan->d, &plan->heuristic.algo, state->workspace, kDenseWorkspace,
                             stream),
              "cublasLtMatmul");
  };
}

double DenseGemm::tflops(uint64_t m, cudaStream_t stream, int repeats, int warmups) const {
  const std::function<void()> launch = launcher(m, stream);
  if (!launch) return std::nan("");
  return tflops_at(m, time_us(launch, stream, repeats, warmups));
}

namespace {

double dense_tflops(bool fp8) {
  constexpr int kSize = 8192;
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  const double tflops = DenseGemm(kSize, kSize, kSize, fp8).tflops(kSize, stream, 10, 3);
  cudaStreamDestroy(stream);
  return tflops;
}

}  // namespace

void fill_random(void* data, uint64_t count, bool bf16, float bf16_magnitude, uint64_t seed, cudaStream_t stream) {
  fill_random_kernel<<<4096, 256, 0, stream>>>(static_cast<uint8_t*>(data), count, bf16, bf16_magnitude, seed);
  cuda_ok(cudaGetLastError(), "fill_random launch");
}

void fill_value(float* data, uint64_t count, float value, cudaStream_t stream) {
  fill_value_kernel<<<1024, 256, 0, stream>>>(data, count, value);
  cuda_ok(cudaGetLastError(), "fill_value launch");
}

namespace {

// Milliseconds of one run of `work` on the idle `stream`, between events recorded around it.
float timed_ms(const std::function<void()>& work, cudaEvent_t start, cudaEvent_t stop, cudaStream_t stream) {
  cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
  work();
  cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
  cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  return ms;
}

double median_of(std::vector<float> times_ms) {
  std::sort(times_ms.begin(), times_ms.end());
  return 1000.0 * times_ms[times_ms.size() / 2];
}

// Median of `repeats` event-timed runs of `work` after `warmups`; `before` (if any) is queued before
// each run's start event.
double median_us(const std::function<void()>& work, const std::function<void()>& before, cudaStream_t stream,
                 int repeats, int warmups) {
  for (int i = 0; i < warmups; ++i) work();
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    if (before) before();
    times.push_back(timed_ms(work, start, stop, stream));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median_of(std::move(times));
}

}  // namespace

double time_us(const std::function<void()>& work, cudaStream_t stream, int repeats, int warmups) {
  return median_us(work, nullptr, stream, repeats, warmups);
}

std::vector<double> interleaved_us(std::span<const std::function<void()>> works, cudaStream_t stream, int repeats,
                                   int warmups) {
  for (int i = 0; i < warmups; ++i)
    for (const auto& work : works) work();
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<std::vector<float>> times(works.size());
  for (int i = 0; i < repeats; ++i)
    for (size_t w = 0; w < works.size(); ++w) times[w].push_back(timed_ms(works[w], start, stop, stream));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<double> medians;
  for (std::vector<float>& samples : times) medians.push_back(median_of(std::move(samples)));
  return medians;
}

L2Flush::L2Flush() {
  int device = 0, l2_bytes = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "L2 cache size");
  vectors_ = 4ull * static_cast<uint64_t>(l2_bytes) / sizeof(uint4);
  cuda_ok(cudaMalloc(&buffer_, vectors_ * sizeof(uint4)), "cudaMalloc(L2 flush)");
  grid_ = read_grid();
  fill_random(buffer_, vectors_ * sizeof(uint4), false, 0.0f, 5, nullptr);
}

L2Flush::~L2Flush() { cudaFree(buffer_); }

void L2Flush::run(cudaStream_t stream) const {
  read_kernel<<<grid_, kReadThreads, 0, stream>>>(buffer_, vectors_);
  cuda_ok(cudaGetLastError(), "L2 flush launch");
}

double time_cold_us(const std::function<void()>& work, cudaStream_t stream, const L2Flush& flush, int repeats,
                    int warmups) {
  return median_us(work, [&] { flush.run(stream); }, stream, repeats, warmups);
}

double hbm_read_us(const void* data, uint64_t bytes, cudaStream_t stream, const L2Flush& flush, int repeats,
                   int warmups) {
  require(reinterpret_cast<uintptr_t>(data) % 16 == 0, "hbm_read_us", "data must be 16-byte aligned");
  const int grid = read_grid();
  return time_cold_us(
      [&] {
        read_kernel<<<grid, kReadThreads, 0, stream>>>(static_cast<const uint4*>(data), bytes / sizeof(uint4));
        cuda_ok(cudaGetLastError(), "HBM read launch");
      },
      stream, flush, repeats, warmups);
}

double hbm_copy_gbps() {
  constexpr size_t kBytes = 1ull << 30;
  void *source = nullptr, *destination = nullptr;
  cuda_ok(cudaMalloc(&source, kBytes), "cudaMalloc");
  cuda_ok(cudaMalloc(&destination, kBytes), "cudaMalloc");
  cuda_ok(cudaMemset(source, 1, kBytes), "cudaMemset");
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  const double us = time_us(
      [&] { cuda_ok(cudaMemcpyAsync(destination, source, kBytes, cudaMemcpyDeviceToDevice, stream), "copy"); },
      stream, 20, 3);
  cudaStreamDestroy(stream);
  cudaFree(source);
  cudaFree(destination);
  return 2.0 * kBytes / (us * 1e-6) / 1e9;
}

double fp8_dense_tflops() { return dense_tflops(true); }
double bf16_dense_tflops() { return dense_tflops(false); }

}  // namespace megamoe::bench
