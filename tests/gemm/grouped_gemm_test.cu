// The grouped GEMM engine against a CPU reference with the same quantization, on fresh random
// inputs: both epilogues, all three recipes, 1..128 groups, uneven, empty and single-row groups, row
// counts that are not multiples of the token tile, a grid smaller than the tile count, decode tiles
// too few for the grid (split K). Each case launches twice on one workspace (split K's counters and
// the claimed-unit counter, which the first launch must leave at zero for the second); outputs are poisoned before each launch, and every element
// that should be written is checked and every other one must still hold the poison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "device_buffer.h"
#include "gpu_test_util.h"
#include "test_seed.h"
#include "kernels/gemm/fp4_scales.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/split_k.cuh"
#include "megamoe/formats.h"
#include "megamoe/layout.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

constexpr uint64_t kTimeoutNs = 10'000'000'000ull;
// Hopper's FP8 wgmma accumulates with fewer than FP32's mantissa bits (seen: ~2e-4 relative on
// 128-long K blocks), so per-token amax and hence scales match the double reference only this well.
constexpr double kScaleTolerance = 2e-3;
// And where a sum cancels, its error is set by its terms, not by the sum: a K block's sum may be off
// by up to this much times the sum of its terms' magnitudes (the wgmmas keep about 14 bits when
// they align their products, over four k32 steps per K block). A block's amax may then move by as
// much as its channels' activations (seen once: a scale 2.05e-3 off with only the above).
constexpr double kAccumulationError = 1.0 / 4096;

struct Case {
  Recipe recipe;
  std::vector<uint32_t> rows_per_group;
  uint32_t hidden;
  uint32_t intermediate;
  uint32_t expected_rows;  // drives the token tile choice
  int grid;                // 0: all multiprocessors
  uint32_t min_splits = 1;  // split K: the count the case's tiles must get (checked on the host)
};

// fp8_fp4 tiles from kExpandFp4Rows expected rows run on weights expanded into scratch.
bool expands(const Case& c) {
  return gemm::choose_tile(c.expected_rows, static_cast<uint32_t>(c.rows_per_group.size()), c.recipe).expand_weights;
}

std::string describe(const Case& c) {
  std::string text = std::string(to_string(c.recipe)) + " groups=" + std::to_string(c.rows_per_group.size()) +
                     " hidden=" + std::to_string(c.hidden) + " intermediate=" + std::to_string(c.intermediate) +
                     " expected_rows=" + std::to_string(c.expected_rows) + " grid=" + std::to_string(c.grid) +
                     (expands(c) ? " expanded" : "") + " rows=[";
  for (size_t g = 0; g < std::min<size_t>(c.rows_per_group.size(), 12); ++g)
    text += (g ? "," : "") + std::to_string(c.rows_per_group[g]);
  return text + (c.rows_per_group.size() > 12 ? ",...]" : "]");
}

std::mt19937_64 fresh_rng() { return std::mt19937_64(testing::announced_test_seed("grouped_gemm_test")); }

// Random operand matrix in the recipe's storage: E4M3 codes or BF16 bits, plus its dequantized value.
struct Operand {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};

Operand random_operand(Recipe recipe, size_t count, float magnitude, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Operand op;
  op.values.resize(count);
  if (recipe == Recipe::fp8) {
    op.bytes.resize(count);
    for (size_t i = 0; i < count; ++i) {
      op.bytes[i] = float_to_e4m3(uniform(rng) * 448.0f);
      op.values[i] = e4m3_to_float(op.bytes[i]);
    }
  } else {
    op.bytes.resize(count * 2);
    for (size_t i = 0; i < count; ++i) {
      const uint16_t bits = float_to_bf16(uniform(rng) * magnitude);
      std::memcpy(&op.bytes[2 * i], &bits, 2);
      op.values[i] = bf16_to_float(bits);
    }
  }
  return op;
}

std::vector<float> random_scales(size_t count, float base, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> factor(0.5f, 2.0f);
  std::vector<float> scales(count);
  for (float& s : scales) s = base * factor(rng);
  return scales;
}

// A case's weight operand in the recipe's device format, and its values for the reference.
struct CaseWeights {
  std::vector<float> values;        // [groups][n_out][k], dequantized except for `block_scales`
  std::vector<float> block_scales;  // fp8: [groups][n_out / 64][k / 128], applied per K block; else empty
  DeviceBuffer<uint8_t> bytes;      // E4M3 codes, packed E2M1 pairs (prepared, fp4_scales.h) or BF16
  DeviceBuffer<float> device_scales;  // the kernel's weight_scales (fp8: block_scales; fp8_fp4: derived)
  DeviceBuffer<uint8_t> shifts;       // fp8_fp4: derived from the UE8M0 scales
  uint32_t n_out = 0, k_blocks = 0;

