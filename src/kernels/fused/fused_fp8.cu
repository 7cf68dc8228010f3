// Kernel instantiations of the fused schedule for the fp8 recipe.
#include "kernels/fused/fused_launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::fused::detail {

void fp8(const FusedLaunch& launch, int grid, cudaStream_t stream) {
  launch_policy<gemm::Fp8Policy>(launch, grid, stream);
}

}  // namespace megamoe::fused::detail
