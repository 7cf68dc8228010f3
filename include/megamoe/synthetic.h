// Deterministic synthetic data: expert weights and rank batches for tests, benchmarks and the CLI.
//
// Every weight element is a pure function of (seed, stream, index), where the stream names the
// expert and the matrix: a counter-based generator, no state. The generators below are marked
// MEGAMOE_HD so a GPU backend can produce the same weights on the device; they use integer
// operations and single float multiplies only (no additions after multiplies that could be
// contracted into FMAs, no transcendental functions), so host and device give identical bits.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/formats.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/weights.h"

namespace megamoe {

// ---- Counter-based generator ------------------------------------------------------------------

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;

// The splitmix64 finalizer: a bijection of 64-bit values with good avalanche.
MEGAMOE_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 64 random bits for element `index` of `stream`: splitmix64 jumped to position `index` of a
// sequence keyed by (seed, stream).
MEGAMOE_HD uint64_t synthetic_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t key = mix64(mix64(seed + kGoldenGamma) ^ stream);
  return mix64(key + (index + 1) * kGoldenGamma);
}

// 24 random bits -> [-1, 1) in steps of 2^-23; exact (integer to float, power-of-two scaling).
MEGAMOE_HD float uniform_from_24_bits(uint32_t bits24) {
  const int32_t steps = static_cast<int32_t>(bits24 & 0xFFFFFFu) - (1 << 23);
  return static_cast<float>(steps) * 0x1p-23f;
}

MEGAMOE_HD float synthetic_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return uniform_from_24_bits(static_cast<uint32_t>(synthetic_bits(seed, stream, index) >> 40));
}

// ---- Streams: which expert and matrix a value belongs to --------------------------------------

enum class WeightMatrix : uint32_t { w1 = 0, w1_scales = 1, w2 = 2, w2_scales = 3 };

MEGAMOE_HD uint64_t routed_weight_stream(int32_t expert, WeightMatrix matrix) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(expert)) << 8) | static_cast<uint32_t>(matrix);
}

MEGAMOE_HD uint64_t shared_weight_stream(int32_t index, WeightMatrix matrix) {
  return (1ull << 56) | (static_cast<uint64_t>(static_cast<uint32_t>(index)) << 8) | static_cast<uint32_t>(matrix);
}

// ---- Weight magnitudes -------------------------------------------------------------------------

// floor(sqrt(n)), integer only.
MEGAMOE_HD uint64_t isqrt64(uint64_t n) {
  uint64_t root = 0;
  uint64_t bit = 1ull << 62;
  while (bit > n) bit >>= 2;
  while (bit != 0) {
    if (n >= root + bit) {
      n -= root + bit;
      root = (root >> 1) + bit;
    } else {
      root >>= 1;
    }
    bit >>= 2;
  }
  return root;
}

// sqrt(3 / fan_in) to about 19 bits: the half-width of a uniform distribution whose standard
// deviation is 1/sqrt(fan_in). Integer square root, so it is exact and equal on host and device.
// Compute it once per matrix and pass it to the generators below.
MEGAMOE_HD float synthetic_weight_range(int32_t fan_in) {
  const uint64_t root = isqrt64((3ull << 48) / static_cast<uint64_t>(fan_in > 0 ? fan_in : 1));
  return static_cast<float>(root) * 0x1p-24f;  // root < 2^24: exact
}

// ---- Per-element generators for the stored weight formats -------------------------------------

// E4M3 code of u * 448, u uniform in [-1, 1).
MEGAMOE_HD uint8_t synthetic_e4m3_code(uint64_t seed, uint64_t stream, uint64_t index) {
  return float_to_e4m3(synthetic_uniform(seed, stream, index) * kE4M3Max);
}

