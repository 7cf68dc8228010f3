// Grouped GEMM benchmark at DeepSeek-V3 expert shapes (L1: N 4096 x K 7168 with the SwiGLU epilogue;
// L2: N 7168 x K 2048 with the store epilogue), against ceilings measured in the same run: dense
// cuBLASLt FP8/BF16 TFLOP/s and the HBM copy rate (for weight bytes read per second). fp8_fp4 is
// compared with dense FP8 (its wgmmas are FP8 ones) and counts its packed weight bytes; its prefill
// rows time the expansion of the weights into E4M3 scratch and fp8's kernel (gemm.h). Decode rows
// are timed from a flushed L2 with the host's launch work hidden (us), and also from a warm L2 with
// it included (us_warm), and without the split-K workspace (us_unsplit, split_speedup). Prefill rows
// (tokens_on_m tiles) also time a dense cuBLASLt product of their own shape (all rows x N x K),
// launches of the two taking turns so that both see one power state (interleaved_us;
// dense_same_shape_tflops, tflops_vs_dense_same_shape),
// and for the scaled recipes the same FP8 product with the fp8 recipe's block scales, which
// cuBLASLt promotes as our kernel does (dense_blocks_same_shape_tflops, tflops_vs_dense_blocks_same_shape).
// Decode rows also time one launch that only reads as many bytes as the row's weights, from the same
// buffer and a flushed L2 (same_bytes_read_us, weight_gbps_vs_same_bytes_read): the launch, ramp-up
// and tail costs that no kernel streaming those bytes avoids, which the 1 GiB copy rate leaves out;
// and one launch that streams the row's weight tiles as our decode producer does, with no math and
// the tiles' K blocks split evenly over the SMs (tile_stream_us, weight_gbps_vs_tile_stream).
// With --energy S, prefill rows also read the board's energy counter over S seconds of back-to-back
// launches of each (two rounds, taking turns): joules per launch and average watts of the row and of
// its products (joules_vs_dense_same_shape, ...): at the board's power cap time follows energy.
//   megamoe_gemm_bench [--out FILE.json] [--recipes fp8,fp8_fp4,bf16] [--experts 32,128] [--tokens 1,4,...]
//                      [--routing uniform,skewed,random] [--tile-rows N] [--energy SECONDS]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common/ceilings.h"
#include "bench/common/energy.h"
#include "bench/common/report.h"
#include "kernels/gemm/gemm.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe::bench {
namespace {

constexpr uint32_t kHidden = 7168, kIntermediate = 2048;

template <typename T>
T* device_alloc(uint64_t count) {
  T* pointer = nullptr;
  cuda_ok(cudaMalloc(&pointer, std::max<uint64_t>(count, 1) * sizeof(T)), "cudaMalloc");
  return pointer;
}

std::vector<std::string> parse_names(const std::string& text) {
  std::vector<std::string> names;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) names.push_back(item);
  return names;
}

std::vector<uint32_t> parse_list(const std::string& text) {
  std::vector<uint32_t> values;
  for (const std::string& item : parse_names(text)) values.push_back(static_cast<uint32_t>(std::stoul(item)));
  return values;
}

// Rows per expert: uniform; skewed (weights 1/(e+1)^1.2, same total); or random (each of the
// experts x tokens routes picks an expert uniformly at random, as the layer's synthetic router does:
// counts spread around the mean, and some groups end in a short token tile).
std::vector<uint32_t> rows_per_expert(uint32_t experts, uint32_t tokens, const std::string& routing) {
  std::vector<uint32_t> rows(experts, tokens);
  const uint64_t total = uint64_t{experts} * tokens;
  if (routing == "random") {
    std::fill(rows.begin(), rows.end(), 0u);
    std::mt19937_64 rng(experts * 1000003ull + tokens);
    std::uniform_int_distribution<uint32_t> expert(0, experts - 1);
    for (uint64_t route = 0; route < total; ++route) ++rows[expert(rng)];
    return rows;
  }
  if (routing != "skewed") return rows;
  std::vector<double> weight(experts);
  double sum = 0;
  for (uint32_t e = 0; e < experts; ++e) sum += weight[e] = std::pow(e + 1.0, -1.2);
  uint64_t assigned = 0;
  for (uint32_t e = 0; e < experts; ++e) assigned += rows[e] = static_cast<uint32_t>(total * weight[e] / sum);
  rows[0] += static_cast<uint32_t>(total - assigned);
  return rows;
}