  double factor(uint32_t group, uint32_t row, uint32_t kb) const {
    return block_scales.empty() ? 1.0 : block_scales[(size_t{group} * (n_out / 64) + row / 64) * k_blocks + kb];
  }
  const float* scales_pointer() const { return device_scales.size() > 0 ? device_scales.get() : nullptr; }
};

// MXFP4 weights: random E2M1 codes, UE8M0 scales near 2^-7 that differ by up to 4x within a
// 64-row x 128-K block, and a few groups far below their block's largest scale (shifts 9..11), which
// the kernel rounds into E4M3's subnormals.
CaseWeights random_weights(Recipe recipe, uint32_t groups, uint32_t n_out, uint32_t k, std::mt19937_64& rng) {
  CaseWeights w;
  w.n_out = n_out;
  w.k_blocks = k / 128;
  const size_t count = size_t{groups} * n_out * k;
  if (recipe != Recipe::fp8_fp4) {
    Operand op = random_operand(recipe, count, std::sqrt(3.0f / k), rng);
    w.values = std::move(op.values);
    w.bytes = DeviceBuffer<uint8_t>(op.bytes);
    if (recipe == Recipe::fp8) {
      w.block_scales = random_scales(size_t{groups} * (n_out / 64) * w.k_blocks, std::sqrt(3.0f / k) / 448.0f, rng);
      w.device_scales = DeviceBuffer<float>(w.block_scales);
    }
    return w;
  }
  const uint32_t rows = groups * n_out;
  std::uniform_int_distribution<uint32_t> code(0, 15), near(118, 120), far(109, 111);
  std::bernoulli_distribution outlier(0.02);
  std::vector<uint8_t> mx(size_t{rows} * (k / 32));
  for (uint8_t& s : mx) s = static_cast<uint8_t>(outlier(rng) ? far(rng) : near(rng));
  std::vector<uint8_t> packed(count / 2);
  w.values.resize(count);
  for (size_t i = 0; i < count; i += 2) {
    const uint8_t low = static_cast<uint8_t>(code(rng)), high = static_cast<uint8_t>(code(rng));
    packed[i / 2] = static_cast<uint8_t>(low | (high << 4));
    const float scale = ue8m0_to_float(mx[i / 32]);  // row-major: element i's group is i / 32
    w.values[i] = e2m1_to_float(low) * scale;
    w.values[i + 1] = e2m1_to_float(high) * scale;
  }
  w.bytes = DeviceBuffer<uint8_t>(packed);
  DeviceBuffer<uint8_t> d_mx(mx);
  w.device_scales = DeviceBuffer<float>(size_t{rows / 64} * w.k_blocks);
  w.shifts = DeviceBuffer<uint8_t>(size_t{rows} * (k / 32));
  gemm::prepare_fp4_weights(w.bytes.get(), d_mx.get(), rows, k, w.device_scales.get(), w.shifts.get(), nullptr);
  testing::cuda_check(cudaDeviceSynchronize(), "prepare_fp4_weights");
  return w;
}

// The gap between an E4M3 code's magnitude and the next larger one (the largest finite code, 448,
// reuses the gap below it): one rounding step at that value.
double e4m3_step_above(uint8_t code) {
  const uint8_t magnitude = code & 0x7F;
  const uint8_t lower = magnitude < 0x7E ? magnitude : 0x7D;
  return double(e4m3_to_float(lower + 1)) - e4m3_to_float(lower);
}

double normalized_error(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

struct Groups {
  std::vector<uint32_t> prefix;
  uint32_t total = 0;
  uint32_t capacity = 0;  // rows allocated: total rounded up, plus a tile of slack that must stay untouched
};

Groups make_groups(const std::vector<uint32_t>& rows_per_group) {
  Groups groups;
  groups.prefix.push_back(0);
  for (uint32_t rows : rows_per_group) groups.prefix.push_back(groups.prefix.back() + rows);
  groups.total = groups.prefix.back();
  groups.capacity = static_cast<uint32_t>(align_up(groups.total + 128, 256));
  return groups;
}

int multiprocessors() {
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, 0);
  return count;
}

// A zeroed split-K workspace of the layer's size.
DeviceBuffer<uint8_t> split_workspace() {
  DeviceBuffer<uint8_t> workspace(kGemmSplitWorkspaceBytes);
  workspace.fill_bytes(0);
  return workspace;
}

