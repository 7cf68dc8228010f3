// Bad arguments to the layer's entry points are refused on the host, before any kernel runs, with
// an error naming the argument and the rule.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/comm.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/layer.h"

namespace megamoe {
namespace {

Problem small_problem(Recipe recipe) {
  Problem p;
  p.num_experts = 4;
  p.top_k = 2;
  p.hidden = 256;
  p.intermediate = 128;
  p.max_tokens_per_rank = 8;
  p.recipe = recipe;
  return p;
}

// Runs `call` and expects megamoe::Error whose message contains every piece of `expected`.
void expect_refused(const std::function<void()>& call, std::initializer_list<const char*> expected) {
  try {
    call();
    ADD_FAILURE() << "expected megamoe::Error mentioning " << *expected.begin();
  } catch (const Error& error) {
    for (const char* piece : expected)
      EXPECT_NE(std::string(error.what()).find(piece), std::string::npos) << error.what() << " lacks: " << piece;
  }
}

TEST(LayerArguments, EachBadArgumentIsNamed) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(1, LaunchMode::emulated, [](Communicator& comm) {
    const Problem p = small_problem(Recipe::fp8);
    SymmBuffer buffer(comm, p);
    const auto weights = DeviceWeights::synthetic(p, 7);
    DeviceBatch batch(p, 4);
    DeviceBatch too_many(p, 9);
    void* y_memory = nullptr;
    ASSERT_EQ(cudaMalloc(&y_memory, 16 * 256 * 2), cudaSuccess);
    const TensorView y = TensorView::contiguous(y_memory, DType::bf16, {4, 256}, Device::cuda);
    cudaStream_t stream = comm.stream();
    const LayerWeights& w = weights->view();

    expect_refused([&] { fp8_mega_moe(buffer, too_many.inputs(), w, TensorView::contiguous(y_memory, DType::bf16, {9, 256}, Device::cuda), stream); },
                   {"inputs.num_tokens", "[0, 8]", "got 9"});
    LayerInputs wrong_dtype = batch.inputs();
    wrong_dtype.x.dtype = DType::bf16;
    expect_refused([&] { fp8_mega_moe(buffer, wrong_dtype, w, y, stream); }, {"inputs.x", "dtype e4m3"});
    LayerInputs wrong_shape = batch.inputs();
    wrong_shape.topk_idx.shape[1] = 3;
    expect_refused([&] { fp8_mega_moe(buffer, wrong_shape, w, y, stream); }, {"inputs.topk_idx", "shape [4, 2]"});
    LayerInputs host_weights = batch.inputs();
    host_weights.topk_weights.device = Device::host;
    expect_refused([&] { fp8_mega_moe(buffer, host_weights, w, y, stream); }, {"inputs.topk_weights", "cuda memory"});
    const TensorView y_f32 = TensorView::contiguous(y_memory, DType::f32, {4, 256}, Device::cuda);
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), w, y_f32, stream); }, {"y", "dtype bf16"});
    LayerWeights wrong_weights = w;
    wrong_weights.routed.w2.values.shape[2] = 256;
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), wrong_weights, y, stream); },
                   {"weights.routed.w2.values", "shape [4, 256, 128]"});
    const TensorView stats = TensorView::contiguous(y_memory, DType::i32, {4}, Device::cuda);
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), w, y, stream, stats); }, {"recv_stats", "dtype i64"});
    expect_refused([&] { bf16_mega_moe(buffer, batch.inputs(), w, y, stream); }, {"buffer", "recipe fp8", "bf16"});
    // The fused schedule's event log: the staged schedule takes none, and a build without the log
    // says how to get one.
    CallOptions traced(Schedule::staged);
    traced.trace = TensorView::contiguous(y_memory, DType::u8, {16}, Device::cuda);
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), w, y, stream, {}, traced); },
                   {"options.trace", "staged schedule"});
    traced.schedule = Schedule::fused;
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), w, y, stream, {}, traced); },
                   {"options.trace", fused_trace_compiled() ? "shape" : "MEGAMOE_FUSED_TRACE"});
    cudaFree(y_memory);
  });
  EXPECT_EQ(failed, 0);
}

