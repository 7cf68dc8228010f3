// Kernel instantiations of the fused schedule for the fp8 recipe.
#include "kernels/fused/fused_launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::fused::detail {

PreparedLaunch fp8(const FusedLaunch& launch, int grid, std::optional<cudaStream_t> now) {
  return launch_or_prepare<gemm::Fp8Policy>(launch, grid, now);
}

}  // namespace megamoe::fused::detail