// Every launch leaves the workspace's counters (split K's and the unit counter) at zero for the next.
void expect_counters_reset(DeviceBuffer<uint8_t>& workspace) {
  std::vector<uint32_t> counters(kGemmSplitCounters);
  MEGAMOE_CUDA_OK(cudaMemcpy(counters.data(), workspace.get(), counters.size() * 4, cudaMemcpyDeviceToHost));
  for (uint32_t i = 0; i < kGemmSplitCounters; ++i)
    ASSERT_EQ(counters[i], 0u) << "workspace counter " << i << " was left set (" << kGemmUnitCounter
                               << " is the unit counter)";
}

// The split count the kernel derives for this case's tiles (1 for tokens_on_m), so that a case meant
// to exercise split K fails if it no longer does.
uint32_t expected_splits(const Case& c, uint32_t n_out, uint32_t k) {
  const gemm::TileShape shape =
      gemm::choose_tile(c.expected_rows, static_cast<uint32_t>(c.rows_per_group.size()), c.recipe);
  if (shape.layout != gemm::TileLayout::weights_on_m || shape.block_n > gemm::kMaxSplitTokenTile) return 1;
  uint32_t tiles = 0;
  for (uint32_t rows : c.rows_per_group) tiles += (rows + shape.block_n - 1) / shape.block_n * ((n_out + 255) / 256);
  const uint32_t k_blocks = k / (c.recipe == Recipe::bf16 ? 64 : 128);
  const uint32_t capacity = gemm::split_capacity_units(kGemmSplitWorkspaceBytes, uint64_t{256} * shape.block_n * 4);
  return gemm::plan_split_k(tiles, c.grid > 0 ? c.grid : multiprocessors(), k_blocks, capacity).splits;
}

gemm::GemmOperands case_operands(const Case& c, uint32_t num_groups, uint32_t n_out, uint32_t k, uint32_t rows,
                                 const CaseWeights& weights, const void* acts, const float* act_scales,
                                 const uint32_t* prefix, ControlBlock* control, DeviceBuffer<uint8_t>& workspace,
                                 DeviceBuffer<uint8_t>& expanded) {
  EXPECT_GE(expected_splits(c, n_out, k), c.min_splits) << "the case no longer splits K";
  gemm::GemmOperands operands;
  operands.recipe = c.recipe;
  operands.num_groups = num_groups;
  operands.n_out = n_out;
  operands.k = k;
  operands.weights = weights.bytes.get();
  operands.weight_scales = weights.scales_pointer();
  operands.weight_shifts = weights.shifts.get();
  operands.acts = acts;
  operands.act_scales = act_scales;
  operands.act_rows = rows;
  operands.groups = gemm::GroupRows{prefix, num_groups, 0};
  operands.tile = gemm::choose_tile(c.expected_rows, num_groups, c.recipe);
  operands.timeout_ns = kTimeoutNs;
  operands.control = control;
  operands.split_workspace = {workspace.get(), workspace.size()};
  if (operands.tile.expand_weights) {
    expanded = DeviceBuffer<uint8_t>(gemm::expanded_weight_bytes(num_groups, n_out, k));
    expanded.fill_bytes(0xFF);  // an empty group's weights must stay so (expect_expansion)
    operands.expanded_weights = expanded.get();
  }
  return operands;
}

// The expanded scratch after an expanded launch: every weight of a group with rows, times its block
// scale, is the MXFP4 value (exact for shifts up to 8, within half an E4M3 subnormal step of the
// block scale above), and an empty group's weights were not written.
void expect_expansion(const Case& c, const CaseWeights& weights, const DeviceBuffer<uint8_t>& expanded, uint32_t k) {
  if (expanded.size() == 0) return;  // the case's tile converts its weights on the SM
  const std::vector<uint8_t> bytes = expanded.download();
  const std::vector<float> block_scales = weights.device_scales.download();
  const uint32_t n_out = weights.n_out;
  size_t wrong = 0, written_empty = 0;
  for (uint32_t g = 0; g < c.rows_per_group.size(); ++g) {
    for (uint32_t row = 0; row < n_out; ++row) {
      for (uint32_t col = 0; col < k; ++col) {
        const size_t i = (size_t{g} * n_out + row) * k + col;
        if (c.rows_per_group[g] == 0) {
          written_empty += bytes[i] != 0xFF;
          continue;
        }
        const double scale = block_scales[(size_t{g} * (n_out / 64) + row / 64) * weights.k_blocks + col / 128];
        wrong += std::abs(double{e4m3_to_float(bytes[i])} * scale - weights.values[i]) > scale / 1024;
      }
    }
  }
  EXPECT_EQ(wrong, 0u) << "expanded weights differ from the MXFP4 values";
  EXPECT_EQ(written_empty, 0u) << "bytes of empty groups' expanded weights were written";
}

