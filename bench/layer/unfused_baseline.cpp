#include "bench/layer/unfused_baseline.h"

#include <cublasLt.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "bench/layer/device_memory.h"
#include "bench/layer/unfused_baseline_kernels.h"
#include "comm/check.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/synthetic.h"

namespace megamoe::bench {
namespace {

constexpr size_t kWorkspaceBytes = 32ull << 20;
// Rows of room past the last row of every GEMM operand buffer (see LtGemms::run).
constexpr int64_t kRowSlack = 16;

void cublas_ok(cublasStatus_t status, const char* call, const std::string& shape = "") {
  require(status == CUBLAS_STATUS_SUCCESS, call, "failed", shape.empty() ? "" : " for ", shape, ": ",
          cublasLtGetStatusName(status), " (", cublasLtGetStatusString(status), ")");
}

// Pinned host memory, so the counts' copy to the host is a plain DMA.
class PinnedCounts {
 public:
  explicit PinnedCounts(uint64_t count) { MEGAMOE_CHECK_CUDA(cudaMallocHost(&data_, sizeof(int32_t) * count)); }
  ~PinnedCounts() { cudaFreeHost(data_); }
  PinnedCounts(const PinnedCounts&) = delete;
  PinnedCounts& operator=(const PinnedCounts&) = delete;
  int32_t* data() const { return data_; }

 private:
  int32_t* data_ = nullptr;
};

// Which linear a GEMM computes; it selects the per-tensor FP8 scales of its two operands.
enum class Linear { first, second };

// One GEMM shape through cuBLASLt: D[n][m] = B[n][k] . A[m][k]^T with all three row-major, that is
// tokens times transposed weights. In cuBLAS's column-major terms D (m x n) = A^T (m x k) . B (k x n):
// the "TN" form FP8 needs. Algorithms are chosen once per shape and kept, as a careful user would.
class LtGemms {
 public:
  // fp8: E4M3 operands with the per-tensor scales scales[0..3] (first-linear weights, first-linear
  // activations, second-linear weights, second-linear activations), applied as alpha = the product
  // of an operand pair's scales (cuBLASLt's scale pointers failed with NOT_SUPPORTED at these shapes
  // on the H200 with cuBLAS 13); else BF16.
  LtGemms(bool fp8, const float (&scales)[4]) : fp8_(fp8) {
    alpha_[0] = fp8 ? scales[0] * scales[1] : 1.0f;
    alpha_[1] = fp8 ? scales[2] * scales[3] : 1.0f;
    cublas_ok(cublasLtCreate(&handle_), "cublasLtCreate");
    for (int i = 0; i < 2; ++i) {
      cublasLtMatmulDesc_t& desc = desc_[i];
      cublas_ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
      const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
      cublas_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
                "cublasLtMatmulDescSetAttribute(TRANSA)");
      cublas_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)),
                "cublasLtMatmulDescSetAttribute(TRANSB)");
    }
    cublas_ok(cublasLtMatmulPreferenceCreate(&preference_), "cublasLtMatmulPreferenceCreate");
    cublas_ok(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &kWorkspaceBytes, sizeof(kWorkspaceBytes)),
              "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    workspace_ = arena_.allocate<uint8_t>(kWorkspaceBytes, "unfused baseline: the cuBLASLt workspace");
  }

  ~LtGemms() {
    for (const auto& [shape, plan] : plans_) destroy(plan);
    cublasLtMatmulPreferenceDestroy(preference_);
    for (cublasLtMatmulDesc_t desc : desc_) cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(handle_);
  }
  LtGemms(const LtGemms&) = delete;
  LtGemms& operator=(const LtGemms&) = delete;

  // FP8 cuBLASLt needs n (tokens) to be a multiple of 16: the callers' buffers hold kRowSlack rows
  // past their last row, and experts run in order, so the padding rows an expert computes are
  // overwritten by the next expert's real ones.
  void run(Linear linear, int32_t m, int32_t k, int32_t n, const void* weights, const void* activations, void* out,
           cudaStream_t stream) {
    if (fp8_) n = (n + kRowSlack - 1) / kRowSlack * kRowSlack;
    const Plan& plan = plan_for(linear, m, k, n);
    const float beta = 0.0f;
    cublas_ok(cublasLtMatmul(handle_, desc_[index(linear)], &alpha_[index(linear)], weights, plan.a, activations, plan.b, &beta, out,
                             plan.d, out, plan.d, &plan.algo, workspace_, kWorkspaceBytes, stream),
              "cublasLtMatmul", describe(linear, m, k, n));
  }

 private:
  struct Plan {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  static int index(Linear linear) { return linear == Linear::first ? 0 : 1; }

  std::string describe(Linear linear, int32_t m, int32_t k, int32_t n) const {
    return detail::concat(fp8_ ? "FP8" : "BF16", linear == Linear::first ? " L1" : " L2", " m=", m, " n=", n, " k=", k);
  }

  const Plan& plan_for(Linear linear, int32_t m, int32_t k, int32_t n) {
    const auto key = std::make_tuple(index(linear), m, k, n);
    const auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    const std::string shape = describe(linear, m, k, n);
    const cudaDataType_t input = fp8_ ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    Plan plan;
    try {
      cublas_ok(cublasLtMatrixLayoutCreate(&plan.a, input, k, m, k), "cublasLtMatrixLayoutCreate(A)", shape);
      cublas_ok(cublasLtMatrixLayoutCreate(&plan.b, input, k, n, k), "cublasLtMatrixLayoutCreate(B)", shape);
      cublas_ok(cublasLtMatrixLayoutCreate(&plan.d, CUDA_R_16BF, m, n, m), "cublasLtMatrixLayoutCreate(D)", shape);
      cublasLtMatmulHeuristicResult_t heuristic{};
      int found_count = 0;
      cublas_ok(cublasLtMatmulAlgoGetHeuristic(handle_, desc_[index(linear)], plan.a, plan.b, plan.d, plan.d,
                                               preference_, 1, &heuristic, &found_count),
                "cublasLtMatmulAlgoGetHeuristic", shape);
      require(found_count > 0, "cuBLASLt", "has no algorithm for ", shape);
      plan.algo = heuristic.algo;
    } catch (...) {
      destroy(plan);
      throw;
    }
    return plans_.emplace(key, plan).first->second;
  }

  static void destroy(const Plan& plan) {
    for (cublasLtMatrixLayout_t layout : {plan.a, plan.b, plan.d})
      if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }

  bool fp8_;
  float alpha_[2];  // per linear: the product of its operands' per-tensor scales (1 for BF16)
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_[2] = {};
  cublasLtMatmulPreference_t preference_ = nullptr;
  DeviceArena arena_;
  void* workspace_ = nullptr;
  std::map<std::tuple<int, int32_t, int32_t, int32_t>, Plan> plans_;
};

}  // namespace

