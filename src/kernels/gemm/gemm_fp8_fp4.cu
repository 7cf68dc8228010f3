// Kernel instantiations of the grouped GEMM for the fp8_fp4 recipe.
#include "kernels/gemm/launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm::detail {

void fp8_fp4_swiglu(std::span<const SwigluJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Fp8Fp4Policy, SwigluEpilogueFor>(jobs, grid, stream);
}

void fp8_fp4_store(std::span<const StoreJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Fp8Fp4Policy, StoreEpilogueFor>(jobs, grid, stream);
}

}  // namespace megamoe::gemm::detail