// FP32 scale of one 128x128 block: range / 448 times a factor in [0.5, 2) (a random exponent of
// -1 or 0 and a random mantissa), so dequantized weights have a standard deviation near
// 1/sqrt(fan_in) and blocks differ in magnitude.
MEGAMOE_HD float synthetic_fp8_block_scale(uint64_t seed, uint64_t stream, uint64_t block, float range) {
  const uint64_t bits = synthetic_bits(seed, stream, block);
  const uint32_t exponent = 126u + static_cast<uint32_t>(bits & 1u);
  const float factor = bits_float((exponent << 23) | static_cast<uint32_t>((bits >> 41) & 0x7FFFFFu));
  return (range * (1.0f / kE4M3Max)) * factor;
}

// Two E2M1 codes of u * 6 in one byte: low nibble = even column 2 * pair, high = odd column.
MEGAMOE_HD uint8_t synthetic_e2m1_pair(uint64_t seed, uint64_t stream, uint64_t pair) {
  const uint64_t bits = synthetic_bits(seed, stream, pair);
  const uint8_t low = float_to_e2m1(uniform_from_24_bits(static_cast<uint32_t>(bits >> 40)) * kE2M1Max);
  const uint8_t high = float_to_e2m1(uniform_from_24_bits(static_cast<uint32_t>(bits >> 16)) * kE2M1Max);
  return static_cast<uint8_t>(low | (high << 4));
}

// UE8M0 scale of one group of 32: the power of two at or just below range / 6, times 2^-1, 2^0 or
// 2^1 at random.
MEGAMOE_HD uint8_t synthetic_ue8m0_scale(uint64_t seed, uint64_t stream, uint64_t group, float range) {
  const int32_t base = static_cast<int32_t>((float_bits(range * (1.0f / kE2M1Max)) >> 23) & 0xFFu);
  int32_t code = base + static_cast<int32_t>(synthetic_bits(seed, stream, group) % 3u) - 1;
  if (code < 1) code = 1;
  if (code > 254) code = 254;
  return static_cast<uint8_t>(code);
}

// BF16 bits of u * range.
MEGAMOE_HD uint16_t synthetic_bf16(uint64_t seed, uint64_t stream, uint64_t index, float range) {
  return float_to_bf16(synthetic_uniform(seed, stream, index) * range);
}

// ---- Host-side synthetic data ------------------------------------------------------------------

// Canonical stored weights of every routed and shared expert of `problem`, generated on demand.
// Routed expert e's matrix m uses routed_weight_stream(e, m); shared expert s uses
// shared_weight_stream(s, m). Element indices are row-major positions in the canonical arrays
// (weights.h): codes (or packed E2M1 pairs, or BF16 values) and scales alike.
class SyntheticWeights : public WeightSource {
 public:
  SyntheticWeights(const Problem& problem, uint64_t seed);

  StoredExpert routed_expert(int32_t global_expert) const override;
  StoredExpert shared_expert(int32_t index) const override;

  const Problem& problem() const { return problem_; }
  uint64_t seed() const { return seed_; }

 private:
  StoredExpert generate(bool shared, int32_t index) const;

  Problem problem_;
  uint64_t seed_;
};

enum class Routing {
  uniform,     // distinct experts, uniformly at random
  zipf,        // distinct experts drawn with probability ~ 1 / rank^1.1 over a seed-shuffled expert order
  one_expert,  // choice 0 of every token is expert 0; the other choices are distinct and uniform
};

std::string_view to_string(Routing routing);
bool parse_routing(std::string_view text, Routing& routing);

// One batch per rank with tokens_per_rank[r] tokens: activations with a standard deviation near 1
// (quantized per 1x128 with Fp8BlockQuantizer for the fp8 recipes, rounded to BF16 for bf16),
// top-k expert ids distinct within a token, each route masked (-1) with probability
// masked_fraction, and positive weights that sum to 1 over a token's unmasked routes (masked
// routes get weight 0). Deterministic in (problem, tokens_per_rank, routing, seed).
std::vector<RankBatch> synthetic_batches(const Problem& problem, const std::vector<int32_t>& tokens_per_rank,
                                         Routing routing, uint64_t seed, float masked_fraction = 0.0f);

}  // namespace megamoe
