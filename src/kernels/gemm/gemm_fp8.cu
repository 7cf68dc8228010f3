// Kernel instantiations of the grouped GEMM for the fp8 recipe.
#include "kernels/gemm/launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm::detail {

void fp8_swiglu(std::span<const SwigluJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Fp8Policy, SwigluEpilogueFor>(jobs, grid, stream);
}

void fp8_store(std::span<const StoreJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Fp8Policy, StoreEpilogueFor>(jobs, grid, stream);
}

}  // namespace megamoe::gemm::detail
