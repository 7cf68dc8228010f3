// DeviceWeights::synthetic: SyntheticWeights' experts generated on the GPU, already transformed.
// Each transformed element is traced back to its canonical position (expert stream, row, column)
// through the same mappings the host uses (l1_canonical_row, concat_shared_experts), then generated
// with the same MEGAMOE_HD functions, so the bits equal the host path's.
#include <cuda_runtime_api.h>

#include "layer/prepare_fp4.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/synthetic.h"
#include "megamoe/weights.h"

namespace megamoe {
namespace {

// One stacked weight matrix to generate: `experts` experts of rows x cols transformed elements.
struct MatrixSpec {
  uint8_t* codes;      // E4M3 codes, packed E2M1 pairs or BF16 bits
  float* scales;       // fp8: per 64 rows x 128 columns; nullptr otherwise
  uint8_t* mx_scales;  // fp8_fp4: transformed UE8M0 scales [experts * rows][cols / 32]
  Recipe recipe;
  uint64_t seed;
  uint32_t experts, rows, cols;
  int32_t first_expert;  // global id of the first routed expert; ignored for shared
  bool first_linear;     // W1 (rows permuted by l1_canonical_row) or W2
  bool shared;           // the concatenation of `shared_count` shared experts
  uint32_t unit_intermediate;  // I of one expert
  uint32_t shared_count;
  float range;           // synthetic_weight_range of the canonical fan-in
};

struct CanonicalPosition {
  uint64_t stream_values;
  uint64_t stream_scales;
  uint32_t row;   // in the canonical matrix of one expert
  uint32_t col;
  uint32_t cols;  // canonical columns of one expert
};

__device__ CanonicalPosition canonical_position(const MatrixSpec& m, uint32_t expert, uint32_t row, uint32_t col) {
  const uint32_t unit = m.unit_intermediate;
  int32_t index = m.first_expert + static_cast<int32_t>(expert);
  CanonicalPosition position;
  if (m.first_linear) {
    const uint32_t total = m.shared ? m.shared_count * unit : unit;
    const uint32_t canonical = static_cast<uint32_t>(l1_canonical_row(static_cast<int32_t>(row), static_cast<int32_t>(total)));
    position.row = canonical;
    if (m.shared) {  // [gate_0; gate_1; ...; up_0; up_1; ...]
      const bool up = canonical >= total;
      const uint32_t offset = up ? canonical - total : canonical;
      index = static_cast<int32_t>(offset / unit);
      position.row = (up ? unit : 0) + offset % unit;
    }
    position.col = col;
    position.cols = m.cols;
  } else {
    position.row = row;
    position.col = col;
    position.cols = unit;
    if (m.shared) {  // columns concatenated
      index = static_cast<int32_t>(col / unit);
      position.col = col % unit;
    }
  }
  const WeightMatrix values = m.first_linear ? WeightMatrix::w1 : WeightMatrix::w2;
  const WeightMatrix scales = m.first_linear ? WeightMatrix::w1_scales : WeightMatrix::w2_scales;
  position.stream_values = m.shared ? shared_weight_stream(index, values) : routed_weight_stream(index, values);
  position.stream_scales = m.shared ? shared_weight_stream(index, scales) : routed_weight_stream(index, scales);
  return position;
}

__global__ void generate_codes(const MatrixSpec m) {
  const uint64_t per_expert = uint64_t{m.rows} * m.cols;
  const uint64_t total = per_expert * m.experts;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t expert = static_cast<uint32_t>(i / per_expert);
    const uint32_t row = static_cast<uint32_t>(i % per_expert / m.cols);
    const uint32_t col = static_cast<uint32_t>(i % m.cols);
    const CanonicalPosition c = canonical_position(m, expert, row, col);
    const uint64_t index = uint64_t{c.row} * c.cols + c.col;
    if (m.recipe == Recipe::fp8) {
      m.codes[i] = synthetic_e4m3_code(m.seed, c.stream_values, index);
    } else {
      reinterpret_cast<uint16_t*>(m.codes)[i] = synthetic_bf16(m.seed, c.stream_values, index, m.range);
    }
  }
}

// fp8_fp4: one packed byte (columns 2j, 2j + 1) per thread iteration.
__global__ void generate_packed_codes(const MatrixSpec m) {
  const uint32_t pairs = m.cols / 2;
  const uint64_t per_expert = uint64_t{m.rows} * pairs;
  const uint64_t total = per_expert * m.experts;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t expert = static_cast<uint32_t>(i / per_expert);
    const uint32_t row = static_cast<uint32_t>(i % per_expert / pairs);
    const uint32_t col = 2 * static_cast<uint32_t>(i % pairs);
    const CanonicalPosition c = canonical_position(m, expert, row, col);
    m.codes[i] = synthetic_e2m1_pair(m.seed, c.stream_values, (uint64_t{c.row} * c.cols + c.col) / 2);
  }
}

