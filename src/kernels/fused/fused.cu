#include "kernels/fused/fused.h"

#include "megamoe/error.h"

namespace megamoe::fused {

namespace {
PreparedLaunch by_recipe(const FusedLaunch& launch, int grid, std::optional<cudaStream_t> now) {
  switch (launch.l1[0].operands.recipe) {
    case Recipe::fp8: return detail::fp8(launch, grid, now);
    case Recipe::fp8_fp4: return detail::fp8_fp4(launch, grid, now);
    case Recipe::bf16: return detail::bf16(launch, grid, now);
  }
  throw Error("fused: unknown recipe");
}
}  // namespace

PreparedLaunch prepare(const FusedLaunch& launch, int grid) { return by_recipe(launch, grid, std::nullopt); }
void launch(const FusedLaunch& launch, int grid, cudaStream_t stream) { by_recipe(launch, grid, stream); }

}  // namespace megamoe::fused
