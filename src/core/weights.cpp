#include "megamoe/weights.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "megamoe/error.h"
#include "megamoe/formats.h"

namespace megamoe {

namespace {

constexpr uint64_t kFp8ScaleRun = kGateUpInterleave;  // transformed fp8 scales cover 64 rows

// `prefix` is "" or "<name>.", so messages read "hidden: ..." or "expert.hidden: ...".
void check_dims(int32_t hidden, int32_t intermediate, const std::string& prefix) {
  require(hidden >= kScaleBlock && hidden % kScaleBlock == 0, (prefix + "hidden").c_str(),
          "must be a positive multiple of ", kScaleBlock, ", got ", hidden);
  // 2 * intermediate rows are indexed with int32 (l1_canonical_row).
  require(intermediate >= kScaleBlock && intermediate % kScaleBlock == 0 && intermediate <= INT32_MAX / 2,
          (prefix + "intermediate").c_str(), "must be a positive multiple of ", kScaleBlock, " below 2^30, got ",
          intermediate);
}

// Bytes of one stored row of w1 (H values) or w2 (I values) in a recipe.
uint64_t row_bytes(Recipe recipe, uint64_t values) {
  switch (recipe) {
    case Recipe::fp8: return values;
    case Recipe::fp8_fp4: return values / 2;
    case Recipe::bf16: return 2 * values;
  }
  return 0;
}

StoredExpertSizes sizes_for(Recipe recipe, int32_t hidden, int32_t intermediate, bool transformed) {
  check_dims(hidden, intermediate, "");
  const uint64_t h = static_cast<uint64_t>(hidden);
  const uint64_t i = static_cast<uint64_t>(intermediate);
  StoredExpertSizes sizes;
  sizes.w1 = 2 * i * row_bytes(recipe, h);
  sizes.w2 = h * row_bytes(recipe, i);
  if (recipe == Recipe::fp8) {
    const uint64_t w1_row_blocks = transformed ? 2 * i / kFp8ScaleRun : 2 * i / kScaleBlock;
    const uint64_t w2_row_blocks = transformed ? h / kFp8ScaleRun : h / kScaleBlock;
    sizes.w1_scales = sizeof(float) * w1_row_blocks * (h / kScaleBlock);
    sizes.w2_scales = sizeof(float) * w2_row_blocks * (i / kScaleBlock);
  } else if (recipe == Recipe::fp8_fp4) {
    sizes.w1_scales = 2 * i * (h / kMxBlock);
    sizes.w2_scales = h * (i / kMxBlock);
  }
  return sizes;
}

template <typename T>
void check_size(const std::vector<T>& values, uint64_t expected_bytes, const std::string& name) {
  const uint64_t actual = values.size() * sizeof(T);
  require(actual == expected_bytes, name.c_str(), "must hold ", expected_bytes, " bytes, got ", actual);
}

// Size checks only: every vector the recipe uses has its size, the others are empty.
void check_sizes(const StoredExpert& expert, Recipe recipe, bool transformed, const std::string& name) {
  check_dims(expert.hidden, expert.intermediate, name + ".");
  const StoredExpertSizes sizes = sizes_for(recipe, expert.hidden, expert.intermediate, transformed);
  check_size(expert.w1, sizes.w1, name + ".w1");
  check_size(expert.w2, sizes.w2, name + ".w2");
  const bool f32_scales = recipe == Recipe::fp8;
  const bool mx_scales = recipe == Recipe::fp8_fp4;
  check_size(expert.w1_scales, f32_scales ? sizes.w1_scales : 0, name + ".w1_scales");
  check_size(expert.w2_scales, f32_scales ? sizes.w2_scales : 0, name + ".w2_scales");
  check_size(expert.w1_mx_scales, mx_scales ? sizes.w1_scales : 0, name + ".w1_mx_scales");
  check_size(expert.w2_mx_scales, mx_scales ? sizes.w2_scales : 0, name + ".w2_mx_scales");
}

void check_f32_scales(const std::vector<float>& scales, uint64_t columns, const std::string& name) {
  for (uint64_t index = 0; index < scales.size(); ++index) {
    const float scale = scales[index];
    require(std::isfinite(scale) && scale > 0.0f, name.c_str(), "scale [", index / columns, "][", index % columns,
            "] (index ", index, ") must be finite and positive, got ", scale);
  }
}

void check_ue8m0_scales(const std::vector<uint8_t>& scales, uint64_t columns, const std::string& name) {
  for (uint64_t index = 0; index < scales.size(); ++index) {
    require(scales[index] != 0xFF, name.c_str(), "scale [", index / columns, "][", index % columns, "] (index ",
            index, ") is the UE8M0 NaN code 0xFF");
  }
}

// Copies `rows` rows of `row_len` elements; destination row r takes source row source_row(r).
template <typename T, typename RowMap>
std::vector<T> gather_rows(const std::vector<T>& source, uint64_t rows, uint64_t row_len, RowMap source_row) {
  std::vector<T> out(rows * row_len);
  for (uint64_t r = 0; r < rows; ++r) {
    memcpy(out.data() + r * row_len, source.data() + static_cast<uint64_t>(source_row(r)) * row_len,
           row_len * sizeof(T));
  }
  return out;
}

// Inverse of gather_rows: destination row dest_row(r) takes source row r.
template <typename T, typename RowMap>
std::vector<T> scatter_rows(const std::vector<T>& source, uint64_t rows, uint64_t row_len, RowMap dest_row) {
  std::vector<T> out(rows * row_len);
  for (uint64_t r = 0; r < rows; ++r) {
    memcpy(out.data() + static_cast<uint64_t>(dest_row(r)) * row_len, source.data() + r * row_len,
           row_len * sizeof(T));
  }
  return out;
}

// Transformed fp8 scale runs -> canonical blocks. Every run of one block must carry the same bits,
// or the transformed scales cannot have come from transform_weights.
template <typename BlockOfRun>
std::vector<float> collapse_scale_runs(const std::vector<float>& runs, uint64_t num_runs, uint64_t num_blocks,
                                       uint64_t columns, const std::string& name, BlockOfRun block_of_run) {
  std::vector<float> blocks(num_blocks * columns);
  std::vector<bool> seen(num_blocks, false);
  for (uint64_t run = 0; run < num_runs; ++run) {
    const uint64_t block = static_cast<uint64_t>(block_of_run(run));
    for (uint64_t c = 0; c < columns; ++c) {
      const float value = runs[run * columns + c];
      float& slot = blocks[block * columns + c];
      require(!seen[block] || float_bits(slot) == float_bits(value), name.c_str(), "scale runs of canonical block [",
              block, "][", c, "] disagree (", slot, " and ", value, " at run ", run, ")");
      slot = value;
    }
    seen[block] = true;
  }
  return blocks;
}

// The canonical 128-row block that holds transformed 64-row run `run` of w1, and of w2.
int32_t w1_block_of_run(uint64_t run, int32_t intermediate) {
  return l1_canonical_row(static_cast<int32_t>(run * kFp8ScaleRun), intermediate) / kScaleBlock;
}

uint64_t w2_block_of_run(uint64_t run) { return run * kFp8ScaleRun / kScaleBlock; }

// Appends rows [first, first + count) of a row-major array with rows of row_len elements.
template <typename T>
void append_rows(std::vector<T>& out, const std::vector<T>& source, uint64_t first, uint64_t count,
                 uint64_t row_len) {
  out.insert(out.end(), source.begin() + static_cast<ptrdiff_t>(first * row_len),
             source.begin() + static_cast<ptrdiff_t>((first + count) * row_len));
}

// Concatenates the columns of row-major arrays that share their row count.
template <typename T, typename Field, typename RowLen>
std::vector<T> concat_columns(const std::vector<StoredExpert>& experts, uint64_t rows, Field field, RowLen row_len) {
  std::vector<T> out;
  for (uint64_t r = 0; r < rows; ++r) {
    for (const StoredExpert& expert : experts) append_rows(out, expert.*field, r, 1, row_len(expert));
  }
  return out;
}

// w1-like arrays: all experts' gate halves first, then all their up halves.
template <typename T, typename Field, typename HalfRows>
std::vector<T> concat_gate_up(const std::vector<StoredExpert>& experts, uint64_t row_len, Field field,
                              HalfRows half_rows) {
  std::vector<T> out;
  for (int half = 0; half < 2; ++half) {
    for (const StoredExpert& expert : experts) {
      append_rows(out, expert.*field, half * half_rows(expert), half_rows(expert), row_len);
    }
  }
  return out;
}

uint16_t load_bf16(const std::vector<uint8_t>& bytes, uint64_t index) {
  return static_cast<uint16_t>(bytes[2 * index] | (bytes[2 * index + 1] << 8));
}

uint8_t load_e2m1(const std::vector<uint8_t>& bytes, uint64_t index) {
  const uint8_t pair = bytes[index / 2];
  return (index % 2 == 0) ? (pair & 0xF) : (pair >> 4);
}

// One matrix [rows][cols] in each recipe's canonical format.
std::vector<float> dequantize_matrix(Recipe recipe, uint64_t rows, uint64_t cols, const std::vector<uint8_t>& codes,
                                     const std::vector<float>& block_scales, const std::vector<uint8_t>& mx_scales) {
  std::vector<float> out(rows * cols);
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      const uint64_t index = r * cols + c;
      switch (recipe) {
        case Recipe::fp8:
          out[index] = e4m3_to_float(codes[index]) *
                       block_scales[(r / kScaleBlock) * (cols / kScaleBlock) + c / kScaleBlock];
          break;
        case Recipe::fp8_fp4:
          out[index] = e2m1_to_float(load_e2m1(codes, index)) * ue8m0_to_float(mx_scales[index / kMxBlock]);
          break;
        case Recipe::bf16:
          out[index] = bf16_to_float(load_bf16(codes, index));
          break;
      }
    }
  }
  return out;
}

