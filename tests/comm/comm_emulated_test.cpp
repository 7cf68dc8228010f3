// Multi-rank scenarios with 2, 4 and 8 emulated ranks sharing one GPU.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "comm/comm_scenarios.h"
#include "comm/scoped_env.h"
#include "gpu_test_util.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

using Scenario = void (*)(Communicator&);

class EmulatedRanks : public ::testing::TestWithParam<int> {
 protected:
  // Runs `scenario` on every rank; each failing rank has printed "rank R: why" on stderr.
  void run(Scenario scenario) {
    EXPECT_EQ(run_ranks(GetParam(), LaunchMode::emulated, scenario, 0), 0) << "ranks failed; see stderr";
  }
};

TEST_P(EmulatedRanks, BufferZeroedAtCreation) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::buffer_zeroed);
}

TEST_P(EmulatedRanks, PeerStoreReleaseAcquireLoad) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::peer_store_flag);
}

TEST_P(EmulatedRanks, RankBarrier10000Times) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::rank_barrier_many);
}

TEST_P(EmulatedRanks, StandaloneBarrierKernel) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::standalone_barrier);
}

TEST_P(EmulatedRanks, GridBarrierOverTheSmBudget) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::grid_barrier_many);
}

TEST_P(EmulatedRanks, FingerprintMismatchFailsOnEveryRank) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::fingerprint_mismatch);
}

TEST_P(EmulatedRanks, InvalidProblemOnOneRankFailsOnEveryRank) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::invalid_problem);
}

TEST_P(EmulatedRanks, RankBarrierTimeoutNamesTheMissingRank) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  run(comm_test::rank_barrier_timeout);
}

TEST_P(EmulatedRanks, GridBarrierTimeoutAndRecovery) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  comm_test::ScopedEnv timeout("MEGAMOE_TIMEOUT_MS", comm_test::kShortTimeoutMs);
  run(comm_test::grid_barrier_timeout);
}

TEST_P(EmulatedRanks, CreateAndDestroy100TimesWithoutLeaking) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::create_destroy_many);
}

TEST_P(EmulatedRanks, PullRowsBulkAndVector) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run(comm_test::pull_rows);
}

// Emulated ranks are threads of one process: per-function launch attributes are shared by them.
TEST(EmulatedLauncher, ConcurrentPullLaunchesOfDifferentRowSizes) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  EXPECT_NO_THROW(comm_test::concurrent_pull_launches());
}

TEST(EmulatedLauncher, CountsFailedRanks) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(
      4, LaunchMode::emulated,
      [](Communicator& comm) {
        if (comm.rank() % 2 == 1) throw std::runtime_error("deliberate failure");
        comm.barrier();  // the healthy ranks must be released, not left waiting for the failed ones
      },
      0);
  EXPECT_EQ(failed, 4);
}

TEST(EmulatedLauncher, GivesEachRankItsShareOfTheGpu) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  int multiprocessors = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int failed = run_ranks(
      4, LaunchMode::emulated,
      [&](Communicator& comm) {
        if (comm.sm_budget() != multiprocessors / 4 || !comm.emulated() || comm.size() != 4 || comm.nccl() != nullptr) {
          throw std::runtime_error("wrong communicator: sm_budget " + std::to_string(comm.sm_budget()));
        }
      },
      0);
  EXPECT_EQ(failed, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EmulatedRanks, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
}  // namespace megamoe