struct UnfusedBaseline::Impl {
  Impl(Communicator& communicator, const Problem& problem, const LayerWeights& layer_weights)
      : nccl(communicator.nccl()),
        p(problem),
        w(layer_weights),
        fp8(problem.recipe == Recipe::fp8),
        local_experts(problem.experts_per_rank()),
        act_bytes(static_cast<uint32_t>(activation_bytes(problem.recipe))),
        hidden_scales(fp8 ? static_cast<uint32_t>(problem.hidden / kScaleBlock) : 0),
        shared_intermediate(problem.num_shared_experts * problem.intermediate),
        max_routes(int64_t{problem.max_tokens_per_rank} * problem.top_k),
        max_received(int64_t{problem.num_ranks} * problem.max_tokens_per_rank * problem.max_routes_per_token_to_rank()),
        host_counts(2ull * problem.num_experts) {
    validate(p);
    require(nccl != nullptr, "unfused baseline", "needs NCCL ranks (one process per GPU), not emulated ranks");
    require(p.recipe == Recipe::fp8 || p.recipe == Recipe::bf16, "unfused baseline", "runs fp8 and bf16, not ",
            to_string(p.recipe));
    require(p.num_experts <= baseline::kMaxLayoutExperts, "unfused baseline", "handles at most ",
            baseline::kMaxLayoutExperts, " experts, got ", p.num_experts);
    const int64_t h = p.hidden, i = p.intermediate, tokens = p.max_tokens_per_rank;
    counts = arena.allocate<int32_t>(2ull * p.num_experts, "unfused baseline: counts");
    route_position = arena.allocate<int32_t>(max_routes, "unfused baseline: route positions");
    send_x = arena.allocate<uint8_t>(max_routes * h * act_bytes, "unfused baseline: send rows");
    recv_x = arena.allocate<uint8_t>((max_received + kRowSlack) * h * act_bytes, "unfused baseline: received rows");
    if (fp8) {
      send_scales = arena.allocate<float>(max_routes * hidden_scales, "unfused baseline: send scales");
      recv_scales = arena.allocate<float>(max_received * hidden_scales, "unfused baseline: received scales");
    }
    // With one rank the received rows are expert-major already.
    expert_x = recv_x;
    expert_scales = recv_scales;
    if (p.num_ranks > 1) {
      expert_x = arena.allocate<uint8_t>((max_received + kRowSlack) * h * act_bytes, "unfused baseline: expert-major rows");
      if (fp8)
        expert_scales = arena.allocate<float>(max_received * hidden_scales, "unfused baseline: expert-major scales");
    }
    l1_out = arena.allocate<uint16_t>((max_received + kRowSlack) * 2 * i, "unfused baseline: L1 output");
    l2_in = arena.allocate<uint8_t>((max_received + kRowSlack) * i * act_bytes, "unfused baseline: L2 input");
    l2_out = arena.allocate<uint16_t>((max_received + kRowSlack) * h, "unfused baseline: L2 output");
    results_back = p.num_ranks > 1
                       ? arena.allocate<uint16_t>(max_received * h, "unfused baseline: source-major L2 output")
                       : l2_out;
    results = arena.allocate<uint16_t>(max_routes * h, "unfused baseline: returned results");
    if (p.num_shared_experts > 0) {
      shared_x = arena.allocate<uint8_t>((tokens + kRowSlack) * h * act_bytes, "unfused baseline: shared experts' input");
      shared_l1_out = arena.allocate<uint16_t>((tokens + kRowSlack) * 2 * shared_intermediate, "unfused baseline: shared L1 output");
      shared_l2_in = arena.allocate<uint8_t>((tokens + kRowSlack) * shared_intermediate * act_bytes,
                                             "unfused baseline: shared L2 input");
      shared_l2_out = arena.allocate<uint16_t>((tokens + kRowSlack) * h, "unfused baseline: shared L2 output");
    }
    // Per-tensor scales: weights at synthetic_weight_range(fan_in) / 448, the middle of the synthetic
    // 128x128 block scales' range (that range times [0.5, 2)); see the header for the activations.
    const float scales_host[4] = {synthetic_weight_range(p.hidden) / kE4M3Max, kActivationScale,
                                  synthetic_weight_range(p.intermediate) / kE4M3Max, kSwigluScale};
    gemms = std::make_unique<LtGemms>(fp8, scales_host);
  }

