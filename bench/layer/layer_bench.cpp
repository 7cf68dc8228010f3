#include "bench/layer/layer_bench.h"

#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>

#include "bench/common/ceilings.h"
#include "bench/common/report.h"
#include "bench/common/shared_array.h"
#include "bench/layer/device_memory.h"
#include "cli/flags.h"
#include "bench/layer/unfused_baseline.h"
#include "comm/check.h"
#include "comm/launcher.h"
#include "megamoe/comm.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layout.h"
#include "megamoe/layer.h"
#include "megamoe/producers.h"
#include "megamoe/router.h"

namespace megamoe::bench {

using cli::Flags;
using cli::parse_list;
using cli::parse_number;
using cli::preset_flag;
using cli::ranks_flag;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int kWarmups = 2;
// The baseline's correctness check: bf16, this many tokens per rank, against the fused layer's y.
constexpr int32_t kCheckTokens = 32;
constexpr double kCheckBound = 1e-2;

// What a rank measured for one token count (or for the baseline check); NaN where not measured.
// Per schedule (indexed by Schedule): the call's median over the repeats, the same call captured
// once in a CUDA graph and replayed (no launch gaps), and the kernels in that graph.
struct RankMeasures {
  double us[2] = {kNaN, kNaN};
  double graph_us[2] = {kNaN, kNaN};
  int64_t launches[2] = {0, 0};
  double gemm_only_us = kNaN;  // the staged call's L1 and L2 launches alone, on the same rows
  double producers_graph_us = kNaN;          // --producers: the producers alone, as a graph
  double end_to_end_graph_us[2] = {kNaN, kNaN};  // the producers, then the call, as one graph
  // --streaming: the producers, then the fused call on their outputs (batch), streamed_mega_moe
  // reading them from the front ring (streamed), and streamed_mega_moe in the form it picks itself
  // (automatic, given the row's tokens as uniform_tokens), each as one graph.
  double streaming_batch_graph_us = kNaN;
  double streamed_graph_us = kNaN;
  double automatic_graph_us = kNaN;
  // The same producers publishing into the ring as plain launches, then mega_moe with
  // CallOptions::streamed after them: the streamed layer with nothing overlapped.
  double streamed_serial_graph_us = kNaN;
  double baseline_us = kNaN;
  double diff_squares = kNaN;      // sum over this rank's y of (baseline - fused)^2
  double fused_squares = kNaN;     // sum of fused^2
  int64_t baseline_nonfinite = 0;  // NaN or infinite values in the baseline's y
};

// sqrt(sum of diff^2 / sum of fused^2) over every rank.
double normalized_error(const RankMeasures* measures, int32_t ranks) {
  double diff = 0, norm = 0;
  for (int32_t r = 0; r < ranks; ++r) {
    diff += measures[r].diff_squares;
    norm += measures[r].fused_squares;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// ---- Ceilings, measured in a child process ---------------------------------------------------

// GPU 0 -> GPU 1 copy of 256 MiB (with peer access where the GPUs allow it), bytes per second.
double peer_copy_gbps() {
  constexpr size_t kBytes = 256ull << 20;
  void* source = nullptr;
  void* destination = nullptr;
  MEGAMOE_CHECK_CUDA(cudaSetDevice(1));
  MEGAMOE_CHECK_CUDA(cudaMalloc(&destination, kBytes));
  MEGAMOE_CHECK_CUDA(cudaSetDevice(0));
  MEGAMOE_CHECK_CUDA(cudaMalloc(&source, kBytes));
  MEGAMOE_CHECK_CUDA(cudaMemset(source, 1, kBytes));
  int can_access = 0;
  MEGAMOE_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, 0, 1));
  if (can_access) {
    const cudaError_t enabled = cudaDeviceEnablePeerAccess(1, 0);
    require(enabled == cudaSuccess || enabled == cudaErrorPeerAccessAlreadyEnabled, "cudaDeviceEnablePeerAccess(1)",
            "failed: ", cudaGetErrorString(enabled));
    cudaGetLastError();  // clears cudaErrorPeerAccessAlreadyEnabled
  }
  cudaStream_t stream = nullptr;
  MEGAMOE_CHECK_CUDA(cudaStreamCreate(&stream));
  const double us = bench::time_us(
      [&] { MEGAMOE_CHECK_CUDA(cudaMemcpyPeerAsync(destination, 1, source, 0, kBytes, stream)); }, stream, 10, 2);
  MEGAMOE_CHECK_CUDA(cudaStreamDestroy(stream));
  MEGAMOE_CHECK_CUDA(cudaFree(source));
  MEGAMOE_CHECK_CUDA(cudaSetDevice(1));
  MEGAMOE_CHECK_CUDA(cudaFree(destination));
  return kBytes / (us * 1e-6) / 1e9;
}

// In a child process: this one must stay free of CUDA to fork NCCL ranks afterwards.
Ceilings measure_ceilings_in_child(int32_t gpus) {
  SharedArray<Ceilings> result(1, Ceilings{kNaN, kNaN, kNaN, kNaN}, "bench");
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  require(pid >= 0, "bench", "could not fork the process that measures the ceilings: ", std::strerror(errno));
  if (pid == 0) {
    int status = 1;
    try {
      // This child runs no emulated ranks, so cuBLASLt's many kernels may load lazily, as CUDA's default
      // has it (the launcher asks for eager loading on behalf of emulated ranks).
      setenv("CUDA_MODULE_LOADING", "LAZY", 1);
      MEGAMOE_CHECK_CUDA(cudaSetDevice(0));
      Ceilings measured;
      measured.hbm_copy_gbps = bench::hbm_copy_gbps();
      measured.fp8_dense_tflops = bench::fp8_dense_tflops();
      measured.bf16_dense_tflops = bench::bf16_dense_tflops();
      measured.peer_copy_gbps = gpus >= 2 ? peer_copy_gbps() : kNaN;
      result[0] = measured;
      status = 0;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "megamoe: bench: measuring the ceilings failed: %s\n", error.what());
    }
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(status);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    require(errno == EINTR, "bench", "lost the process measuring the ceilings: ", std::strerror(errno));
  }
  require(WIFEXITED(status) && WEXITSTATUS(status) == 0, "bench", "measuring the ceilings failed (see above; status ",
          status, ")");
  return result[0];
}

// ---- One rank --------------------------------------------------------------------------------

// Everything the ranks need, made before they start.
struct BenchData {
  Problem problem;                              // `rank` is set by each rank
  std::vector<std::vector<RankBatch>> batches;  // [size][rank]
  Problem check_problem;                        // bf16, kCheckTokens
  std::vector<RankBatch> check_batches;         // [rank]; empty without a baseline
  bool with_baseline = true;  // one NCCL process per GPU and a recipe cuBLASLt can run (not fp8_fp4)
  uint64_t seed = 1;
  int32_t repeats = 10;
  std::vector<Schedule> schedules;
  bool inputs_in_buffer = false;
  std::string trace_dir;  // empty: no event logs
  bool producers = false;
  bool streaming = false;
  RouterConfig router;  // the preset's, for --producers
};

