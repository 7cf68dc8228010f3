// Ceilings measured in the same run as a benchmark: what its ratios are taken against.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace megamoe::bench {

// Throws megamoe::Error naming `what` when a CUDA call did not succeed.
void cuda_ok(cudaError_t status, const char* what);

// Fills `count` elements with random finite values (never zeros: they hide unwritten outputs and run
// faster than real data): E4M3 codes of uniform [-448, 448), or BF16 of uniform [-magnitude, magnitude).
void fill_random(void* data, uint64_t count, bool bf16, float bf16_magnitude, uint64_t seed, cudaStream_t stream);
// Sets `count` floats to `value`.
void fill_value(float* data, uint64_t count, float value, cudaStream_t stream);

// Median time in microseconds of `work` on `stream` over `repeats` runs after `warmups`, with events.
// The events bracket the host's launch preparation too, since the stream is idle when `work` starts.
double time_us(const std::function<void()>& work, cudaStream_t stream, int repeats = 10, int warmups = 2);

// Median times in microseconds of each of `works`, timed as time_us does, but run in turn within
// each of `repeats` rounds (a, b, c, a, b, c, ...) after `warmups` such rounds, so that kernels that
// are compared see the same power and clock state. Timed one after the other they do not: the board
// reaches its power cap during a series of dense FP8 products, and the fp8 L1 GEMM at 32 experts x
// 1024 tokens took 1747-1749 us timed right after them against 1475-1478 us timed before them.
std::vector<double> interleaved_us(std::span<const std::function<void()>> works, cudaStream_t stream, int repeats,
                                   int warmups);

// Reads a buffer four times the size of L2 (clean lines: no write-backs later), so that the next
// kernel finds none of its operands there.
class L2Flush {
 public:
  L2Flush();
  ~L2Flush();
  L2Flush(const L2Flush&) = delete;
  L2Flush& operator=(const L2Flush&) = delete;
  void run(cudaStream_t stream) const;

 private:
  uint4* buffer_ = nullptr;
  uint64_t vectors_ = 0;
  int grid_ = 0;
};

// As time_us, with L2 flushed before each run (weights come from HBM, as they do in a layer). The
// flush is queued first, so the host prepares the launch while it runs: the time is the device's.
double time_cold_us(const std::function<void()>& work, cudaStream_t stream, const L2Flush& flush, int repeats = 10,
                    int warmups = 2);

// Time in microseconds of one launch that reads `bytes` (a multiple of 16) from `data` with nothing
// else to do, timed as time_cold_us: the floor of any single launch that streams those bytes from
// HBM, its fixed costs (launch, ramp-up, the last wave) included.
double hbm_read_us(const void* data, uint64_t bytes, cudaStream_t stream, const L2Flush& flush, int repeats = 10,
                   int warmups = 2);

// Time in microseconds of one launch that streams weight tiles from HBM as the decode GEMM's producer
// does (TMA boxes of 256 rows x 128 bytes, 128-byte swizzle, a ring of six 32 KiB stages per SM),
// with no math, no epilogue, and the (tile, K block) boxes split evenly over every SM. `weights` has
// `rows` rows of `row_bytes`; tile_rows holds each tile's first row. Timed as time_cold_us: what a
// GEMM streaming those tiles could reach at best, which the same-bytes read (a flat, sequential
// read) does not show.
double tile_stream_us(const void* weights, uint64_t rows, uint64_t row_bytes, std::span<const uint32_t> tile_rows,
                      cudaStream_t stream, const L2Flush& flush, int repeats = 10, int warmups = 2,
                      uint32_t box_bytes = 128);

// Device-to-device copy of 1 GiB, counting bytes read plus written.
double hbm_copy_gbps();
// Dense 8192^3 matrix products through cuBLASLt: FP8 E4M3 (per-tensor scales, FP32 accumulation,
// BF16 output) and BF16.
double fp8_dense_tflops();
double bf16_dense_tflops();

// How a dense FP8 product scales its operands: one scale per tensor (the plain FP8 rate), or the fp8
// recipe's own blocks (1x128 per token row, 128x128 per weight block), which cuBLASLt promotes as
// our kernel does.
enum class DenseScaling { per_tensor, blocks };

// A dense product D[m x n] = A[m x k] B[n x k]^T through cuBLASLt, both operands K-major (as tokens
// and weights are), FP32 accumulation, BF16 output; FP8 E4M3 (DenseScaling), or BF16. The
// GEMM benchmark times it at a row's own shape interleaved with the row's own launches
// (interleaved_us), so that both run in the same power and clock state: back-to-back launches of
// several milliseconds run into the board's power cap, which the short 8192^3 ceiling at the start
// of a run does not.
class DenseGemm {
 public:
  // Random operands, up to max_m rows.
  DenseGemm(uint64_t max_m, uint32_t n, uint32_t k, bool fp8, DenseScaling scaling = DenseScaling::per_tensor);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;
  // One launch of the product at m rows on `stream`, with the algorithm cuBLASLt picks for that shape
  // (chosen here, once); an empty function when it has none (block scaling needs a recent cuBLASLt).
  std::function<void()> launcher(uint64_t m, cudaStream_t stream) const;
  // Median TFLOP/s at m rows over `repeats` runs after `warmups`; NaN when there is no algorithm.
  double tflops(uint64_t m, cudaStream_t stream, int repeats, int warmups) const;
  // TFLOP/s of the product at m rows taking `us` microseconds.
  double tflops_at(uint64_t m, double us) const { return 2.0 * double(m) * n_ * k_ / (us * 1e-6) / 1e12; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  uint64_t max_m_;
  uint32_t n_, k_;
  bool fp8_;
  DenseScaling scaling_;
};

}  // namespace megamoe::bench
