// Kernel instantiations of the fused schedule for the bf16 recipe.
#include "kernels/fused/fused_launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::fused::detail {

void bf16(const FusedLaunch& launch, int grid, cudaStream_t stream) {
  launch_policy<gemm::Bf16Policy>(launch, grid, stream);
}

}  // namespace megamoe::fused::detail