// What an engine runs on a rank's tokens before the layer (producers.h), in batch mode: the router's
// logits and top-k on BF16 activations, then their 1x128 quantization (fp8 recipes; bf16 takes x as
// it is). Inputs are random; outputs go to scratch, so that the timed layer calls keep the
// benchmark's routing: the kernels and their order are an engine's, the data dependence is not.
class BatchProducers {
 public:
  BatchProducers(const Problem& p, const RouterConfig& router, uint64_t seed, DeviceArena& memory)
      : problem_(p), router_(router) {
    const int64_t tokens = p.max_tokens_per_rank, hidden = p.hidden, experts = router.num_experts;
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    // Random BF16 values: `high`'s exponent bits, then a random sign, exponent's lowest bit and
    // mantissa, so magnitudes in [2^e, 2^(e+2)) for `high`'s exponent e (xorshift).
    const auto random_bf16 = [&](int64_t count, uint16_t high) {
      std::vector<uint16_t> values(static_cast<size_t>(count));
      for (uint16_t& v : values) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        v = static_cast<uint16_t>(high | (state & 0x80FF));
      }
      return values;
    };
    // x in [0.5, 2), and a router weight in [2^-7, 2^-5) drawn apart from it, so that the
    // logits spread by one to two (hidden 4096-7168): unsaturated scores and a near-uniform routing
    // (simulated: every expert routed to, the busiest at about twice the mean over 256 tokens).
    // (Until stop 69 the weight was x's first rows: DeepSeek-V3's sigmoid scores saturated and ties
    // sent about 45% of the routes to experts 0-12.)
    const std::vector<uint16_t> x_host = random_bf16(tokens * hidden, 0x3F00);
    const std::vector<uint16_t> weight_host = random_bf16(experts * hidden, 0x3C00);
    x_ = memory.allocate<uint16_t>(tokens * hidden, "bench: producers' x");
    weight_ = memory.allocate<uint16_t>(experts * hidden, "bench: router weight");
    MEGAMOE_CHECK_CUDA(cudaMemcpy(x_, x_host.data(), tokens * hidden * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CHECK_CUDA(cudaMemcpy(weight_, weight_host.data(), experts * hidden * 2, cudaMemcpyHostToDevice));
    logits_ = memory.allocate<float>(tokens * experts, "bench: router logits");
    topk_idx_ = memory.allocate<int32_t>(tokens * router.top_k, "bench: producers' topk_idx");
    topk_weights_ = memory.allocate<float>(tokens * router.top_k, "bench: producers' topk_weights");
    x_out_ = memory.allocate<uint8_t>(tokens * hidden, "bench: producers' quantized x");
    x_scales_ = memory.allocate<float>(tokens * (hidden / kScaleBlock), "bench: producers' x scales");
  }

  void run(int64_t tokens, cudaStream_t stream) const {
    const LayerInputs out = outputs(tokens);
    router_logits(x(tokens), router_weight(), logits(tokens), stream);
    route_tokens(router_, logits(tokens), TensorView{}, out.topk_idx, out.topk_weights, stream);
    if (problem_.recipe != Recipe::bf16) quantize_activations(x(tokens), out.x, out.x_scales, stream);
  }

  // The same producers for streamed_mega_moe, which launches them with the layer, in `form`; every
  // rank has `tokens` (the row's tokens per rank), the call's uniform_tokens.
  StreamedCall streamed_call(int64_t tokens, CallForm form) const {
    StreamedCall call;
    call.router = &router_;
    call.x = x(tokens);
    call.router_weight = router_weight();
    call.logits = logits(tokens);
    call.form = form;
    call.uniform_tokens = tokens;
    call.topk_idx = outputs(tokens).topk_idx;
    return call;
  }

  // The producers publishing `tokens` tokens into `buffer`'s front ring, one after the other, then
  // the layer reading them (CallOptions::streamed, with `options`' schedule fused): nothing overlapped.
  void run_streamed_serial(int32_t tokens, SymmBuffer& buffer, const LayerWeights& weights, const TensorView& y,
                           cudaStream_t stream, CallOptions options = CallOptions{Schedule::fused}) const {
    router_logits(x(tokens), router_weight(), logits(tokens), stream);
    route_tokens(router_, logits(tokens), TensorView{}, buffer, stream);
    quantize_activations(x(tokens), buffer, stream);
    options.schedule = Schedule::fused;
    options.streamed = true;
    LayerInputs in;
    in.num_tokens = tokens;
    mega_moe(buffer, in, weights, y, stream, {}, options);
  }

  // What run() writes, as the layer's inputs.
  LayerInputs outputs(int64_t tokens) const {
    const int64_t hidden = problem_.hidden, k = router_.top_k;
    LayerInputs in;
    in.num_tokens = static_cast<int32_t>(tokens);
    in.topk_idx = view(topk_idx_, DType::i32, {tokens, k});
    in.topk_weights = view(topk_weights_, DType::f32, {tokens, k});
    if (problem_.recipe == Recipe::bf16) {
      in.x = x(tokens);
    } else {
      in.x = view(x_out_, DType::e4m3, {tokens, hidden});
      in.x_scales = view(x_scales_, DType::f32, {tokens, hidden / kScaleBlock});
    }
    return in;
  }

 private:
  static TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(data, dtype, shape, Device::cuda);
  }
  TensorView x(int64_t tokens) const { return view(x_, DType::bf16, {tokens, problem_.hidden}); }
  TensorView router_weight() const {
    return view(weight_, DType::bf16, {router_.num_experts, problem_.hidden});
  }
  TensorView logits(int64_t tokens) const { return view(logits_, DType::f32, {tokens, router_.num_experts}); }

  Problem problem_;
  RouterConfig router_;
  uint16_t *x_ = nullptr, *weight_ = nullptr;
  float *logits_ = nullptr, *topk_weights_ = nullptr, *x_scales_ = nullptr;
  int32_t* topk_idx_ = nullptr;
  uint8_t* x_out_ = nullptr;
};

// The router of a preset's model for --producers: DeepSeek-V3's group-limited sigmoid, else softmax top-k.
RouterConfig preset_router(const Preset& preset, const Problem& p) {
  if (preset.name == "deepseek-v3") return deepseek_v3_router();
  return softmax_router(p.num_experts, p.top_k, true);
}

