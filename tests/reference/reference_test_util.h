// Helpers shared by the reference tests: hand-built experts and batches, an error-message matcher,
// and an independent per-token recomputation of the layer.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/reference.h"
#include "megamoe/weights.h"

namespace megamoe::testing {

// Weights held in memory.
class MemoryWeights : public WeightSource {
 public:
  std::vector<StoredExpert> routed;
  std::vector<StoredExpert> shared;

  StoredExpert routed_expert(int32_t global_expert) const override {
    return routed.at(static_cast<size_t>(global_expert));
  }
  StoredExpert shared_expert(int32_t index) const override { return shared.at(static_cast<size_t>(index)); }
};

inline DenseExpert zero_dense(int32_t hidden, int32_t intermediate) {
  DenseExpert dense;
  dense.hidden = hidden;
  dense.intermediate = intermediate;
  dense.w1.assign(2 * static_cast<size_t>(intermediate) * static_cast<size_t>(hidden), 0.0f);
  dense.w2.assign(static_cast<size_t>(hidden) * static_cast<size_t>(intermediate), 0.0f);
  return dense;
}

inline float& w1_at(DenseExpert& dense, int row, int col) {
  return dense.w1[static_cast<size_t>(row) * static_cast<size_t>(dense.hidden) + static_cast<size_t>(col)];
}
inline float& w2_at(DenseExpert& dense, int row, int col) {
  return dense.w2[static_cast<size_t>(row) * static_cast<size_t>(dense.intermediate) + static_cast<size_t>(col)];
}

inline std::vector<uint8_t> bf16_bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(2 * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = float_to_bf16(values[i]);
    EXPECT_EQ(bf16_to_float(bits), values[i]) << "value " << i << " is not exact in BF16";
    bytes[2 * i] = static_cast<uint8_t>(bits & 0xFF);
    bytes[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
  }
  return bytes;
}

// E4M3 codes of values / scale; every value must be exact.
inline std::vector<uint8_t> e4m3_codes(const std::vector<float>& values, float scale) {
  std::vector<uint8_t> codes(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    codes[i] = float_to_e4m3(values[i] / scale);
    EXPECT_EQ(e4m3_to_float(codes[i]) * scale, values[i]) << "value " << i << " is not exact in E4M3 * " << scale;
  }
  return codes;
}

// Canonical fp8 expert with one scale for all of W1's blocks of gate rows, one for its up rows and
// one for all of W2's blocks.
inline StoredExpert fp8_expert(const DenseExpert& dense, float gate_scale, float up_scale, float w2_scale) {
  const size_t h = static_cast<size_t>(dense.hidden);
  const size_t i = static_cast<size_t>(dense.intermediate);
  StoredExpert out;
  out.hidden = dense.hidden;
  out.intermediate = dense.intermediate;
  std::vector<float> gate(dense.w1.begin(), dense.w1.begin() + static_cast<ptrdiff_t>(i * h));
  std::vector<float> up(dense.w1.begin() + static_cast<ptrdiff_t>(i * h), dense.w1.end());
  out.w1 = e4m3_codes(gate, gate_scale);
  const std::vector<uint8_t> up_codes = e4m3_codes(up, up_scale);
  out.w1.insert(out.w1.end(), up_codes.begin(), up_codes.end());
  const size_t h_blocks = h / kScaleBlock;
  const size_t i_blocks = i / kScaleBlock;
  out.w1_scales.assign(i_blocks * h_blocks, gate_scale);
  out.w1_scales.insert(out.w1_scales.end(), i_blocks * h_blocks, up_scale);
  out.w2 = e4m3_codes(dense.w2, w2_scale);
  out.w2_scales.assign(h_blocks * i_blocks, w2_scale);
  return out;
}

inline float y_at(const ReferenceResult& result, int rank, int token, int hidden, int column) {
  return bf16_to_float(result.y[static_cast<size_t>(rank)][static_cast<size_t>(token) * hidden + column]);
}

// Runs `action`, expects megamoe::Error, and checks its message contains every part.
inline void expect_error(const std::function<void()>& action, const std::vector<std::string>& parts) {
  try {
    action();
    ADD_FAILURE() << "expected megamoe::Error";
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "message \"" << message << "\" lacks \"" << part << "\"";
    }
  }
}