struct QuantizedMatrix {
  std::vector<uint8_t> codes;
  std::vector<float> block_scales;
  std::vector<uint8_t> mx_scales;
};

QuantizedMatrix quantize_matrix(Recipe recipe, uint64_t rows, uint64_t cols, const std::vector<float>& values,
                                const char* name) {
  for (uint64_t index = 0; index < values.size(); ++index) {
    require(std::isfinite(values[index]), name, "weight [", index / cols, "][", index % cols,
            "] must be finite, got ", values[index]);
  }
  QuantizedMatrix out;
  switch (recipe) {
    case Recipe::fp8: {
      out.codes.resize(rows * cols);
      const uint64_t col_blocks = cols / kScaleBlock;
      out.block_scales.resize((rows / kScaleBlock) * col_blocks);
      for (uint64_t rb = 0; rb < rows / kScaleBlock; ++rb) {
        for (uint64_t cb = 0; cb < col_blocks; ++cb) {
          const uint64_t first = rb * kScaleBlock * cols + cb * kScaleBlock;
          float amax = 0.0f;
          for (uint64_t r = 0; r < kScaleBlock; ++r) {
            for (uint64_t c = 0; c < kScaleBlock; ++c) amax = std::fmax(amax, std::fabs(values[first + r * cols + c]));
          }
          const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
          out.block_scales[rb * col_blocks + cb] = quantizer.scale;
          for (uint64_t r = 0; r < kScaleBlock; ++r) {
            for (uint64_t c = 0; c < kScaleBlock; ++c) {
              out.codes[first + r * cols + c] = quantizer.quantize(values[first + r * cols + c]);
            }
          }
        }
      }
      break;
    }
    case Recipe::fp8_fp4: {
      out.codes.assign(rows * cols / 2, 0);
      out.mx_scales.resize(rows * cols / kMxBlock);
      for (uint64_t group = 0; group < out.mx_scales.size(); ++group) {
        const uint64_t first = group * kMxBlock;
        float amax = 0.0f;
        for (uint64_t j = 0; j < kMxBlock; ++j) amax = std::fmax(amax, std::fabs(values[first + j]));
        const uint8_t scale_code = mxfp4_scale_for_amax(amax);
        const float scale = ue8m0_to_float(scale_code);
        out.mx_scales[group] = scale_code;
        for (uint64_t j = 0; j < kMxBlock; ++j) {
          const uint64_t index = first + j;
          const uint8_t code = float_to_e2m1(values[index] / scale);  // exact: scale is a power of two
          out.codes[index / 2] |= (index % 2 == 0) ? code : static_cast<uint8_t>(code << 4);
        }
      }
      break;
    }
    case Recipe::bf16: {
      out.codes.resize(2 * rows * cols);
      for (uint64_t index = 0; index < rows * cols; ++index) {
        const uint16_t bits = float_to_bf16(values[index]);
        out.codes[2 * index] = static_cast<uint8_t>(bits & 0xFF);
        out.codes[2 * index + 1] = static_cast<uint8_t>(bits >> 8);
      }
      break;
    }
  }
  return out;
}

}  // namespace

