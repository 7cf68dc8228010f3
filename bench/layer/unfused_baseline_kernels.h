// The unfused baseline's own kernels (everything it does not get from NCCL or cuBLASLt): the route
// permutation, the regrouping of received rows by expert, SwiGLU (+ FP8 quantization) and the
// weighted-sum combine. Each launcher checks its launch and throws megamoe::Error naming the kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::bench::baseline {

// Largest number of experts route_layout handles (two counters per expert in shared memory).
inline constexpr int32_t kMaxLayoutExperts = 6144;

// A counting sort of this rank's routes by global expert, in one block: send_counts[e] = routes to
// expert e (all num_experts entries are written, also when routes == 0), and route_position[route] =
// the route's row in the send buffer, whose rows are grouped by expert and so by destination rank
// (experts are numbered rank-major); -1 for a masked route (an id outside [0, num_experts)).
// The order of rows inside one expert's group is whatever the atomics give: every row is computed
// on its own and found again through route_position, so it does not change y.
void route_layout(const int32_t* topk_idx, int32_t routes, int32_t num_experts, int32_t* send_counts,
                  int32_t* route_position, cudaStream_t stream);

// send_rows[route_position[route]] = x[route / top_k] for every unmasked route; the same for the
// FP32 scale rows when `x_scales` is not null. row_bytes must be a multiple of 16.
void gather_rows(const uint8_t* x, const float* x_scales, const int32_t* route_position, int32_t routes, int32_t top_k,
                 uint32_t row_bytes, uint32_t scales_per_row, uint8_t* send_rows, float* send_scales,
                 cudaStream_t stream);

// Moves rows between source-major order ([source rank][local expert], as NCCL delivers them) and
// expert-major order ([local expert][source rank], as the per-expert GEMMs read them).
// counts: [sources][experts] rows per chunk, on the device. `total_rows` (the sum of counts, known on
// the host) only sizes the grid. Scales move with their rows when `scales` is not null.
struct RegroupRows {
  const int32_t* counts;
  int32_t sources;
  int32_t experts;
  bool to_expert_major;  // false: back from expert-major to source-major
  const uint8_t* from;
  uint8_t* to;
  uint32_t row_bytes;  // a multiple of 16
  const float* from_scales;
  float* to_scales;
  uint32_t scales_per_row;
};
void regroup_rows(const RegroupRows& args, int64_t total_rows, cudaStream_t stream);

// a[row][c] = SiLU(gate) * up for c < intermediate, where h [rows][2 * intermediate] (BF16) holds the
// L1 output in the transformed W1 row order (weights.h): channel c's gate is column
// 256 * (c / 128) + 128 * (c % 128 / 64) + c % 64 and its up the column 64 further on.
// fp8: a is stored as E4M3 codes of a[row][c] / out_scale (saturating); else as BF16.
void swiglu(const uint16_t* h, int64_t rows, int32_t intermediate, bool fp8, float out_scale, void* a,
            cudaStream_t stream);

// y[token] = BF16(sum over k of topk_weights[token][k] * results[route_position[token * top_k + k]]
//                 + shared[token]), in FP32, k in order, then the shared experts' row (when not null).
void combine(const uint16_t* results, const int32_t* route_position, const float* topk_weights, const uint16_t* shared,
             int32_t tokens, int32_t top_k, int32_t hidden, uint16_t* y, cudaStream_t stream);

}  // namespace megamoe::bench::baseline