// ---- L1: SwiGLU epilogue -------------------------------------------------------------------------

void run_swiglu_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  auto rng = fresh_rng();
  const bool scaled = c.recipe != Recipe::bf16;  // E4M3 activations with 1x128 scales
  const uint32_t num_groups = static_cast<uint32_t>(c.rows_per_group.size());
  const uint32_t n_out = 2 * c.intermediate, k = c.hidden, k_blocks = k / 128;
  const Groups groups = make_groups(c.rows_per_group);
  const uint32_t rows = groups.capacity;

  const CaseWeights weights = random_weights(c.recipe, num_groups, n_out, k, rng);
  const Operand acts = random_operand(scaled ? Recipe::fp8 : Recipe::bf16, size_t{rows} * k, 1.0f, rng);
  const std::vector<float> act_scales = scaled ? random_scales(size_t{k_blocks} * rows, 1.0f / 448.0f, rng)
                                               : std::vector<float>{};
  std::vector<float> row_weights(rows);
  std::uniform_real_distribution<float> weight_dist(0.05f, 1.0f);
  for (float& w : row_weights) w = weight_dist(rng);

  DeviceBuffer<uint8_t> d_acts(acts.bytes);
  DeviceBuffer<float> d_act_scales(scaled ? act_scales : std::vector<float>{0.0f});
  DeviceBuffer<float> d_row_weights(row_weights);
  DeviceBuffer<uint32_t> d_prefix(groups.prefix);
  const uint32_t element_bytes = scaled ? 1 : 2;
  DeviceBuffer<uint8_t> d_out(size_t{rows} * c.intermediate * element_bytes);
  DeviceBuffer<float> d_out_scales(size_t{c.intermediate / 128} * rows);

  DeviceBuffer<ControlBlock> d_control(1);
  d_control.fill_bytes(0);
  DeviceBuffer<uint8_t> workspace = split_workspace();
  DeviceBuffer<uint8_t> expanded;
  const gemm::GemmOperands operands =
      case_operands(c, num_groups, n_out, k, rows, weights, d_acts.get(), scaled ? d_act_scales.get() : nullptr,
                    d_prefix.get(), d_control.get(), workspace, expanded);
  gemm::SwigluOutput output{d_out.get(), scaled ? d_out_scales.get() : nullptr, d_row_weights.get(), rows};
  for (int launch = 0; launch < 2; ++launch) {
    d_out.fill_bytes(0x7F);         // E4M3 NaN, and 0x7F7F is a BF16 NaN
    d_out_scales.fill_bytes(0xFF);  // FP32 NaN
    gemm::grouped_gemm_swiglu(operands, output, c.grid > 0 ? c.grid : multiprocessors(), nullptr);
  }
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(d_control.download()[0].error.code, kDeviceOk) << "the GEMM pipeline recorded a stuck wait";
  expect_counters_reset(workspace);
  expect_expansion(c, weights, expanded, k);

  const std::vector<uint8_t> out = d_out.download();
  const std::vector<float> out_scales = d_out_scales.download();

  // Reference from the transformed layout: channel c of tile t has gate at transformed row
  // 256t + 128w + r and up at 256t + 128w + 64 + r (w = (c % 128) / 64, r = c % 64).
  std::vector<double> got, want;
  size_t code_mismatches = 0;
  std::vector<float> activation(c.intermediate);
  std::vector<double> activation_error(c.intermediate);  // from kAccumulationError
  for (uint32_t g = 0; g < num_groups; ++g) {
    for (uint32_t row = groups.prefix[g]; row < groups.prefix[g + 1]; ++row) {
      for (uint32_t channel = 0; channel < c.intermediate; ++channel) {
        const uint32_t tile = channel / 128, w = (channel % 128) / 64, r = channel % 64;
        const uint32_t gate_row = 256 * tile + 128 * w + r, up_row = gate_row + 64;
        double gate = 0, up = 0, gate_terms = 0, up_terms = 0;
        for (uint32_t kb = 0; kb < k_blocks; ++kb) {
          double gate_block = 0, up_block = 0, gate_block_terms = 0, up_block_terms = 0;
          for (uint32_t kk = 0; kk < 128; ++kk) {
            const uint32_t col = kb * 128 + kk;
            const double x = acts.values[size_t{row} * k + col];
            const double gate_term = x * weights.values[(size_t{g} * n_out + gate_row) * k + col];
            const double up_term = x * weights.values[(size_t{g} * n_out + up_row) * k + col];
            gate_block += gate_term;
            up_block += up_term;
            gate_block_terms += std::fabs(gate_term);
            up_block_terms += std::fabs(up_term);
          }
          if (scaled) {
            const double sx = act_scales[size_t{kb} * rows + row];
            gate_block *= sx * weights.factor(g, gate_row, kb);
            up_block *= sx * weights.factor(g, up_row, kb);
            gate_block_terms *= std::fabs(sx * weights.factor(g, gate_row, kb));
            up_block_terms *= std::fabs(sx * weights.factor(g, up_row, kb));
          }
          gate += gate_block;
          up += up_block;
          gate_terms += gate_block_terms;
          up_terms += up_block_terms;
        }
        const double sigmoid = 1.0 / (1.0 + std::exp(-gate));
        activation[channel] = static_cast<float>(gate * sigmoid * up * row_weights[row]);
        // d SiLU(g) / dg = sigmoid(g) (1 + g (1 - sigmoid(g))).
        activation_error[channel] = kAccumulationError * row_weights[row] *
                                    (std::fabs(sigmoid * (1.0 + gate * (1.0 - sigmoid)) * up) * gate_terms +
                                     std::fabs(gate * sigmoid) * up_terms);
      }
      for (uint32_t block = 0; block < c.intermediate / 128; ++block) {
        float amax = 0;
        double amax_error = 0;
        for (uint32_t i = 0; i < 128; ++i) {
          amax = std::max(amax, std::fabs(activation[block * 128 + i]));
          amax_error = std::max(amax_error, activation_error[block * 128 + i]);
        }
        const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
        const float scale = scaled ? out_scales[size_t{block} * rows + row] : 1.0f;
        if (scaled) {
          ASSERT_FALSE(std::isnan(scale)) << "scale of row " << row << " block " << block << " not written";
          EXPECT_NEAR(scale, quantizer.scale, kScaleTolerance * quantizer.scale + amax_error / kE4M3Max)
              << "row " << row << " block " << block << ", amax " << amax << " (accumulation error up to "
              << amax_error << ")";
        }
        for (uint32_t i = 0; i < 128; ++i) {
          const uint32_t channel = block * 128 + i;
          const size_t index = size_t{row} * c.intermediate + channel;
          if (scaled) {
            const uint8_t want_code = quantizer.quantize(activation[channel]);
            code_mismatches += out[index] != want_code;
            const double got_value = e4m3_to_float(out[index]) * scale;
            const double want_value = e4m3_to_float(want_code) * quantizer.scale;
            ASSERT_LE(std::fabs(got_value - want_value), e4m3_step_above(want_code) * quantizer.scale + amax / 1024)
                << "row " << row << " channel " << channel << ": code " << int(out[index]) << ", reference code "
                << int(want_code) << ", block amax " << amax;
            got.push_back(got_value);
            want.push_back(want_value);
          } else {
            uint16_t bits;
            std::memcpy(&bits, &out[2 * index], 2);
            got.push_back(bf16_to_float(bits));
            want.push_back(bf16_to_float(float_to_bf16(activation[channel])));
          }
        }
      }
    }
  }
  // The FP8 wgmma accumulates with about 14 mantissa bits, relative to the sum of the products'
  // magnitudes: a few values round to a neighbouring E4M3 code (6-12.5% of their size), and values
  // near zero, where the products cancel, may differ by more codes but by a tiny fraction of the
  // block's amax. Each value is checked against exactly that above. The flips make the normalized
  // error about sqrt(fraction flipped) / 10, so the fraction is bounded below 2% and the error by the
  // recipe's documented bound (README: 2e-2), which that fraction implies. BF16 outputs only differ
  // by flips of a BF16 rounding.
  const double error = normalized_error(got, want);
  const double mismatch_fraction = got.empty() ? 0.0 : double(code_mismatches) / got.size();
  std::printf("L1 %s: normalized error %.3g, E4M3 codes differing %.3g%% over %zu values\n", describe(c).c_str(),
              error, 100 * mismatch_fraction, got.size());
  EXPECT_LT(error, scaled ? 2e-2 : 2e-3);
  EXPECT_LT(mismatch_fraction, 0.02);

  // Rows past the last group stay untouched.
  for (size_t i = size_t{groups.total} * c.intermediate * element_bytes; i < out.size(); ++i)
    ASSERT_EQ(out[i], 0x7F) << "byte " << i << " past the last row was written";
  if (scaled) {
    for (uint32_t block = 0; block < c.intermediate / 128; ++block)
      for (uint32_t row = groups.total; row < rows; ++row)
        ASSERT_TRUE(std::isnan(out_scales[size_t{block} * rows + row])) << "scale past the last row was written";
  }
}

