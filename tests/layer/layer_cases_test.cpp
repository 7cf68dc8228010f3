// The layer cases' selection by name (MEGAMOE_TEST_CASES), on the CPU.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "comm/scoped_env.h"
#include "layer/layer_cases.h"

namespace megamoe::layer_test {
namespace {

TEST(LayerCases, EveryCaseWithoutASelection) {
  const comm_test::ScopedEnv unset("MEGAMOE_TEST_CASES", nullptr);
  const comm_test::ScopedEnv empty_list("MEGAMOE_TEST_CASES", "");
  EXPECT_GT(cases_for_ranks(2).size(), 20u);
}

TEST(LayerCases, KeepsTheCasesWhoseNameContainsAnEntry) {
  const comm_test::ScopedEnv list("MEGAMOE_TEST_CASES", "basic_shared,,capacity_one_below");
  const std::vector<LayerCase> cases = cases_for_ranks(1);
  ASSERT_EQ(cases.size(), 4u);
  for (const LayerCase& c : cases)
    EXPECT_TRUE(c.name.starts_with("basic_shared_") || c.name == "capacity_one_below") << c.name;
}

TEST(LayerCases, ASelectionThatMatchesNoCaseIsAnError) {
  const comm_test::ScopedEnv list("MEGAMOE_TEST_CASES", "basic_sharde");
  try {
    cases_for_ranks(1);
    FAIL() << "a selection that matches no case was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("MEGAMOE_TEST_CASES='basic_sharde'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megamoe::layer_test
