// Kernel instantiations of the grouped GEMM for the fp8 recipe.
#include "kernels/gemm/launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm::detail {

void fp8_swiglu(const GemmOperands& operands, const SwigluOutput& output, int grid, cudaStream_t stream) {
  launch_policy<Fp8Policy, SwigluEpilogueFor>(operands, output, grid, stream);
}

void fp8_store(const GemmOperands& operands, const RoutedDestination& destination, int grid, cudaStream_t stream) {
  launch_policy<Fp8Policy, StoreEpilogueFor<RoutedDestination>::With>(operands, destination, grid, stream);
}

void fp8_store(const GemmOperands& operands, const SharedDestination& destination, int grid, cudaStream_t stream) {
  launch_policy<Fp8Policy, StoreEpilogueFor<SharedDestination>::With>(operands, destination, grid, stream);
}

}  // namespace megamoe::gemm::detail
