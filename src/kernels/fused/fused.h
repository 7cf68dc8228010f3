// Host entry of the fused schedule (CUDA translation units only): one persistent launch that runs
// the whole layer (fused_layer.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>

#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/units.h"
#include "kernels/gemm/gemm.h"
#include "megamoe/layer.h"

namespace megamoe::fused {

// The event log (CallOptions::trace) is compiled in only with MEGAMOE_FUSED_TRACE (the CMake option
// of that name): its code in the math warps' loop spilled the fp8 prefill mainloop (176 spill
// accesses per four K blocks instead of 29).
#ifdef MEGAMOE_FUSED_TRACE
inline constexpr bool kFusedTrace = true;
#else
inline constexpr bool kFusedTrace = false;
#endif

// One call's launch: the routed and shared experts' GEMMs (all four in the routed tile shape; the
// shared ones only when `shared`), the dispatch and combine arguments, and the units.
struct FusedLaunch {
  gemm::SwigluJob l1[2];  // routed, shared
  gemm::StoreJob l2[2];   // routed, shared
  bool shared = false;
  dispatch::DispatchArgs dispatch;
  dispatch::StagedInputs staged;
  combine::CombineArgs combine;
  UnitPlan plan;
  bool overlapped_launch = false;  // launched while the stream's previous kernel runs
  // Launched right after this call's front-ring producers, to start while they run and wait for their
  // chunks through the ring (FusedParams::ring_synchronized).
  bool ring_synchronized = false;
  FusedTraceEvent* trace = nullptr;  // CallOptions::trace, or none
};

// A launch made ready: every check passed, the jobs' TMA descriptors made, the kernel's attributes
// set; calling it only launches the kernel on the stream it is given. A caller that launches other
// kernels first which must not run unless this one does (streamed_mega_moe's producers) prepares it
// before them.
using PreparedLaunch = std::function<void(cudaStream_t)>;
PreparedLaunch prepare(const FusedLaunch& launch, int grid);
void launch(const FusedLaunch& launch, int grid, cudaStream_t stream);

namespace detail {
// One translation unit per recipe instantiates its kernels (fused_fp8.cu, fused_fp8_fp4.cu, fused_bf16.cu):
// the launch made on `now` at once (returning nothing), or made ready and returned.
PreparedLaunch fp8(const FusedLaunch&, int grid, std::optional<cudaStream_t> now);
PreparedLaunch fp8_fp4(const FusedLaunch&, int grid, std::optional<cudaStream_t> now);
PreparedLaunch bf16(const FusedLaunch&, int grid, std::optional<cudaStream_t> now);
}  // namespace detail

}  // namespace megamoe::fused
