// The hand-over deadline's rule (pipeline.cuh: SharedDeadline), played on the CPU against random
// timings: a producer hands units over one after the other, each a decision at some time and an
// arrival a little later; walkers take each unit after finishing the one before, polling at their own
// pace. Every walker of a unit must take it or every one give up, and a unit handed over is never
// given up. The rule each walker used before (its own clock: twice the timeout after it began to wait)
// is played too, and must split some units: the test can tell the rules apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/gemm/pipeline.cuh"

namespace megamoe::gemm {
namespace {

constexpr uint64_t kTimeoutNs = 20 * kHandOverMarginNs;

struct HandOver {
  uint64_t decided;  // the producer's reading of the timer for its check
  uint64_t written;  // its write of the next deadline, when made
  uint64_t arrived;  // its arrival, kNever when not made
};
constexpr uint64_t kNever = ~uint64_t{0};

// The producer's hand-overs: after each, a gap (mostly short, sometimes far past the deadline,
// sometimes within two margins of it either way); the arrival follows the decision by less than the
// margin, and the write of the next deadline falls between the two. With `refuse` (the shared rule)
// it stops at the first hand-over it may no longer make; without (the rule before), it makes every one.
std::vector<HandOver> produce(std::mt19937_64& rng, uint64_t start, uint32_t units, bool refuse) {
  std::uniform_int_distribution<uint64_t> short_gap(0, kTimeoutNs / 4), long_gap(2 * kTimeoutNs, 5 * kTimeoutNs);
  std::uniform_int_distribution<uint64_t> near(0, 4 * kHandOverMarginNs), delay(0, kHandOverMarginNs - 1);
  std::uniform_int_distribution<int> kind(0, 99);
  std::vector<HandOver> made;
  uint64_t deadline = next_hand_over_deadline(start, kTimeoutNs), now = start;
  for (uint32_t k = 0; k < units; ++k) {
    const int what = kind(rng);
    now = what < 3   ? now + long_gap(rng)
          : what < 8 ? std::max(now, deadline - 2 * kHandOverMarginNs + near(rng))
                     : now + short_gap(rng);
    if (refuse && !hand_over_allowed(now, deadline)) {
      made.push_back({now, kNever, kNever});
      break;
    }
    deadline = next_hand_over_deadline(now, kTimeoutNs);
    const uint64_t arrived = now + delay(rng);
    made.push_back({now, now + (arrived - now) / 2, arrived});
  }
  return made;
}

// One walker over the units: for each, the time it took it, or kNever once it gave up (then it stops).
// With the shared rule it reads, at each poll, the last deadline written by then (a walker waiting for
// unit k has seen unit k - 1 arrive, and with it the write before that arrival).
std::vector<uint64_t> walk(std::mt19937_64& rng, const std::vector<HandOver>& made, uint64_t start, bool shared_rule) {
  std::uniform_int_distribution<uint64_t> work(0, kTimeoutNs / 2), poll(1, kHandOverMarginNs / 3);
  std::vector<uint64_t> taken;
  uint64_t now = start, deadline = next_hand_over_deadline(start, kTimeoutNs);
  size_t written = 0;  // the decisions whose deadline this walker has read
  for (const HandOver& h : made) {
    const uint64_t began = now;
    for (;;) {
      if (now >= h.arrived) break;
      for (; written < made.size() && made[written].written <= now; ++written)
        deadline = next_hand_over_deadline(made[written].decided, kTimeoutNs);
      if (shared_rule ? now > deadline : now - began > 2 * kTimeoutNs) {
        taken.push_back(kNever);
        return taken;
      }
      now += poll(rng);
    }
    taken.push_back(now);
    now += work(rng);  // the unit's work before the walker waits for the next
  }
  return taken;
}

// What random runs of four walkers saw, unit by unit.
struct Outcome {
  uint32_t split = 0;                   // some walkers took the unit, others gave up on it
  uint32_t given_up_after_arrival = 0;  // a walker gave up on a unit that was handed over
  uint32_t handed_over = 0;
  uint32_t refused = 0;  // not handed over: every walker must give up on it
};

Outcome play(bool shared_rule, uint32_t runs) {
  std::mt19937_64 rng(shared_rule ? 1 : 2);
  Outcome o;
  for (uint32_t run = 0; run < runs; ++run) {
    const uint64_t start = 1000;
    const std::vector<HandOver> made = produce(rng, start, 40, shared_rule);
    std::vector<std::vector<uint64_t>> walkers;
    for (int w = 0; w < 4; ++w) walkers.push_back(walk(rng, made, start, shared_rule));
    for (size_t k = 0; k < made.size(); ++k) {
      uint32_t took = 0, gave_up = 0;
      for (const auto& taken : walkers) {
        if (k >= taken.size()) continue;  // gave up on an earlier unit
        (taken[k] == kNever ? gave_up : took) += 1;
      }
      if (took > 0 && gave_up > 0) ++o.split;
      if (made[k].arrived != kNever && gave_up > 0) ++o.given_up_after_arrival;
      (made[k].arrived != kNever ? o.handed_over : o.refused) += 1;
    }
  }
  return o;
}

TEST(HandOver, EveryWalkerTakesAUnitOrNoneDoes) {
  const Outcome o = play(true, 3000);
  EXPECT_EQ(o.split, 0u);
  EXPECT_EQ(o.given_up_after_arrival, 0u) << "a walker gave up on a unit the producer handed over in time";
  // Both cases were played: units handed over, and late ones refused (which the walkers gave up on,
  // since nothing arrived).
  EXPECT_GT(o.handed_over, 10000u);
  EXPECT_GT(o.refused, 100u);
}

// The control: each walker on its own clock splits units whose hand-over comes near its deadline.
TEST(HandOver, WalkersOnTheirOwnClocksSplitLateUnits) {
  EXPECT_GT(play(false, 3000).split, 0u);
}

// The producer's side alone: in time up to the margin before the deadline, not after.
TEST(HandOver, ProducerStopsAMarginBeforeTheWalkers) {
  const uint64_t deadline = next_hand_over_deadline(5000, kTimeoutNs);
  EXPECT_EQ(deadline, 5000 + 3 * kTimeoutNs + kHandOverMarginNs);
  EXPECT_TRUE(hand_over_allowed(deadline - kHandOverMarginNs, deadline));
  EXPECT_FALSE(hand_over_allowed(deadline - kHandOverMarginNs + 1, deadline));
}

}  // namespace
}  // namespace megamoe::gemm
