// Backend selection of the CLI.
#include <gtest/gtest.h>

#include "cli/backend.h"
#include "comm/launcher.h"
#include "megamoe/error.h"

namespace megamoe::cli {
namespace {

TEST(Backend, ParsesNames) {
  BackendKind kind = BackendKind::cpu;
  EXPECT_TRUE(parse_backend("auto", kind));
  EXPECT_EQ(kind, BackendKind::automatic);
  EXPECT_TRUE(parse_backend("gpu", kind));
  EXPECT_EQ(kind, BackendKind::gpu);
  EXPECT_FALSE(parse_backend("tpu", kind));
}

TEST(Backend, AutoPicksTheGpuExactlyWhenAHopperGpuIsPresent) {
  const bool hopper = count_hopper_gpus_in_child() > 0;
  const BackendChoice choice = choose_backend(BackendKind::automatic);
  EXPECT_EQ(choice.kind, hopper ? BackendKind::gpu : BackendKind::cpu) << choice.reason;
  EXPECT_NE(choice.reason.find("Hopper GPU"), std::string::npos) << choice.reason;
  EXPECT_EQ(choose_backend(BackendKind::gpu).kind, BackendKind::gpu);
  EXPECT_EQ(choose_backend(BackendKind::cpu).kind, BackendKind::cpu);
}

TEST(Backend, GpuBackendWithoutAGpuSaysSo) {
  if (count_hopper_gpus_in_child() > 0) GTEST_SKIP() << "a Hopper GPU is present";
  Problem p;
  p.num_experts = 2;
  p.top_k = 1;
  p.hidden = 128;
  p.intermediate = 128;
  p.max_tokens_per_rank = 1;
  const SyntheticWeights weights(p, 1);
  try {
    run_gpu_backend(p, synthetic_batches(p, {1}, Routing::uniform, 1), weights, {});
    FAIL() << "expected megamoe::Error";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "--backend gpu: needs a Hopper GPU; found none");
  }
}

TEST(Backend, CpuBackendRunsTheReference) {
  Problem p;
  p.num_experts = 2;
  p.top_k = 1;
  p.hidden = 128;
  p.intermediate = 128;
  p.max_tokens_per_rank = 2;
  const SyntheticWeights weights(p, 1);
  const auto batches = synthetic_batches(p, {2}, Routing::uniform, 1);
  const BackendResult result = run_backend(BackendKind::cpu, p, batches, weights, {});
  EXPECT_EQ(result.name, "cpu");
  EXPECT_EQ(result.result.y, reference_moe(p, batches, weights).y);
}

}  // namespace
}  // namespace megamoe::cli
