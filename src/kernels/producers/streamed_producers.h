// The producers as streamed_mega_moe launches them: the layout producer first (a plain launch, after
// everything before it), then the router's logits beside it and the route producer after those,
// each `overlapped` (the programmatic dependent of the kernel before it, kernels/overlapped_launch.cuh),
// so that the quantization runs beside the router instead of after it. The logits kernel reads only
// what predates the call; the route producer waits for the logits kernel before it reads the logits.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/producers.h"

namespace megamoe::detail {

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits, cudaStream_t stream,
                   bool overlapped);
void route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias, SymmBuffer& buffer,
                  cudaStream_t stream, bool overlapped);

}  // namespace megamoe::detail
