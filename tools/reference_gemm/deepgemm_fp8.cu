// The public FP8 kernel issue 30 measures ours against: DeepGEMM's SM90 grouped contiguous GEMM
// (sm90_fp8_gemm_1d2d_impl: 1x128 token scales, 128x128 weight-block scales, FP32 promotion per K
// block, the fp8 recipe's math) at DeepSeek-V3's L1 and L2 shapes, its launches and the same-shape
// cuBLASLt plain FP8 product taking turns (bench/common's interleaved_us), as megamoe_gemm_bench
// times ours. Built only when MEGAMOE_DEEPGEMM_DIR names a DeepGEMM source tree (its
// deep_gemm/include and third-party/cutlass/include), with DeepGEMM's own JIT flags.
//   megamoe_reference_deepgemm [--experts 32,128] [--tokens 1024,4096] [--repeats N] [--energy S] [--out FILE]
// Uniform routing (every expert the same rows, a multiple of 128). Each config is its heuristics'
// choice (128 x 192, four stages, weights multicast to a 2-CTA cluster) or a variant of it; each is
// checked on sampled outputs against the recipe computed on the host before it is timed.
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common/ceilings.h"
#include "bench/common/energy.h"
#include "bench/common/report.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace {

using megamoe::bench::cuda_ok;

void driver_ok(CUresult status, const char* what) {
  megamoe::require(status == CUDA_SUCCESS, what, "failed with CUresult ", static_cast<int>(status));
}