// An independent recomputation of one token's output: whole dense experts from dequantize(),
// double accumulation, then the documented rounding steps. Returns y[token] as floats.
class NaiveLayer {
 public:
  NaiveLayer(const Problem& problem, const WeightSource& weights) : p_(problem), weights_(weights) {}

  std::vector<float> token_output(const RankBatch& batch, int32_t token) {
    const size_t h = static_cast<size_t>(p_.hidden);
    std::vector<double> x(h);
    for (size_t c = 0; c < h; ++c) {
      const size_t index = static_cast<size_t>(token) * h + c;
      if (p_.recipe == Recipe::bf16) {
        x[c] = bf16_to_float(static_cast<uint16_t>(batch.x[2 * index] | (batch.x[2 * index + 1] << 8)));
      } else {
        x[c] = static_cast<double>(e4m3_to_float(batch.x[index])) *
               batch.x_scales[static_cast<size_t>(token) * (h / kScaleBlock) + c / kScaleBlock];
      }
    }
    std::vector<float> sum(h, 0.0f);
    for (int32_t k = 0; k < p_.top_k; ++k) {
      const size_t route = static_cast<size_t>(token) * static_cast<size_t>(p_.top_k) + static_cast<size_t>(k);
      const int32_t expert = batch.topk_idx[route];
      if (expert < 0) continue;
      add_slot(expert_weights(expert), x, batch.topk_weights[route], sum);
    }
    if (p_.num_shared_experts > 0) add_slot(shared_weights(), x, 1.0f, sum);
    for (float& value : sum) value = bf16_to_float(float_to_bf16(value));
    return sum;
  }

 private:
  void add_slot(const DenseExpert& w, const std::vector<double>& x, float weight, std::vector<float>& sum) const {
    const size_t h = static_cast<size_t>(w.hidden);
    const size_t inter = static_cast<size_t>(w.intermediate);
    std::vector<float> a(inter);
    for (size_t c = 0; c < inter; ++c) {
      double gate = 0.0, up = 0.0;
      for (size_t j = 0; j < h; ++j) {
        gate += static_cast<double>(w.w1[c * h + j]) * x[j];
        up += static_cast<double>(w.w1[(inter + c) * h + j]) * x[j];
      }
      a[c] = static_cast<float>(gate / (1.0 + std::exp(-gate)) * up * weight);
    }
    for (size_t block = 0; block < inter; block += kScaleBlock) {
      float amax = 0.0f;
      for (int c = 0; c < kScaleBlock; ++c) amax = std::fmax(amax, std::fabs(a[block + c]));
      const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
      for (int c = 0; c < kScaleBlock; ++c) {
        float& value = a[block + c];
        value = p_.recipe == Recipe::bf16 ? bf16_to_float(float_to_bf16(value))
                                          : e4m3_to_float(quantizer.quantize(value)) * quantizer.scale;
      }
    }
    for (size_t j = 0; j < h; ++j) {
      double out = 0.0;
      for (size_t c = 0; c < inter; ++c) out += static_cast<double>(w.w2[j * inter + c]) * a[c];
      sum[j] += bf16_to_float(float_to_bf16(static_cast<float>(out)));
    }
  }

  const DenseExpert& expert_weights(int32_t expert) {
    auto found = routed_.find(expert);
    if (found == routed_.end()) {
      found = routed_.emplace(expert, dequantize(weights_.routed_expert(expert), p_.recipe)).first;
    }
    return found->second;
  }

  const DenseExpert& shared_weights() {
    if (shared_.w1.empty()) {
      std::vector<StoredExpert> experts;
      for (int32_t s = 0; s < p_.num_shared_experts; ++s) experts.push_back(weights_.shared_expert(s));
      shared_ = dequantize(concat_shared_experts(experts, p_.recipe), p_.recipe);
    }
    return shared_;
  }

  Problem p_;
  const WeightSource& weights_;
  std::map<int32_t, DenseExpert> routed_;
  DenseExpert shared_;
};

// Largest |a - b| over a token's outputs, relative to the largest |b|.
inline double normalized_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::fmax(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::fmax(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

inline std::vector<float> token_row(const ReferenceResult& result, int rank, int token, int hidden) {
  std::vector<float> row(static_cast<size_t>(hidden));
  for (int c = 0; c < hidden; ++c) row[static_cast<size_t>(c)] = y_at(result, rank, token, hidden, c);
  return row;
}

}  // namespace megamoe::testing
