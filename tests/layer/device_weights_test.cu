// DeviceWeights::synthetic generates on the GPU exactly the bits of transforming SyntheticWeights'
// experts on the host and uploading them.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/device_weights.h"
#include "megamoe/synthetic.h"

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
  const uint64_t seed = std::random_device{}();
  const SyntheticWeights host(p, seed);
  const DeviceWeights uploaded(p, host);
  const auto generated = DeviceWeights::synthetic(p, seed);
  const LayerWeights& a = generated->view();
  const LayerWeights& b = uploaded.view();
  expect_same(a.w1, b.w1, "w1");
  expect_same(a.w1_scales, b.w1_scales, "w1_scales");
  expect_same(a.w2, b.w2, "w2");
  expect_same(a.w2_scales, b.w2_scales, "w2_scales");
  expect_same(a.shared_w1, b.shared_w1, "shared_w1");
  expect_same(a.shared_w1_scales, b.shared_w1_scales, "shared_w1_scales");
  expect_same(a.shared_w2, b.shared_w2, "shared_w2");
  expect_same(a.shared_w2_scales, b.shared_w2_scales, "shared_w2_scales");
}

INSTANTIATE_TEST_SUITE_P(Recipes, SyntheticDeviceWeights, ::testing::Values(Recipe::fp8, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace megamoe
