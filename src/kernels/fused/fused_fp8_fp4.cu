// Kernel instantiations of the fused schedule for the fp8_fp4 recipe.
#include "kernels/fused/fused_launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::fused::detail {

void fp8_fp4(const FusedLaunch& launch, int grid, cudaStream_t stream) {
  launch_policy<gemm::Fp8Fp4Policy>(launch, grid, stream);
}

}  // namespace megamoe::fused::detail