CUtensorMap tensor_map_2d(void* base, CUtensorMapDataType type, uint32_t element_bytes, uint64_t inner, uint64_t outer,
                          uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * element_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  driver_ok(cuTensorMapEncodeTiled(&map, type, 2, base, dims, strides, box, element_strides,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            what);
  return map;
}

// The operands of one shape: tokens [m][k] E4M3 with scales [k/128][m] (MN-major, as its TMA reads
// them), weights [groups][n][k] E4M3 with scales [groups][n/128][k/128], the output [m][n] BF16 and
// each row's group.
struct Operands {
  uint32_t groups, rows_per_group, n, k, m;
  uint8_t* tokens = nullptr;
  uint8_t* weights = nullptr;
  float* token_scales = nullptr;
  float* weight_scales = nullptr;
  __nv_bfloat16* out = nullptr;
  int* row_groups = nullptr;
  std::vector<float> host_token_scales, host_weight_scales;

  Operands(uint32_t groups_, uint32_t rows_per_group_, uint32_t n_, uint32_t k_, cudaStream_t stream)
      : groups(groups_), rows_per_group(rows_per_group_), n(n_), k(k_), m(groups_ * rows_per_group_) {
    cuda_ok(cudaMalloc(&tokens, uint64_t{m} * k), "tokens");
    cuda_ok(cudaMalloc(&weights, uint64_t{groups} * n * k), "weights");
    cuda_ok(cudaMalloc(&token_scales, uint64_t{m} * (k / 128) * 4), "token scales");
    cuda_ok(cudaMalloc(&weight_scales, uint64_t{groups} * (n / 128) * (k / 128) * 4), "weight scales");
    cuda_ok(cudaMalloc(&out, uint64_t{m} * n * 2), "output");
    cuda_ok(cudaMalloc(&row_groups, uint64_t{m} * 4), "row groups");
    megamoe::bench::fill_random(tokens, uint64_t{m} * k, false, 0.0f, 1, stream);
    megamoe::bench::fill_random(weights, uint64_t{groups} * n * k, false, 0.0f, 2, stream);
    // Scales of about 1/1000 keep sums of 7168 products of E4M3 values (up to 448^2) well inside BF16.
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> scale(0.5e-3f, 1.5e-3f);
    host_token_scales.resize(uint64_t{m} * (k / 128));
    host_weight_scales.resize(uint64_t{groups} * (n / 128) * (k / 128));
    for (float& s : host_token_scales) s = scale(rng);
    for (float& s : host_weight_scales) s = scale(rng);
    std::vector<int> host_row_groups(m);
    for (uint32_t row = 0; row < m; ++row) host_row_groups[row] = static_cast<int>(row / rows_per_group);
    cuda_ok(cudaMemcpy(token_scales, host_token_scales.data(), host_token_scales.size() * 4, cudaMemcpyHostToDevice),
            "token scales");
    cuda_ok(cudaMemcpy(weight_scales, host_weight_scales.data(), host_weight_scales.size() * 4, cudaMemcpyHostToDevice),
            "weight scales");
    cuda_ok(cudaMemcpy(row_groups, host_row_groups.data(), uint64_t{m} * 4, cudaMemcpyHostToDevice), "row groups");
    cuda_ok(cudaStreamSynchronize(stream), "operands");
  }
  ~Operands() {
    cudaFree(tokens);
    cudaFree(weights);
    cudaFree(token_scales);
    cudaFree(weight_scales);
    cudaFree(out);
    cudaFree(row_groups);
  }
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;

  // The largest error of `samples` outputs against the recipe computed here, relative to the output's
  // expected size (the sum of its K blocks' magnitudes over sqrt(K blocks)).
  double worst_error(int samples) const {
    std::vector<uint8_t> token_row(k), weight_row(k);
    std::mt19937 pick(7);
    double worst = 0;
    for (int s = 0; s < samples; ++s) {
      const uint32_t row = pick() % m, col = pick() % n, group = row / rows_per_group;
      cuda_ok(cudaMemcpy(token_row.data(), tokens + uint64_t{row} * k, k, cudaMemcpyDeviceToHost), "token row");
      cuda_ok(cudaMemcpy(weight_row.data(), weights + (uint64_t{group} * n + col) * k, k, cudaMemcpyDeviceToHost),
              "weight row");
      double sum = 0, magnitude = 0;
      for (uint32_t kb = 0; kb < k / 128; ++kb) {
        double part = 0;
        for (uint32_t i = kb * 128; i < kb * 128 + 128; ++i)
          part += double(megamoe::e4m3_to_float(token_row[i])) * megamoe::e4m3_to_float(weight_row[i]);
        const double scaled = part * host_token_scales[uint64_t{kb} * m + row] *
                              host_weight_scales[(uint64_t{group} * (n / 128) + col / 128) * (k / 128) + kb];
        sum += scaled;
        magnitude += std::fabs(scaled);
      }
      __nv_bfloat16 result;
      cuda_ok(cudaMemcpy(&result, out + uint64_t{row} * n + col, 2, cudaMemcpyDeviceToHost), "output");
      const double expected_size = magnitude / std::sqrt(double(k / 128)) + 1e-30;
      worst = std::max(worst, std::fabs(__bfloat162float(result) - sum) / expected_size);
    }
    return worst;
  }
};

// One instantiation of the kernel: weight rows per tile, stages, CTAs sharing the weight tile.
template <uint32_t kN, uint32_t kK, uint32_t kBlockN, uint32_t kStages, uint32_t kMulticast>
struct Config {
  static constexpr uint32_t kBlockM = 128, kBlockK = 128, kMathThreads = 256, kTmaThreads = 128, kSms = 132;
  static constexpr uint32_t kOutSwizzle = (kBlockN * 2) % 128 == 0 ? 128 : (kBlockN * 2) % 64 == 0 ? 64 : 32;
  // Its heuristics' shared-memory plan: output tile, barriers, the weight scales of all K blocks
  // (two per K block when a tile spans two 128-row scale blocks), and the stages.
  static constexpr uint32_t kSmemBytes =
      (kBlockM * kBlockN * 2 + 1023) / 1024 * 1024 + 16 * 8 * 2 + ((kK / 128) * (128 % kBlockN == 0 ? 1 : 2) * 4 + 7) / 8 * 8 +
      kStages * (kBlockM * kBlockK + kBlockN * kBlockK + (kBlockM * 4 + 127) / 128 * 128);
  // The contiguous layout reads no group count: 1.
  static auto kernel() {
    return &deep_gemm::sm90_fp8_gemm_1d2d_impl<cute::UMMA::Major::K, 0, kN, kK, 1, kBlockM, kBlockN, kBlockK, 128, 128,
                                               kOutSwizzle, kStages, kTmaThreads, kMathThreads, kMulticast, false, kSms,
                                               deep_gemm::GemmType::MGroupedContiguous, cutlass::bfloat16_t>;
  }

  static std::string name() {
    return "128x" + std::to_string(kBlockN) + (kMulticast > 1 ? " multicast" : "");
  }
  static std::function<void()> launcher(const Operands& o, cudaStream_t stream) {
    cuda_ok(cudaFuncSetAttribute(kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem attribute");
    const CUtensorMap tokens = tensor_map_2d(o.tokens, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kK, o.m, kBlockK, kBlockM,
                                             CU_TENSOR_MAP_SWIZZLE_128B, "tokens map");
    const CUtensorMap weights = tensor_map_2d(o.weights, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kK, uint64_t{kN} * o.groups,
                                              kBlockK, kBlockN, CU_TENSOR_MAP_SWIZZLE_128B, "weights map");
    const CUtensorMap out = tensor_map_2d(
        o.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kN, o.m, kOutSwizzle / 2, kBlockM,
        kOutSwizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : kOutSwizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B,
        "output map");
    const CUtensorMap token_scales = tensor_map_2d(o.token_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, o.m, kK / 128,
                                                   kBlockM, 1, CU_TENSOR_MAP_SWIZZLE_NONE, "token scales map");
    float* weight_scales = o.weight_scales;
    int* row_groups = o.row_groups;
    const uint32_t m = o.m;
    return [=] {
      cudaLaunchAttribute cluster{};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = kMulticast;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(kSms);
      config.blockDim = dim3(kTmaThreads + kMathThreads);
      config.dynamicSmemBytes = kSmemBytes;
      config.stream = stream;
      config.attrs = &cluster;
      config.numAttrs = 1;
      cuda_ok(cudaLaunchKernelEx(&config, kernel(), weight_scales, row_groups, m, kN, kK, tokens, weights, out,
                                 token_scales),
              "DeepGEMM launch");
    };
  }
};

struct Options {
  std::vector<uint32_t> experts{32};
  std::vector<uint32_t> tokens{1024, 4096};
  int repeats = 10;
  double energy_seconds = 0;
  std::string out = "bench/results/reference_gemm-deepgemm-fp8.json";
};

std::vector<uint32_t> parse_list(const std::string& text) {
  std::vector<uint32_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) values.push_back(static_cast<uint32_t>(std::stoul(item)));
  return values;
}

// Every config of one shape and the same-shape plain FP8 product, taking turns; one row per config.
template <uint32_t kN, uint32_t kK, class... Configs>
void run_shape(const char* stage, uint32_t experts, uint32_t rows, const Options& options,
               megamoe::bench::Report& report) {
  megamoe::require(rows % 128 == 0, "--tokens", "takes multiples of 128 (the contiguous layout's alignment), got ", rows);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  {
    const Operands operands(experts, rows, kN, kK, stream);
    std::vector<std::function<void()>> works{Configs::launcher(operands, stream)...};
    const std::vector<std::string> names{Configs::name()...};
    std::vector<double> errors;
    for (const auto& work : works) {
      cuda_ok(cudaMemset(operands.out, 0, uint64_t{operands.m} * kN * 2), "clear output");
      work();
      cuda_ok(cudaStreamSynchronize(stream), "checked launch");
      errors.push_back(operands.worst_error(48));
      megamoe::require(errors.back() < 2e-2, "DeepGEMM", names[errors.size() - 1], " at ", stage, " disagrees with the recipe: ",
                       "normalized error ", errors.back());
    }
    const megamoe::bench::DenseGemm dense(operands.m, kN, kK, true);
    works.push_back(dense.launcher(operands.m, stream));
    const std::vector<double> us = megamoe::bench::interleaved_us(works, stream, options.repeats, 2);
    std::vector<megamoe::bench::LaunchEnergy> energies;
    if (options.energy_seconds > 0) {
      const megamoe::bench::EnergyCounter counter;
      megamoe::require(counter.available(), "--energy", "needs NVML's energy counter (libnvidia-ml.so.1)");
      energies = megamoe::bench::energy_per_launch(counter, works, us, stream, options.energy_seconds, 2);
    }
    const double flops = 2.0 * operands.m * kN * kK;
    const double dense_tflops = flops / (us.back() * 1e-6) / 1e12;
    for (size_t c = 0; c < names.size(); ++c) {
      const double tflops = flops / (us[c] * 1e-6) / 1e12;
      megamoe::bench::Row row{{"stage", std::string(stage)},
                              {"experts", static_cast<long long>(experts)},
                              {"tokens_per_expert", static_cast<long long>(rows)},
                              {"routing", std::string("uniform")},
                              {"recipe", std::string("fp8")},
                              {"implementation", std::string("deepgemm sm90_fp8_gemm_1d2d_impl")},
                              {"config", names[c]},
                              {"us", us[c]},
                              {"tflops", tflops},
                              {"dense_same_shape_tflops", dense_tflops},
                              {"tflops_vs_dense_same_shape", tflops / dense_tflops},
                              {"worst_error", errors[c]}};
      if (!energies.empty()) {
        row.emplace_back("joules", energies[c].joules);
        row.emplace_back("watts", energies[c].watts);
        row.emplace_back("joules_vs_dense_same_shape", energies[c].joules / energies.back().joules);
      }
      report.rows.push_back(row);
    }
  }
  cuda_ok(cudaStreamDestroy(stream), "stream");
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--experts" && has_value) options.experts = parse_list(argv[++i]);
    else if (arg == "--tokens" && has_value) options.tokens = parse_list(argv[++i]);
    else if (arg == "--repeats" && has_value) options.repeats = std::stoi(argv[++i]);
    else if (arg == "--energy" && has_value) options.energy_seconds = std::stod(argv[++i]);
    else if (arg == "--out" && has_value) options.out = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: megamoe_reference_deepgemm [--experts 32,128] [--tokens 1024,4096] [--repeats N] "
                   "[--energy SECONDS] [--out FILE]\n");
      return 2;
    }
  }
  try {
    driver_ok(cuInit(0), "cuInit");
    megamoe::bench::Report report;
    report.benchmark = "reference_gemm";
    report.command = megamoe::bench::command_line(argc, argv);
    for (uint32_t experts : options.experts)
      for (uint32_t rows : options.tokens) {
        // DeepSeek-V3: L1 (gate and up, 2 x 2048, of 7168) and L2 (7168 of 2048).
        run_shape<4096, 7168, Config<4096, 7168, 192, 4, 2>, Config<4096, 7168, 192, 4, 1>,
                  Config<4096, 7168, 128, 5, 2>, Config<4096, 7168, 128, 5, 1>>("l1", experts, rows, options, report);
        run_shape<7168, 2048, Config<7168, 2048, 192, 4, 2>, Config<7168, 2048, 192, 4, 1>,
                  Config<7168, 2048, 128, 5, 2>, Config<7168, 2048, 128, 5, 1>>("l2", experts, rows, options, report);
      }
    megamoe::bench::write_report(report, options.out);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  return 0;
}
