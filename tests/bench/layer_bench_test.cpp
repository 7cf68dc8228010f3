// The layer benchmark (`megamoe bench`): its command line, and the work model of its floors and rates.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "bench/layer/layer_bench.h"
#include "comm/launcher.h"
#include "megamoe/error.h"

namespace megamoe::bench {
namespace {

std::string parse_error(const std::vector<std::string>& args) {
  try {
    parse_bench(args);
  } catch (const Error& error) {
    return error.what();
  }
  return "(parsed without an error)";
}

// The message starts with the flag it is about.
void expect_names(const std::vector<std::string>& args, const std::string& flag) {
  const std::string message = parse_error(args);
  EXPECT_EQ(message.rfind(flag + ":", 0), 0u) << message;
}

TEST(BenchFlags, ReadsEveryFlag) {
  const BenchOptions o =
      parse_bench({"--preset", "deepseek-v3", "--ranks", "2", "--tokens", "1,8,128", "--recipe", "bf16",
                   "--routing=zipf", "--seed", "7", "--repeats", "20", "--out", "layer.json"});
  EXPECT_EQ(o.preset->name, "deepseek-v3");
  EXPECT_EQ(o.problem.num_ranks, 2);
  EXPECT_EQ(o.problem.num_experts, 256);
  EXPECT_EQ(o.problem.recipe, Recipe::bf16);
  EXPECT_EQ(o.problem.max_tokens_per_rank, 128);  // the largest size
  EXPECT_EQ(o.tokens, (std::vector<int32_t>{1, 8, 128}));
  EXPECT_EQ(o.routing, Routing::zipf);
  EXPECT_EQ(o.seed, 7u);
  EXPECT_EQ(o.repeats, 20);
  EXPECT_EQ(o.out, "layer.json");
  EXPECT_EQ(o.command,
            "megamoe bench --preset deepseek-v3 --ranks 2 --tokens 1,8,128 --recipe bf16 --routing=zipf --seed 7 "
            "--repeats 20 --out layer.json");
}

TEST(BenchFlags, DefaultsComeFromThePreset) {
  const BenchOptions o = parse_bench({"--preset", "tiny", "--out", "layer.json"});
  EXPECT_EQ(o.problem.num_ranks, o.preset->default_ranks);
  EXPECT_EQ(o.problem.recipe, Recipe::fp8);
  EXPECT_EQ(o.tokens, kDefaultBenchTokens);
  EXPECT_EQ(o.problem.max_tokens_per_rank, 8192);
  EXPECT_EQ(o.routing, Routing::uniform);
  EXPECT_EQ(o.seed, 1u);
  EXPECT_EQ(o.repeats, 10);
}

TEST(BenchFlags, MistakesNameTheirFlag) {
  expect_names({"--out", "layer.json"}, "--preset");
  expect_names({"--preset", "nope", "--out", "layer.json"}, "--preset");
  expect_names({"--preset", "tiny"}, "--out");
  expect_names({"--preset", "tiny", "--out", "/no/such/directory/layer.json"}, "--out");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--tokens", "0"}, "--tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--tokens", "1,,8"}, "--tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--tokens", "1,8,"}, "--tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--tokens", "many"}, "--tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--recipe", "fp4"}, "--recipe");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--routing", "one_expert"}, "--routing");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--repeats", "0"}, "--repeats");
  expect_names({"--preset", "deepseek-v3", "--out", "layer.json", "--ranks", "3"}, "--ranks");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--bogus", "1"}, "--bogus");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--seed"}, "--seed");
  expect_names({"--preset", "tiny", "--out", "a.json", "--out", "b.json"}, "--out");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--trace", "/no/such/directory"}, "--trace");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--inputs", "pinned"}, "--inputs");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--producers", "yes"}, "--producers");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--streaming", "yes"}, "--streaming");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--streaming", "on", "--schedule", "staged"}, "--streaming");
}

TEST(BenchFlags, ProducersAreTimedOnlyWhenAsked) {
  EXPECT_FALSE(parse_bench({"--preset", "tiny", "--out", "layer.json"}).producers);
  EXPECT_FALSE(parse_bench({"--preset", "tiny", "--out", "layer.json", "--producers", "off"}).producers);
  EXPECT_TRUE(parse_bench({"--preset", "tiny", "--out", "layer.json", "--producers", "on"}).producers);
}

