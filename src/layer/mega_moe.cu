// The staged MoE layer: the dispatch, GEMM and combine building blocks issued on one stream.
//   send_routes (copy inputs into the buffer, count, scatter, publish the counts, rank barrier) -> pull
//   -> L1 (routed, shared) -> L2 (routed to the source ranks' slots, shared to our own)
//   -> rank barrier -> combine
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>

#include "comm/rank_barrier.h"
#include "kernels/combine/combine_kernel.cuh"
#include "kernels/dispatch/dispatch_kernels.cuh"
#include "kernels/fused/fused.h"
#include "kernels/gemm/gemm.h"
#include "kernels/overlapped_launch.cuh"
#include "kernels/producers/producer_checks.h"
#include "kernels/producers/streamed_producers.h"
#include "megamoe/activation.h"
#include "megamoe/error.h"
#include "megamoe/layer.h"
#include "megamoe/producers.h"
#include "megamoe/router.h"

namespace megamoe {
namespace {

constexpr int kDispatchThreads = 512;
constexpr int kPullThreads = dispatch::kPullThreads;
constexpr int kCombineThreads = combine::kCombineThreads;

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

// One linear of `experts` experts x rows x cols (LinearWeights' formats), named `name` in errors.
void check_linear(Recipe recipe, const LinearWeights& w, const std::string& name, int64_t experts, int64_t rows,
                  int64_t cols) {
  const bool packed = recipe == Recipe::fp8_fp4;
  check_tensor(w.values, (name + ".values").c_str(), packed ? DType::e2m1x2 : activation_dtype(recipe),
               {experts, rows, packed ? cols / 2 : cols}, Device::cuda);
  if (recipe == Recipe::bf16) return;
  check_tensor(w.scales, (name + ".scales").c_str(), DType::f32, {experts, rows / 64, cols / 128}, Device::cuda);
  if (packed) check_tensor(w.shifts, (name + ".shifts").c_str(), DType::u8, {cols / 128, experts * rows, 4}, Device::cuda);
}

void check_weights(const Problem& p, const LayerWeights& w) {
  const int64_t e = p.experts_per_rank(), h = p.hidden, i = p.intermediate;
  check_linear(p.recipe, w.routed.w1, "weights.routed.w1", e, 2 * i, h);
  check_linear(p.recipe, w.routed.w2, "weights.routed.w2", e, h, i);
  if (p.num_shared_experts == 0) return;
  const int64_t si = int64_t{p.num_shared_experts} * i;
  check_linear(p.recipe, w.shared.w1, "weights.shared.w1", 1, 2 * si, h);
  check_linear(p.recipe, w.shared.w2, "weights.shared.w2", 1, h, si);
}

void check_inputs(const Problem& p, const LayerInputs& in, const TensorView& y, const TensorView& recv_stats,
                  bool streamed) {
  require(in.num_tokens >= 0 && in.num_tokens <= p.max_tokens_per_rank, "inputs.num_tokens", "must be in [0, ",
          p.max_tokens_per_rank, "] (the buffer's max_tokens_per_rank), got ", in.num_tokens);
  const int64_t t = in.num_tokens;
  check_tensor(y, "y", DType::bf16, {t, p.hidden}, Device::cuda);
  if (!recv_stats.empty())
    check_tensor(recv_stats, "recv_stats", DType::i64, {p.experts_per_rank()}, Device::cuda);
  if (streamed) {
    const std::pair<const TensorView*, const char*> given[] = {{&in.x, "inputs.x"},
                                                               {&in.x_scales, "inputs.x_scales"},
                                                               {&in.topk_idx, "inputs.topk_idx"},
                                                               {&in.topk_weights, "inputs.topk_weights"}};
    for (const auto& [tensor, name] : given)
      require(tensor->empty(), name, "must be empty in a streamed call (options.streamed): its inputs are the front "
              "ring's, as the producers published them");
    require(p.front_num_slots > 0, "options.streamed", "needs a buffer with a front ring (Problem::front_num_slots > 0)");
    // A rule on the buffer, not on this call's tokens, so that no rank's call can be refused while
    // the others' go ahead. (The ring holds a call: Problem's rule.)
    require(tokens_per_wave(p) >= p.max_tokens_per_rank, "options.streamed",
            "reads a call in one wave: the buffer's wave (", tokens_per_wave(p),
            " tokens, Problem::wave_tokens) must hold max_tokens_per_rank (", p.max_tokens_per_rank, ")");
    return;
  }
  check_tensor(in.x, "inputs.x", activation_dtype(p.recipe), {t, p.hidden}, Device::cuda);
  if (p.recipe != Recipe::bf16)
    check_tensor(in.x_scales, "inputs.x_scales", DType::f32, {t, p.hidden / 128}, Device::cuda);
  check_tensor(in.topk_idx, "inputs.topk_idx", DType::i32, {t, p.top_k}, Device::cuda);
  check_tensor(in.topk_weights, "inputs.topk_weights", DType::f32, {t, p.top_k}, Device::cuda);
}

// A copy of `source` into the buffer region at `destination`, unless the caller already wrote it there.
dispatch::StagedCopy staged_copy(const TensorView& source, char* destination) {
  if (source.numel() == 0 || source.data == destination) return {nullptr, nullptr, 0, 0};
  const uint64_t words = static_cast<uint64_t>(source.bytes()) / 4;
  return {static_cast<const uint32_t*>(source.data), reinterpret_cast<uint32_t*>(destination), words,
          static_cast<uint32_t>(words / static_cast<uint64_t>(source.shape[0]))};
}

// The GEMM operands of one linear over the routed experts (the expert-major pool, one group per local
// expert, rows from expert_rows) or over the concatenated shared experts (this rank's tokens, one
// group of `rows`), in tile shape `tile`.
gemm::GemmOperands expert_operands(const Problem& p, const BufferLayout& l, char* local, uint64_t timeout_ns,
                                   const TensorView& weights, const TensorView& weight_scales,
                                   const TensorView& weight_shifts, bool first_linear, bool shared, uint32_t rows,
                                   gemm::TileShape tile, bool overlapped_launch) {
  const uint32_t intermediate = shared ? l.shared_intermediate : static_cast<uint32_t>(p.intermediate);
  const uint32_t hidden = static_cast<uint32_t>(p.hidden);
  const Region& acts = first_linear ? (shared ? l.x : l.l1_pool) : (shared ? l.shared_l2 : l.l2_pool);
  const Region& act_scales = first_linear ? (shared ? l.shared_x_scales : l.l1_pool_scales)
                                          : (shared ? l.shared_l2_scales : l.l2_pool_scales);
  gemm::GemmOperands o;
  o.recipe = p.recipe;
  o.num_groups = shared ? 1 : l.experts_per_rank;
  o.n_out = first_linear ? 2 * intermediate : hidden;
  o.k = first_linear ? hidden : intermediate;
  o.weights = weights.data;
  o.weight_scales = weight_scales.as<const float>();
  o.weight_shifts = weight_shifts.as<const uint8_t>();
  o.acts = local + acts.offset;
  o.act_scales = p.recipe != Recipe::bf16 ? BufferLayout::at<float>(local, act_scales) : nullptr;
  o.act_rows = shared ? l.wave_tokens : l.pool_rows;
  o.groups = shared ? gemm::GroupRows{nullptr, 1, rows}
                    : gemm::GroupRows{BufferLayout::at<uint32_t>(local, l.expert_rows), l.experts_per_rank, 0};
  o.tile = tile;
  o.timeout_ns = timeout_ns;
  o.control = l.control_block(local);
  o.rank = static_cast<uint32_t>(p.rank);
  o.split_workspace = {local + l.gemm_split.offset, l.gemm_split.bytes};
  o.overlapped_launch = overlapped_launch;
  if (tile.expand_weights) {
    // The layout sizes this scratch with the same rule (expands_fp4_weights) that chose the tile.
    const uint64_t part_offset = shared ? l.expanded_shared_offset : 0;
    const uint64_t part_bytes = shared ? l.expanded_weights.bytes - l.expanded_shared_offset : l.expanded_shared_offset;
    require(gemm::expanded_weight_bytes(o.num_groups, o.n_out, o.k) <= part_bytes, "expanded_weights",
            "the buffer's scratch for expanded fp4 weights is smaller than this launch's weights (",
            part_bytes, " bytes)");
    o.expanded_weights = local + l.expanded_weights.offset + part_offset;
  }
  return o;
}

// The CTAs of a call's launches (the fused call's persistent grid): the rank's SM budget.
int call_grid(const SymmBuffer& buffer) { return std::max(1, buffer.comm().sm_budget()); }

// What both schedules share: the checked arguments, the GEMMs' operands and outputs, and the dispatch
// and combine arguments of one call.
struct CallPlan {
  const Problem& p;
  const BufferLayout& l;
  char* local;
  SymmView view;
  dispatch::DispatchArgs dispatch;
  dispatch::StagedInputs staged{};  // nothing to copy unless set
  combine::CombineArgs combine;
  uint32_t tokens;
  uint32_t expected_rows;  // per local expert, assuming every rank routes like this one (tile choice only)
  gemm::TileShape routed_tile;
  bool shared;  // shared experts with tokens to run
  bool overlap;  // each kernel launched while the one before it runs (kernels/overlapped_launch.cuh)
  int grid;
  float clamp;  // before SwiGLU (megamoe/activation.h)