// fp8_fp4: the UE8M0 scale of each group of 32 columns, rows in transformed order.
__global__ void generate_mx_scales(const MatrixSpec m) {
  const uint32_t groups = m.cols / kMxBlock;
  const uint64_t per_expert = uint64_t{m.rows} * groups;
  const uint64_t total = per_expert * m.experts;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t expert = static_cast<uint32_t>(i / per_expert);
    const uint32_t row = static_cast<uint32_t>(i % per_expert / groups);
    const uint32_t col = static_cast<uint32_t>(i % groups) * kMxBlock;
    const CanonicalPosition c = canonical_position(m, expert, row, col);
    m.mx_scales[i] = synthetic_ue8m0_scale(m.seed, c.stream_scales, (uint64_t{c.row} * c.cols + c.col) / kMxBlock, m.range);
  }
}

// Transformed fp8 scales: one per 64 rows x 128 columns, the canonical 128x128 block's scale.
__global__ void generate_scales(const MatrixSpec m) {
  const uint32_t row_blocks = m.rows / 64, col_blocks = m.cols / 128;
  const uint64_t total = uint64_t{m.experts} * row_blocks * col_blocks;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t expert = static_cast<uint32_t>(i / (uint64_t{row_blocks} * col_blocks));
    const uint32_t row_block = static_cast<uint32_t>(i / col_blocks % row_blocks);
    const uint32_t col_block = static_cast<uint32_t>(i % col_blocks);
    const CanonicalPosition c = canonical_position(m, expert, row_block * 64, col_block * 128);
    const uint64_t block = uint64_t{c.row / 128} * (c.cols / 128) + c.col / 128;
    m.scales[i] = synthetic_fp8_block_scale(m.seed, c.stream_scales, block, m.range);
  }
}

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

}  // namespace

std::unique_ptr<DeviceWeights> DeviceWeights::synthetic(const Problem& problem, uint64_t seed) {
  validate(problem);
  std::unique_ptr<DeviceWeights> weights(new DeviceWeights());
  const bool f32_scales = problem.recipe == Recipe::fp8;
  const bool packed = problem.recipe == Recipe::fp8_fp4;
  const DType codes_type = packed ? DType::e2m1x2 : activation_dtype(problem.recipe);
  const uint32_t element_bytes = static_cast<uint32_t>(activation_bytes(problem.recipe));
  const int64_t h = problem.hidden;

  auto make = [&](bool shared, bool first_linear, uint32_t experts, uint32_t intermediate, LinearWeights& linear) {
    MatrixSpec m{};
    m.recipe = problem.recipe;
    m.seed = seed;
    m.experts = experts;
    m.rows = first_linear ? 2 * intermediate : static_cast<uint32_t>(h);
    m.cols = first_linear ? static_cast<uint32_t>(h) : intermediate;
    m.first_expert = problem.rank * problem.experts_per_rank();
    m.first_linear = first_linear;
    m.shared = shared;
    m.unit_intermediate = static_cast<uint32_t>(problem.intermediate);
    m.shared_count = static_cast<uint32_t>(problem.num_shared_experts);
    m.range = synthetic_weight_range(first_linear ? problem.hidden : problem.intermediate);
    const uint64_t elements = uint64_t{experts} * m.rows * m.cols;
    m.codes = reinterpret_cast<uint8_t*>(weights->allocate(packed ? elements / 2 : elements * element_bytes));
    if (packed) generate_packed_codes<<<1024, 256>>>(m);
    else generate_codes<<<1024, 256>>>(m);
    cuda_ok(cudaGetLastError(), "generate_codes launch");
    const int64_t n = experts;
    linear.values = TensorView::contiguous(m.codes, codes_type, {n, m.rows, packed ? m.cols / 2 : m.cols}, Device::cuda);
    if (packed) {
      cuda_ok(cudaMalloc(&m.mx_scales, elements / kMxBlock), "cudaMalloc of UE8M0 scales");
      struct FreeScales {
        uint8_t* pointer;
        ~FreeScales() { cudaFree(pointer); }
      } free_scales{m.mx_scales};
      generate_mx_scales<<<1024, 256>>>(m);
      cuda_ok(cudaGetLastError(), "generate_mx_scales launch");
      prepare_fp4_matrices(*weights->allocations_, reinterpret_cast<char*>(m.codes), m.mx_scales, n, m.rows, m.cols,
                           linear.scales, linear.shifts);
    }
    if (f32_scales) {
      m.scales = reinterpret_cast<float*>(
          weights->allocate(uint64_t{experts} * (m.rows / 64) * (m.cols / 128) * sizeof(float)));
      generate_scales<<<256, 256>>>(m);
      cuda_ok(cudaGetLastError(), "generate_scales launch");
      linear.scales = TensorView::contiguous(m.scales, DType::f32, {n, m.rows / 64, m.cols / 128}, Device::cuda);
    }
  };
  LayerWeights& v = weights->view_;
  const uint32_t local = static_cast<uint32_t>(problem.experts_per_rank());
  const uint32_t intermediate = static_cast<uint32_t>(problem.intermediate);
  make(false, true, local, intermediate, v.routed.w1);
  make(false, false, local, intermediate, v.routed.w2);
  if (problem.num_shared_experts > 0) {
    const uint32_t concatenated = intermediate * static_cast<uint32_t>(problem.num_shared_experts);
    make(true, true, 1, concatenated, v.shared.w1);
    make(true, false, 1, concatenated, v.shared.w2);
  }
  cuda_ok(cudaDeviceSynchronize(), "synthetic weight generation");
  return weights;
}

}  // namespace megamoe