struct StageShape {
  const char* name;
  uint32_t n_out, k;
};

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  using namespace megamoe;
  using namespace megamoe::bench;
  std::string out = "gemm-bench.json";
  std::vector<std::string> recipes = {"fp8", "fp8_fp4", "bf16"};
  std::vector<std::string> routings = {"uniform", "skewed"};
  std::vector<uint32_t> expert_counts = {32, 128};
  std::vector<uint32_t> token_counts = {1, 4, 16, 64, 256, 1024, 4096};
  uint32_t tile_rows = 0;  // the rows per expert the tile heuristic is told (0: the row's own)
  double energy_seconds = 0;  // prefill rows: seconds of back-to-back launches per energy reading (0: none)
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--out" && has_value) out = argv[++i];
    else if (arg == "--experts" && has_value) expert_counts = parse_list(argv[++i]);
    else if (arg == "--tokens" && has_value) token_counts = parse_list(argv[++i]);
    else if (arg == "--tile-rows" && has_value) tile_rows = static_cast<uint32_t>(std::stoul(argv[++i]));
    else if (arg == "--recipes" && has_value) recipes = parse_names(argv[++i]);
    else if (arg == "--routing" && has_value) routings = parse_names(argv[++i]);
    else if (arg == "--energy" && has_value) energy_seconds = std::stod(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--recipes fp8,fp8_fp4,bf16] [--experts 32,128] [--tokens 1,4,...] "
                   "[--routing uniform,skewed,random] [--tile-rows N] [--energy SECONDS]\n",
                   argv[0]);
      return 2;
    }
  }
  for (const std::string& routing : routings)
    if (routing != "uniform" && routing != "skewed" && routing != "random") {
      std::fprintf(stderr, "--routing takes uniform, skewed and random, got %s\n", routing.c_str());
      return 2;
    }
  try {
    Report report;
    report.benchmark = "gemm";
    report.command = command_line(argc, argv);
    report.ceilings["hbm_copy_gbps"] = hbm_copy_gbps();
    report.ceilings["fp8_dense_tflops"] = fp8_dense_tflops();
    report.ceilings["bf16_dense_tflops"] = bf16_dense_tflops();
    std::printf("ceilings: HBM copy %.0f GB/s, dense FP8 %.0f TFLOP/s, dense BF16 %.0f TFLOP/s\n",
                report.ceilings["hbm_copy_gbps"], report.ceilings["fp8_dense_tflops"],
                report.ceilings["bf16_dense_tflops"]);

    int sms = 0;
    cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "multiprocessor count");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    const L2Flush flush;
    const EnergyCounter energy;
    require(energy_seconds <= 0 || energy.available(), "--energy", "needs NVML's energy counter (libnvidia-ml.so.1)");
    const uint32_t max_experts = *std::max_element(expert_counts.begin(), expert_counts.end());
    const uint32_t max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
    const uint64_t max_rows = align_up(uint64_t{max_experts} * max_tokens + 256, 256);
    constexpr uint32_t kCombineTokens = 65536;  // L2 rows reuse these slots: timing only

    for (const std::string& recipe_name : recipes) {
      Recipe recipe;
      require(parse_recipe(recipe_name, recipe), "--recipes", "takes fp8, fp8_fp4 and bf16");
      const bool scaled = recipe != Recipe::bf16;
      const bool packed = recipe == Recipe::fp8_fp4;
      const uint32_t element_bytes = scaled ? 1 : 2;  // activations, and fp8 or bf16 weights
      const double weight_element_bytes = packed ? 0.5 : element_bytes;
      const double dense = report.ceilings[scaled ? "fp8_dense_tflops" : "bf16_dense_tflops"];
      for (const StageShape stage : {StageShape{"l1", 2 * kIntermediate, kHidden}, StageShape{"l2", kHidden, kIntermediate}}) {
        const uint64_t weight_elements = uint64_t{max_experts} * stage.n_out * stage.k;
        const uint64_t weight_storage = packed ? weight_elements / 2 : weight_elements * element_bytes;
        uint8_t* weights = device_alloc<uint8_t>(weight_storage);
        uint8_t* weight_shifts = packed ? device_alloc<uint8_t>(weight_elements / 32) : nullptr;
        if (packed) cuda_ok(cudaMemset(weight_shifts, 1, weight_elements / 32), "cudaMemset");
        // fp8_fp4 prefill launches expand the weights once into this scratch (gemm.h).
        uint8_t* expanded_weights =
            packed ? device_alloc<uint8_t>(gemm::expanded_weight_bytes(max_experts, stage.n_out, stage.k)) : nullptr;
        float* weight_scales = device_alloc<float>(uint64_t{max_experts} * (stage.n_out / 64) * (stage.k / 128));
        uint8_t* acts = device_alloc<uint8_t>(max_rows * stage.k * element_bytes);
        float* act_scales = device_alloc<float>(max_rows * (stage.k / 128));
        fill_random(weights, packed ? weight_storage : weight_elements, !scaled, 0.05f, 7, stream);
        fill_random(acts, max_rows * stage.k, !scaled, 0.05f, 11, stream);
        fill_value(weight_scales, uint64_t{max_experts} * (stage.n_out / 64) * (stage.k / 128), 1.0f / 4096.0f,
                   stream);
        fill_value(act_scales, max_rows * (stage.k / 128), 1.0f / 448.0f, stream);
        float* row_weights = device_alloc<float>(max_rows);
        fill_value(row_weights, max_rows, 0.5f, stream);
        // Outputs: the L2 pool for L1; combine slots for L2 (sources wrap around kCombineTokens).
        uint8_t* l1_out = stage.n_out == 2 * kIntermediate ? device_alloc<uint8_t>(max_rows * kIntermediate * element_bytes)
                                                           : nullptr;
        float* l1_out_scales = l1_out ? device_alloc<float>(max_rows * (kIntermediate / 128)) : nullptr;
        uint16_t* combine = l1_out ? nullptr : device_alloc<uint16_t>(uint64_t{kCombineTokens} * 2 * kHidden);
        std::vector<PoolSource> sources(max_rows);
        for (uint64_t row = 0; row < max_rows; ++row) sources[row] = {0, static_cast<uint32_t>(row % kCombineTokens)};
        PoolSource* d_sources = device_alloc<PoolSource>(max_rows);
        cuda_ok(cudaMemcpy(d_sources, sources.data(), max_rows * sizeof(PoolSource), cudaMemcpyHostToDevice), "copy");
        ControlBlock* control = device_alloc<ControlBlock>(1);
        cuda_ok(cudaMemset(control, 0, sizeof(ControlBlock)), "cudaMemset");
        // The layer's split-K workspace (decode launches with too few tiles for the grid split K).
        uint8_t* split_workspace = device_alloc<uint8_t>(kGemmSplitWorkspaceBytes);
        cuda_ok(cudaMemset(split_workspace, 0, kGemmSplitWorkspaceBytes), "cudaMemset");
        uint32_t* prefix = device_alloc<uint32_t>(max_experts + 1);
        std::unique_ptr<DenseGemm> same_shape;         // made at the stage's first prefill row
        std::unique_ptr<DenseGemm> same_shape_blocks;  // the same, FP8 with the fp8 recipe's block scales

        for (uint32_t experts : expert_counts) {
          for (uint32_t tokens : token_counts) {
            for (const std::string& routing : routings) {
              const std::vector<uint32_t> rows = rows_per_expert(experts, tokens, routing);
              std::vector<uint32_t> host_prefix(experts + 1, 0);
              uint32_t active = 0;
              for (uint32_t e = 0; e < experts; ++e) {
                host_prefix[e + 1] = host_prefix[e] + rows[e];
                active += rows[e] > 0;
              }
              cuda_ok(cudaMemcpy(prefix, host_prefix.data(), host_prefix.size() * 4, cudaMemcpyHostToDevice), "copy");
              gemm::GemmOperands operands;
              operands.recipe = recipe;
              operands.num_groups = experts;
              operands.n_out = stage.n_out;
              operands.k = stage.k;
              operands.weights = weights;
              operands.weight_scales = scaled ? weight_scales : nullptr;
              operands.weight_shifts = weight_shifts;
              operands.expanded_weights = expanded_weights;
              operands.acts = acts;
              operands.act_scales = scaled ? act_scales : nullptr;
              operands.act_rows = static_cast<uint32_t>(max_rows);
              operands.groups = gemm::GroupRows{prefix, experts, 0};
              operands.tile = gemm::choose_tile(tile_rows > 0 ? tile_rows : tokens, experts, recipe);
              operands.timeout_ns = 10'000'000'000ull;
              operands.control = control;
              const uint64_t total_rows = host_prefix.back();
              const int repeats = total_rows > 100000 ? 5 : 20;
              const auto run = [&] {
                    if (l1_out) {
                      gemm::grouped_gemm_swiglu(operands,
                                                gemm::SwigluOutput{l1_out, l1_out_scales, row_weights,
                                                                   static_cast<uint32_t>(max_rows)},
                                                sms, stream);
                    } else {
                      SymmView view{};
                      view.peers[0] = reinterpret_cast<char*>(combine);
                      view.num_ranks = 1;
                      gemm::grouped_gemm_store(operands, gemm::RoutedDestination{view, 0, d_sources, 1, kHidden},
                                               sms, stream);
                    }
                  };
              // Decode tiles stream weights: timed from a flushed L2, with the host's launch preparation
              // hidden behind the flush (time_cold_us), and also as before (us_warm: warm L2, host
              // time included). Also timed without the split-K workspace (tiles never split), as the
              // same-run baseline of split K.
              const gemm::TileShape tile = operands.tile;
              const bool decode = tile.layout == gemm::TileLayout::weights_on_m;
              const double us_unsplit = decode ? time_cold_us(run, stream, flush, repeats, 2) : 0.0;
              if (!decode && !same_shape) same_shape = std::make_unique<DenseGemm>(max_rows, stage.n_out, stage.k, scaled);
              if (!decode && scaled && !same_shape_blocks)
                same_shape_blocks =
                    std::make_unique<DenseGemm>(max_rows, stage.n_out, stage.k, true, DenseScaling::blocks);
              operands.split_workspace = {split_workspace, kGemmSplitWorkspaceBytes};
              double us = 0.0, us_warm = 0.0, same_shape_tflops = 0.0, same_shape_blocks_tflops = 0.0;
              std::vector<LaunchEnergy> energies;  // --energy: the row's launch, then the products
              if (decode) {
                us = time_cold_us(run, stream, flush, repeats, 2);
                us_warm = time_us(run, stream, repeats, 2);
              } else {
                // The row's launches and the same-shape products in turn, in one power state.
                const std::function<void()> blocks =
                    scaled ? same_shape_blocks->launcher(total_rows, stream) : std::function<void()>{};
                std::vector<std::function<void()>> works{run, same_shape->launcher(total_rows, stream)};
                if (blocks) works.push_back(blocks);
                const std::vector<double> medians = interleaved_us(works, stream, repeats, 2);
                us = medians[0];
                same_shape_tflops = same_shape->tflops_at(total_rows, medians[1]);
                if (scaled)
                  same_shape_blocks_tflops = blocks ? same_shape_blocks->tflops_at(total_rows, medians[2]) : std::nan("");
                if (energy_seconds > 0) energies = energy_per_launch(energy, works, medians, stream, energy_seconds, 2);
              }
              operands.split_workspace = {};
              DeviceError recorded{};
              cuda_ok(cudaMemcpy(&recorded, &control->error, sizeof(recorded), cudaMemcpyDeviceToHost), "error record");
              require(recorded.code == kDeviceOk, "grouped GEMM", "recorded a device error during the benchmark");
              const double flops = 2.0 * total_rows * stage.n_out * stage.k;
              const double weight_bytes = double(active) * stage.n_out * stage.k * weight_element_bytes +
                                          (scaled ? active * (stage.n_out / 64.0) * (stage.k / 128) * 4 : 0) +
                                          (packed ? active * stage.n_out * (stage.k / 32.0) : 0);
              const double same_bytes_read_us =
                  decode ? hbm_read_us(weights, std::min<uint64_t>(static_cast<uint64_t>(weight_bytes), weight_storage) / 16 * 16,
                                       stream, flush, repeats, 2)
                         : 0.0;
              // The active experts' weight tiles streamed with no math, split evenly over the grid.
              double tile_stream = 0.0, packed_stream = 0.0;
              if (decode) {
                std::vector<uint32_t> tile_rows;
                for (uint32_t e = 0; e < experts; ++e)
                  for (uint32_t m = 0; rows[e] > 0 && m < stage.n_out / 256; ++m) tile_rows.push_back(e * stage.n_out + 256 * m);
                const uint64_t row_bytes = packed ? stage.k / 2 : uint64_t{stage.k} * element_bytes;
                tile_stream = tile_stream_us(weights, uint64_t{max_experts} * stage.n_out, row_bytes, tile_rows, stream,
                                             flush, repeats, 2);
                // The same tiles in the packed decode stages' boxes: 64 bytes (one K block) per row.
                if (packed)
                  packed_stream = tile_stream_us(weights, uint64_t{max_experts} * stage.n_out, row_bytes, tile_rows,
                                                 stream, flush, repeats, 2, 64);
              }
              const double tflops = flops / (us * 1e-6) / 1e12;
              const double weight_gbps = weight_bytes / (us * 1e-6) / 1e9;
              Row row{{"recipe", recipe_name},
                                     {"stage", std::string(stage.name)},
                                     {"experts", static_cast<long long>(experts)},
                                     {"tokens_per_expert", static_cast<long long>(tokens)},
                                     {"routing", routing},
                                     {"tile", std::string(gemm::to_string(tile.layout)) + "/" + std::to_string(tile.block_n)},
                                     {"us", us},
                                     {"tflops", tflops},
                                     {"weight_gbps", weight_gbps},
                                     {"tflops_vs_dense", tflops / dense},
                                     {"weight_gbps_vs_hbm_copy", weight_gbps / report.ceilings["hbm_copy_gbps"]}};
              if (decode) {
                row.emplace_back("us_unsplit", us_unsplit);
                row.emplace_back("split_speedup", us_unsplit / us);
                row.emplace_back("us_warm", us_warm);
                row.emplace_back("same_bytes_read_us", same_bytes_read_us);
                row.emplace_back("weight_gbps_vs_same_bytes_read", same_bytes_read_us / us);
                row.emplace_back("tile_stream_us", tile_stream);
                row.emplace_back("weight_gbps_vs_tile_stream", tile_stream / us);
                if (packed) {
                  row.emplace_back("packed_stage_stream_us", packed_stream);
                  row.emplace_back("weight_gbps_vs_packed_stage_stream", packed_stream / us);
                }
              } else {
                row.emplace_back("dense_same_shape_tflops", same_shape_tflops);
                row.emplace_back("tflops_vs_dense_same_shape", tflops / same_shape_tflops);
                if (scaled) {
                  row.emplace_back("dense_blocks_same_shape_tflops", same_shape_blocks_tflops);
                  row.emplace_back("tflops_vs_dense_blocks_same_shape", tflops / same_shape_blocks_tflops);
                }
                // Same shape, so the same work: the ratios of joules per launch compare energy per FLOP.
                static const char* const kProducts[] = {"", "dense_same_shape", "dense_blocks_same_shape"};
                for (size_t w = 0; w < energies.size(); ++w) {
                  const std::string prefix = w == 0 ? "" : std::string(kProducts[w]) + "_";
                  row.emplace_back(prefix + "joules", energies[w].joules);
                  row.emplace_back(prefix + "watts", energies[w].watts);
                  if (w > 0) row.emplace_back("joules_vs_" + std::string(kProducts[w]), energies[0].joules / energies[w].joules);
                }
              }
              report.rows.push_back(std::move(row));
              std::fprintf(stderr, "%s %s E=%u t=%u %s: %.1f us, %.0f TFLOP/s, %.0f GB/s of weights", recipe_name.c_str(),
                           stage.name, experts, tokens, routing.c_str(), us, tflops, weight_gbps);
              if (decode)
                std::fprintf(stderr,
                             " (warm L2, host time included: %.1f us; reading the same bytes alone %.1f us, streaming"
                             " the same tiles alone %.1f us)\n",
                             us_warm, same_bytes_read_us, tile_stream);
              else
                std::fprintf(stderr, ", dense at this shape %.0f TFLOP/s (with fp8 block scales %.0f)\n",
                             same_shape_tflops, same_shape_blocks_tflops);
            }
          }
        }
        for (void* pointer : {static_cast<void*>(weights), static_cast<void*>(weight_scales), static_cast<void*>(acts),
                              static_cast<void*>(act_scales), static_cast<void*>(row_weights),
                              static_cast<void*>(l1_out), static_cast<void*>(l1_out_scales),
                              static_cast<void*>(combine), static_cast<void*>(d_sources), static_cast<void*>(control),
                              static_cast<void*>(prefix), static_cast<void*>(weight_shifts),
                              static_cast<void*>(expanded_weights),
                              static_cast<void*>(split_workspace)})
          if (pointer) cudaFree(pointer);
      }
    }
    write_report(report, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megamoe_gemm_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