TEST(BenchFlags, StreamingTimesTheProducersAndGivesTheBufferARing) {
  const BenchOptions off = parse_bench({"--preset", "tiny", "--out", "layer.json"});
  EXPECT_FALSE(off.streaming);
  EXPECT_EQ(off.problem.front_num_slots, 0);
  const BenchOptions on =
      parse_bench({"--preset", "tiny", "--out", "layer.json", "--tokens", "1,300", "--streaming", "on"});
  EXPECT_TRUE(on.streaming);
  EXPECT_TRUE(on.producers);
  EXPECT_EQ(on.problem.front_num_slots, 2);  // a whole call per slot: one chunk per rank and call
  EXPECT_EQ(on.problem.front_tokens_per_slot, 300);
  const BenchOptions chunked = parse_bench(
      {"--preset", "tiny", "--out", "layer.json", "--tokens", "1,300", "--streaming", "on", "--chunk-tokens", "64"});
  EXPECT_EQ(chunked.chunk_tokens, 64);
  EXPECT_EQ(chunked.problem.front_num_slots, 10);  // two calls of five chunks, the last of 44 tokens
  EXPECT_EQ(chunked.problem.front_tokens_per_slot, 64);
  expect_names({"--preset", "tiny", "--out", "layer.json", "--chunk-tokens", "64"}, "--chunk-tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--streaming", "on", "--chunk-tokens", "0"},
               "--chunk-tokens");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--streaming", "on", "--producers", "off"}, "--streaming");
  expect_names({"--preset", "tiny", "--out", "layer.json", "--streaming", "on", "--inputs", "buffer"}, "--streaming");
  // A streamed call is one wave: the buffer holds the largest call, also where the default would cut
  // it in waves (DeepSeek-V3, 8 ranks x 8192 tokens: four by default).
  const BenchOptions large = parse_bench(
      {"--preset", "deepseek-v3", "--ranks", "8", "--tokens", "8192", "--streaming", "on", "--out", "l.json"});
  EXPECT_EQ(large.problem.wave_tokens, 8192);
  // The baseline check's 32-token problem is valid beside a ring sized for fewer tokens (a run with
  // --tokens 1,8 was refused before any timing).
  const BenchOptions small =
      parse_bench({"--preset", "deepseek-v3", "--tokens", "1,8", "--streaming", "on", "--out", "l.json"});
  EXPECT_EQ(small.problem.front_num_slots * small.problem.front_tokens_per_slot, 16);
  const Problem check = baseline_check_problem(small.problem);
  EXPECT_EQ(check.max_tokens_per_rank, 32);
  EXPECT_EQ(check.recipe, Recipe::bf16);
  EXPECT_EQ(check.front_num_slots, 0);
  EXPECT_NO_THROW(validate(check));
}

TEST(BenchFlags, InputsAreCopiedUnlessToldBuffer) {
  EXPECT_FALSE(parse_bench({"--preset", "tiny", "--out", "layer.json"}).inputs_in_buffer);
  EXPECT_FALSE(parse_bench({"--preset", "tiny", "--out", "layer.json", "--inputs", "copied"}).inputs_in_buffer);
  EXPECT_TRUE(parse_bench({"--preset", "tiny", "--out", "layer.json", "--inputs", "buffer"}).inputs_in_buffer);
  // DeepSeek-V3 at 8 ranks x 8192 tokens runs four waves by default: its inputs do not fit the buffer's regions.
  expect_names({"--preset", "deepseek-v3", "--ranks", "8", "--tokens", "8192", "--inputs", "buffer", "--out", "l.json"},
               "--inputs");
  EXPECT_TRUE(parse_bench({"--preset", "deepseek-v3", "--ranks", "8", "--tokens", "2048", "--inputs", "buffer", "--out",
                           "l.json"})
                  .inputs_in_buffer);
}

TEST(BenchFlags, TraceNamesAnExistingDirectory) {
  EXPECT_EQ(parse_bench({"--preset", "tiny", "--out", "layer.json"}).trace_dir, "");
  const std::string dir = ::testing::TempDir();
  EXPECT_EQ(parse_bench({"--preset", "tiny", "--out", "layer.json", "--trace", dir}).trace_dir, dir);
}

// Two ranks, experts 0-1 on rank 0 and 2-3 on rank 1, top-2, H = I = 128, one shared expert.
//   rank 0: token 0 -> experts 0, 2; token 1 -> expert 1 (its second route masked)
//   rank 1: token 0 -> experts 3, 0
Problem small_problem(Recipe recipe) {
  Problem p;
  p.num_ranks = 2;
  p.num_experts = 4;
  p.top_k = 2;
  p.hidden = 128;
  p.intermediate = 128;
  p.num_shared_experts = 1;
  p.max_tokens_per_rank = 2;
  p.recipe = recipe;
  return p;
}