// ---- L2: store epilogue into combine slots on two "ranks" ---------------------------------------

void run_store_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  auto rng = fresh_rng();
  const bool scaled = c.recipe != Recipe::bf16;
  const uint32_t num_groups = static_cast<uint32_t>(c.rows_per_group.size());
  const uint32_t n_out = c.hidden, k = c.intermediate, k_blocks = k / 128;
  const Groups groups = make_groups(c.rows_per_group);
  const uint32_t rows = groups.capacity;
  constexpr uint32_t kTopK = 4;
  constexpr int32_t kRanks = 2;

  const CaseWeights weights = random_weights(c.recipe, num_groups, n_out, k, rng);
  const Operand acts = random_operand(scaled ? Recipe::fp8 : Recipe::bf16, size_t{rows} * k, 1.0f, rng);
  const std::vector<float> act_scales = scaled ? random_scales(size_t{k_blocks} * rows, 1.0f / 448.0f, rng)
                                               : std::vector<float>{};

  // Every pool row goes to a distinct (rank, token, k) slot, shuffled.
  const uint32_t tokens = (groups.total + kTopK - 1) / kTopK + 1;
  std::vector<PoolSource> all_slots;
  for (int32_t rank = 0; rank < kRanks; ++rank)
    for (uint32_t slot = 0; slot < tokens * kTopK; ++slot) all_slots.push_back({static_cast<uint32_t>(rank), slot});
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<PoolSource> sources(rows, PoolSource{0, 0});
  for (uint32_t row = 0; row < groups.total; ++row) sources[row] = all_slots[row];

  DeviceBuffer<uint8_t> d_acts(acts.bytes);
  DeviceBuffer<float> d_act_scales(scaled ? act_scales : std::vector<float>{0.0f});
  DeviceBuffer<uint32_t> d_prefix(groups.prefix);
  DeviceBuffer<PoolSource> d_sources(sources);
  const size_t slot_elements = size_t{tokens} * (kTopK + 1) * n_out;
  std::vector<DeviceBuffer<uint16_t>> combine;
  SymmView view{};
  view.rank = 0;
  view.num_ranks = kRanks;
  view.timeout_ns = kTimeoutNs;
  for (int32_t rank = 0; rank < kRanks; ++rank) {
    combine.emplace_back(slot_elements);
    view.peers[rank] = reinterpret_cast<char*>(combine.back().get());
  }

  DeviceBuffer<ControlBlock> d_control(1);
  d_control.fill_bytes(0);
  DeviceBuffer<uint8_t> workspace = split_workspace();
  DeviceBuffer<uint8_t> expanded;
  const gemm::GemmOperands operands =
      case_operands(c, num_groups, n_out, k, rows, weights, d_acts.get(), scaled ? d_act_scales.get() : nullptr,
                    d_prefix.get(), d_control.get(), workspace, expanded);
  const gemm::RoutedDestination destination{view, 0, d_sources.get(), kTopK, n_out};
  for (int launch = 0; launch < 2; ++launch) {
    for (auto& buffer : combine) buffer.fill_bytes(0xFF);
    gemm::grouped_gemm_store(operands, destination, c.grid > 0 ? c.grid : multiprocessors(), nullptr);
  }
  MEGAMOE_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(d_control.download()[0].error.code, kDeviceOk) << "the GEMM pipeline recorded a stuck wait";
  expect_counters_reset(workspace);
  expect_expansion(c, weights, expanded, k);

  std::vector<std::vector<uint16_t>> out;
  for (const auto& buffer : combine) out.push_back(buffer.download());
  std::vector<std::vector<bool>> written(kRanks, std::vector<bool>(tokens * (kTopK + 1), false));
  std::vector<double> got, want;
  for (uint32_t g = 0; g < num_groups; ++g) {
    for (uint32_t row = groups.prefix[g]; row < groups.prefix[g + 1]; ++row) {
      const PoolSource source = sources[row];
      const uint32_t token = source.token_topk / kTopK, slot = source.token_topk % kTopK;
      written[source.rank][token * (kTopK + 1) + slot] = true;
      const uint16_t* result = out[source.rank].data() + (size_t{token} * (kTopK + 1) + slot) * n_out;
      for (uint32_t feature = 0; feature < n_out; ++feature) {
        double sum = 0;
        for (uint32_t kb = 0; kb < k_blocks; ++kb) {
          double block = 0;
          for (uint32_t kk = 0; kk < 128; ++kk) {
            const uint32_t col = kb * 128 + kk;
            block += double{acts.values[size_t{row} * k + col]} *
                     weights.values[(size_t{g} * n_out + feature) * k + col];
          }
          if (scaled) block *= act_scales[size_t{kb} * rows + row] * weights.factor(g, feature, kb);
          sum += block;
        }
        got.push_back(bf16_to_float(result[feature]));
        want.push_back(bf16_to_float(float_to_bf16(static_cast<float>(sum))));
      }
    }
  }
  const double error = normalized_error(got, want);
  std::printf("L2 %s: normalized error %.3g over %zu values\n", describe(c).c_str(), error, got.size());
  EXPECT_LT(error, 2e-3);
  for (int32_t rank = 0; rank < kRanks; ++rank)
    for (uint32_t slot = 0; slot < tokens * (kTopK + 1); ++slot)
      if (!written[rank][slot])
        for (uint32_t feature = 0; feature < n_out; ++feature)
          ASSERT_EQ(out[rank][size_t{slot} * n_out + feature], 0xFFFF)
              << "rank " << rank << " slot " << slot << " was written but no pool row maps to it";
}