  // Host tables from the counts: rows per peer in both directions and per local expert.
  void plan_rows() {
    const int32_t ranks = p.num_ranks;
    const int32_t* sent = host_counts.data();                      // [num_experts], global expert order
    const int32_t* received = host_counts.data() + p.num_experts;  // [source rank][local expert]
    send_rows.assign(ranks, 0);
    recv_rows.assign(ranks, 0);
    expert_rows.assign(local_experts, 0);
    for (int32_t peer = 0; peer < ranks; ++peer) {
      for (int32_t e = 0; e < local_experts; ++e) {
        send_rows[peer] += sent[peer * local_experts + e];
        recv_rows[peer] += received[peer * local_experts + e];
        expert_rows[e] += received[peer * local_experts + e];
      }
    }
    auto exclusive_sums = [](const std::vector<int64_t>& rows) {
      std::vector<int64_t> offsets(rows.size() + 1, 0);
      for (size_t i = 0; i < rows.size(); ++i) offsets[i + 1] = offsets[i] + rows[i];
      return offsets;
    };
    send_offset = exclusive_sums(send_rows);
    recv_offset = exclusive_sums(recv_rows);
    expert_offset = exclusive_sums(expert_rows);
    total_received = recv_offset.back();
    require(total_received <= max_received, "unfused baseline", "received ", total_received, " rows, more than the ",
            max_received, " a token count of max_tokens_per_rank allows");
  }