StoredExpertSizes canonical_sizes(Recipe recipe, int32_t hidden, int32_t intermediate) {
  return sizes_for(recipe, hidden, intermediate, false);
}

StoredExpertSizes transformed_sizes(Recipe recipe, int32_t hidden, int32_t intermediate) {
  return sizes_for(recipe, hidden, intermediate, true);
}

void check_canonical(const StoredExpert& expert, Recipe recipe, const char* name) {
  const std::string prefix = name;
  check_sizes(expert, recipe, false, prefix);
  const uint64_t h = static_cast<uint64_t>(expert.hidden);
  const uint64_t i = static_cast<uint64_t>(expert.intermediate);
  if (recipe == Recipe::fp8) {
    check_f32_scales(expert.w1_scales, h / kScaleBlock, prefix + ".w1_scales");
    check_f32_scales(expert.w2_scales, i / kScaleBlock, prefix + ".w2_scales");
  } else if (recipe == Recipe::fp8_fp4) {
    check_ue8m0_scales(expert.w1_mx_scales, h / kMxBlock, prefix + ".w1_mx_scales");
    check_ue8m0_scales(expert.w2_mx_scales, i / kMxBlock, prefix + ".w2_mx_scales");
  }
}

StoredExpert transform_weights(const StoredExpert& canonical, Recipe recipe) {
  check_canonical(canonical, recipe, "canonical");
  const int32_t intermediate = canonical.intermediate;
  const uint64_t h = static_cast<uint64_t>(canonical.hidden);
  const uint64_t w1_rows = 2 * static_cast<uint64_t>(intermediate);
  auto canonical_row = [intermediate](uint64_t row) {
    return l1_canonical_row(static_cast<int32_t>(row), intermediate);
  };

  StoredExpert out;
  out.hidden = canonical.hidden;
  out.intermediate = intermediate;
  out.w1 = gather_rows(canonical.w1, w1_rows, row_bytes(recipe, h), canonical_row);
  out.w2 = canonical.w2;
  if (recipe == Recipe::fp8) {
    const uint64_t h_blocks = h / kScaleBlock;
    const uint64_t i_blocks = static_cast<uint64_t>(intermediate) / kScaleBlock;
    out.w1_scales = gather_rows(canonical.w1_scales, w1_rows / kFp8ScaleRun, h_blocks,
                                [intermediate](uint64_t run) { return w1_block_of_run(run, intermediate); });
    out.w2_scales = gather_rows(canonical.w2_scales, h / kFp8ScaleRun, i_blocks, w2_block_of_run);
  } else if (recipe == Recipe::fp8_fp4) {
    out.w1_mx_scales = gather_rows(canonical.w1_mx_scales, w1_rows, h / kMxBlock, canonical_row);
    out.w2_mx_scales = canonical.w2_mx_scales;
  }
  return out;
}

