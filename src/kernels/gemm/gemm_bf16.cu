// Kernel instantiations of the grouped GEMM for the bf16 recipe.
#include "kernels/gemm/launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm::detail {

void bf16_swiglu(std::span<const SwigluJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Bf16Policy, SwigluEpilogueFor>(jobs, grid, stream);
}

void bf16_store(std::span<const StoreJob> jobs, int grid, cudaStream_t stream) {
  launch_policy<Bf16Policy, StoreEpilogueFor>(jobs, grid, stream);
}

}  // namespace megamoe::gemm::detail
