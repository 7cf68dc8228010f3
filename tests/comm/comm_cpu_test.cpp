// Host-only parts of the communication layer: error words, the timeout setting, problem agreement
// and the emulated group's barrier and all-gather.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/agreement.h"
#include "comm/check.h"
#include "comm/emulated.h"
#include "comm/scoped_env.h"
#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {
namespace {

using comm_test::ScopedEnv;

DeviceError timeout_at(WaitSite site, uint32_t peer, uint64_t expected, uint64_t seen) {
  DeviceError e{};
  e.code = kDeviceTimeout;
  e.site = site;
  e.rank = 1;
  e.block = 0;
  e.thread = 0;
  e.peer = peer;
  e.detail = 5000;
  e.expected = expected;
  e.seen = seen;
  return e;
}

TEST(DescribeDeviceError, RankBarrierTimeoutNamesRankBlockPeerAndValues) {
  EXPECT_EQ(describe(timeout_at(kWaitRankBarrier, 0, 7, 6)),
            "rank 1, block 0, thread 0: timed out after 5000 ms waiting at the cross-rank barrier for rank 0 "
            "(expected epoch 7, saw 6)");
}

TEST(DescribeDeviceError, GridBarrierAndOtherSites) {
  DeviceError grid = timeout_at(kWaitGridBarrier, 1, 3, 2);
  grid.block = 17;
  grid.thread = 5;
  EXPECT_EQ(describe(grid),
            "rank 1, block 17, thread 5: timed out after 5000 ms waiting at the grid barrier (expected generation 3, "
            "saw 2)");
  EXPECT_EQ(describe(timeout_at(kWaitTest, 2, 1, 0)),
            "rank 1, block 0, thread 0: timed out after 5000 ms waiting on a test flag from rank 2 (expected value 1, "
            "saw 0)");
  DeviceError gemm = timeout_at(kWaitGemmStage, 1, 1, 0);
  gemm.detail = 3;  // the stage, not a timeout
  EXPECT_EQ(describe(gemm),
            "rank 1, block 0, thread 0: timed out waiting for GEMM pipeline stage 3 (expected parity 1, saw 0)");
  gemm.detail = kGemmScaleHandOver;
  EXPECT_EQ(describe(gemm),
            "rank 1, block 0, thread 0: timed out waiting for the weight-scale warp's hand-over (expected parity 1, "
            "saw 0)");
  DeviceError handed = timeout_at(kWaitFusedTileDone, 1, 5, 4);
  handed.detail = 1;  // the math warpgroup, not a timeout
  EXPECT_EQ(describe(handed),
            "rank 1, block 0, thread 0: timed out waiting for math warpgroup 1 to hand over its next tile-done count "
            "(expected count 5, saw 4)");
  EXPECT_NE(describe(timeout_at(static_cast<WaitSite>(99), 2, 1, 0)).find("unknown wait site 99"), std::string::npos);
}

TEST(DescribeDeviceError, OtherCodes) {
  DeviceError bad{};
  bad.code = kDeviceBadExpertId;
  bad.rank = 2;
  bad.block = 3;
  bad.thread = 4;
  bad.detail = 12;
  bad.choice = 3;
  bad.seen = static_cast<uint32_t>(-5);
  EXPECT_EQ(describe(bad),
            "rank 2, block 3, thread 4: token 12, choice 3 routes to expert id -5, outside [-1, num_experts)");
  DeviceError refused{};
  refused.code = kDeviceCapacityExceeded;
  refused.rank = 1;
  refused.peer = 1;
  refused.seen = 70000;
  refused.expected = 65536;
  EXPECT_EQ(describe(refused),
            "rank 1, block 0, thread 0: rank 1 received 70000 routes, more than its receive capacity 65536 "
            "(Problem::recv_capacity): the call was refused on every rank and wrote no output");
  refused.rank = 0;  // a peer of the refusing rank knows only who refused
  refused.seen = 0;
  EXPECT_EQ(describe(refused),
            "rank 0, block 0, thread 0: rank 1 received more routes than its receive capacity "
            "(Problem::recv_capacity): the call was refused on every rank and wrote no output");
  DeviceError chunks{};
  chunks.code = kDeviceStreamedChunks;
  chunks.peer = 3;
  chunks.detail = 2;
  chunks.seen = uint64_t{16} << 32 | 33;
  chunks.expected = uint64_t{32} << 32 | 40;
  EXPECT_EQ(describe(chunks),
            "rank 0, block 0, thread 0: a streamed call read rank 3's front-ring chunk 2 as starting at token 16 of "
            "a call of 33 tokens, where the call puts it at token 32 of 40: the ring's sequence numbers are out of "
            "step (make a new buffer; with one rank, check_device_error resets it)");
  chunks.detail = 0;
  chunks.seen = 5000;
  chunks.expected = 4096;
  chunks.choice = 1;
  EXPECT_EQ(describe(chunks),
            "rank 0, block 0, thread 0: a streamed call read rank 3's front-ring chunk 0 as starting at token 0 of "
            "a call of 5000 tokens, where a call holds at most 4096 tokens (max_tokens_per_rank): the ring's "
            "sequence numbers are out of step (make a new buffer; with one rank, check_device_error resets it)");
  chunks.detail = 1;
  chunks.seen = chunks.expected = uint64_t{16} << 32 | 40;
  chunks.choice = 2;
  EXPECT_EQ(describe(chunks),
            "rank 0, block 0, thread 0: a streamed call read rank 3's front-ring chunk 1 as starting at token 16 of "
            "a call of 40 tokens, where its token count in the slot or its last-chunk flag disagrees with that: the "
            "ring's sequence numbers are out of step (make a new buffer; with one rank, check_device_error resets "
            "it)");
  DeviceError tokens{};
  tokens.code = kDeviceStreamedTokens;
  tokens.expected = 17;
  tokens.seen = 16;
  EXPECT_EQ(describe(tokens),
            "rank 0, block 0, thread 0: a streamed call of 17 tokens found 16 in this rank's front ring: "
            "inputs.num_tokens must be the producers' token count");
  EXPECT_EQ(describe(timeout_at(kWaitFusedRoutes, 1, 4, 3)),
            "rank 1, block 0, thread 0: timed out after 5000 ms waiting for this rank's route units (every "
            "source's routes read) (expected count 4, saw 3)");
  DeviceError unknown{};
  unknown.code = 77;
  EXPECT_NE(describe(unknown).find("unknown device error code 77"), std::string::npos);
}

// What stops a rank's waits and makes check_device_error reset the front ring: errors that leave the
// call's protocol incomplete (recorded in ControlBlock::error), not input errors (input_error).
TEST(DeviceErrorCodes, WhatBreaksACall) {
  for (const uint32_t code : {kDeviceTimeout, kDeviceStreamedChunks, kDeviceStreamedTokens})
    EXPECT_TRUE(breaks_call(code)) << code;
  for (const uint32_t code : {kDeviceOk, kDeviceBadExpertId, kDeviceSlotOverflow, kDeviceCapacityExceeded})
    EXPECT_FALSE(breaks_call(code)) << code;
}

TEST(DefaultTimeout, FiveSecondsUnlessTheEnvironmentSaysOtherwise) {
  {
    ScopedEnv env("MEGAMOE_TIMEOUT_MS", nullptr);
    EXPECT_EQ(default_timeout_ns(), 5000ull * 1000000ull);
  }
  {
    ScopedEnv env("MEGAMOE_TIMEOUT_MS", "");
    EXPECT_EQ(default_timeout_ns(), 5000ull * 1000000ull);
  }
  {
    ScopedEnv env("MEGAMOE_TIMEOUT_MS", "250");
    EXPECT_EQ(default_timeout_ns(), 250ull * 1000000ull);
  }
  {
    ScopedEnv env("MEGAMOE_TIMEOUT_MS", "300000");
    EXPECT_EQ(default_timeout_ns(), 300000ull * 1000000ull);
  }
}

TEST(DefaultTimeout, RejectsWhatIsNotAPositiveWholeNumber) {
  for (const char* text : {"abc", "0", "-3", "12ms", " 5", "99999999999", "1.5"}) {
    ScopedEnv env("MEGAMOE_TIMEOUT_MS", text);
    try {
      default_timeout_ns();
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("MEGAMOE_TIMEOUT_MS"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  }
}

Problem two_rank_problem(int32_t rank) {
  Problem p;
  p.num_ranks = 2;
  p.rank = rank;
  p.num_experts = 8;
  p.top_k = 2;
  p.hidden = 7168;
  p.intermediate = 2048;
  p.max_tokens_per_rank = 256;
  return p;
}

TEST(Agreement, IdenticalProblemsAgree) {
  EXPECT_EQ(disagreement({make_record(two_rank_problem(0), 0, 2), make_record(two_rank_problem(1), 1, 2)}), "");
}

TEST(Agreement, NamesTheFieldAndEveryDifferingRank) {
  Problem other = two_rank_problem(1);
  other.hidden = 4096;
  const std::string message = disagreement({make_record(two_rank_problem(0), 0, 2), make_record(other, 1, 2)});
  EXPECT_NE(message.find("ranks disagree on hidden: rank 0 has 7168, rank 1 has 4096"), std::string::npos) << message;
  EXPECT_NE(message.find("ranks disagree on buffer bytes"), std::string::npos) << message;
  EXPECT_EQ(message.find("top_k"), std::string::npos) << message;
}

TEST(Agreement, NamesRecipes) {
  Problem other = two_rank_problem(1);
  other.recipe = Recipe::bf16;
  const std::string message = disagreement({make_record(two_rank_problem(0), 0, 2), make_record(other, 1, 2)});
  EXPECT_NE(message.find("ranks disagree on recipe: rank 0 has fp8, rank 1 has bf16"), std::string::npos) << message;
}

TEST(Agreement, ProblemMustMatchItsPlaceInTheCommunicator) {
  // Both ranks describe rank 0, and think there are 2 ranks in a communicator of 3.
  const std::string message = disagreement({make_record(two_rank_problem(0), 0, 3), make_record(two_rank_problem(0), 1, 3)});
  EXPECT_NE(message.find("rank 1: problem.rank is 0 but the communicator's rank is 1"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0: problem.num_ranks is 2 but the communicator has 3 ranks"), std::string::npos)
      << message;
}

TEST(Agreement, AFingerprintDifferenceAloneIsReported) {
  ProblemRecord a = make_record(two_rank_problem(0), 0, 2);
  ProblemRecord b = make_record(two_rank_problem(1), 1, 2);
  b.fingerprint ^= 1;
  EXPECT_NE(disagreement({a, b}).find("ranks disagree on the problem fingerprint"), std::string::npos);
}

TEST(EmulatedGroup, AllGatherReturnsEveryRanksBytesInRankOrder) {
  constexpr int kRanks = 4;
  constexpr int kRounds = 200;
  EmulatedGroup group(kRanks);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      for (int round = 0; round < kRounds; ++round) {
        const size_t size = 1 + round % 5;  // the same on every rank within a round
        const std::vector<uint8_t> mine(size, static_cast<uint8_t>(rank * 50 + round % 50));
        const auto gathered = group.all_gather(rank, mine);
        for (int r = 0; r < kRanks; ++r) {
          if (gathered[r] != std::vector<uint8_t>(size, static_cast<uint8_t>(r * 50 + round % 50))) ++wrong;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(EmulatedGroup, NoRankPassesTheBarrierBeforeAllArrive) {
  constexpr int kRanks = 8;
  constexpr int kRounds = 1000;
  EmulatedGroup group(kRanks);
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      for (int round = 0; round < kRounds; ++round) {
        ++arrived;
        group.barrier(rank);
        if (arrived.load() < kRanks * (round + 1)) ++early;
        group.barrier(rank);  // nobody arrives at the next round before all have checked this one
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(early.load(), 0);
  EXPECT_EQ(arrived.load(), kRanks * kRounds);
}

TEST(EmulatedGroup, AbortReleasesWaitingRanksWithAnError) {
  EmulatedGroup group(3);
  std::atomic<int> released{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        group.barrier(rank);
      } catch (const Error& e) {
        if (std::string(e.what()).find("another rank failed") != std::string::npos) ++released;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group.abort();
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(released.load(), 2);
  EXPECT_THROW(group.all_gather(2, {1}), Error);
}

// The loaded libnccl must be the release whose device API the build compiled in.
TEST(NcclVersion, OnlyTheCompiledReleaseIsAccepted) {
  using comm_detail::nccl_version_mismatch;
  EXPECT_EQ(nccl_version_mismatch(22809, 22809, "/lib/libnccl.so.2"), "");
  const std::string older = nccl_version_mismatch(22809, 22703, "/usr/lib/libnccl.so.2");
  EXPECT_NE(older.find("compiled against NCCL 2.28.9"), std::string::npos) << older;
  EXPECT_NE(older.find("loaded NCCL 2.27.3 from /usr/lib/libnccl.so.2"), std::string::npos) << older;
  EXPECT_NE(nccl_version_mismatch(22809, 22810, "").find("from an unknown path"), std::string::npos);
}

}  // namespace
}  // namespace megamoe
