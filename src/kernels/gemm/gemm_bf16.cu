// Kernel instantiations of the grouped GEMM for the bf16 recipe.
#include "kernels/gemm/launch.cuh"
#include "kernels/gemm/policy.cuh"

namespace megamoe::gemm::detail {

void bf16_swiglu(const GemmOperands& operands, const SwigluOutput& output, int grid, cudaStream_t stream) {
  launch_policy<Bf16Policy, SwigluEpilogueFor>(operands, output, grid, stream);
}

void bf16_store(const GemmOperands& operands, const RoutedDestination& destination, int grid, cudaStream_t stream) {
  launch_policy<Bf16Policy, StoreEpilogueFor<RoutedDestination>::With>(operands, destination, grid, stream);
}

void bf16_store(const GemmOperands& operands, const SharedDestination& destination, int grid, cudaStream_t stream) {
  launch_policy<Bf16Policy, StoreEpilogueFor<SharedDestination>::With>(operands, destination, grid, stream);
}

}  // namespace megamoe::gemm::detail
