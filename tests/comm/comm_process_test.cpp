// Multi-rank scenarios with one process per GPU (NCCL), on 1 and 2 GPUs.
//
// This process forks the ranks, and a process that has initialized CUDA cannot fork children that
// use it: nothing here may call CUDA. So GPUs are counted in a forked child (launcher.h), not with
// MEGAMOE_SKIP_WITHOUT_GPU, and keeping these tests in their own binary keeps other tests' CUDA
// calls out of this process.
#include <gtest/gtest.h>

#include <csignal>
#include <stdexcept>
#include <string>

#include "comm/comm_scenarios.h"
#include "comm/launcher.h"
#include "comm/scoped_env.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

using Scenario = void (*)(Communicator&);

int hopper_gpus() {
  static const int count = count_hopper_gpus_in_child();
  return count;
}

#define SKIP_WITHOUT_HOPPER_GPUS(count)                                                                  \
  do {                                                                                                   \
    if (hopper_gpus() < (count)) {                                                                       \
      GTEST_SKIP() << "needs " << (count) << " Hopper GPUs, found " << hopper_gpus();                    \
    }                                                                                                    \
  } while (0)

class ProcessRanks : public ::testing::TestWithParam<int> {
 protected:
  // Runs `scenario` on GetParam() ranks, one per GPU; each failing rank has printed "rank R: why".
  void run(Scenario scenario) {
    EXPECT_EQ(run_ranks(GetParam(), LaunchMode::processes, scenario), 0) << "ranks failed; see stderr";
  }
};

// Cases about disagreement between ranks: they need two ranks or more, so they run only on 2.
class MultiProcessRanks : public ProcessRanks {};

TEST_P(ProcessRanks, BufferZeroedAtCreation) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::buffer_zeroed);
}

TEST_P(ProcessRanks, PeerStoreReleaseAcquireLoad) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::peer_store_flag);
}

TEST_P(ProcessRanks, RankBarrier10000Times) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::rank_barrier_many);
}

TEST_P(ProcessRanks, StandaloneBarrierKernel) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::standalone_barrier);
}

TEST_P(ProcessRanks, GridBarrierOverAllMultiprocessors) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::grid_barrier_many);
}

TEST_P(MultiProcessRanks, FingerprintMismatchFailsOnEveryRank) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::fingerprint_mismatch);
}

TEST_P(MultiProcessRanks, InvalidProblemOnOneRankFailsOnEveryRank) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::invalid_problem);
}

TEST_P(MultiProcessRanks, RankBarrierTimeoutNamesTheMissingRank) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  run(comm_test::rank_barrier_timeout);
}

TEST_P(ProcessRanks, GridBarrierTimeoutAndRecovery) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  run(comm_test::grid_barrier_timeout);
}

TEST_P(ProcessRanks, CreateAndDestroy100TimesWithoutLeaking) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::create_destroy_many);
}

TEST_P(ProcessRanks, PullRowsBulkAndVector) {
  SKIP_WITHOUT_HOPPER_GPUS(GetParam());
  run(comm_test::pull_rows);
}

INSTANTIATE_TEST_SUITE_P(Gpus, ProcessRanks, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "gpus"; });
INSTANTIATE_TEST_SUITE_P(Gpus, MultiProcessRanks, ::testing::Values(2),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "gpus"; });

TEST(ProcessLauncher, AFailingRankFailsTheRunAndItsStuckPeerIsKilled) {
  SKIP_WITHOUT_HOPPER_GPUS(2);
  // Rank 1 fails at once; rank 0 waits in a barrier that can never complete until the launcher kills
  // it, one grace period (timeout + 5 s) later.
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  const int failed = run_ranks(2, LaunchMode::processes, [](Communicator& comm) {
    if (comm.rank() == 1) throw std::runtime_error("deliberate failure");
    comm.barrier();
  });
  EXPECT_EQ(failed, 2);
}

TEST(ProcessLauncher, AKilledRankIsCounted) {
  SKIP_WITHOUT_HOPPER_GPUS(1);
  EXPECT_EQ(run_ranks(1, LaunchMode::processes, [](Communicator&) { std::raise(SIGKILL); }), 1);
}

}  // namespace
}  // namespace megamoe