std::vector<uint32_t> random_rows(uint32_t groups, uint32_t max_rows, double empty_fraction, std::mt19937_64& rng) {
  std::uniform_int_distribution<uint32_t> rows(1, max_rows);
  std::bernoulli_distribution empty(empty_fraction);
  std::vector<uint32_t> result(groups);
  for (uint32_t& r : result) r = empty(rng) ? 0 : rows(rng);
  return result;
}

class GroupedGemm : public ::testing::TestWithParam<Recipe> {};

// Each case runs as two tests: the L1 (SwiGLU) epilogue and the L2 (store) epilogue.
#define MEGAMOE_GEMM_CASE(Name, ...)          \
  TEST_P(GroupedGemm, Name##Swiglu) {         \
    MEGAMOE_SKIP_WITHOUT_GPU();               \
    std::mt19937_64 rng(testing::announced_test_seed("group sizes")); \
    for (const Case& c : __VA_ARGS__) run_swiglu_case(c); \
  }                                           \
  TEST_P(GroupedGemm, Name##Store) {          \
    MEGAMOE_SKIP_WITHOUT_GPU();               \
    std::mt19937_64 rng(testing::announced_test_seed("group sizes")); \
    for (const Case& c : __VA_ARGS__) run_store_case(c); \
  }

MEGAMOE_GEMM_CASE(OneGroupManyRows, std::vector<Case>{{GetParam(), {300}, 512, 256, 300, 0}})
MEGAMOE_GEMM_CASE(EightUnevenGroupsWithEmptyAndSingleRowOnes,
                  std::vector<Case>{{GetParam(), {5, 0, 1, 77, 16, 0, 33, 1}, 384, 256, 20, 0}})