StoredExpert untransform_weights(const StoredExpert& transformed, Recipe recipe) {
  const std::string name = "transformed";
  check_sizes(transformed, recipe, true, name);
  const int32_t intermediate = transformed.intermediate;
  const uint64_t h = static_cast<uint64_t>(transformed.hidden);
  const uint64_t i = static_cast<uint64_t>(intermediate);
  const uint64_t w1_rows = 2 * i;
  auto canonical_row = [intermediate](uint64_t row) {
    return l1_canonical_row(static_cast<int32_t>(row), intermediate);
  };

  StoredExpert out;
  out.hidden = transformed.hidden;
  out.intermediate = intermediate;
  out.w1 = scatter_rows(transformed.w1, w1_rows, row_bytes(recipe, h), canonical_row);
  out.w2 = transformed.w2;
  if (recipe == Recipe::fp8) {
    out.w1_scales = collapse_scale_runs(transformed.w1_scales, w1_rows / kFp8ScaleRun, w1_rows / kScaleBlock,
                                        h / kScaleBlock, name + ".w1_scales",
                                        [intermediate](uint64_t run) { return w1_block_of_run(run, intermediate); });
    out.w2_scales = collapse_scale_runs(transformed.w2_scales, h / kFp8ScaleRun, h / kScaleBlock, i / kScaleBlock,
                                        name + ".w2_scales", w2_block_of_run);
  } else if (recipe == Recipe::fp8_fp4) {
    out.w1_mx_scales = scatter_rows(transformed.w1_mx_scales, w1_rows, h / kMxBlock, canonical_row);
    out.w2_mx_scales = transformed.w2_mx_scales;
  }
  return out;
}

