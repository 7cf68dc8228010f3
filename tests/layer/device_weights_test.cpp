// DeviceWeights::synthetic generates on the GPU exactly the bits of transforming SyntheticWeights'
// experts on the host and uploading them; fp8_fp4's derived scales follow their rule.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "test_seed.h"
#include "megamoe/device_weights.h"
#include "megamoe/formats.h"
#include "megamoe/synthetic.h"
#include "megamoe/weights.h"

namespace megamoe {
namespace {

std::vector<uint8_t> download(const TensorView& view) {
  std::vector<uint8_t> bytes(static_cast<size_t>(view.bytes()));
  EXPECT_EQ(cudaMemcpy(bytes.data(), view.data, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return bytes;
}

void expect_same(const TensorView& got, const TensorView& want, const char* name) {
  ASSERT_EQ(got.empty(), want.empty()) << name;
  if (want.empty()) return;
  ASSERT_EQ(got.numel(), want.numel()) << name;
  const std::vector<uint8_t> a = download(got), b = download(want);
  size_t first = a.size();
  for (size_t i = 0; i < a.size() && first == a.size(); ++i)
    if (a[i] != b[i]) first = i;
  EXPECT_EQ(first, a.size()) << name << ": first differing byte " << first << " of " << a.size();
}

class SyntheticDeviceWeights : public ::testing::TestWithParam<Recipe> {};

TEST_P(SyntheticDeviceWeights, SameBitsAsTheHostTransform) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  Problem p;
  p.num_ranks = 2;
  p.rank = 1;
  p.num_experts = 6;
  p.top_k = 2;
  p.hidden = 384;
  p.intermediate = 256;
  p.num_shared_experts = 2;
  p.max_tokens_per_rank = 16;
  p.recipe = GetParam();
  const uint64_t seed = testing::announced_test_seed("synthetic weights");
  const SyntheticWeights host(p, seed);
  const DeviceWeights uploaded(p, host);
  const auto generated = DeviceWeights::synthetic(p, seed);
  const LayerWeights& a = generated->view();
  const LayerWeights& b = uploaded.view();
  for (const auto& [group_name, group] :
       {std::pair{"routed", &LayerWeights::routed}, std::pair{"shared", &LayerWeights::shared}})
    for (const auto& [linear_name, linear] :
         {std::pair{"w1", &ExpertGroupWeights::w1}, std::pair{"w2", &ExpertGroupWeights::w2}}) {
      const LinearWeights& from_gpu = (a.*group).*linear;
      const LinearWeights& uploaded_one = (b.*group).*linear;
      const std::string name = std::string(group_name) + "." + linear_name;
      expect_same(from_gpu.values, uploaded_one.values, (name + ".values").c_str());
      expect_same(from_gpu.scales, uploaded_one.scales, (name + ".scales").c_str());
      expect_same(from_gpu.shifts, uploaded_one.shifts, (name + ".shifts").c_str());
    }
  if (p.recipe == Recipe::fp8_fp4) {
    EXPECT_FALSE(a.routed.w1.shifts.empty());
    EXPECT_FALSE(a.shared.w2.shifts.empty());
  }
}

// fp8_fp4's derived scales: each 64-row x 128-column block scale is the largest UE8M0 scale in it,
// and each group's shift is how far below that its own scale lies (clamped at 15).
TEST(Fp4DerivedScales, BlockScaleIsTheLargestAndShiftsAreRelativeToIt) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  Problem p;
  p.num_experts = 2;
  p.top_k = 1;
  p.hidden = 256;
  p.intermediate = 128;
  p.max_tokens_per_rank = 4;
  p.recipe = Recipe::fp8_fp4;
  const SyntheticWeights host(p, testing::announced_test_seed("synthetic weights"));
  const DeviceWeights uploaded(p, host);
  const LayerWeights& w = uploaded.view();
  const int64_t rows = 2 * p.intermediate, cols = p.hidden;
  const std::vector<uint8_t> scale_bytes = download(w.routed.w1.scales), shifts = download(w.routed.w1.shifts);
  for (int32_t e = 0; e < p.num_experts; ++e) {
    const StoredExpert expert = transform_weights(host.routed_expert(e), p.recipe);
    for (int64_t row_block = 0; row_block < rows / 64; ++row_block)
      for (int64_t kb = 0; kb < cols / 128; ++kb) {
        uint8_t largest = 0;
        for (int64_t r = 0; r < 64; ++r)
          for (int64_t g = 0; g < 4; ++g)
            largest = std::max(largest, expert.w1_mx_scales[(row_block * 64 + r) * (cols / 32) + kb * 4 + g]);
        float block;
        std::memcpy(&block, &scale_bytes[4 * ((e * rows / 64 + row_block) * (cols / 128) + kb)], 4);
        ASSERT_EQ(block, ue8m0_to_float(largest)) << "expert " << e << " block " << row_block << "," << kb;
        for (int64_t r = 0; r < 64; ++r)
          for (int64_t g = 0; g < 4; ++g) {
            const int64_t row = row_block * 64 + r;
            const uint8_t code = expert.w1_mx_scales[row * (cols / 32) + kb * 4 + g];
            ASSERT_EQ(shifts[(kb * p.num_experts * rows + e * rows + row) * 4 + g], std::min(largest - code, 15))
                << "expert " << e << " row " << row << " group " << kb * 4 + g;
          }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, SyntheticDeviceWeights, ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace megamoe
