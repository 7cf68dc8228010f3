#include "bench/common/ceilings.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe::bench {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}
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

double dense_tflops(bool fp8) {
  constexpr int kSize = 8192;
  const uint64_t elements = uint64_t{kSize} * kSize;
  const int in_bytes = fp8 ? 1 : 2;
  uint8_t *a = nullptr, *b = nullptr, *d = nullptr, *workspace = nullptr;
  constexpr size_t kWorkspace = 64ull << 20;
  cuda_ok(cudaMalloc(&a, elements * in_bytes), "cudaMalloc(A)");
  cuda_ok(cudaMalloc(&b, elements * in_bytes), "cudaMalloc(B)");
  cuda_ok(cudaMalloc(&d, elements * 2), "cudaMalloc(D)");
  cuda_ok(cudaMalloc(&workspace, kWorkspace), "cudaMalloc(workspace)");
  fill_random(a, elements, !fp8, 1.0f, 1, nullptr);
  fill_random(b, elements, !fp8, 1.0f, 2, nullptr);

  cublasLtHandle_t handle;
  cublas_ok(cublasLtCreate(&handle), "cublasLtCreate");
  cublasLtMatmulDesc_t desc;
  cublas_ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;  // FP8 needs the TN form
  cublas_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)), "TRANSA");
  cublas_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)), "TRANSB");
  const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatrixLayout_t layout_a, layout_b, layout_d;
  cublas_ok(cublasLtMatrixLayoutCreate(&layout_a, in_type, kSize, kSize, kSize), "layout A");
  cublas_ok(cublasLtMatrixLayoutCreate(&layout_b, in_type, kSize, kSize, kSize), "layout B");
  cublas_ok(cublasLtMatrixLayoutCreate(&layout_d, CUDA_R_16BF, kSize, kSize, kSize), "layout D");
  cublasLtMatmulPreference_t preference;
  cublas_ok(cublasLtMatmulPreferenceCreate(&preference), "preference");
  cublas_ok(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                                 sizeof(kWorkspace)),
            "preference workspace");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublas_ok(cublasLtMatmulAlgoGetHeuristic(handle, desc, layout_a, layout_b, layout_d, layout_d, preference, 1,
                                           &heuristic, &found),
            "cublasLtMatmulAlgoGetHeuristic");
  require(found > 0, "cuBLASLt", "found no algorithm for the dense ceiling");
  const float alpha = 1.0f, beta = 0.0f;
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  const double us = time_us(
      [&] {
        cublas_ok(cublasLtMatmul(handle, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d, d, layout_d,
                                 &heuristic.algo, workspace, kWorkspace, stream),
                  "cublasLtMatmul");
      },
      stream, 10, 3);
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(layout_a);
  cublasLtMatrixLayoutDestroy(layout_b);
  cublasLtMatrixLayoutDestroy(layout_d);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(handle);
  cudaStreamDestroy(stream);
  cudaFree(a);
  cudaFree(b);
  cudaFree(d);
  cudaFree(workspace);
  return 2.0 * kSize * kSize * double{kSize} / (us * 1e-6) / 1e12;
}

}  // namespace

void fill_random(void* data, uint64_t count, bool bf16, float bf16_magnitude, uint64_t seed, cudaStream_t stream) {
  fill_random_kernel<<<4096, 256, 0, stream>>>(static_cast<uint8_t*>(data), count, bf16, bf16_magnitude, seed);
  cuda_ok(cudaGetLastError(), "fill_random launch");
}

double time_us(const std::function<void()>& work, cudaStream_t stream, int repeats, int warmups) {
  for (int i = 0; i < warmups; ++i) work();
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    work();
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return 1000.0 * times[times.size() / 2];
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
