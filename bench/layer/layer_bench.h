// `megamoe bench`: the whole layer, per token count, against the unfused baseline (unfused_baseline.h),
// with floors from ceilings measured in the same run, printed and written as JSON in the format of
// docs/results.md (benchmark "layer").
//
// Run mode: with at least --ranks Hopper GPUs, every rank is a process on its own GPU (NCCL) and both
// the fused layer and the baseline run; otherwise the ranks are emulated on GPU 0, only the fused
// layer runs, and rows say "mode": "emulated" with no baseline figures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/presets.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"

namespace megamoe::bench {

struct BenchOptions {
  const Preset* preset = nullptr;
  Problem problem;              // max_tokens_per_rank is the largest of `tokens`
  std::vector<int32_t> tokens;  // tokens per rank of each measured size, in the order given
  Routing routing = Routing::uniform;
  uint64_t seed = 1;
  int32_t repeats = 10;
  std::vector<Schedule> schedules = {Schedule::staged, Schedule::fused};  // each timed, in the same rounds
  // --inputs buffer: the calls read x, its scales and the route weights from the buffer's own input
  // regions (buffer_input_views), as an engine that writes them there does; copied: from separate
  // tensors, which each call first copies into those regions.
  bool inputs_in_buffer = false;
  // --producers: also times what an engine runs before the layer (producers.h: the router's logits
  // and top-k, the activations' quantization for fp8 recipes), alone and followed by the layer.
  bool producers = false;
  // --streaming: also times the producers followed by the fused layer two ways, as graphs: on the
  // producers' outputs (batch) and reading them from the buffer's front ring (CallOptions::streamed).
  // Implies --producers; the buffer's front ring holds two calls (front_ring_shape).
  bool streaming = false;
  int32_t chunk_tokens = 0;  // --chunk-tokens: a streamed call's chunk (0: the whole call)
  std::string out;      // the JSON results file
  std::string trace_dir;  // --trace: one fused call's event log per size and rank, as JSON, here
  std::string command;  // the command line, for the report
};

// The token counts measured when --tokens is not given.
inline const std::vector<int32_t> kDefaultBenchTokens = {1, 8, 128, 512, 2048, 8192};

// The flags of `megamoe bench` (everything after the command word). Throws megamoe::Error whose
// message starts with the flag it is about.
BenchOptions parse_bench(const std::vector<std::string>& args);

// The usage lines of `megamoe bench`, for `megamoe help`.
const char* bench_usage();

// The small bf16 problem on which the baseline is checked against the fused layer before any timing
// (every rank's rows as the timed problem's, 32 tokens per rank, no front ring).
Problem baseline_check_problem(const Problem& timed);

// Runs the benchmark and writes the report; throws megamoe::Error when it cannot.
void run_bench(const BenchOptions& options);

// ---- The work model the floors and rates are computed from ------------------------------------

// What one rank's GPU does in one layer call: the staged layer's traffic, route-granular (every
// route's token row is moved and its BF16 result returned, as both the fused layer and the baseline
// do). Masked routes count nowhere.
struct RankWork {
  int64_t tokens = 0;
  int64_t routes_sent = 0;      // unmasked routes of this rank's tokens, to any rank
  int64_t routes_received = 0;  // routes to this rank's experts, from every rank (itself included)
  int64_t remote_sent = 0;      // routes of this rank's tokens to experts on other ranks
  int64_t remote_received = 0;  // routes from other ranks' tokens to this rank's experts
  int64_t active_experts = 0;   // local experts that received at least one route
  double flops = 0;             // 2 * routes_received * 3 * I * H + 2 * tokens * 3 * S * I * H
  // Weights of the active experts (and the shared experts when there are tokens), read once; x read
  // once; the L1 and L2 pools, the shared experts' L2 input and the combine slots written once and
  // read once; y written once. FP32 scales count with their rows.
  double hbm_bytes = 0;
  double link_out_bytes = 0;  // token rows to remote owners + BF16 results for remote tokens
  double link_in_bytes = 0;   // token rows from remote tokens + BF16 results of this rank's remote routes
};

// One entry per rank; batches[r] is rank r's batch.
std::vector<RankWork> layer_work(const Problem& problem, const std::vector<RankBatch>& batches);

// Measured in the same run; NaN where not measured (peer copies need two GPUs).
struct Ceilings {
  double hbm_copy_gbps = 0;
  double fp8_dense_tflops = 0;
  double bf16_dense_tflops = 0;
  double peer_copy_gbps = 0;
};

// Lower bounds on the time of one call, in microseconds, for the busiest GPU: its FLOPs at the
// recipe's dense rate, its HBM bytes at the copy rate, and the larger of its outgoing and incoming
// cross-rank bytes at the peer copy rate (NVLink is full duplex). With emulated ranks one GPU does
// every rank's work, so the sums count and there is no NVLink floor (NaN); with no cross-rank bytes
// the NVLink floor is 0.
struct Floors {
  double compute_us = 0;
  double hbm_us = 0;
  double nvlink_us = 0;
  double largest_us() const;  // of those that are not NaN
};
Floors layer_floors(const Problem& problem, const std::vector<RankWork>& work, const Ceilings& ceilings, bool emulated);

// Achieved rates per GPU (the work of all ranks over the GPUs doing it, over the time): TFLOP/s, HBM
// GB/s, and outgoing cross-rank GB/s (NaN with emulated ranks, which have no NVLink between them).
struct Rates {
  double tflops = 0;
  double hbm_gbps = 0;
  double nvlink_gbps = 0;
};
Rates layer_rates(const std::vector<RankWork>& work, double us, bool emulated);

}  // namespace megamoe::bench
