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

int multiprocessors() {
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return sms;
}

// One block on each of `count` multiprocessors, each with all the shared memory a block may take: a
// layer CTA of any configuration (the small test problems' use less than half of it) cannot run
// beside it.
void hold(cudaStream_t stream, uint64_t milliseconds, int count) {
  int device = 0, smem = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "shared memory");
  cuda_ok(cudaFuncSetAttribute(hold_multiprocessor, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute");
  hold_multiprocessor<<<count, 32, smem, stream>>>(milliseconds * 1'000'000ull);
  cuda_ok(cudaGetLastError(), "hold_multiprocessor launch");
}

}  // namespace

void hold_half_the_sms(cudaStream_t stream, uint64_t milliseconds) { hold(stream, milliseconds, multiprocessors() / 2); }

void hold_all_but_sms(cudaStream_t stream, uint64_t milliseconds, int free_sms) {
  hold(stream, milliseconds, multiprocessors() - free_sms);
}

}  // namespace megamoe::layer_test