MEGAMOE_GEMM_CASE(ThirtyTwoGroupsSmallGridLoopsOverTiles,
                  std::vector<Case>{{GetParam(), random_rows(32, 70, 0.2, rng), 256, 384, 30, 7}})
// 4 expected rows over 128 groups take the 64-token tile (fp8_fp4: 16); one expected row takes the
// 16-token tile, where groups of up to 6 rows are one token tile and those of 17..40 several.
MEGAMOE_GEMM_CASE(HundredTwentyEightGroupsDecodeSized,
                  std::vector<Case>{{GetParam(), random_rows(128, 6, 0.3, rng), 256, 128, 4, 0}})
MEGAMOE_GEMM_CASE(HundredTwentyEightGroupsOneExpectedRow,
                  std::vector<Case>{{GetParam(), [&] {
                                       std::vector<uint32_t> rows = random_rows(128, 3, 0.6, rng);
                                       rows[5] = 40;
                                       rows[77] = 17;
                                       return rows;
                                     }(),
                                     256, 128, 1, 0}})
MEGAMOE_GEMM_CASE(TokenTile16, std::vector<Case>{{GetParam(), {11, 33, 0, 16}, 256, 128, 8, 0}})
// 4..16 expected rows over 32 groups take the 64-token tile (fp8_fp4 keeps 16): single-tile groups
// of 1..64 rows narrow their wgmmas, and the groups of 150 and 65 rows run their tiles at full width.
MEGAMOE_GEMM_CASE(DecodeRowsOfManyGroupsTake64TokenTiles,
                  std::vector<Case>{{GetParam(),
                                     {150, 12, 0, 1, 16, 17, 9, 33, 5, 0, 64, 8, 2, 24, 11, 7,
                                      13, 3, 0, 40, 6, 15, 10, 1, 20, 9, 4, 12, 0, 65, 14, 8},
                                     256, 128, 12, 0}})