class EventPair {
 public:
  EventPair() {
    MEGAMOE_CHECK_CUDA(cudaEventCreate(&start));
    MEGAMOE_CHECK_CUDA(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  cudaEvent_t start = nullptr, stop = nullptr;
};

// Median times of each of `calls` on `stream` over `repeats` rounds after kWarmups. Each round runs
// every call once, in an order that rotates from round to round, so all of them see the same
// clocks and power state (a long run heats the GPU and its power cap lowers the clock). Before each
// call the ranks line up (host barrier), events bracket it, and the host waits for it. A host
// synchronization inside a call is part of its time.
std::vector<double> median_calls_us(Communicator& comm, cudaStream_t stream, int32_t repeats,
                                    const std::vector<std::function<void()>>& calls) {
  for (const auto& call : calls)
    for (int i = 0; i < kWarmups; ++i) call();
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  EventPair events;
  std::vector<std::vector<float>> times(calls.size());
  for (int32_t round = 0; round < repeats; ++round) {
    for (size_t i = 0; i < calls.size(); ++i) {
      const size_t which = (i + static_cast<size_t>(round)) % calls.size();
      comm.barrier();
      MEGAMOE_CHECK_CUDA(cudaEventRecord(events.start, stream));
      calls[which]();
      MEGAMOE_CHECK_CUDA(cudaEventRecord(events.stop, stream));
      MEGAMOE_CHECK_CUDA(cudaEventSynchronize(events.stop));
      float ms = 0;
      MEGAMOE_CHECK_CUDA(cudaEventElapsedTime(&ms, events.start, events.stop));
      times[which].push_back(ms);
    }
  }
  std::vector<double> medians;
  for (std::vector<float>& call_times : times) {
    std::sort(call_times.begin(), call_times.end());
    medians.push_back(1000.0 * call_times[call_times.size() / 2]);
  }
  return medians;
}

void call_layer(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                cudaStream_t stream, Schedule schedule) {
  mega_moe(buffer, inputs, weights, y, stream, {}, CallOptions{schedule});
}

// A fused call's event log (`bytes` of `log` on the device) written to `path` as
// {"tokens": T, "rank": R, "events": [[cta, unit, kind, what, ns], ...]} with ns from the first event.
void write_events(const std::string& path, const uint8_t* log, int64_t bytes, int32_t tokens, int32_t rank) {
  std::vector<FusedTraceEvent> events(static_cast<size_t>(bytes) / sizeof(FusedTraceEvent));
  MEGAMOE_CHECK_CUDA(cudaMemcpy(events.data(), log, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  uint64_t first = UINT64_MAX;
  for (const FusedTraceEvent& e : events)
    if (e.ns != 0) first = std::min(first, e.ns);
  FILE* file = std::fopen(path.c_str(), "w");
  require(file != nullptr, "--trace", "cannot write '", path, "'");
  std::fprintf(file, "{\"tokens\": %d, \"rank\": %d, \"events\": [", tokens, rank);
  bool comma = false;
  for (const FusedTraceEvent& e : events) {
    if (e.ns == 0) continue;
    std::fprintf(file, "%s\n  [%u, %u, %u, %u, %llu]", comma ? "," : "", unsigned{e.cta}, e.unit, unsigned{e.kind},
                 unsigned{e.what}, static_cast<unsigned long long>(e.ns - first));
    comma = true;
  }
  std::fprintf(file, "\n]}\n");
  require(std::fclose(file) == 0, "--trace", "writing '", path, "' failed");
}

// One more fused call with its event log (CallOptions::trace), written to DIR/trace-<tokens>-r<rank>.json.
// With `ring_producers`, two streamed calls instead: the producers publishing into the front ring,
// then the layer reading it (CallOptions::streamed, nothing overlapped: trace-streamed-...), and
// streamed_mega_moe's streamed form, the layer launched beside its producers (trace-overlapped-...).
void write_trace(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                 cudaStream_t stream, const std::string& dir, int32_t rank,
                 const BatchProducers* ring_producers = nullptr) {
  const int64_t bytes = fused_trace_bytes(buffer);
  DeviceArena memory;
  uint8_t* log = memory.allocate<uint8_t>(static_cast<uint64_t>(bytes), "bench: fused trace");
  const TensorView trace = TensorView::contiguous(log, DType::u8, {bytes}, Device::cuda);
  const std::string suffix = std::to_string(inputs.num_tokens) + "-r" + std::to_string(rank) + ".json";
  // Runs `call` with the log cleared first, then writes the log to DIR/<name>-<tokens>-r<rank>.json.
  const auto traced = [&](const char* name, const auto& call) {
    MEGAMOE_CHECK_CUDA(cudaMemsetAsync(log, 0, static_cast<size_t>(bytes), stream));
    call();
    buffer.check_device_error(stream);
    write_events(dir + "/" + name + "-" + suffix, log, bytes, inputs.num_tokens, rank);
  };
  CallOptions options{Schedule::fused};
  options.trace = trace;
  if (ring_producers == nullptr) {
    traced("trace", [&] { mega_moe(buffer, inputs, weights, y, stream, {}, options); });
    return;
  }
  traced("trace-streamed", [&] {
    ring_producers->run_streamed_serial(inputs.num_tokens, buffer, weights, y, stream, options);
  });
  traced("trace-overlapped", [&] {
    StreamedCall call = ring_producers->streamed_call(inputs.num_tokens, CallForm::streamed);
    call.trace = trace;
    streamed_mega_moe(buffer, call, weights, y, stream);
  });
}

// A call captured in a CUDA graph, and the number of kernels it launches.
struct CapturedCall {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  int64_t kernels = 0;
  template <class Call>
  CapturedCall(cudaStream_t stream, const Call& call) {
    MEGAMOE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    call();
    MEGAMOE_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    MEGAMOE_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    size_t nodes = 0;
    MEGAMOE_CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    std::vector<cudaGraphNode_t> all(nodes);
    MEGAMOE_CHECK_CUDA(cudaGraphGetNodes(graph, all.data(), &nodes));
    for (cudaGraphNode_t node : all) {
      cudaGraphNodeType type;
      MEGAMOE_CHECK_CUDA(cudaGraphNodeGetType(node, &type));
      kernels += type == cudaGraphNodeTypeKernel ? 1 : 0;
    }
  }
  ~CapturedCall() {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  CapturedCall(const CapturedCall&) = delete;
  CapturedCall& operator=(const CapturedCall&) = delete;
};

// Compares the baseline's y with the fused layer's (both [tokens, hidden] BF16 on the device).
void compare_outputs(const uint16_t* fused, const uint16_t* baseline, int64_t count, cudaStream_t stream,
                     RankMeasures& measures) {
  std::vector<uint16_t> fused_host(static_cast<size_t>(count)), baseline_host(static_cast<size_t>(count));
  MEGAMOE_CHECK_CUDA(
      cudaMemcpyAsync(fused_host.data(), fused, count * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CHECK_CUDA(
      cudaMemcpyAsync(baseline_host.data(), baseline, count * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  double diff = 0, norm = 0;
  int64_t nonfinite = 0;
  for (size_t i = 0; i < fused_host.size(); ++i) {
    const double want = bf16_to_float(fused_host[i]), got = bf16_to_float(baseline_host[i]);
    if (!std::isfinite(got)) ++nonfinite;
    diff += (got - want) * (got - want);
    norm += want * want;
  }
  measures.diff_squares = diff;
  measures.fused_squares = norm;
  measures.baseline_nonfinite = nonfinite;
}

TensorView y_view(void* data, int64_t tokens, int32_t hidden) {
  return TensorView::contiguous(data, DType::bf16, {tokens, hidden}, Device::cuda);
}

// The baseline against the fused layer on a small bf16 problem, where both compute the recipe's math.
// Every rank learns every rank's result, so all of them stop together when the baseline is wrong.
void check_baseline(Communicator& comm, const BenchData& data, RankMeasures& result) {
  Problem p = data.check_problem;
  p.rank = comm.rank();
  const RankBatch& batch = data.check_batches[static_cast<size_t>(p.rank)];
  cudaStream_t stream = comm.stream();
  SymmBuffer buffer(comm, p);
  const auto weights = DeviceWeights::synthetic(p, data.seed);
  DeviceBatch inputs(p, batch.num_tokens);
  DeviceArena memory;
  const int64_t elements = int64_t{batch.num_tokens} * p.hidden;
  uint16_t* fused_y = memory.allocate<uint16_t>(elements, "bench: fused y (check)");
  uint16_t* baseline_y = memory.allocate<uint16_t>(elements, "bench: baseline y (check)");
  inputs.fill(batch, stream);
  UnfusedBaseline unfused(comm, p, weights->view());
  comm.barrier();

  bf16_mega_moe(buffer, inputs.inputs(), weights->view(), y_view(fused_y, batch.num_tokens, p.hidden), stream, {},
                CallOptions{data.schedules.front()});
  buffer.check_device_error(stream);
  unfused.run(inputs.inputs(), y_view(baseline_y, batch.num_tokens, p.hidden), stream);
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  compare_outputs(fused_y, baseline_y, elements, stream, result);

  std::vector<uint8_t> mine(sizeof(RankMeasures));
  std::memcpy(mine.data(), &result, sizeof(RankMeasures));
  const std::vector<std::vector<uint8_t>> everyone = comm.all_gather(mine);
  std::vector<RankMeasures> all(everyone.size());
  for (size_t r = 0; r < everyone.size(); ++r) std::memcpy(&all[r], everyone[r].data(), sizeof(RankMeasures));
  const double error = normalized_error(all.data(), static_cast<int32_t>(all.size()));
  require(error < kCheckBound, "bench", "the unfused baseline's y differs from the fused layer's on the bf16 check (",
          kCheckTokens, " tokens per rank): normalized error ", error, " >= ", kCheckBound,
          "; not timing a broken baseline");
}

// The buffer's input views (buffer_input_views) holding a copy of `batch`'s x, x scales and route weights.
LayerInputs copy_into_buffer(SymmBuffer& buffer, const LayerInputs& batch, cudaStream_t stream) {
  const LayerInputs in = buffer_input_views(buffer, batch.num_tokens, batch.topk_idx);
  for (const auto& [to, from] : {std::pair{in.x, batch.x}, std::pair{in.x_scales, batch.x_scales},
                                 std::pair{in.topk_weights, batch.topk_weights}}) {
    if (from.numel() == 0) continue;
    MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(to.data, from.data, static_cast<size_t>(from.bytes()), cudaMemcpyDeviceToDevice,
                                       stream));
  }
  return in;
}

void bench_rank(Communicator& comm, const BenchData& data, const SharedArray<RankMeasures>& measures,
                const SharedArray<RankMeasures>& checks) {
  const int32_t rank = comm.rank();
  const int32_t ranks = comm.size();
  const bool with_baseline = data.with_baseline;
  cudaStream_t stream = comm.stream();
  if (with_baseline) check_baseline(comm, data, checks[static_cast<size_t>(rank)]);

  Problem p = data.problem;
  p.rank = rank;
  SymmBuffer buffer(comm, p);
  const auto weights = DeviceWeights::synthetic(p, data.seed);
  std::vector<std::unique_ptr<DeviceBatch>> inputs;
  for (const std::vector<RankBatch>& size : data.batches)
    inputs.push_back(std::make_unique<DeviceBatch>(p, size[static_cast<size_t>(rank)].num_tokens));
  DeviceArena memory;
  const int64_t max_elements = int64_t{p.max_tokens_per_rank} * p.hidden;
  uint16_t* fused_y = memory.allocate<uint16_t>(max_elements, "bench: fused y");
  uint16_t* baseline_y = with_baseline ? memory.allocate<uint16_t>(max_elements, "bench: baseline y") : nullptr;
  for (size_t s = 0; s < data.batches.size(); ++s) inputs[s]->fill(data.batches[s][static_cast<size_t>(rank)], stream);
  const std::unique_ptr<UnfusedBaseline> unfused =
      with_baseline ? std::make_unique<UnfusedBaseline>(comm, p, weights->view()) : nullptr;
  const std::unique_ptr<BatchProducers> producers =
      data.producers ? std::make_unique<BatchProducers>(p, data.router, data.seed, memory) : nullptr;
  comm.barrier();  // every rank has allocated before any rank launches

  for (size_t s = 0; s < data.batches.size(); ++s) {
    const LayerInputs& batch = inputs[s]->inputs();
    // The calls' inputs: the batch itself, or its copy in the buffer's input regions (made once, here;
    // the calls read those regions and never write them).
    const LayerInputs in = data.inputs_in_buffer ? copy_into_buffer(buffer, batch, stream) : batch;
    const TensorView fused_out = y_view(fused_y, in.num_tokens, p.hidden);
    RankMeasures m;
    // Each schedule eager and as a replayed graph (decode engines replay captured graphs; neither
    // schedule syncs with the host, so both can be one), the expert GEMMs alone on the same rows, and
    // the baseline: all take turns in every round.
    std::vector<std::unique_ptr<CapturedCall>> graphs;
    std::vector<std::function<void()>> calls;
    for (Schedule schedule : data.schedules) {
      graphs.push_back(std::make_unique<CapturedCall>(
          stream, [&] { call_layer(buffer, in, weights->view(), fused_out, stream, schedule); }));
      cudaGraphExec_t exec = graphs.back()->exec;
      calls.push_back([&, schedule] { call_layer(buffer, in, weights->view(), fused_out, stream, schedule); });
      calls.push_back([&, exec] { MEGAMOE_CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
    }
    // After any call of these inputs the pool holds their rows (the calls before it in each round).
    calls.push_back([&] { detail::expert_gemms(buffer, in, weights->view(), stream); });
    if (unfused) {
      calls.push_back([&] { unfused->run(in, y_view(baseline_y, in.num_tokens, p.hidden), stream); });
    }
    const size_t first_producer_call = calls.size();
    if (producers) {
      graphs.push_back(std::make_unique<CapturedCall>(stream, [&] { producers->run(in.num_tokens, stream); }));
      for (Schedule schedule : data.schedules) {
        graphs.push_back(std::make_unique<CapturedCall>(stream, [&] {
          producers->run(in.num_tokens, stream);
          call_layer(buffer, in, weights->view(), fused_out, stream, schedule);
        }));
      }
      for (size_t g = graphs.size() - data.schedules.size() - 1; g < graphs.size(); ++g) {
        cudaGraphExec_t exec = graphs[g]->exec;
        calls.push_back([&, exec] { MEGAMOE_CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
      }
    }
    // Streaming against batch on the same routes: the producers' own outputs, not the benchmark's.
    const size_t first_streaming_call = calls.size();
    if (data.streaming) {
      const LayerInputs produced = producers->outputs(in.num_tokens);
      graphs.push_back(std::make_unique<CapturedCall>(stream, [&] {
        producers->run(in.num_tokens, stream);
        call_layer(buffer, produced, weights->view(), fused_out, stream, Schedule::fused);
      }));
      for (const CallForm form : {CallForm::streamed, CallForm::automatic}) {
        graphs.push_back(std::make_unique<CapturedCall>(stream, [&] {
          streamed_mega_moe(buffer, producers->streamed_call(in.num_tokens, form), weights->view(), fused_out, stream);
        }));
      }
      graphs.push_back(std::make_unique<CapturedCall>(
          stream, [&] { producers->run_streamed_serial(in.num_tokens, buffer, weights->view(), fused_out, stream); }));
      for (size_t g = graphs.size() - 4; g < graphs.size(); ++g) {
        cudaGraphExec_t exec = graphs[g]->exec;
        calls.push_back([&, exec] { MEGAMOE_CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
      }
    }
    const std::vector<double> medians = median_calls_us(comm, stream, data.repeats, calls);
    if (producers) {
      m.producers_graph_us = medians[first_producer_call];
      for (size_t i = 0; i < data.schedules.size(); ++i)
        m.end_to_end_graph_us[static_cast<size_t>(data.schedules[i])] = medians[first_producer_call + 1 + i];
    }
    if (data.streaming) {
      m.streaming_batch_graph_us = medians[first_streaming_call];
      m.streamed_graph_us = medians[first_streaming_call + 1];
      m.automatic_graph_us = medians[first_streaming_call + 2];
      m.streamed_serial_graph_us = medians[first_streaming_call + 3];
    }
    for (size_t i = 0; i < data.schedules.size(); ++i) {
      const size_t which = static_cast<size_t>(data.schedules[i]);
      m.us[which] = medians[2 * i];
      m.graph_us[which] = medians[2 * i + 1];
      m.launches[which] = graphs[i]->kernels;
    }
    m.gemm_only_us = medians[2 * data.schedules.size()];
    buffer.check_device_error(stream);
    if (unfused) {
      m.baseline_us = medians[first_producer_call - 1];
      // y of the last call in the last round: every schedule's y is checked against the reference by
      // the tests; here the baseline's is compared with it.
      call_layer(buffer, in, weights->view(), fused_out, stream, data.schedules.front());
      compare_outputs(fused_y, baseline_y, int64_t{in.num_tokens} * p.hidden, stream, m);
    }
    if (!data.trace_dir.empty()) {
      write_trace(buffer, in, weights->view(), fused_out, stream, data.trace_dir, rank);
      if (data.streaming)
        write_trace(buffer, in, weights->view(), fused_out, stream, data.trace_dir, rank, producers.get());
    }
    measures[s * static_cast<size_t>(ranks) + static_cast<size_t>(rank)] = m;
    if (rank == 0) {
      std::fprintf(stderr, "bench: %d tokens/rank: rank 0 staged %.1f us, fused %.1f us, baseline %.1f us\n",
                   in.num_tokens, m.us[0], m.us[1], m.baseline_us);
    }
  }
  comm.barrier();  // no rank frees its buffer while another still uses it
}

// ---- Report ----------------------------------------------------------------------------------

std::string format(double value, const char* spec) {
  if (std::isnan(value)) return "n/a";
  char text[32];
  std::snprintf(text, sizeof(text), spec, value);
  return text;
}

const char* limiting_floor(const Floors& floors) {
  const double largest = floors.largest_us();
  if (largest == floors.compute_us) return "compute";
  if (largest == floors.hbm_us) return "hbm";
  return "nvlink";
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Problem baseline_check_problem(const Problem& timed) {
  Problem check = timed;
  check.recipe = Recipe::bf16;
  check.max_tokens_per_rank = kCheckTokens;
  // The check calls the layer in batch form: a front ring sized for --tokens need not hold its tokens.
  check.front_num_slots = 0;
  check.front_tokens_per_slot = 0;
  return check;
}

// ---- Command line ------------------------------------------------------------------------------

const char* bench_usage() {
  return "  megamoe bench --preset NAME [--ranks R] [--tokens LIST] [--recipe fp8|fp8_fp4|bf16]\n"
         "                [--routing uniform|zipf] [--schedule staged,fused] [--seed S] [--repeats N]\n"
         "                [--inputs copied|buffer] [--producers on|off] [--streaming on|off]\n"
         "                [--chunk-tokens N] [--trace DIR] --out FILE\n"
         "\n"
         "Times the whole layer and an unfused baseline (NCCL all-to-all, cuBLASLt per-expert GEMMs and\n"
         "permute/SwiGLU/combine kernels) for each token count, with floors from ceilings measured in\n"
         "the same run, and writes the results as JSON (docs/results.md, benchmark \"layer\").\n"
         "With fewer Hopper GPUs than ranks the ranks are emulated on GPU 0 and only the fused layer runs;\n"
         "so does fp8_fp4, which cuBLASLt has no GEMM for.\n"
         "  --tokens   tokens per rank, comma-separated (default 1,8,128,512,2048,8192)\n"
         "  --schedule which schedules to time, comma-separated (default staged,fused; rows per schedule)\n"
         "  --repeats  timed calls per size; the median is reported (default 10)\n"
         "  --inputs   where the calls read x, its scales and the route weights: copied (default: from\n"
         "             separate tensors, which each call copies into the buffer) or buffer (from the\n"
         "             buffer's own input regions, written once before the timed calls)\n"
         "  --producers on: also time what an engine runs before the layer (the router's logits and\n"
         "             top-k, the activations' quantization; megamoe/producers.h), alone and followed by\n"
         "             the layer, both as graphs: rows add producers_graph_us, end_to_end_graph_us and\n"
         "             producer_fraction (their share of the end-to-end time); default off\n"
         "  --streaming on: also time the producers followed by the fused layer on their outputs (batch_us),\n"
         "             streamed_mega_moe reading them from the buffer's front ring (streamed_us) and in the\n"
         "             form it picks for the row's tokens (call_form, streaming_us), and the ring producers then\n"
         "             mega_moe(CallOptions::streamed), nothing overlapped (streamed_serial_us), as graphs, in the same\n"
         "             rounds; fused rows add chunk_tokens, and producer_fraction becomes their share of\n"
         "             batch_us. Implies --producers on; default off\n"
         "  --chunk-tokens a streamed call's chunk: the producers publish and the layer reads a rank's\n"
         "             tokens N at a time (default: the whole call in one chunk)\n"
         "  --trace    after each size, one more fused call with its event log, written to\n"
         "             DIR/trace-<tokens>-r<rank>.json (tools/plot_trace.py draws it)\n"
         "  --out      the JSON results file (its directory must exist)\n";
}

BenchOptions parse_bench(const std::vector<std::string>& args) {
  const Flags flags(args, {"--preset", "--ranks", "--tokens", "--recipe", "--routing", "--seed", "--repeats",
                           "--schedule", "--inputs", "--producers", "--streaming", "--chunk-tokens", "--trace",
                           "--out"});
  BenchOptions options;
  options.command = "megamoe bench";
  for (const std::string& arg : args) options.command += " " + arg;
  options.preset = &preset_flag(flags);
  const Preset& preset = *options.preset;
  const int32_t ranks = ranks_flag(flags, preset);

  options.tokens = kDefaultBenchTokens;
  if (auto text = flags.value("--tokens")) {
    options.tokens.clear();
    std::stringstream list(*text);
    std::string item;
    while (std::getline(list, item, ',')) options.tokens.push_back(parse_number<int32_t>("--tokens", item, 1, 1 << 20));
    require(!options.tokens.empty() && text->back() != ',', "--tokens",
            "expected a comma-separated list of token counts, got '", *text, "'");
  }
  options.problem = preset_problem(preset, ranks, *std::max_element(options.tokens.begin(), options.tokens.end()));
  if (auto text = flags.value("--recipe")) {
    Recipe recipe = Recipe::fp8;
    require(parse_recipe(*text, recipe), "--recipe", "must be fp8, fp8_fp4 or bf16, got '", *text, "'");
    options.problem.recipe = recipe;
  }
  if (auto text = flags.value("--routing")) {
    require(parse_routing(*text, options.routing) && options.routing != Routing::one_expert, "--routing",
            "must be uniform or zipf, got '", *text, "'");
  }
  options.schedules = parse_list<Schedule>(
      flags, "--schedule", options.schedules, "staged and fused",
      [](const std::string& item, Schedule& value) { return parse_schedule(item, value); });
  if (auto text = flags.value("--inputs")) {
    require(*text == "copied" || *text == "buffer", "--inputs", "must be copied or buffer, got '", *text, "'");
    options.inputs_in_buffer = *text == "buffer";
  }
  if (auto text = flags.value("--producers")) {
    require(*text == "on" || *text == "off", "--producers", "must be on or off, got '", *text, "'");
    options.producers = *text == "on";
  }
  if (auto text = flags.value("--streaming")) {
    require(*text == "on" || *text == "off", "--streaming", "must be on or off, got '", *text, "'");
    options.streaming = *text == "on";
  }
  if (auto text = flags.value("--chunk-tokens")) {
    require(options.streaming, "--chunk-tokens", "cuts streamed calls: it needs --streaming on");
    options.chunk_tokens = parse_number<int32_t>("--chunk-tokens", *text, 1, 1 << 20);
  }
  if (options.streaming) {
    require(std::find(options.schedules.begin(), options.schedules.end(), Schedule::fused) != options.schedules.end(),
            "--streaming", "compares fused calls: --schedule must include fused");
    require(flags.value("--producers").value_or("on") == "on", "--streaming",
            "times the producers with the layer: it cannot run with --producers off");
    require(!options.inputs_in_buffer, "--streaming",
            "cannot run with --inputs buffer: the layout producer writes its rows into the buffer's input regions");
    options.producers = true;
    options.problem.wave_tokens = options.problem.max_tokens_per_rank;  // a streamed call is one wave
    const FrontRingShape ring = front_ring_shape(options.problem.max_tokens_per_rank, options.chunk_tokens);
    options.problem.front_num_slots = ring.num_slots;
    options.problem.front_tokens_per_slot = ring.tokens_per_slot;
  }
  if (auto text = flags.value("--seed")) options.seed = parse_number<uint64_t>("--seed", *text, 0, UINT64_MAX);
  if (auto text = flags.value("--repeats")) options.repeats = parse_number<int32_t>("--repeats", *text, 1, 10000);
  if (auto text = flags.value("--trace")) {
    require(std::filesystem::is_directory(*text), "--trace", "directory '", *text, "' does not exist");
    options.trace_dir = *text;
  }
  const std::optional<std::string> out = flags.value("--out");
  require(out.has_value() && !out->empty(), "--out", "is required: the JSON results file to write");
  const std::filesystem::path directory = std::filesystem::path(*out).parent_path();
  require(directory.empty() || std::filesystem::is_directory(directory), "--out", "directory '", directory.string(),
          "' does not exist");
  options.out = *out;
  validate(options.problem);
  require(!options.inputs_in_buffer || tokens_per_wave(options.problem) >= options.problem.max_tokens_per_rank,
          "--inputs", "buffer holds one wave of inputs (", tokens_per_wave(options.problem),
          " tokens per rank for this problem), but --tokens asks for up to ", options.problem.max_tokens_per_rank);
  return options;
}

// ---- Work model --------------------------------------------------------------------------------

std::vector<RankWork> layer_work(const Problem& p, const std::vector<RankBatch>& batches) {
  require(batches.size() == static_cast<size_t>(p.num_ranks), "batches", "must have one entry per rank (", p.num_ranks,
          "), got ", batches.size());
  const int32_t local_experts = p.experts_per_rank();
  std::vector<RankWork> work(static_cast<size_t>(p.num_ranks));
  std::vector<bool> active(static_cast<size_t>(p.num_experts), false);
  for (int32_t source = 0; source < p.num_ranks; ++source) {
    const RankBatch& batch = batches[static_cast<size_t>(source)];
    RankWork& sender = work[static_cast<size_t>(source)];
    sender.tokens = batch.num_tokens;
    for (const int32_t expert : batch.topk_idx) {
      if (expert < 0 || expert >= p.num_experts) continue;
      const int32_t owner = expert / local_experts;
      RankWork& receiver = work[static_cast<size_t>(owner)];
      ++sender.routes_sent;
      ++receiver.routes_received;
      active[static_cast<size_t>(expert)] = true;
      if (owner == source) continue;
      ++sender.remote_sent;
      ++receiver.remote_received;
    }
  }
  for (int32_t expert = 0; expert < p.num_experts; ++expert)
    if (active[static_cast<size_t>(expert)]) ++work[static_cast<size_t>(expert / local_experts)].active_experts;

  const bool scaled = has_activation_scales(p.recipe);
  const double act = activation_bytes(p.recipe);
  const double h = p.hidden, i = p.intermediate, si = static_cast<double>(p.num_shared_experts) * p.intermediate;
  const bool shared = p.num_shared_experts > 0;
  // A row of k activations with its 1x128 FP32 scales.
  auto row_bytes = [&](double k) { return k * act + (scaled ? k / kScaleBlock * 4 : 0); };
  // One expert of this intermediate size as stored: W1 [2I][H], W2 [H][I], FP32 scales per 64 x 128;
  // fp8_fp4 weights are half a byte each, plus one shift byte per 32.
  const bool packed = p.recipe == Recipe::fp8_fp4;
  auto expert_bytes = [&](double intermediate) {
    const double values = 3 * intermediate * h;
    return values * (packed ? 0.5 + 1.0 / kMxBlock : act) +
           (scaled ? 4 * (2 * intermediate / 64 * (h / 128) + h / 64 * (intermediate / 128)) : 0);
  };
  const double bf16_row = h * 2;
  for (RankWork& w : work) {
    const double tokens = static_cast<double>(w.tokens);
    const double received = static_cast<double>(w.routes_received);
    w.flops = 2 * received * 3 * i * h + (shared ? 2 * tokens * 3 * si * h : 0);
    w.hbm_bytes = static_cast<double>(w.active_experts) * expert_bytes(i) +
                  (shared && w.tokens > 0 ? expert_bytes(si) : 0) + tokens * row_bytes(h) +
                  2 * received * (row_bytes(h) + row_bytes(i)) + (shared ? 2 * tokens * row_bytes(si) : 0) +
                  2 * (static_cast<double>(w.routes_sent) + (shared ? tokens : 0)) * bf16_row + tokens * bf16_row;
    w.link_out_bytes =
        static_cast<double>(w.remote_sent) * row_bytes(h) + static_cast<double>(w.remote_received) * bf16_row;
    w.link_in_bytes =
        static_cast<double>(w.remote_received) * row_bytes(h) + static_cast<double>(w.remote_sent) * bf16_row;
  }
  return work;
}

double Floors::largest_us() const {
  double largest = 0;
  for (double floor : {compute_us, hbm_us, nvlink_us})
    if (!std::isnan(floor)) largest = std::max(largest, floor);
  return largest;
}

Floors layer_floors(const Problem& problem, const std::vector<RankWork>& work, const Ceilings& ceilings,
                    bool emulated) {
  // The busiest GPU's share: one rank's with a GPU per rank, all of them on the one emulating GPU.
  auto busiest = [&](const std::function<double(const RankWork&)>& amount) {
    double result = 0;
    for (const RankWork& w : work) result = emulated ? result + amount(w) : std::max(result, amount(w));
    return result;
  };
  const double dense_tflops = problem.recipe == Recipe::bf16 ? ceilings.bf16_dense_tflops : ceilings.fp8_dense_tflops;
  Floors floors;
  floors.compute_us = busiest([](const RankWork& w) { return w.flops; }) / (dense_tflops * 1e6);
  floors.hbm_us = busiest([](const RankWork& w) { return w.hbm_bytes; }) / (ceilings.hbm_copy_gbps * 1e3);
  double link = 0;
  for (const RankWork& w : work) link = std::max({link, w.link_out_bytes, w.link_in_bytes});
  floors.nvlink_us = link == 0 ? 0 : emulated ? kNaN : link / (ceilings.peer_copy_gbps * 1e3);
  return floors;
}

Rates layer_rates(const std::vector<RankWork>& work, double us, bool emulated) {
  double flops = 0, hbm = 0, link = 0;
  for (const RankWork& w : work) {
    flops += w.flops;
    hbm += w.hbm_bytes;
    link += w.link_out_bytes;
  }
  const double gpus = emulated ? 1.0 : static_cast<double>(work.size());
  Rates rates;
  rates.tflops = flops / gpus / (us * 1e6);
  rates.hbm_gbps = hbm / gpus / (us * 1e3);
  rates.nvlink_gbps = emulated ? kNaN : link / gpus / (us * 1e3);
  return rates;
}

// ---- The run -----------------------------------------------------------------------------------

void run_bench(const BenchOptions& options) {
  const Problem& problem = options.problem;
  const int32_t ranks = problem.num_ranks;
  std::printf("preset: %s (%s)\n", std::string(options.preset->name).c_str(),
              std::string(options.preset->note).c_str());
  std::printf("problem: %s\n", describe(problem).c_str());
  std::printf("routing %s, seed %llu, %d timed calls per size (median reported, after %d warm-up calls)\n",
              std::string(to_string(options.routing)).c_str(), static_cast<unsigned long long>(options.seed),
              options.repeats, kWarmups);

  // Counted in a child process: this one must stay free of CUDA to fork NCCL ranks.
  const int32_t gpus = count_hopper_gpus_in_child();
  require(gpus >= 1, "bench", "needs a Hopper GPU; found none");
  const bool emulated = gpus < ranks;
  // cuBLASLt has no MXFP4 GEMM, so fp8_fp4 runs the fused layer only.
  const bool with_baseline = !emulated && problem.recipe != Recipe::fp8_fp4;
  if (emulated) {
    std::printf(
        "mode: emulated: %d ranks on GPU 0 (%d Hopper GPU%s, fewer than the ranks); fused layer only, "
        "each rank on its share of the multiprocessors; no baseline (it needs one NCCL process per GPU)\n",
        ranks, gpus, gpus == 1 ? "" : "s");
  } else {
    std::printf("mode: processes: %d ranks, one process per GPU (NCCL); fused layer%s\n", ranks,
                with_baseline ? " and unfused baseline" : " only (the unfused baseline has no MXFP4 path)");
  }
  std::fflush(stdout);

  const auto inputs_start = std::chrono::steady_clock::now();
  BenchData data;
  data.problem = problem;
  data.seed = options.seed;
  data.repeats = options.repeats;
  data.schedules = options.schedules;
  data.inputs_in_buffer = options.inputs_in_buffer;
  data.trace_dir = options.trace_dir;
  data.with_baseline = with_baseline;
  data.producers = options.producers;
  data.streaming = options.streaming;
  if (options.producers) data.router = preset_router(*options.preset, problem);
  for (int32_t tokens : options.tokens) {
    data.batches.push_back(synthetic_batches(problem, std::vector<int32_t>(static_cast<size_t>(ranks), tokens),
                                             options.routing, options.seed));
  }
  if (with_baseline) {
    data.check_problem = baseline_check_problem(problem);
    data.check_batches =
        synthetic_batches(data.check_problem, std::vector<int32_t>(static_cast<size_t>(ranks), kCheckTokens),
                          options.routing, options.seed);
  }
  std::printf("inputs: generated on the host in %.1f s\n", seconds_since(inputs_start));

  const Ceilings ceilings = measure_ceilings_in_child(gpus);
  std::printf(
      "ceilings (this run): HBM copy %.0f GB/s, dense FP8 %.0f TFLOP/s, dense BF16 %.0f TFLOP/s, peer copy %s GB/s\n",
      ceilings.hbm_copy_gbps, ceilings.fp8_dense_tflops, ceilings.bf16_dense_tflops,
      format(ceilings.peer_copy_gbps, "%.0f").c_str());
  std::fflush(stdout);

  const size_t sizes = options.tokens.size();
  SharedArray<RankMeasures> measures(sizes * static_cast<size_t>(ranks), RankMeasures{}, "bench");
  SharedArray<RankMeasures> checks(static_cast<size_t>(ranks), RankMeasures{}, "bench");
  const int failed = run_ranks(ranks, emulated ? LaunchMode::emulated : LaunchMode::processes,
                               [&](Communicator& comm) { bench_rank(comm, data, measures, checks); });
  require(failed == 0, "bench", failed, " of ", ranks, " ranks failed (see above)");

  const double check_error = with_baseline ? normalized_error(&checks[0], ranks) : kNaN;
  if (with_baseline) {
    std::printf(
        "baseline check: bf16, %d tokens per rank, y against the fused layer's: normalized error %.3g "
        "(bound %.0e)\n",
        kCheckTokens, check_error, kCheckBound);
  }

  bench::Report report;
  report.benchmark = "layer";
  report.command = options.command;
  report.ceilings = {{"hbm_copy_gbps", ceilings.hbm_copy_gbps},
                     {"fp8_dense_tflops", ceilings.fp8_dense_tflops},
                     {"bf16_dense_tflops", ceilings.bf16_dense_tflops},
                     {"peer_copy_gbps", ceilings.peer_copy_gbps}};
  std::printf("\n%11s %-8s %3s | %9s %9s %8s %9s %9s | %9s | %11s | %7s %7s | %8s %8s %-7s | %9s\n",
              "tokens/rank", "schedule", "kn", "us", "graph us", "TFLOP/s", "HBM GB/s", "NVL GB/s", "GEMMs us",
              "baseline us", "speedup", "(graph)", "roofline", "(base)", "bound", "y diff");
  std::vector<std::string> problems;  // baseline outputs that fail their check
  const uint64_t buffer_bytes = BufferLayout::make(problem).total_bytes;
  for (size_t s = 0; s < sizes; ++s) {
    const int32_t tokens = options.tokens[s];
    const RankMeasures* row = &measures[s * static_cast<size_t>(ranks)];
    double baseline_us = 0, gemm_only_us = 0;
    int64_t nonfinite = 0;
    for (int32_t r = 0; r < ranks; ++r) {
      baseline_us = with_baseline ? std::max(baseline_us, row[r].baseline_us) : kNaN;
      gemm_only_us = std::max(gemm_only_us, row[r].gemm_only_us);
      nonfinite += row[r].baseline_nonfinite;
    }
    const double y_error = with_baseline ? normalized_error(row, ranks) : kNaN;
    const std::vector<RankWork> work = layer_work(problem, data.batches[s]);
    const Floors floors = layer_floors(problem, work, ceilings, emulated);
    const Rates baseline = layer_rates(work, baseline_us, emulated);
    const double baseline_roofline = floors.largest_us() / baseline_us;
    if (with_baseline && nonfinite > 0)
      problems.push_back(detail::concat(tokens, " tokens/rank: ", nonfinite, " non-finite values in the baseline's y"));
    if (with_baseline && problem.recipe == Recipe::bf16 && !(y_error < kCheckBound))
      problems.push_back(detail::concat(tokens, " tokens/rank: the baseline's y differs from the layer's by ", y_error,
                                        " (normalized, bound ", kCheckBound, ")"));
    double flops = 0, hbm_bytes = 0, link_bytes = 0;
    int64_t routes = 0;
    for (const RankWork& w : work) {
      flops += w.flops;
      hbm_bytes += w.hbm_bytes;
      link_bytes += w.link_out_bytes;
      routes += w.routes_sent;
    }
    for (Schedule schedule : options.schedules) {
      const size_t which = static_cast<size_t>(schedule);
      double us = 0, graph_us = 0, producers_us = 0, end_to_end_us = 0, batch_us = 0, streamed_us = 0,
             streaming_us = 0, streamed_serial_us = 0;
      int64_t launches = 0;
      for (int32_t r = 0; r < ranks; ++r) {
        us = std::max(us, row[r].us[which]);
        graph_us = std::max(graph_us, row[r].graph_us[which]);
        launches = std::max(launches, row[r].launches[which]);
        producers_us = std::max(producers_us, row[r].producers_graph_us);
        end_to_end_us = std::max(end_to_end_us, row[r].end_to_end_graph_us[which]);
        batch_us = std::max(batch_us, row[r].streaming_batch_graph_us);
        streamed_us = std::max(streamed_us, row[r].streamed_graph_us);
        streaming_us = std::max(streaming_us, row[r].automatic_graph_us);
        streamed_serial_us = std::max(streamed_serial_us, row[r].streamed_serial_graph_us);
      }
      const Rates rates = layer_rates(work, us, emulated);
      const double speedup = baseline_us / us;
      const double graph_speedup = baseline_us / graph_us;
      const double roofline = floors.largest_us() / us;
      std::printf("%11d %-8s %3lld | %9.1f %9.1f %8.1f %9.0f %9s | %9.1f | %11s | %7s %7s | %8.3f %8s %-7s | %9s\n",
                  tokens, std::string(to_string(schedule)).c_str(), static_cast<long long>(launches), us, graph_us,
                  rates.tflops, rates.hbm_gbps, format(rates.nvlink_gbps, "%.0f").c_str(), gemm_only_us,
                  format(baseline_us, "%.1f").c_str(), format(speedup, "%.2fx").c_str(),
                  format(graph_speedup, "%.2fx").c_str(), roofline, format(baseline_roofline, "%.3f").c_str(),
                  limiting_floor(floors), format(y_error, "%.2e").c_str());
      report.rows.push_back({{"recipe", std::string(to_string(problem.recipe))},
                             {"preset", std::string(options.preset->name)},
                             {"ranks", static_cast<long long>(ranks)},
                             {"tokens_per_rank", static_cast<long long>(tokens)},
                             {"schedule", std::string(to_string(schedule))},
                             {"inputs", std::string(options.inputs_in_buffer ? "buffer" : "copied")},
                             {"launches_per_call", static_cast<long long>(launches)},
                             {"buffer_bytes", static_cast<long long>(buffer_bytes)},
                             {"mode", std::string(emulated ? "emulated" : "processes")},
                             {"routing", std::string(to_string(options.routing))},
                             {"us", us},
                             {"graph_us", graph_us},
                             {"gemm_only_us", gemm_only_us},
                             {"graph_vs_gemm_only", graph_us / gemm_only_us},
                             {"tflops", rates.tflops},
                             {"hbm_gbps", rates.hbm_gbps},
                             {"nvlink_gbps", rates.nvlink_gbps},
                             {"baseline_available", static_cast<long long>(with_baseline ? 1 : 0)},
                             {"baseline_us", baseline_us},
                             {"baseline_tflops", baseline.tflops},
                             {"baseline_hbm_gbps", baseline.hbm_gbps},
                             {"baseline_nvlink_gbps", baseline.nvlink_gbps},
                             {"speedup", speedup},
                             {"graph_speedup", graph_speedup},
                             {"roofline_fraction", roofline},
                             {"graph_roofline_fraction", floors.largest_us() / graph_us},
                             {"baseline_roofline_fraction", baseline_roofline},
                             {"floor_compute_us", floors.compute_us},
                             {"floor_hbm_us", floors.hbm_us},
                             {"floor_nvlink_us", floors.nvlink_us},
                             {"flops", flops},
                             {"hbm_bytes", hbm_bytes},
                             {"nvlink_bytes", link_bytes},
                             {"routes", static_cast<long long>(routes)},
                             {"repeats", static_cast<long long>(options.repeats)},
                             {"baseline_y_error", y_error},
                             {"baseline_check_error", check_error}});
      if (options.producers) {
        // A streamed row's share is of its batch sequence, timed in the same rounds as the streamed one.
        const bool streamed_row = options.streaming && schedule == Schedule::fused;
        const double producer_fraction = producers_us / (streamed_row ? batch_us : end_to_end_us);
        std::printf("%11s %-8s     | producers %.1f us, producers + layer %.1f us (graphs): producer fraction %.3f\n",
                    "", "", producers_us, streamed_row ? batch_us : end_to_end_us, producer_fraction);
        report.rows.back().push_back({"producers_graph_us", producers_us});
        report.rows.back().push_back({"end_to_end_graph_us", end_to_end_us});
        report.rows.back().push_back({"producer_fraction", producer_fraction});
        if (streamed_row) {
          const std::string form(to_string(choose_call_form(problem, tokens)));
          std::printf("%11s %-8s     | streaming: batch %.1f us, streamed %.1f us (graphs, chunks of %d tokens), "
                      "automatic (%s) %.1f us: %.3fx\n",
                      "", "", batch_us, streamed_us, problem.front_tokens_per_slot, form.c_str(), streaming_us,
                      batch_us / streaming_us);
          report.rows.back().push_back({"chunk_tokens", static_cast<long long>(problem.front_tokens_per_slot)});
          report.rows.back().push_back({"batch_us", batch_us});
          report.rows.back().push_back({"streamed_us", streamed_us});
          report.rows.back().push_back({"call_form", form});
          report.rows.back().push_back({"streaming_us", streaming_us});
          report.rows.back().push_back({"streaming_speedup", batch_us / streaming_us});
          std::printf("%11s %-8s     | streamed, producers then layer (nothing overlapped): %.1f us\n", "", "",
                      streamed_serial_us);
          report.rows.back().push_back({"streamed_serial_us", streamed_serial_us});
        }
      }
    }
  }
  std::printf(
      "us: the slowest rank's median of eager calls; graph us: the same call captured once in a CUDA graph "
      "and replayed (the baseline cannot be captured: it waits on the host for the counts); kn: kernels per "
      "call (in the graph); GEMMs us: the staged call's L1 and L2 launches alone on the same rows; every "
      "schedule's eager and graph calls, the GEMMs and the baseline take turns in rotating order, so they "
      "run at the same clocks; rates and roofline "
      "use us; rates per GPU; roofline = the largest floor (compute, HBM, NVLink at "
      "this run's ceilings) / us; bound: that floor; y diff: the baseline's y against the fused layer's "
      "(normalized)%s\n",
      emulated ? "\nmode emulated: no baseline (n/a: it needs one NCCL process per GPU); the ranks share GPU 0, "
                 "so the floors count all ranks' work there, and there is no NVLink floor"
               : "");
  if (with_baseline && problem.recipe == Recipe::fp8) {
    std::printf(
        "note: the fp8 baseline uses cuBLASLt's per-tensor FP8 scaling (same bytes and FLOPs, different "
        "numerics from the 1x128/128x128 block-scaled recipe), so its y is only checked to be finite\n");
  }
  require(problems.empty(), "bench", "the baseline's output failed its check: ", [&] {
    std::string text;
    for (const std::string& line : problems) text += (text.empty() ? "" : "; ") + line;
    return text;
  }());
  std::printf("\n");
  bench::write_report(report, options.out);
}

}  // namespace megamoe::bench
