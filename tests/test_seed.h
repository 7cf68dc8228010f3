// The random seed of a randomized test, and the command that replays it.
//   MEGAMOE_TEST_SEED=S   every seed a test draws is S instead of a fresh random one, so a failure
//                         printed with its seed can be run again exactly.
//   MEGAMOE_TEST_QUICK=1  fewer tokens and calls, for runs under compute-sanitizer (quick_run).
#pragma once

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

namespace megamoe::testing {

inline constexpr const char* kSeedVariable = "MEGAMOE_TEST_SEED";

// Whether MEGAMOE_TEST_QUICK is set (and not 0): tools/gpu_check.sh sanitize sets it.
inline bool quick_run() {
  const char* value = std::getenv("MEGAMOE_TEST_QUICK");
  return value != nullptr && value[0] != '\0' && std::string(value) != "0";
}

// MEGAMOE_TEST_SEED when set, else a fresh random seed. A malformed value throws: a typo must not
// silently turn a replay into a fresh random run.
inline uint64_t test_seed() {
  const char* text = std::getenv(kSeedVariable);
  if (text == nullptr || text[0] == '\0') return (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  char* end = nullptr;
  errno = 0;
  const unsigned long long seed = std::strtoull(text, &end, 10);
  if (text[0] < '0' || text[0] > '9' || *end != '\0' || errno != 0)
    throw std::invalid_argument(std::string(kSeedVariable) + ": must be a whole number in [0, 2^64), got '" + text +
                                "'");
  return seed;
}

// The command line that runs the current GoogleTest test again with `seed`.
inline std::string replay_command(uint64_t seed) {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  std::string command = std::string(kSeedVariable) + "=" + std::to_string(seed) + " " +
                        (error ? std::string("<test binary>") : self.string());
  if (const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info())
    command += std::string(" --gtest_filter='") + test->test_suite_name() + "." + test->name() + "'";
  return command;
}

// test_seed(), printed with its replay command (GoogleTest's output is where a failure is read).
inline uint64_t announced_test_seed(const char* what) {
  const uint64_t seed = test_seed();
  std::printf("%s: random seed %llu (replay: %s)\n", what, static_cast<unsigned long long>(seed),
              replay_command(seed).c_str());
  return seed;
}

}  // namespace megamoe::testing