// fp8_fp4 weights are packed E2M1 pairs with derived scales and shifts: fp8 weights, or weights
// without their shifts, are refused by name.
TEST(LayerArguments, Fp8Fp4WeightsAreCheckedInTheirOwnFormat) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(1, LaunchMode::emulated, [](Communicator& comm) {
    const Problem p = small_problem(Recipe::fp8_fp4);
    SymmBuffer buffer(comm, p);
    const auto fp4_weights = DeviceWeights::synthetic(p, 7);
    const auto fp8_weights = DeviceWeights::synthetic(small_problem(Recipe::fp8), 7);
    DeviceBatch batch(p, 4);
    void* y_memory = nullptr;
    ASSERT_EQ(cudaMalloc(&y_memory, 4 * 256 * 2), cudaSuccess);
    const TensorView y = TensorView::contiguous(y_memory, DType::bf16, {4, 256}, Device::cuda);
    cudaStream_t stream = comm.stream();
    expect_refused([&] { fp8_fp4_mega_moe(buffer, batch.inputs(), fp8_weights->view(), y, stream); },
                   {"weights.routed.w1.values", "dtype e2m1x2"});
    LayerWeights no_shifts = fp4_weights->view();
    no_shifts.routed.w2.shifts = {};
    expect_refused([&] { fp8_fp4_mega_moe(buffer, batch.inputs(), no_shifts, y, stream); },
                   {"weights.routed.w2.shifts"});
    expect_refused([&] { fp8_mega_moe(buffer, batch.inputs(), fp4_weights->view(), y, stream); },
                   {"buffer", "recipe fp8_fp4", "fp8"});
    cudaFree(y_memory);
  });
  EXPECT_EQ(failed, 0);
}

// Every field of LayerWeights a recipe reads is checked by name: missing, of another shape, dtype or
// device. (fp8 reads no shifts, bf16 no scales and no shifts.)
struct WeightField {
  std::string name;  // as the errors name it
  ExpertGroupWeights LayerWeights::*group;
  LinearWeights ExpertGroupWeights::*linear;
  TensorView LinearWeights::*part;
  TensorView& of(LayerWeights& w) const { return (w.*group).*linear.*part; }
  const TensorView& of(const LayerWeights& w) const { return (w.*group).*linear.*part; }
};

std::vector<WeightField> weight_fields() {
  const std::pair<const char*, ExpertGroupWeights LayerWeights::*> groups[] = {{"routed", &LayerWeights::routed},
                                                                                {"shared", &LayerWeights::shared}};
  const std::pair<const char*, LinearWeights ExpertGroupWeights::*> linears[] = {{"w1", &ExpertGroupWeights::w1},
                                                                                  {"w2", &ExpertGroupWeights::w2}};
  const std::pair<const char*, TensorView LinearWeights::*> parts[] = {
      {"values", &LinearWeights::values}, {"scales", &LinearWeights::scales}, {"shifts", &LinearWeights::shifts}};
  std::vector<WeightField> fields;
  for (const auto& [group_name, group] : groups)
    for (const auto& [linear_name, linear] : linears)
      for (const auto& [part_name, part] : parts)
        fields.push_back({std::string("weights.") + group_name + "." + linear_name + "." + part_name, group, linear,
                          part});
  return fields;
}

bool recipe_reads(Recipe recipe, const std::string& field) {
  if (field.ends_with(".shifts")) return recipe == Recipe::fp8_fp4;
  if (field.ends_with(".scales")) return recipe != Recipe::bf16;
  return true;
}

class LayerWeightFields : public ::testing::TestWithParam<Recipe> {};

