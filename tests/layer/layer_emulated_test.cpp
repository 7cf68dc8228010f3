// The whole layer with 1, 2, 4 and 8 ranks emulated on one GPU, against the CPU reference; and one
// process driving two GPUs.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "gpu_test_util.h"
#include "layer/layer_cases.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

class EmulatedLayer : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedLayer, EveryCase) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (const layer_test::LayerCase& c : layer_test::cases_for_ranks(GetParam())) {
    SCOPED_TRACE(c.name);
    const auto data = layer_test::prepare(c);
    // Both schedules on the same inputs, each against the CPU reference.
    for (Schedule schedule : {Schedule::staged, Schedule::fused}) {
      std::printf("case %s, %s schedule\n", c.name.c_str(), std::string(to_string(schedule)).c_str());
      EXPECT_EQ(run_ranks(GetParam(), LaunchMode::emulated,
                          [&](Communicator& comm) { layer_test::run_rank(comm, *data, schedule); }),
                0)
          << "case " << c.name << ", " << to_string(schedule) << " schedule: ranks failed; see stderr; replay: "
          << data->replay;
    }
  }
}

// One rank never calls the layer: every other rank's call times out (1 s here) and
// check_device_error names the absent rank, in both schedules.
class EmulatedAbsentRank : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedAbsentRank, RankThatNeverCalls) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  layer_test::expect_ranks_pass_with_short_timeout(GetParam(), LaunchMode::emulated,
                                                   layer_test::absent_rank_case(GetParam()));
}

// The last rank calls after the others have timed out waiting for it: they report the timeout,
// naming it, and the late rank reports an error too (or is exact), in both schedules. Until the
// staged schedule's rank barrier stopped arriving after a broken call, the late rank passed that
// barrier on the broken peers' arrival and combined results they never produced, reporting nothing.
class EmulatedLateRank : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedLateRank, CallsAfterThePeersGaveUp) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  layer_test::expect_ranks_pass_with_short_timeout(GetParam(), LaunchMode::emulated,
                                                   layer_test::late_rank_case(GetParam()));
}

// One process driving two GPUs, one after the other: the kernels' attributes (their shared-memory
// size) are set per device, so the second device's launches must succeed as the first's do.
TEST(TwoDevicesOneProcess, EachDeviceRunsTheLayer) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  int devices = 0;
  MEGAMOE_CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two GPUs, found " << devices;
  layer_test::LayerCase c;
  c.name = "two_devices_one_process";
  c.num_experts = 16;
  c.top_k = 4;
  c.num_shared_experts = 1;
  c.tokens_per_rank = {300, 64};
  const auto data = layer_test::prepare(c);
  for (int32_t device : {0, 1})
    for (Schedule schedule : {Schedule::staged, Schedule::fused}) {
      std::printf("device %d, %s schedule\n", device, std::string(to_string(schedule)).c_str());
      EXPECT_EQ(run_ranks(2, LaunchMode::emulated,
                          [&](Communicator& comm) { layer_test::run_rank(comm, *data, schedule); }, device),
                0)
          << "device " << device << ", " << to_string(schedule) << " schedule: ranks failed; see stderr; replay: "
          << data->replay;
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, EmulatedLayer, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });
INSTANTIATE_TEST_SUITE_P(Ranks, EmulatedAbsentRank, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });
INSTANTIATE_TEST_SUITE_P(Ranks, EmulatedLateRank, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

}  // namespace
}  // namespace megamoe
