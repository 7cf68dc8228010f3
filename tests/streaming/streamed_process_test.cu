// Streamed calls with one process and NCCL rank per GPU (1 GPU, and 2 when there are two): each rank's
// streamed outputs against its batch twin, in one chunk per call and in chunks, with randomly late
// producers and layers. This process forks the ranks, so it never initializes CUDA itself.
#include <gtest/gtest.h>

#include <string>

#include "comm/launcher.h"
#include "megamoe/comm.h"
#include "streaming/streamed_cases.h"
#include "test_seed.h"

namespace megamoe {
namespace {

using namespace streamed_test;

class StreamedProcesses : public ::testing::TestWithParam<int> {};

TEST_P(StreamedProcesses, MatchTheBatchCalls) {
  static const int gpus = count_hopper_gpus_in_child();
  if (gpus < GetParam()) GTEST_SKIP() << "needs " << GetParam() << " Hopper GPUs, found " << gpus;
  const uint64_t seed = testing::test_seed();
  struct Variant {
    const char* name;
    bool late;
    Chunking chunking;
  };
  for (const Variant& v : {Variant{"one chunk per call", false, {}}, Variant{"chunks of 16", false, kChunksOf16},
                           Variant{"chunks of 16, late", true, kChunksOf16}}) {
    EXPECT_EQ(run_ranks(GetParam(), LaunchMode::processes,
                        [&](Communicator& comm) {
                          streamed_against_batch(comm, Recipe::fp8, seed, kTopK, v.late, v.chunking);
                        }),
              0)
        << v.name << ", seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Gpus, StreamedProcesses, ::testing::Values(1, 2),
                         [](const auto& info) { return std::to_string(info.param) + "_gpus"; });

}  // namespace
}  // namespace megamoe