TEST_P(LayerWeightFields, EachFieldIsCheckedByName) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const Recipe recipe = GetParam();
  const int failed = run_ranks(1, LaunchMode::emulated, [recipe](Communicator& comm) {
    Problem p = small_problem(recipe);
    p.num_shared_experts = 1;
    SymmBuffer buffer(comm, p);
    const auto weights = DeviceWeights::synthetic(p, 7);
    DeviceBatch batch(p, 4);
    void* y_memory = nullptr;
    ASSERT_EQ(cudaMalloc(&y_memory, 4 * 256 * 2), cudaSuccess);
    const TensorView y = TensorView::contiguous(y_memory, DType::bf16, {4, 256}, Device::cuda);
    const auto call = [&](const LayerWeights& w) { mega_moe(buffer, batch.inputs(), w, y, comm.stream()); };
    int checked = 0;
    for (const WeightField& field : weight_fields()) {
      if (!recipe_reads(p.recipe, field.name)) continue;
      ++checked;
      const char* name = field.name.c_str();
      const TensorView& good = field.of(weights->view());
      ASSERT_FALSE(good.empty()) << name << " was not made by DeviceWeights";
      LayerWeights w = weights->view();
      field.of(w) = {};
      expect_refused([&] { call(w); }, {name});
      w = weights->view();
      field.of(w).shape[good.ndim - 1] += 1;
      expect_refused([&] { call(w); }, {name, "must have shape"});
      w = weights->view();
      field.of(w).dtype = DType::i64;  // no weight tensor is i64
      expect_refused([&] { call(w); }, {name, "must have dtype"});
      w = weights->view();
      field.of(w).device = Device::host;
      expect_refused([&] { call(w); }, {name, "cuda memory"});
    }
    EXPECT_EQ(checked, p.recipe == Recipe::fp8_fp4 ? 12 : p.recipe == Recipe::fp8 ? 8 : 4);
    cudaFree(y_memory);
  });
  EXPECT_EQ(failed, 0);
}

// Weights made for another recipe, or another problem's shape, are refused before any kernel runs.
TEST_P(LayerWeightFields, WeightsOfAnotherRecipeOrShape) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const Recipe recipe = GetParam();
  const int failed = run_ranks(1, LaunchMode::emulated, [recipe](Communicator& comm) {
    const Problem p = small_problem(recipe);
    SymmBuffer buffer(comm, p);
    DeviceBatch batch(p, 4);
    void* y_memory = nullptr;
    ASSERT_EQ(cudaMalloc(&y_memory, 4 * 256 * 2), cudaSuccess);
    const TensorView y = TensorView::contiguous(y_memory, DType::bf16, {4, 256}, Device::cuda);
    for (Recipe other : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
      if (other == p.recipe) continue;
      const auto weights = DeviceWeights::synthetic(small_problem(other), 7);
      expect_refused([&] { mega_moe(buffer, batch.inputs(), weights->view(), y, comm.stream()); },
                     {"weights.routed.w1.values", "must have dtype"});
    }
    Problem wider = p;
    wider.intermediate = 256;
    const auto wider_weights = DeviceWeights::synthetic(wider, 7);
    expect_refused([&] { mega_moe(buffer, batch.inputs(), wider_weights->view(), y, comm.stream()); },
                   {"weights.routed.w1.values", "must have shape"});
    Problem more_experts = p;
    more_experts.num_experts = 8;
    const auto more_weights = DeviceWeights::synthetic(more_experts, 7);
    expect_refused([&] { mega_moe(buffer, batch.inputs(), more_weights->view(), y, comm.stream()); },
                   {"weights.routed.w1.values", "must have shape [4,"});
    cudaFree(y_memory);
  });
  EXPECT_EQ(failed, 0);
}

INSTANTIATE_TEST_SUITE_P(Recipes, LayerWeightFields, ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// num_tokens outside [0, max_tokens_per_rank] is refused by every entry point that takes it.
TEST(LayerArguments, TokenCountOutsideTheBuffer) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int failed = run_ranks(1, LaunchMode::emulated, [](Communicator& comm) {
    const Problem p = small_problem(Recipe::bf16);
    SymmBuffer buffer(comm, p);
    const auto weights = DeviceWeights::synthetic(p, 7);
    DeviceBatch batch(p, 4);
    LayerInputs negative = batch.inputs();
    negative.num_tokens = -1;
    expect_refused([&] { mega_moe(buffer, negative, weights->view(), {}, comm.stream()); },
                   {"inputs.num_tokens", "[0, 8]", "got -1"});
    expect_refused([&] { buffer_input_views(buffer, 9, batch.inputs().topk_idx); }, {"num_tokens", "[0, 8]", "got 9"});
  });
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace megamoe