  // `in`: one wave, whose first token is the call's token `first_token`. `streamed`: the inputs are
  // the front ring's (CallOptions::streamed; `in` holds only the token count).
  CallPlan(SymmBuffer& buffer, const LayerInputs& in, const TensorView& y, const TensorView& recv_stats,
           int64_t first_token = 0, bool streamed = false)
      : p(buffer.problem()), l(buffer.layout()), local(buffer.local()), view(buffer.view()) {
    dispatch = {view, l, p, in.num_tokens, in.topk_idx.as<int32_t>(),
                recv_stats.empty() ? nullptr : recv_stats.as<int64_t>(), static_cast<uint32_t>(first_token),
                streamed, streamed ? FrontRingLayout::make(p) : FrontRingLayout{}};
    // A streamed call copies nothing: peers read the ring, and this rank's shared experts read its rows
    // and scales from the buffer's regions, where the layout producer also wrote them.
    if (!streamed) {
      staged = {{staged_copy(in.x, local + l.x.offset),
                 p.recipe != Recipe::bf16 ? staged_copy(in.x_scales, local + l.x_scales.offset)
                                          : dispatch::StagedCopy{},
                 staged_copy(in.topk_weights, local + l.topk_weights.offset)}};
    }
    // A streamed call's own route unit copies this rank's ids to the topk_idx region for the combine.
    const int32_t* own_ids = streamed ? BufferLayout::at<int32_t>(local, l.topk_idx) : in.topk_idx.as<int32_t>();
    combine = {l.control_block(local), p.rank, BufferLayout::at<uint16_t>(local, l.combine), own_ids,
               y.as<uint16_t>(), in.num_tokens, p.top_k, p.num_experts, p.hidden, p.num_shared_experts > 0};
    tokens = static_cast<uint32_t>(in.num_tokens);
    expected_rows = static_cast<uint32_t>(std::max<int64_t>(
        1, int64_t{in.num_tokens} * p.num_ranks * p.top_k / std::max(1, p.num_experts)));
    routed_tile = gemm::choose_tile(expected_rows, l.experts_per_rank, p.recipe);
    shared = p.num_shared_experts > 0 && in.num_tokens > 0;
    overlap = overlap_launches(buffer.comm());
    grid = call_grid(buffer);
    clamp = kernel_activation_clamp(in.activation_clamp, "inputs.activation_clamp");
  }

