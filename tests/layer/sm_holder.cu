#include "layer/sm_holder.h"

#include <cuda/ptx>

#include <cstdint>

#include "megamoe/error.h"

namespace megamoe::layer_test {
namespace {

__global__ void hold_multiprocessor(uint64_t ns) {
  extern __shared__ uint8_t held[];
  const uint64_t start = cuda::ptx::get_sreg_globaltimer();
  while (cuda::ptx::get_sreg_globaltimer() - start < ns) {
  }
  held[threadIdx.x] = 1;
}

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

}  // namespace

void hold_half_the_sms(cudaStream_t stream) {
  int device = 0, sms = 0, smem = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  cuda_ok(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "shared memory");
  cuda_ok(cudaFuncSetAttribute(hold_multiprocessor, cudaFuncAttributeMaxDynamicSharedMemorySize, smem / 2),
          "cudaFuncSetAttribute");
  hold_multiprocessor<<<sms / 2, 32, smem / 2, stream>>>(50'000'000ull);
  cuda_ok(cudaGetLastError(), "hold_multiprocessor launch");
}

}  // namespace megamoe::layer_test