std::vector<RankBatch> small_batches() {
  std::vector<RankBatch> batches(2);
  batches[0].num_tokens = 2;
  batches[0].topk_idx = {0, 2, 1, -1};
  batches[1].num_tokens = 1;
  batches[1].topk_idx = {3, 0};
  return batches;
}

TEST(BenchWork, CountsRoutesFlopsAndBytesByHand) {
  const std::vector<RankWork> work = layer_work(small_problem(Recipe::fp8), small_batches());
  ASSERT_EQ(work.size(), 2u);
  const RankWork& r0 = work[0];
  const RankWork& r1 = work[1];
  EXPECT_EQ(r0.tokens, 2);
  EXPECT_EQ(r0.routes_sent, 3);
  EXPECT_EQ(r0.routes_received, 3);  // experts 0, 1 from itself, expert 0 from rank 1
  EXPECT_EQ(r0.remote_sent, 1);      // expert 2
  EXPECT_EQ(r0.remote_received, 1);  // rank 1's route to expert 0
  EXPECT_EQ(r0.active_experts, 2);
  EXPECT_EQ(r1.tokens, 1);
  EXPECT_EQ(r1.routes_sent, 2);
  EXPECT_EQ(r1.routes_received, 2);  // expert 2 from rank 0, expert 3 from itself
  EXPECT_EQ(r1.remote_sent, 1);
  EXPECT_EQ(r1.remote_received, 1);
  EXPECT_EQ(r1.active_experts, 2);

  // 2 * 3 * I * H = 98304 FLOPs per routed row and per token through the shared expert.
  EXPECT_DOUBLE_EQ(r0.flops, 98304.0 * 3 + 98304.0 * 2);
  EXPECT_DOUBLE_EQ(r1.flops, 98304.0 * 2 + 98304.0 * 1);

  // One fp8 expert: 3 * 128 * 128 code bytes + (4 + 2) FP32 scales = 49176 bytes. An fp8 row of 128:
  // 128 codes + one FP32 scale = 132 bytes; a BF16 row of 128: 256 bytes.
  //   rank 0: 2 routed experts + the shared one, x (2 rows), L1 and L2 pools (3 routes, written and read),
  //           the shared L2 input (2 rows, written and read), combine slots (3 routes + 2 shared rows, written
  //           and read), y (2 rows)
  EXPECT_DOUBLE_EQ(r0.hbm_bytes, 3 * 49176.0 + 2 * 132 + 2 * 3 * (132 + 132) + 2 * 2 * 132 + 2 * 5 * 256 + 2 * 256);
  EXPECT_DOUBLE_EQ(r1.hbm_bytes, 3 * 49176.0 + 1 * 132 + 2 * 2 * (132 + 132) + 2 * 1 * 132 + 2 * 3 * 256 + 256);
  // One token row out and one BF16 result back, each way.
  EXPECT_DOUBLE_EQ(r0.link_out_bytes, 132 + 256);
  EXPECT_DOUBLE_EQ(r0.link_in_bytes, 132 + 256);
  EXPECT_DOUBLE_EQ(r1.link_out_bytes, 132 + 256);
}

TEST(BenchWork, Fp8Fp4WeightsAreHalfABytePlusAShiftPer32) {
  const std::vector<RankWork> fp8 = layer_work(small_problem(Recipe::fp8), small_batches());
  const std::vector<RankWork> fp4 = layer_work(small_problem(Recipe::fp8_fp4), small_batches());
  // One fp8_fp4 expert: 3 * 128 * 128 * (1/2 + 1/32) bytes + the same 6 FP32 block scales = 26136,
  // against fp8's 49176; its activation rows are fp8's.
  EXPECT_DOUBLE_EQ(fp4[0].hbm_bytes, fp8[0].hbm_bytes - 3 * (49176.0 - 26136.0));
  EXPECT_DOUBLE_EQ(fp4[0].link_out_bytes, fp8[0].link_out_bytes);
}

TEST(BenchWork, Bf16RowsHaveNoScales) {
  const std::vector<RankWork> work = layer_work(small_problem(Recipe::bf16), small_batches());
  // One bf16 expert: 3 * 128 * 128 * 2 bytes; rows of 128 are 256 bytes.
  EXPECT_DOUBLE_EQ(work[0].hbm_bytes, 3 * 98304.0 + 2 * 256 + 2 * 3 * 512 + 2 * 2 * 256 + 2 * 5 * 256 + 2 * 256);
  EXPECT_DOUBLE_EQ(work[0].link_out_bytes, 256 + 256);
}