  gemm::GemmOperands operands(const LayerWeights& w, bool first_linear, bool is_shared, gemm::TileShape tile) const {
    const ExpertGroupWeights& group = is_shared ? w.shared : w.routed;
    const LinearWeights& linear = first_linear ? group.w1 : group.w2;
    return expert_operands(p, l, local, view.timeout_ns, linear.values, linear.scales, linear.shifts, first_linear,
                           is_shared, is_shared ? tokens : expected_rows, tile, overlap);
  }
  gemm::SwigluOutput swiglu_output(bool is_shared) const {
    const bool scaled = p.recipe != Recipe::bf16;  // E4M3 activations with 1x128 scales
    if (is_shared)
      return {local + l.shared_l2.offset, scaled ? BufferLayout::at<float>(local, l.shared_l2_scales) : nullptr,
              nullptr, l.wave_tokens, clamp};
    return {local + l.l2_pool.offset, scaled ? BufferLayout::at<float>(local, l.l2_pool_scales) : nullptr,
            BufferLayout::at<float>(local, l.pool_weight), l.pool_rows, clamp};
  }
  gemm::SlotDestination slot_destination(bool is_shared) const {
    if (is_shared)
      return {{}, {BufferLayout::at<uint16_t>(local, l.combine), static_cast<uint32_t>(p.top_k),
                   static_cast<uint32_t>(p.hidden)}, true};
    return {{view, l.combine.offset, BufferLayout::at<PoolSource>(local, l.pool_source),
             static_cast<uint32_t>(p.top_k), static_cast<uint32_t>(p.hidden)},
            {},
            false};
  }
};

// The staged schedule's L1 and L2 launches (routed, and shared experts).
void run_expert_gemms(const CallPlan& c, const LayerWeights& w, cudaStream_t stream) {
  const Problem& p = c.p;
  // The shared experts run as a second job of the routed experts' launches, in the routed tile
  // shape, when that shape suits them too: the same shape, or at most 8 token tiles per weight tile.
  // One persistent grid then balances both, which matters most when few tokens leave SMs idle
  // (their own launch would cover only n_out / 256 SMs). Otherwise each gets its own launch.
  const gemm::TileShape own_shared_tile = gemm::choose_tile(c.tokens, 1, p.recipe);
  const bool merged = (c.routed_tile.layout == own_shared_tile.layout &&
                       c.routed_tile.block_n == own_shared_tile.block_n) ||
                      c.tokens <= 8 * c.routed_tile.block_n;
  const gemm::TileShape shared_tile = merged ? c.routed_tile : own_shared_tile;
  const size_t num_jobs = c.shared && merged ? 2 : 1;
  const gemm::SwigluJob l1_jobs[2] = {
      {c.operands(w, true, false, c.routed_tile), c.swiglu_output(false)},
      {c.shared ? c.operands(w, true, true, shared_tile) : gemm::GemmOperands{}, c.swiglu_output(true)}};
  gemm::grouped_gemm_swiglu(std::span<const gemm::SwigluJob>(l1_jobs, num_jobs), c.grid, stream);
  if (c.shared && !merged)
    gemm::grouped_gemm_swiglu(std::span<const gemm::SwigluJob>(l1_jobs + 1, 1), c.grid, stream);
  const gemm::StoreJob l2_jobs[2] = {
      {c.operands(w, false, false, c.routed_tile), c.slot_destination(false)},
      {c.shared ? c.operands(w, false, true, shared_tile) : gemm::GemmOperands{}, c.slot_destination(true)}};
  gemm::grouped_gemm_store(std::span<const gemm::StoreJob>(l2_jobs, num_jobs), c.grid, stream);
  if (c.shared && !merged) gemm::grouped_gemm_store(std::span<const gemm::StoreJob>(l2_jobs + 1, 1), c.grid, stream);
}

// The staged schedule: send_routes -> pull -> L1 (routed, shared) -> L2 (routed to the source ranks'
// slots, shared to our own) -> rank barrier -> combine.
void run_staged(SymmBuffer& buffer, const CallPlan& c, const LayerWeights& w, cudaStream_t stream) {
  const Problem& p = c.p;
  const BufferLayout& l = c.l;
  const auto launch = [&](const char* what, auto kernel, int blocks, int threads, size_t smem_bytes,
                          const auto&... args) {
    cuda_ok(launch_kernel(kernel, blocks, threads, smem_bytes, stream, c.overlap, args...), what);
  };
  const size_t count_smem = sizeof(uint32_t) * p.num_experts;
  launch("send_routes launch", dispatch::send_routes, c.grid, kDispatchThreads, count_smem, c.dispatch, c.staged);
  const size_t pull_smem = sizeof(uint32_t) * (size_t{l.experts_per_rank} * p.num_ranks + 1);
  launch("pull launch", dispatch::pull, c.grid, kPullThreads, pull_smem, c.dispatch);

  run_expert_gemms(c, w, stream);
  // Every rank's L2 results have landed in our combine slots once all ranks pass this barrier.
  launch_rank_barrier(buffer, stream);
  if (c.tokens > 0) launch("combine launch", combine::combine_kernel, c.grid, kCombineThreads, 0, c.combine);
}

// The event log's bytes for a fused launch of `grid` CTAs.
int64_t trace_bytes(int64_t grid) {
  return grid * kFusedTraceEventsPerCta * static_cast<int64_t>(sizeof(FusedTraceEvent));
}

// A fused call's event log (CallOptions::trace) for a launch of `grid` CTAs: a trace build's, u8 of
// trace_bytes(grid), 8-byte aligned. `what` names the argument.
void check_trace(const TensorView& trace, const char* what, int64_t grid) {
  require(fused::kFusedTrace, what,
          "this build logs no events: configure it with -DMEGAMOE_FUSED_TRACE=ON (its fused kernels run slower)");
  check_tensor(trace, what, DType::u8, {trace_bytes(grid)}, Device::cuda);
  require(reinterpret_cast<uintptr_t>(trace.data) % alignof(FusedTraceEvent) == 0, what,
          "must start on an 8-byte boundary");
}

// The fused schedule: one persistent launch (kernels/fused), all four GEMMs in the routed tile shape;
// its arguments for fused::launch or fused::prepare. ring_synchronized: launched right after this
// call's front-ring producers (streamed_mega_moe).
fused::FusedLaunch fused_launch(const CallPlan& c, const LayerWeights& w, const CallOptions& options,
                                bool ring_synchronized = false) {
  const Problem& p = c.p;
  require(static_cast<uint32_t>(p.num_experts) <= fused::kMaxExperts &&
              static_cast<uint64_t>(c.l.experts_per_rank) * p.num_ranks <= fused::kMaxSegments &&
              c.l.experts_per_rank <= fused::kMaxLocalExperts,
          "schedule", "fused runs at most ", fused::kMaxExperts, " experts, ", fused::kMaxLocalExperts,
          " per rank and ", fused::kMaxSegments, " local experts x ranks; got ", p.num_experts, " experts over ",
          p.num_ranks, " ranks (use Schedule::staged)");
  fused::FusedLaunch f;
  f.shared = c.shared;
  f.l1[0] = {c.operands(w, true, false, c.routed_tile), c.swiglu_output(false)};
  f.l2[0] = {c.operands(w, false, false, c.routed_tile), c.slot_destination(false)};
  if (c.shared) {
    f.l1[1] = {c.operands(w, true, true, c.routed_tile), c.swiglu_output(true)};
    f.l2[1] = {c.operands(w, false, true, c.routed_tile), c.slot_destination(true)};
  }
  f.dispatch = c.dispatch;
  f.staged = c.staged;
  f.combine = c.combine;
  const uint32_t shared_intermediate = static_cast<uint32_t>(p.num_shared_experts * p.intermediate);
  f.plan = fused::make_unit_plan({c.tokens, static_cast<uint32_t>(p.top_k), static_cast<uint32_t>(c.grid),
                                  c.routed_tile.block_n, c.shared ? 2 * shared_intermediate / 256 : 0,
                                  c.shared ? (static_cast<uint32_t>(p.hidden) + 255) / 256 : 0,
                                  c.routed_tile.layout == gemm::TileLayout::tokens_on_m,
                                  static_cast<uint32_t>(p.hidden) / 8, p.num_ranks == 1 && !c.dispatch.streamed});
  f.overlapped_launch = c.overlap;
  f.ring_synchronized = ring_synchronized;
  if (!options.trace.empty()) {
    check_trace(options.trace, "options.trace", c.grid);
    f.trace = options.trace.as<FusedTraceEvent>();
  }
  return f;
}
void run_fused(const CallPlan& c, const LayerWeights& w, const CallOptions& options, cudaStream_t stream) {
  fused::launch(fused_launch(c, w, options), c.grid, stream);
}

// Rows [begin, begin + count) of a tensor whose rows are tokens (checked contiguous).
TensorView token_rows(const TensorView& whole, int64_t begin, int64_t count) {
  if (whole.empty()) return whole;
  TensorView part = whole;
  part.data = static_cast<char*>(whole.data) + begin * whole.strides[0] * element_bytes(whole.dtype);
  part.shape[0] = count;
  return part;
}

// A streamed layer call reads the chunks this rank's producers published since its previous one:
// refused where, with `launching` calls of each producer still to come, they would be more than one
// call ahead of it (a layer call refused after its producers ran): it would read an older call's
// chunks, every call from then on one call late.
void check_front_calls(SymmBuffer& buffer, uint64_t launching, const char* name) {
  const SymmBuffer::FrontCalls& calls = buffer.front_calls();
  require(calls.route + launching <= calls.layer + 1 && calls.layout + launching <= calls.layer + 1, name,
          "reads the call this rank's producers published last, but the front ring holds more than one it has not "
          "read (route_tokens ", calls.route + launching, " and quantize_activations ", calls.layout + launching,
          " calls, streamed layer calls ", calls.layer, "): a streamed layer call was refused or left out after its "
          "producers; make a new buffer");
}

// A call runs as waves_per_call(problem) waves, each a whole call over the next tokens_per_wave()
// tokens of every rank (layout.h: the buffer holds one wave). Every rank runs every wave, empty ones
// too, so the ranks agree on the waves without telling each other their token counts.
void run_layer(SymmBuffer& buffer, const LayerInputs& in, const LayerWeights& w, const TensorView& y,
               cudaStream_t stream, const TensorView& recv_stats, const CallOptions& options) {
  const Problem& p = buffer.problem();
  check_inputs(p, in, y, recv_stats, options.streamed);
  check_weights(p, w);
  require(options.trace.empty() || options.schedule == Schedule::fused, "options.trace",
          "is the fused schedule's event log; the staged schedule takes none");
  require(!options.streamed || options.schedule == Schedule::fused, "options.streamed",
          "runs in the fused schedule only (options.schedule = Schedule::fused)");
  if (options.streamed) {  // one wave (check_inputs)
    check_front_calls(buffer, 0, "options.streamed");
    run_fused(CallPlan(buffer, in, y, recv_stats, 0, true), w, options, stream);
    ++buffer.front_calls().layer;
    return;
  }
  const int64_t wave_tokens = tokens_per_wave(p);
  const int32_t waves = waves_per_call(p);
  for (int32_t wave = 0; wave < waves; ++wave) {
    const int64_t begin = std::min<int64_t>(in.num_tokens, wave * wave_tokens);
    const int64_t count = std::min<int64_t>(in.num_tokens - begin, wave_tokens);
    LayerInputs part = in;
    part.num_tokens = static_cast<int32_t>(count);
    part.x = token_rows(in.x, begin, count);
    part.x_scales = token_rows(in.x_scales, begin, count);
    part.topk_idx = token_rows(in.topk_idx, begin, count);
    part.topk_weights = token_rows(in.topk_weights, begin, count);
    const CallPlan plan(buffer, part, token_rows(y, begin, count), recv_stats, begin);
    if (options.schedule == Schedule::fused) {
      CallOptions wave_options = options;
      if (wave > 0) wave_options.trace = {};  // the event log covers the first wave
      run_fused(plan, w, wave_options, stream);
    } else {
      run_staged(buffer, plan, w, stream);
    }
  }
}

}  // namespace

bool fused_trace_compiled() { return fused::kFusedTrace; }

int64_t fused_trace_bytes(const SymmBuffer& buffer) { return trace_bytes(call_grid(buffer)); }

CallForm choose_call_form(const Problem& p, int64_t uniform_tokens) {
  require(uniform_tokens >= 0 && uniform_tokens <= p.max_tokens_per_rank, "uniform_tokens", "must be in [0, ",
          p.max_tokens_per_rank, "] (the problem's max_tokens_per_rank; 0 means that), got ", uniform_tokens);
  const int64_t tokens = uniform_tokens > 0 ? uniform_tokens : p.max_tokens_per_rank;
  return tokens <= kStreamedCallsUpToTokens ? CallForm::streamed : CallForm::batch;
}

void streamed_mega_moe(SymmBuffer& buffer, const StreamedCall& call, const LayerWeights& weights, const TensorView& y,
                       cudaStream_t stream, const TensorView& recv_stats) {
  const Problem& p = buffer.problem();
  // Every check before the first launch: producers that published a call the layer then refused (or
  // one half without the other) would leave the ring's sequences out of step.
  require(call.router != nullptr, "call.router", "is required");
  const RouterConfig& router = *call.router;
  try {
    validate(router);
  } catch (const Error& e) {  // its fields as this call names them
    throw Error(std::string("call.router.") + e.what());
  }
  require(router.num_experts == p.num_experts && router.top_k == p.top_k, "call.router", "routes to ",
          router.num_experts, " experts, top-", router.top_k, "; the buffer's problem has ", p.num_experts, ", top-",
          p.top_k);
  require(router.num_experts <= kMaxRouterExperts && router.num_groups <= kMaxRouterGroups, "call.router",
          "runs on the device with at most ", kMaxRouterExperts, " experts in at most ", kMaxRouterGroups,
          " groups; got ", router.num_experts, " in ", router.num_groups);
  require(call.x.ndim == 2, "call.x", "must be [num_tokens, hidden], got ", call.x.ndim, " dimensions");
  const int64_t t = call.x.shape[0];
  check_tensor(call.x, "call.x", DType::bf16, {t, p.hidden}, Device::cuda);
  check_tensor(call.router_weight, "call.router_weight", DType::bf16, {p.num_experts, p.hidden}, Device::cuda);
  check_tensor(call.logits, "call.logits", DType::f32, {t, p.num_experts}, Device::cuda);
  require(call.router_bias.empty() || router.scoring == RouterScoring::sigmoid, "call.router_bias",
          "corrects the sigmoid router's choice only; softmax scoring takes none");
  if (!call.router_bias.empty())
    check_tensor(call.router_bias, "call.router_bias", DType::f32, {p.num_experts}, Device::cuda);
  require(call.uniform_tokens == 0 || (call.uniform_tokens >= t && call.uniform_tokens <= p.max_tokens_per_rank),
          "call.uniform_tokens", "is 0 or the most tokens any rank has in this call: at least this rank's ", t,
          ", at most max_tokens_per_rank (", p.max_tokens_per_rank, "); got ", call.uniform_tokens);
  require(t <= p.max_tokens_per_rank, "call.x", "holds ", t, " tokens, more than the buffer's max_tokens_per_rank (",
          p.max_tokens_per_rank, ")");
  // Rules on the buffer and the form, not on this call's tokens, so that no rank's call is refused
  // while the others' go ahead, whichever form automatic picks.
  require(call.form == CallForm::batch || p.front_num_slots > 0, "buffer", "has no front ring, which form ",
          to_string(call.form), " needs (Problem::front_num_slots > 0; in Python, Buffer(streaming=True))");
  require(tokens_per_wave(p) >= p.max_tokens_per_rank, "buffer", "runs a streamed_mega_moe call in one wave: its wave (",
          tokens_per_wave(p), " tokens, Problem::wave_tokens) must hold max_tokens_per_rank (", p.max_tokens_per_rank,
          ")");
  if (call.form != CallForm::streamed)  // automatic may pick batch for other tokens: required alike
    check_tensor(call.topk_idx, "call.topk_idx", DType::i32, {t, p.top_k}, Device::cuda);
  // The layer checks it again; here before the producers' launches.
  if (!call.trace.empty()) check_trace(call.trace, "call.trace", call_grid(buffer));
  const CallForm form = call.form == CallForm::automatic ? choose_call_form(p, call.uniform_tokens) : call.form;
  LayerInputs in;
  in.num_tokens = static_cast<int32_t>(t);
  detail::check_router_logits(call.x, call.router_weight, call.logits);
  CallOptions options(Schedule::fused);
  options.trace = call.trace;
  if (form == CallForm::batch) {
    // The producers write the layer's inputs where the layer reads them (no copies; bf16 x is copied
    // in by the layer).
    in = buffer_input_views(buffer, in.num_tokens, call.topk_idx);
    if (p.recipe == Recipe::bf16) in.x = call.x;
    check_inputs(p, in, y, recv_stats, false);
    check_weights(p, weights);
    detail::check_route_arguments(router, call.logits, call.router_bias);
    if (p.recipe != Recipe::bf16) quantize_activations(call.x, in.x, in.x_scales, stream);
    router_logits(call.x, call.router_weight, call.logits, stream);
    route_tokens(router, call.logits, call.router_bias, in.topk_idx, in.topk_weights, stream);
    run_layer(buffer, in, weights, y, stream, recv_stats, options);
    return;
  }
  options.streamed = true;
  check_inputs(p, in, y, recv_stats, true);
  check_weights(p, weights);
  const CallPlan plan(buffer, in, y, recv_stats, 0, true);
  // What the producers check of their arguments (the above in their terms), and the layer's launch
  // made ready, before any of them is launched.
  detail::check_route_arguments(router, call.logits, call.router_bias);
  const fused::PreparedLaunch layer = fused::prepare(fused_launch(plan, weights, options, true), plan.grid);
  check_front_calls(buffer, 1, "buffer");
  // The quantization first, then the router beside it (streamed_producers.h), then the layer.
  quantize_activations(call.x, buffer, stream);
  detail::router_logits(call.x, call.router_weight, call.logits, stream, true);
  detail::route_tokens(*call.router, call.logits, call.router_bias, buffer, stream, true);
  layer(stream);
  ++buffer.front_calls().layer;
}

void detail::expert_gemms(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights,
                          cudaStream_t stream) {
  const Problem& p = buffer.problem();
  require(inputs.num_tokens <= tokens_per_wave(p), "inputs.num_tokens", "must be at most one wave (",
          tokens_per_wave(p), " tokens): the GEMMs run on the rows of the last wave, got ", inputs.num_tokens);
  const TensorView y = TensorView::contiguous(nullptr, DType::bf16, {inputs.num_tokens, p.hidden}, Device::cuda);
  check_weights(p, weights);
  run_expert_gemms(CallPlan(buffer, inputs, y, {}), weights, stream);
}

LayerInputs buffer_input_views(const SymmBuffer& buffer, int32_t num_tokens, const TensorView& topk_idx) {
  const Problem& p = buffer.problem();
  const BufferLayout& l = buffer.layout();
  require(num_tokens >= 0 && num_tokens <= tokens_per_wave(p), "num_tokens", "must be in [0, ", tokens_per_wave(p),
          "] (the buffer's regions hold one wave of tokens), got ", num_tokens);
  char* local = buffer.local();
  LayerInputs in;
  in.num_tokens = num_tokens;
  in.x = TensorView::contiguous(local + l.x.offset, activation_dtype(p.recipe), {num_tokens, p.hidden}, Device::cuda);
  if (p.recipe != Recipe::bf16)
    in.x_scales = TensorView::contiguous(local + l.x_scales.offset, DType::f32, {num_tokens, p.hidden / 128},
                                         Device::cuda);
  in.topk_idx = topk_idx;
  in.topk_weights =
      TensorView::contiguous(local + l.topk_weights.offset, DType::f32, {num_tokens, p.top_k}, Device::cuda);
  return in;
}

void fp8_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                  cudaStream_t stream, const TensorView& recv_stats, const CallOptions& options) {
  require(buffer.problem().recipe == Recipe::fp8, "buffer", "was made for recipe ", to_string(buffer.problem().recipe),
          "; fp8_mega_moe needs fp8");
  run_layer(buffer, inputs, weights, y, stream, recv_stats, options);
}

void fp8_fp4_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights,
                      const TensorView& y, cudaStream_t stream, const TensorView& recv_stats,
                      const CallOptions& options) {
  require(buffer.problem().recipe == Recipe::fp8_fp4, "buffer", "was made for recipe ",
          to_string(buffer.problem().recipe), "; fp8_fp4_mega_moe needs fp8_fp4");
  run_layer(buffer, inputs, weights, y, stream, recv_stats, options);
}

void bf16_mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
                   cudaStream_t stream, const TensorView& recv_stats, const CallOptions& options) {
  require(buffer.problem().recipe == Recipe::bf16, "buffer", "was made for recipe ",
          to_string(buffer.problem().recipe), "; bf16_mega_moe needs bf16");
  run_layer(buffer, inputs, weights, y, stream, recv_stats, options);
}

void mega_moe(SymmBuffer& buffer, const LayerInputs& inputs, const LayerWeights& weights, const TensorView& y,
              cudaStream_t stream, const TensorView& recv_stats, const CallOptions& options) {
  run_layer(buffer, inputs, weights, y, stream, recv_stats, options);
}

}  // namespace megamoe
