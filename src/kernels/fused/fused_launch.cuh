// The fused schedule's launcher, instantiated per recipe: the GEMM jobs' TMA descriptors and
// epilogues as the grouped GEMM's launcher makes them, and the config of the launch's tile shape.
#pragma once

#include "kernels/fused/fused.h"
#include "kernels/fused/fused_layer.cuh"
#include "kernels/gemm/launch.cuh"

namespace megamoe::fused {

// The launch of one kernel config made ready, handed to use(launch): the launch callable with a
// stream, which a batch call calls at once (no std::function, so no allocation) and prepare keeps.
template <class Config, class Use>
PreparedLaunch prepare_config(const FusedLaunch& l, int grid, const Use& use) {
  FusedParams<Config> params{};
  const auto swiglu = [](const gemm::SwigluJob& job) {
    return gemm::make_job<Config>(job.operands, gemm::SwigluEpilogueFor<Config>::make(job.operands, job.output));
  };
  const auto store = [](const gemm::StoreJob& job) {
    return gemm::make_job<Config>(job.operands, gemm::StoreEpilogueFor<Config>::make(job.operands, job.output));
  };
  params.l1[0] = swiglu(l.l1[0]);
  params.l2[0] = store(l.l2[0]);
  if (l.shared) {
    params.l1[1] = swiglu(l.l1[1]);
    params.l2[1] = store(l.l2[1]);
  }
  params.dispatch = l.dispatch;
  params.staged = l.staged;
  params.combine = l.combine;
  params.plan = l.plan;
  if constexpr (!kLocalRoutesConfig<Config>) params.plan.local_routes = false;  // this kernel pulls
  params.split = gemm::split_args<Config>(l.l1[0].operands.split_workspace);
  params.trace = l.trace;
  params.ring_synchronized = l.ring_synchronized;
  gemm::configure_once_per_device<fused_layer_kernel<Config>>(Config::kSmemBytes, "fused layer kernel");
  const bool overlapped = l.overlapped_launch || l.ring_synchronized;
  return use([params, grid, overlapped](cudaStream_t stream) {
    gemm::check_launch(launch_kernel(fused_layer_kernel<Config>, grid, Config::kThreads, Config::kSmemBytes, stream,
                                     overlapped, params),
                       "fused layer launch");
  });
}

// The batch or the streamed calls' kernel of one tile shape.
template <class Gemm, class Use>
PreparedLaunch prepare_calls(const FusedLaunch& l, int grid, const Use& use) {
  if (l.dispatch.streamed) return prepare_config<FusedConfig<Gemm, true>>(l, grid, use);
  return prepare_config<FusedConfig<Gemm, false>>(l, grid, use);
}

template <class Policy, class Use>
PreparedLaunch prepare_policy(const FusedLaunch& l, int grid, const Use& use) {
  const gemm::GemmOperands* operands[4] = {&l.l1[0].operands, &l.l2[0].operands, &l.l1[1].operands,
                                           &l.l2[1].operands};
  for (size_t j = 0; j < (l.shared ? 4u : 2u); ++j) {
    gemm::validate_jobs({operands + j, 1}, Policy::kElementBytes, Policy::kScaled);
    if constexpr (Policy::kPackedWeights) gemm::validate_packed_weights(*operands[j]);
    require(operands[j]->tile.layout == l.l1[0].operands.tile.layout &&
                operands[j]->tile.block_n == l.l1[0].operands.tile.block_n,
            "tile", "the fused schedule runs all four GEMMs in one tile shape");
  }
  require(grid >= 1, "grid", "must be at least 1, got ", grid);
  const gemm::TileShape shape = l.l1[0].operands.tile;
  if (shape.layout == gemm::TileLayout::tokens_on_m)
    return prepare_calls<gemm::GemmConfig<Policy, gemm::TileLayout::tokens_on_m, 128, false, true>>(l, grid, use);
  if (shape.block_n == 16)
    return prepare_calls<gemm::GemmConfig<Policy, gemm::TileLayout::weights_on_m, 16, false, true>>(l, grid, use);
  return prepare_calls<gemm::GemmConfig<Policy, gemm::TileLayout::weights_on_m, 64, false, true>>(l, grid, use);
}

// A recipe's entry (detail::fp8 and its kin): launched at once on `now`, or made ready.
template <class Policy>
PreparedLaunch launch_or_prepare(const FusedLaunch& l, int grid, std::optional<cudaStream_t> now) {
  if (now) {
    return prepare_policy<Policy>(l, grid, [&](const auto& launch) {
      launch(*now);
      return PreparedLaunch{};
    });
  }
  return prepare_policy<Policy>(l, grid, [](const auto& launch) { return PreparedLaunch(launch); });
}

}  // namespace megamoe::fused
