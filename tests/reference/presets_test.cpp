#include <gtest/gtest.h>

#include <string>

#include "megamoe/error.h"
#include "megamoe/presets.h"

namespace megamoe {
namespace {

TEST(Presets, EveryPresetIsAValidProblem) {
  ASSERT_EQ(all_presets().size(), 7u);
  for (const Preset& preset : all_presets()) {
    EXPECT_NO_THROW(validate(preset_problem(preset, preset.default_ranks, preset.default_tokens))) << preset.name;
    EXPECT_FALSE(preset.note.empty()) << preset.name;
  }
}

TEST(Presets, ShapesOfTheModels) {
  const Preset& deepseek = find_preset("deepseek-v3");
  EXPECT_EQ(deepseek.num_experts, 256);
  EXPECT_EQ(deepseek.top_k, 8);
  EXPECT_EQ(deepseek.hidden, 7168);
  EXPECT_EQ(deepseek.intermediate, 2048);
  EXPECT_EQ(deepseek.num_shared_experts, 1);
  EXPECT_EQ(deepseek.recipe, Recipe::fp8);
  const Preset& tiny = find_preset("tiny");
  EXPECT_EQ(tiny.num_experts, 8);
  EXPECT_EQ(tiny.default_ranks, 2);
  EXPECT_EQ(tiny.default_tokens, 16);
  const Preset& gpt = find_preset("gpt-oss-120b");
  EXPECT_EQ(gpt.hidden, 2944);
  EXPECT_EQ(gpt.intermediate, 2944);
  EXPECT_NE(std::string(gpt.note).find("2880"), std::string::npos);
  EXPECT_EQ(find_preset("mixtral-8x7b").recipe, Recipe::bf16);
  EXPECT_EQ(find_preset("qwen3-235b-a22b").num_shared_experts, 0);
  EXPECT_EQ(deepseek.activation_clamp, 0.0f);
  for (const char* name : {"deepseek-v4-flash", "deepseek-v4-pro"}) {
    const Preset& v4 = find_preset(name);
    EXPECT_EQ(v4.top_k, 6) << name;
    EXPECT_EQ(v4.num_shared_experts, 1) << name;
    EXPECT_EQ(v4.recipe, Recipe::fp8_fp4) << name;
    EXPECT_EQ(v4.activation_clamp, 10.0f) << name;
  }
  EXPECT_EQ(find_preset("deepseek-v4-flash").num_experts, 256);
  EXPECT_EQ(find_preset("deepseek-v4-flash").hidden, 4096);
  EXPECT_EQ(find_preset("deepseek-v4-flash").intermediate, 2048);
  EXPECT_EQ(find_preset("deepseek-v4-pro").num_experts, 384);
  EXPECT_EQ(find_preset("deepseek-v4-pro").hidden, 7168);
  EXPECT_EQ(find_preset("deepseek-v4-pro").intermediate, 3072);
}

TEST(Presets, PresetProblemCarriesTheShape) {
  const Problem p = preset_problem(find_preset("qwen3-235b-a22b"), 4, 32);
  EXPECT_EQ(p.num_ranks, 4);
  EXPECT_EQ(p.max_tokens_per_rank, 32);
  EXPECT_EQ(p.num_experts, 128);
  EXPECT_EQ(p.top_k, 8);
  EXPECT_EQ(p.hidden, 4096);
  EXPECT_EQ(p.intermediate, 1536);
}

TEST(Presets, UnknownNameListsTheValidOnes) {
  try {
    find_preset("llama");
    FAIL() << "expected megamoe::Error";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("preset: unknown name 'llama'"), std::string::npos) << message;
    for (const Preset& preset : all_presets()) {
      EXPECT_NE(message.find(std::string(preset.name)), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace megamoe
