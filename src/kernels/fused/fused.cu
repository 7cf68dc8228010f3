#include "kernels/fused/fused.h"

namespace megamoe::fused {

void launch(const FusedLaunch& launch, int grid, cudaStream_t stream) {
  switch (launch.l1[0].operands.recipe) {
    case Recipe::fp8: return detail::fp8(launch, grid, stream);
    case Recipe::fp8_fp4: return detail::fp8_fp4(launch, grid, stream);
    case Recipe::bf16: return detail::bf16(launch, grid, stream);
  }
}

}  // namespace megamoe::fused