  // Grouped send/recv: rows [send_first[peer], + send_count[peer]) of `send` to each peer and rows
  // [recv_first[peer], ...) of `recv` from it; `row_bytes` per row, plus FP32 scale rows when given.
  void exchange(const uint8_t* send, const std::vector<int64_t>& send_first, const std::vector<int64_t>& send_count,
                uint8_t* recv, const std::vector<int64_t>& recv_first, const std::vector<int64_t>& recv_count,
                uint64_t row_bytes, const float* send_scales_rows, float* recv_scales_rows, cudaStream_t stream) {
    MEGAMOE_CHECK_NCCL(ncclGroupStart(), nccl);
    for (int32_t peer = 0; peer < p.num_ranks; ++peer) {
      if (send_count[peer] > 0) {
        MEGAMOE_CHECK_NCCL(
            ncclSend(send + send_first[peer] * row_bytes, send_count[peer] * row_bytes, ncclUint8, peer, nccl, stream),
            nccl);
        if (send_scales_rows != nullptr)
          MEGAMOE_CHECK_NCCL(ncclSend(send_scales_rows + send_first[peer] * hidden_scales,
                                      send_count[peer] * hidden_scales, ncclFloat32, peer, nccl, stream),
                             nccl);
      }
      if (recv_count[peer] > 0) {
        MEGAMOE_CHECK_NCCL(
            ncclRecv(recv + recv_first[peer] * row_bytes, recv_count[peer] * row_bytes, ncclUint8, peer, nccl, stream),
            nccl);
        if (recv_scales_rows != nullptr)
          MEGAMOE_CHECK_NCCL(ncclRecv(recv_scales_rows + recv_first[peer] * hidden_scales,
                                      recv_count[peer] * hidden_scales, ncclFloat32, peer, nccl, stream),
                             nccl);
      }
    }
    MEGAMOE_CHECK_NCCL(ncclGroupEnd(), nccl);
  }

  void run(const LayerInputs& in, const TensorView& y, cudaStream_t stream) {
    const int64_t tokens = in.num_tokens, h = p.hidden, i = p.intermediate;
    require(tokens >= 0 && tokens <= p.max_tokens_per_rank, "inputs.num_tokens", "must be in [0, ",
            p.max_tokens_per_rank, "], got ", tokens);
    check_tensor(in.x, "inputs.x", activation_dtype(p.recipe), {tokens, h}, Device::cuda);
    if (fp8) check_tensor(in.x_scales, "inputs.x_scales", DType::f32, {tokens, h / kScaleBlock}, Device::cuda);
    check_tensor(in.topk_idx, "inputs.topk_idx", DType::i32, {tokens, p.top_k}, Device::cuda);
    check_tensor(in.topk_weights, "inputs.topk_weights", DType::f32, {tokens, p.top_k}, Device::cuda);
    check_tensor(y, "y", DType::bf16, {tokens, h}, Device::cuda);
    const int32_t routes = static_cast<int32_t>(tokens * p.top_k);
    const uint64_t x_row_bytes = h * act_bytes;

    // Dispatch: permute, exchange counts, wait for them, exchange rows.
    baseline::route_layout(in.topk_idx.as<int32_t>(), routes, p.num_experts, counts, route_position, stream);
    baseline::gather_rows(in.x.as<uint8_t>(), fp8 ? in.x_scales.as<float>() : nullptr, route_position, routes, p.top_k,
                          static_cast<uint32_t>(x_row_bytes), hidden_scales, send_x, send_scales, stream);
    MEGAMOE_CHECK_NCCL(ncclAlltoAll(counts, counts + p.num_experts, local_experts, ncclInt32, nccl, stream), nccl);
    MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(host_counts.data(), counts, sizeof(int32_t) * 2 * p.num_experts,
                                       cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
    plan_rows();
    exchange(send_x, send_offset, send_rows, recv_x, recv_offset, recv_rows, x_row_bytes, send_scales, recv_scales,
             stream);
    const int32_t* received_counts = counts + p.num_experts;
    if (p.num_ranks > 1) {
      baseline::regroup_rows({received_counts, p.num_ranks, local_experts, true, recv_x, expert_x,
                              static_cast<uint32_t>(x_row_bytes), recv_scales, expert_scales, hidden_scales},
                             total_received, stream);
    }

    // Experts.
    const uint64_t w1_bytes = 2 * i * h * act_bytes, w2_bytes = h * i * act_bytes;
    for (int32_t e = 0; e < local_experts; ++e) {
      if (expert_rows[e] == 0) continue;
      gemms->run(Linear::first, static_cast<int32_t>(2 * i), static_cast<int32_t>(h),
                 static_cast<int32_t>(expert_rows[e]), w.routed.w1.values.as<uint8_t>() + e * w1_bytes,
                 expert_x + expert_offset[e] * x_row_bytes, l1_out + expert_offset[e] * 2 * i, stream);
    }
    baseline::swiglu(l1_out, total_received, p.intermediate, fp8, kSwigluScale, l2_in, stream);
    for (int32_t e = 0; e < local_experts; ++e) {
      if (expert_rows[e] == 0) continue;
      gemms->run(Linear::second, static_cast<int32_t>(h), static_cast<int32_t>(i), static_cast<int32_t>(expert_rows[e]),
                 w.routed.w2.values.as<uint8_t>() + e * w2_bytes, l2_in + expert_offset[e] * i * act_bytes,
                 l2_out + expert_offset[e] * h, stream);
    }

    // Results back to the ranks their tokens came from.
    if (p.num_ranks > 1) {
      baseline::regroup_rows(
          {received_counts, p.num_ranks, local_experts, false, reinterpret_cast<const uint8_t*>(l2_out),
           reinterpret_cast<uint8_t*>(results_back), static_cast<uint32_t>(h * sizeof(uint16_t)), nullptr, nullptr, 0},
          total_received, stream);
    }
    exchange(reinterpret_cast<const uint8_t*>(results_back), recv_offset, recv_rows,
             reinterpret_cast<uint8_t*>(results), send_offset, send_rows, h * sizeof(uint16_t), nullptr, nullptr,
             stream);

    // Shared experts on this rank's tokens, then the combine.
    const bool shared = p.num_shared_experts > 0 && tokens > 0;
    if (shared) {
      const int64_t si = shared_intermediate;
      MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(shared_x, in.x.data, in.x.bytes(), cudaMemcpyDeviceToDevice, stream));
      gemms->run(Linear::first, static_cast<int32_t>(2 * si), static_cast<int32_t>(h), static_cast<int32_t>(tokens),
                 w.shared.w1.values.data, shared_x, shared_l1_out, stream);
      baseline::swiglu(shared_l1_out, tokens, shared_intermediate, fp8, kSwigluScale, shared_l2_in, stream);
      gemms->run(Linear::second, static_cast<int32_t>(h), static_cast<int32_t>(si), static_cast<int32_t>(tokens),
                 w.shared.w2.values.data, shared_l2_in, shared_l2_out, stream);
    }
    baseline::combine(results, route_position, in.topk_weights.as<float>(), shared ? shared_l2_out : nullptr,
                      static_cast<int32_t>(tokens), p.top_k, p.hidden, y.as<uint16_t>(), stream);
  }