TEST(BenchFloors, BusiestGpuAtTheCeilings) {
  const Problem p = small_problem(Recipe::fp8);
  const std::vector<RankWork> work = layer_work(p, small_batches());
  const Ceilings ceilings{1000.0, 100.0, 50.0, 100.0};  // GB/s, TFLOP/s, TFLOP/s, GB/s
  const Floors floors = layer_floors(p, work, ceilings, false);
  EXPECT_DOUBLE_EQ(floors.compute_us, 491520.0 / 100e12 * 1e6);  // rank 0's FLOPs at 100 TFLOP/s
  EXPECT_DOUBLE_EQ(floors.hbm_us, 152976.0 / 1000e9 * 1e6);      // rank 0's bytes at 1000 GB/s
  EXPECT_DOUBLE_EQ(floors.nvlink_us, 388.0 / 100e9 * 1e6);
  EXPECT_DOUBLE_EQ(floors.largest_us(), floors.hbm_us);

  Problem bf16 = small_problem(Recipe::bf16);
  EXPECT_DOUBLE_EQ(layer_floors(bf16, layer_work(bf16, small_batches()), ceilings, false).compute_us,
                   491520.0 / 50e12 * 1e6);
}

TEST(BenchFloors, EmulatedRanksShareOneGpuAndHaveNoNvlinkFloor) {
  const Problem p = small_problem(Recipe::fp8);
  const std::vector<RankWork> work = layer_work(p, small_batches());
  const Ceilings ceilings{1000.0, 100.0, 50.0, std::nan("")};
  const Floors floors = layer_floors(p, work, ceilings, true);
  EXPECT_DOUBLE_EQ(floors.compute_us, (491520.0 + 294912.0) / 100e12 * 1e6);
  EXPECT_DOUBLE_EQ(floors.hbm_us, (152976.0 + 150772.0) / 1000e9 * 1e6);
  EXPECT_TRUE(std::isnan(floors.nvlink_us));
  EXPECT_DOUBLE_EQ(floors.largest_us(), floors.hbm_us);
}

TEST(BenchFloors, OneRankMovesNothingOverNvlink) {
  Problem p = small_problem(Recipe::fp8);
  p.num_ranks = 1;
  RankBatch batch;
  batch.num_tokens = 2;
  batch.topk_idx = {0, 3, 1, 2};
  const std::vector<RankWork> work = layer_work(p, {batch});
  EXPECT_EQ(work[0].remote_sent, 0);
  EXPECT_EQ(work[0].active_experts, 4);
  const Floors floors = layer_floors(p, work, Ceilings{1000.0, 100.0, 50.0, std::nan("")}, false);
  EXPECT_EQ(floors.nvlink_us, 0.0);
}

TEST(BenchRates, PerGpuOverTheTime) {
  const std::vector<RankWork> work = layer_work(small_problem(Recipe::fp8), small_batches());
  const Rates rates = layer_rates(work, 2.0, false);
  // (491520 + 294912) FLOPs over 2 GPUs in 2 us.
  EXPECT_DOUBLE_EQ(rates.tflops, 786432.0 / 2 / 2e-6 / 1e12);
  EXPECT_DOUBLE_EQ(rates.hbm_gbps, (152976.0 + 150772.0) / 2 / 2e-6 / 1e9);
  EXPECT_DOUBLE_EQ(rates.nvlink_gbps, 2 * 388.0 / 2 / 2e-6 / 1e9);
  const Rates emulated = layer_rates(work, 2.0, true);
  EXPECT_DOUBLE_EQ(emulated.tflops, 786432.0 / 2e-6 / 1e12);
  EXPECT_TRUE(std::isnan(emulated.nvlink_gbps));
  EXPECT_TRUE(std::isnan(layer_rates(work, std::nan(""), false).tflops));  // no baseline time
}

TEST(BenchRun, WithoutAGpuSaysSo) {
  if (count_hopper_gpus_in_child() > 0) GTEST_SKIP() << "a Hopper GPU is present";
  const BenchOptions options = parse_bench({"--preset", "tiny", "--tokens", "1", "--out", "layer.json"});
  try {
    run_bench(options);
    FAIL() << "expected megamoe::Error";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "bench: needs a Hopper GPU; found none");
  }
}

}  // namespace
}  // namespace megamoe::bench
