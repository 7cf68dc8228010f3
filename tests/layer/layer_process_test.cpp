// The whole layer with one process per GPU (NCCL), on 1 and 2 GPUs, against the CPU reference.
// This process forks the ranks, so it never initializes CUDA itself (see tests/comm).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "comm/launcher.h"
#include "layer/layer_cases.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

class ProcessLayer : public ::testing::TestWithParam<int> {};

TEST_P(ProcessLayer, EveryCase) {
  static const int gpus = count_hopper_gpus_in_child();
  if (gpus < GetParam()) GTEST_SKIP() << "needs " << GetParam() << " Hopper GPUs, found " << gpus;
  for (const layer_test::LayerCase& c : layer_test::cases_for_ranks(GetParam())) {
    SCOPED_TRACE(c.name);
    const auto data = layer_test::prepare(c);
    // Both schedules on the same inputs, each against the CPU reference.
    for (Schedule schedule : {Schedule::staged, Schedule::fused}) {
      std::printf("case %s, %s schedule\n", c.name.c_str(), std::string(to_string(schedule)).c_str());
      EXPECT_EQ(run_ranks(GetParam(), LaunchMode::processes,
                          [&](Communicator& comm) { layer_test::run_rank(comm, *data, schedule); }),
                0)
          << "case " << c.name << ", " << to_string(schedule) << " schedule: ranks failed; see stderr; replay: "
          << data->replay;
    }
  }
}

// One rank process never calls the layer: the others time out (1 s) and name it, in both schedules.
class ProcessAbsentRank : public ::testing::TestWithParam<int> {};

TEST_P(ProcessAbsentRank, RankThatNeverCalls) {
  static const int gpus = count_hopper_gpus_in_child();
  if (gpus < GetParam()) GTEST_SKIP() << "needs " << GetParam() << " Hopper GPUs, found " << gpus;
  layer_test::expect_ranks_pass_with_short_timeout(GetParam(), LaunchMode::processes,
                                                   layer_test::absent_rank_case(GetParam()));
}

// The last rank process calls after the others timed out waiting for it: each reports an error
// (the late one, or is exact), in both schedules.
class ProcessLateRank : public ::testing::TestWithParam<int> {};

TEST_P(ProcessLateRank, CallsAfterThePeersGaveUp) {
  static const int gpus = count_hopper_gpus_in_child();
  if (gpus < GetParam()) GTEST_SKIP() << "needs " << GetParam() << " Hopper GPUs, found " << gpus;
  layer_test::expect_ranks_pass_with_short_timeout(GetParam(), LaunchMode::processes,
                                                   layer_test::late_rank_case(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Gpus, ProcessLayer, ::testing::Values(1, 2),
                         [](const auto& info) { return std::to_string(info.param) + "_gpus"; });
// Two GPUs only: it belongs to the two_gpus ctest entry.
INSTANTIATE_TEST_SUITE_P(Gpus, ProcessAbsentRank, ::testing::Values(2),
                         [](const auto& info) { return std::to_string(info.param) + "_gpus"; });
INSTANTIATE_TEST_SUITE_P(Gpus, ProcessLateRank, ::testing::Values(2),
                         [](const auto& info) { return std::to_string(info.param) + "_gpus"; });

}  // namespace
}  // namespace megamoe