StoredExpert concat_shared_experts(const std::vector<StoredExpert>& experts, Recipe recipe) {
  require(!experts.empty(), "shared_experts", "must hold at least one expert");
  const int32_t hidden = experts.front().hidden;
  int64_t total_intermediate = 0;
  for (size_t s = 0; s < experts.size(); ++s) {
    const std::string name = "shared_experts[" + std::to_string(s) + "]";
    check_canonical(experts[s], recipe, name.c_str());
    require(experts[s].hidden == hidden, (name + ".hidden").c_str(), "must equal shared_experts[0].hidden (",
            hidden, "), got ", experts[s].hidden);
    total_intermediate += experts[s].intermediate;
  }
  require(total_intermediate <= INT32_MAX / 2, "shared_experts", "total intermediate must stay below 2^30, got ",
          total_intermediate);

  const uint64_t h = static_cast<uint64_t>(hidden);
  auto rows_of = [](uint64_t per_block) {
    return [per_block](const StoredExpert& e) { return static_cast<uint64_t>(e.intermediate) / per_block; };
  };
  StoredExpert out;
  out.hidden = hidden;
  out.intermediate = static_cast<int32_t>(total_intermediate);
  out.w1 = concat_gate_up<uint8_t>(experts, row_bytes(recipe, h), &StoredExpert::w1, rows_of(1));
  out.w2 = concat_columns<uint8_t>(experts, h, &StoredExpert::w2, [recipe](const StoredExpert& e) {
    return row_bytes(recipe, static_cast<uint64_t>(e.intermediate));
  });
  if (recipe == Recipe::fp8) {
    // Block rows of w1's scales split into gate and up halves like the rows they cover.
    out.w1_scales = concat_gate_up<float>(experts, h / kScaleBlock, &StoredExpert::w1_scales, rows_of(kScaleBlock));
    out.w2_scales = concat_columns<float>(experts, h / kScaleBlock, &StoredExpert::w2_scales, rows_of(kScaleBlock));
  } else if (recipe == Recipe::fp8_fp4) {
    out.w1_mx_scales = concat_gate_up<uint8_t>(experts, h / kMxBlock, &StoredExpert::w1_mx_scales, rows_of(1));
    out.w2_mx_scales = concat_columns<uint8_t>(experts, h, &StoredExpert::w2_mx_scales, rows_of(kMxBlock));
  }
  return out;
}

DenseExpert dequantize(const StoredExpert& canonical, Recipe recipe) {
  check_canonical(canonical, recipe, "canonical");
  const uint64_t h = static_cast<uint64_t>(canonical.hidden);
  const uint64_t i = static_cast<uint64_t>(canonical.intermediate);
  DenseExpert out;
  out.hidden = canonical.hidden;
  out.intermediate = canonical.intermediate;
  out.w1 = dequantize_matrix(recipe, 2 * i, h, canonical.w1, canonical.w1_scales, canonical.w1_mx_scales);
  out.w2 = dequantize_matrix(recipe, h, i, canonical.w2, canonical.w2_scales, canonical.w2_mx_scales);
  return out;
}

StoredExpert quantize(const DenseExpert& dense, Recipe recipe) {
  check_dims(dense.hidden, dense.intermediate, "dense.");
  const uint64_t h = static_cast<uint64_t>(dense.hidden);
  const uint64_t i = static_cast<uint64_t>(dense.intermediate);
  check_size(dense.w1, sizeof(float) * 2 * i * h, "dense.w1");
  check_size(dense.w2, sizeof(float) * h * i, "dense.w2");
  QuantizedMatrix w1 = quantize_matrix(recipe, 2 * i, h, dense.w1, "dense.w1");
  QuantizedMatrix w2 = quantize_matrix(recipe, h, i, dense.w2, "dense.w2");
  StoredExpert out;
  out.hidden = dense.hidden;
  out.intermediate = dense.intermediate;
  out.w1 = std::move(w1.codes);
  out.w2 = std::move(w2.codes);
  out.w1_scales = std::move(w1.block_scales);
  out.w2_scales = std::move(w2.block_scales);
  out.w1_mx_scales = std::move(w1.mx_scales);
  out.w2_mx_scales = std::move(w2.mx_scales);
  return out;
}

}  // namespace megamoe