// 32 expected rows also take the 64-token tile: groups of 35 and 65 rows end in tiles of 3 and 1.
MEGAMOE_GEMM_CASE(TokenTile64For32ExpectedRows, std::vector<Case>{{GetParam(), {35, 65, 0, 32}, 256, 128, 32, 0}})
MEGAMOE_GEMM_CASE(TokenTile64, std::vector<Case>{{GetParam(), {67, 129, 0, 64}, 256, 128, 36, 0}})
// Groups of one token tile of 17..32 and 1..16 rows in the 64-token config run 32- and 16-wide
// wgmmas; the group of 89 rows keeps 64 for both its tiles.
MEGAMOE_GEMM_CASE(TokenTile64NarrowWgmmasForSingleTileGroups,
                  std::vector<Case>{{GetParam(), {20, 89, 7, 0, 64, 33}, 256, 128, 36, 0}})
// From 40 expected rows (bf16: 49) the tile switches to tokens on wgmma's M (128 tokens
// x 256 weight rows): groups of up to 64 rows leave the second math warpgroup idle, and those of
// 65..128 rows are one tile.
MEGAMOE_GEMM_CASE(TokensOnMFromFortyRows,
                  std::vector<Case>{{GetParam(), {40, 64, 1, 0, 65, 20, 128, 129}, 256, 128, 56, 0}})
MEGAMOE_GEMM_CASE(TokensOnM, std::vector<Case>{{GetParam(), {203, 401, 0, 200}, 256, 128, 200, 0}})
MEGAMOE_GEMM_CASE(TokensOnMPartialWeightTileAndSmallGrid,
                  std::vector<Case>{{GetParam(), {129, 1, 0, 640, 77, 128}, 384, 384, 300, 5}})
// L2 (hidden 640): two whole weight tiles and a partial one of 128 rows, on a grid smaller than the tiles.
MEGAMOE_GEMM_CASE(TokensOnMSeveralWeightTilesWithAPartialOne,
                  std::vector<Case>{{GetParam(), {150, 0, 257}, 640, 256, 200, 9}})
MEGAMOE_GEMM_CASE(TokensOnMManyUnevenGroups,
                  std::vector<Case>{{GetParam(), random_rows(32, 300, 0.2, rng), 256, 256, 150, 0}})
MEGAMOE_GEMM_CASE(AllGroupsEmpty, std::vector<Case>{{GetParam(), {0, 0, 0}, 256, 128, 1, 0}})
// Decode tiles that leave most of the grid idle: K split 2..8 ways (hidden 2048 gives the L1 16 fp8
// K blocks, intermediate 1024 gives the L2 8), with partial token tiles, an empty group, a group
// of several token tiles and a small grid. On a grid of 30, 32 tiles run as 30 whole ones and 2
// split ones.
MEGAMOE_GEMM_CASE(SplitKDecodeTilesFewerThanTheGrid,
                  std::vector<Case>{{GetParam(), {20, 3, 0, 9}, 2048, 1024, 8, 0, 2},
                                    {GetParam(), {1, 40}, 1024, 1024, 16, 0, 2},
                                    {GetParam(), {3}, 2048, 1024, 8, 16, 2},
                                    {GetParam(), {20, 3, 0, 9}, 2048, 1024, 8, 30, 2}})

// fp8_fp4 prefill from kExpandFp4Rows expected rows (the tile choice; the groups' rows may be
// fewer): the weights of the groups with rows expanded once, then fp8's kernel. Empty groups,
// partial weight tiles, a grid smaller than the tiles and the L2 shape's partial tile of 128 rows.
std::vector<Case> expanded_cases(std::mt19937_64& rng) {
  const uint32_t rows = static_cast<uint32_t>(kExpandFp4Rows);
  std::vector<Case> cases{{Recipe::fp8_fp4, {40, 64, 1, 0, 65, 20, 128, 129}, 256, 128, rows, 0},
                          {Recipe::fp8_fp4, {129, 1, 0, 1100, 77, 128}, 384, 384, rows, 5},
                          {Recipe::fp8_fp4, {150, 0, 257}, 640, 256, rows, 9},
                          {Recipe::fp8_fp4, random_rows(32, 300, 0.2, rng), 256, 256, rows, 0}};
  for (const Case& c : cases) EXPECT_TRUE(expands(c)) << describe(c);
  // One expected row fewer keeps the converters.
  EXPECT_FALSE(expands({Recipe::fp8_fp4, {1}, 256, 128, rows - 1, 0}));
  return cases;
}
TEST(GroupedGemmFp4Expanded, TokensOnMSwiglu) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(testing::announced_test_seed("group sizes"));
  for (const Case& c : expanded_cases(rng)) run_swiglu_case(c);
}
TEST(GroupedGemmFp4Expanded, TokensOnMStore) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(testing::announced_test_seed("group sizes"));
  for (const Case& c : expanded_cases(rng)) run_store_case(c);
}

INSTANTIATE_TEST_SUITE_P(Recipes, GroupedGemm, ::testing::Values(Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace megamoe