  ncclComm_t nccl;
  Problem p;
  LayerWeights w;
  bool fp8;
  int32_t local_experts;
  uint32_t act_bytes;
  uint32_t hidden_scales;  // FP32 scales per x row: hidden / 128 for fp8, else 0
  int32_t shared_intermediate;
  int64_t max_routes;        // rows this rank sends at most
  int64_t max_received;      // rows this rank receives at most
  PinnedCounts host_counts;  // a copy of `counts`

  DeviceArena arena;
  int32_t* counts = nullptr;  // [2 * num_experts]: routes sent per global expert, then received [source][local expert]
  int32_t* route_position = nullptr;
  uint8_t* send_x = nullptr;
  float* send_scales = nullptr;
  uint8_t* recv_x = nullptr;  // source-major
  float* recv_scales = nullptr;
  uint8_t* expert_x = nullptr;  // expert-major
  float* expert_scales = nullptr;
  uint16_t* l1_out = nullptr;
  uint8_t* l2_in = nullptr;
  uint16_t* l2_out = nullptr;        // expert-major
  uint16_t* results_back = nullptr;  // source-major
  uint16_t* results = nullptr;       // this rank's routes, in send order
  uint8_t* shared_x = nullptr;  // a copy of x with kRowSlack rows of room
  uint16_t* shared_l1_out = nullptr;
  uint8_t* shared_l2_in = nullptr;
  uint16_t* shared_l2_out = nullptr;
  std::unique_ptr<LtGemms> gemms;

  std::vector<int64_t> send_rows, recv_rows, expert_rows;        // per peer, per peer, per local expert
  std::vector<int64_t> send_offset, recv_offset, expert_offset;  // their exclusive prefix sums
  int64_t total_received = 0;
};

UnfusedBaseline::UnfusedBaseline(Communicator& comm, const Problem& problem, const LayerWeights& weights)
    : impl_(std::make_unique<Impl>(comm, problem, weights)) {}

UnfusedBaseline::~UnfusedBaseline() = default;

void UnfusedBaseline::run(const LayerInputs& inputs, const TensorView& y, cudaStream_t stream) {
  impl_->run(inputs, y, stream);
}

}  // namespace megamoe::bench
