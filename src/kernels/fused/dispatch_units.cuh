// The fused kernel's dispatch warps: the send, route and pull units the producer hands them, with the
// staged schedule's dispatch functions (kernels/dispatch).
#pragma once

#include "kernels/fused/scheduler.cuh"

namespace megamoe::fused {

// Pull rows in flight per lane of the dispatch warps (in prefill configs their 40 registers hold
// four 16-byte vectors).
inline constexpr int kDispatchPullUnroll = 4;

// In the prefill config one dispatch thread stages a send unit's token rows with bulk copies through
// the ring's shared memory (dispatch::stage_rows_bulk), while the other threads copy the scales and
// route weights: the three warps' 16-byte vectors, about 6 KB in flight per SM, were latency-bound
// on the rows (~100 µs for a 63-token unit of DeepSeek-V3). The ring is idle until the CTA's send
// units are done: every GEMM unit and the producer's bulk pulls wait for all of this rank's sends.
template <class Config>
__device__ void stage_send_inputs(const FusedScheduler<Config>& s, const dispatch::StagedInputs& staged,
                                  UnitRange tokens, uint32_t thread) {
  const bool bulk = Config::kLayout == gemm::TileLayout::tokens_on_m && dispatch::bulk_stageable(staged.copies[0]);
  if (bulk && thread == 0) {
    static_assert(kPullAreaBytes<Config> >= kPullSegmentBytes + 2 * 1024, "the staging's bounce area");
    dispatch::BounceArea bounce{s.smem.base + kPullSegmentBytes, kPullAreaBytes<Config> - kPullSegmentBytes,
                                s.stage_loaded(), *s.stage_phases()};
    dispatch::stage_rows_bulk(staged.copies[0], tokens.begin, tokens.end, bounce);
    *s.stage_phases() = bounce.phases;
  }
  // One call, every thread (thread 0 after its bulk copies): each inlined copy of stage_inputs adds
  // its three loops to the warps' code, which spilled more with a variable thread count.
  dispatch::stage_inputs(staged, bulk ? 1 : 0, tokens.begin, tokens.end, thread, kDispatchThreads);
}

// One thread: waits until chunk `chunk` of source rank `source`'s call (whose first chunk is sequence
// `first_seq` of the source's ring) is published, both halves; false after a timeout (recorded), or
// at once when the rank's call has failed already.
template <class Config>
__device__ bool wait_call_chunk(const FusedScheduler<Config>& s, void* source_ring, uint32_t source,
                                uint64_t first_seq, uint32_t chunk) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const FrontWaitResult ready = front_wait_ready<device::FrontRingAtomics>(
      a.ring, source_ring, source, first_seq + chunk, a.view.timeout_ns, device::StopOnFailure{s.control()});
  return device::front_wait_ok(a.view, s.control(), ready);
}

// A ring-synchronized streamed call's producer warp (one lane), before its first claim: waits until
// this rank's producers have published its whole call. The layer's CTAs are placed one by one as the
// producers' blocks leave the SMs; without the wait the first ones fill their dispatch queues (16
// units each) with most of the call's send, route and pull units, which their dispatch warps then run
// alone while later CTAs find none. A wait that fails is recorded; the claims go on, and their units
// find the failure.
template <class Config>
__device__ void wait_own_call_published(const FusedScheduler<Config>& s) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const FrontRingLayout& ring = a.ring;
  const uint32_t rank = static_cast<uint32_t>(a.view.rank);
  void* own_ring = a.view.local() + a.layout.front_ring.offset;
  const uint64_t first_seq = *ring.consumer_cursor(own_ring, rank);
  if (!wait_call_chunk(s, own_ring, rank, first_seq, 0)) return;
  const uint32_t published = ring.slot_meta(own_ring, front_slot(first_seq, ring.num_slots))->call_tokens;
  // Not the layer's count (or past the buffer's): no later chunk is awaited, and this rank's route
  // units report the difference at once.
  if (published != static_cast<uint32_t>(a.num_tokens)) return;
  const uint32_t chunks = front_chunk_count(published, ring.tokens_per_slot);
  if (chunks > 1) wait_call_chunk(s, own_ring, rank, first_seq, chunks - 1);
}

// A streamed call's send unit: once the chunks holding this unit's tokens are published, their scales
// staged for the shared experts. The layout producer wrote the rows and scales into the buffer's
// regions as well as into the ring (quantize_activations); peers read the ring itself; nothing is
// counted or scattered.
template <class Config>
__device__ void run_streamed_send(const FusedScheduler<Config>& s, UnitRange tokens, uint32_t thread) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const FrontRingLayout& ring = a.ring;
  const uint32_t rank = static_cast<uint32_t>(a.view.rank);
  void* own_ring = a.view.local() + a.layout.front_ring.offset;
  const uint64_t first_seq = *ring.consumer_cursor(own_ring, rank);
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{}, [&] {
        if (!wait_call_chunk(s, own_ring, rank, first_seq, 0)) return false;
        // The first chunk says how many tokens the producers published: a call that says more waits
        // for none past them (its route unit reports the difference).
        const uint32_t published = ring.slot_meta(own_ring, front_slot(first_seq, ring.num_slots))->call_tokens;
        const uint32_t end = tokens.end < published ? tokens.end : published;
        for (uint32_t chunk = tokens.begin / ring.tokens_per_slot; chunk * ring.tokens_per_slot < end; ++chunk)
          if (chunk > 0 && !wait_call_chunk(s, own_ring, rank, first_seq, chunk)) return false;
        return true;
      }))
    return;
  dispatch::stage_shared_scales(a, tokens.begin, tokens.end, thread, kDispatchThreads);
  __threadfence();  // only this rank's shared experts read them
  DispatchSync{}();
  if (thread == 0) device::atomic_add_acq_rel_ranks(s.view(), &s.control()->fused_sends_done, 1u);
}

// After a warp's copy of a pool row of `expert` (every lane): the row counted for its expert. The L1
// tiles read it through the async proxy once the count is complete; the warp's stores are ordered
// before lane 0's release by the warp barrier.
__device__ __forceinline__ void count_copied_row(uint32_t* rows_pulled, uint32_t expert, uint32_t lane) {
  __syncwarp();
  if (lane == 0) {
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(rows_pulled[expert]).fetch_add(1, cuda::memory_order_release);
  }
}

// The decode configs' rows a dispatch unit copies into the pool, each counted for its expert: a pull
// unit's range of received rows (their sources from the segments), or a one-rank send unit's routes
// (UnitPlan::local_routes: their rows and experts from place_local_routes' table). Both go through
// one copy loop (copy_unit_rows): a second inlined copy of the row pull moved the bf16 64-token
// decode kernel's math warps into 78 local-memory instructions (ptxas). The other configs keep
// run_dispatch_pull's own loop: through copy_unit_rows their dispatch warps spilled more.
struct UnitRows {
  uint32_t count = 0;                       // rows, or routes of the token
  bool pulled = false;                      // a pull unit's rows (segments), or a send unit's routes
  bool local_send = false;                  // a one-rank send unit's, placed: run_send counts it after the copy
  dispatch::PoolSegments segments{};        // a pull unit's
  uint32_t first = 0;                       // a pull unit's first row, or the token's first route
  const uint32_t* route_rows = nullptr;     // [count] the routes' pool rows (kNoPoolRow: none)
  const int32_t* route_experts = nullptr;   // [count] their experts
};

// A one-rank call's send unit (UnitPlan::local_routes: one token), before its inputs are staged: where
// its routes go in the pool (the table in the dispatch warps' shared memory, with the pool's expert
// offsets before it). The caller copies their rows from the caller's tensors, then stages the token
// (run_send): the rows reach the pool before the weight streams load the memory system, where each
// of the dispatch warps' round trips took 2-4 times as long (traced on one H100, stop 85). The rank's
// barrier is not crossed: no peer sends counts, and every producer counts the experts' rows from the
// routes itself. Traced steps: 1 the previous call seen ended, 2 the rows found.
template <class Config>
__device__ UnitRows place_local_routes(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const UnitRange tokens = unit_range(index, s.plan().tokens_per_send, static_cast<uint32_t>(a.num_tokens));
  // Not before the previous call has ended (sync.cuh), as every send.
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{},
                  [&] { return device::peers_previous_call_ended(s.view(), s.control()); }))
    return {};
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 1);
  const uint32_t top_k = static_cast<uint32_t>(a.problem.top_k);
  const uint32_t experts = static_cast<uint32_t>(a.problem.num_experts);
  uint32_t* expert_begin = s.dispatch_table();
  UnitRows routes;
  routes.local_send = true;
  if (tokens.begin >= tokens.end) {  // a call without tokens: its one send unit has empty pools
    for (uint32_t e = thread; e <= experts; e += kDispatchThreads) expert_begin[e] = 0;
    DispatchSync{}();
    return routes;
  }
  int32_t* token_experts = reinterpret_cast<int32_t*>(expert_begin + experts + 1);
  uint32_t* rows = expert_begin + experts + 1 + kMaxTopK;
  dispatch::local_route_rows(a, tokens.begin, expert_begin, token_experts, rows, thread, kDispatchThreads,
                             DispatchSync{});
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 2);
  routes.count = top_k;
  routes.first = tokens.begin * top_k;
  routes.route_rows = rows;
  routes.route_experts = token_experts;
  return routes;
}

// A one-rank call's send unit once its routes' rows are copied and its inputs staged: the first unit
// publishes the pool's expert offsets (or refuses the call), then the unit counts itself sent, its
// staged inputs fenced for the shared experts' tiles. Traced step 4: counted.
template <class Config>
__device__ void finish_local_send(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread) {
  if (index == 0) dispatch::publish_local_rows(s.params.dispatch, s.dispatch_table(), thread, kDispatchThreads);
  device::fence_ranks(s.view());
  DispatchSync{}();
  if (thread == 0) device::atomic_add_acq_rel_ranks(s.view(), &s.control()->fused_sends_done, 1u);
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 4);
}

// Copies a unit's rows into the pool, a warp per row, each counted for its expert once it is there.
template <class Config>
__device__ void copy_unit_rows(const FusedScheduler<Config>& s, const UnitRows& unit, uint32_t thread, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  uint32_t* rows_pulled = s.counters().rows_pulled;
  constexpr uint32_t kWarps = kDispatchThreads / 32;
  for (uint32_t i = thread / 32; i < unit.count; i += kWarps) {
    uint32_t row, expert;
    dispatch::RowSource source;
    dispatch::RowInputs inputs;
    if (unit.pulled) {
      row = unit.first + i;
      source = dispatch::row_source(a, unit.segments, row);
      inputs = dispatch::buffer_inputs<Config::kStreamed>(a, source.buffer);
      expert = unit.segments.find(row) / unit.segments.num_ranks;
    } else {  // a send unit's own routes, from the caller's tensors (staged after the copy)
      row = unit.route_rows[i];
      if (row == dispatch::kNoPoolRow) continue;
      source = {static_cast<uint32_t>(a.view.rank), unit.first + i, a.view.local()};
      inputs = dispatch::caller_inputs(a, s.params.staged);
      expert = static_cast<uint32_t>(unit.route_experts[i]);
    }
    dispatch::pull_row_from<Config::kStreamed, kDispatchPullUnroll>(a, source, inputs, row, lane);
    count_copied_row(rows_pulled, expert, lane);
  }
}

// A send unit: this unit's tokens' inputs into the buffer, their routes counted and scattered; the
// last one to finish sends the counts and arrives on the cross-rank barrier. Traced steps (thread 0;
// send units come first in the claim order, so `index` is the unit's number): 0 its inputs staged, 1
// the shared experts' scales staged and the peers' previous call ended, 2 its routes scattered, 3
// fenced, 4 counted done, 5 the counts sent and fenced (the last unit). A one-rank call's send unit
// (local_routes) has placed and copied its routes before (place_local_routes: 1, 2; the caller: 3
// copied); here it is staged (0) and counted (finish_local_send: 4).
template <class Config>
__device__ void run_send(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, bool placed) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const UnitRange tokens = unit_range(index, s.plan().tokens_per_send, static_cast<uint32_t>(a.num_tokens));
  if constexpr (Config::kStreamed) return run_streamed_send(s, tokens, thread);
  stage_send_inputs(s, s.params.staged, tokens, thread);
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 0);
  DispatchSync{}();  // the scales the shared experts' copy reads are the ones just staged
  dispatch::stage_shared_scales(a, tokens.begin, tokens.end, thread, kDispatchThreads);
  if constexpr (kLocalRoutesConfig<Config>) {
    if (s.plan().local_routes) {
      if (placed) finish_local_send(s, index, thread);  // not after a failed wait (recorded)
      return;
    }
  }
  // Not before every peer's previous call has ended (sync.cuh). This rank's staged inputs need no
  // wait: peers pull them only in calls where this rank has tokens, whose combine waited for their L2.
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{},
                  [&] { return device::peers_previous_call_ended(s.view(), s.control()); }))
    return;
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 1);
  const uint32_t top_k = static_cast<uint32_t>(a.problem.top_k);
  dispatch::count_and_scatter(a, tokens.begin * top_k, tokens.end * top_k, s.dispatch_table(), thread,
                              kDispatchThreads, DispatchSync{});
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 2);
  // Peers read the staged inputs and the scattered indices once the barrier is crossed.
  device::fence_ranks(s.view());
  DispatchSync{}();
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 3);
  const bool last = group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{}, [&] {
    return device::atomic_add_acq_rel_ranks(s.view(), &s.control()->fused_sends_done, 1u) + 1 == s.plan().send_units;
  });
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 4);
  if (!last) return;
  dispatch::send_counts(a, thread, kDispatchThreads);
  device::fence_ranks(s.view());
  DispatchSync{}();
  trace_step(s, thread == 0, TraceRole::dispatch, index, UnitKind::send, 5);
  if (thread == 0) device::rank_arrive(s.view(), s.control(), s.epoch(1));
}

// Whether two chunks' metadata agree in every field.
__device__ __forceinline__ bool same_meta(const FrontSlotMeta& x, const FrontSlotMeta& y) {
  return x.token_base == y.token_base && x.valid == y.valid && x.last == y.last && x.call_tokens == y.call_tokens;
}

// Records a streamed call's error `code` about source rank `source` (layout.h says what the other
// fields hold for each code).
template <class Config>
__device__ void record_streamed_error(const FusedScheduler<Config>& s, uint32_t code, uint32_t source, uint32_t detail,
                                      uint64_t expected, uint64_t seen, uint32_t choice) {
  DeviceError error{};
  error.code = code;
  error.rank = static_cast<uint32_t>(s.view().rank);
  error.block = blockIdx.x;
  error.thread = threadIdx.x;
  error.peer = source;
  error.detail = detail;
  error.expected = expected;
  error.seen = seen;
  error.choice = choice;
  device::record_error(s.control(), error);
}

// Records that source rank `source`'s chunk `chunk` of a streamed call holds `seen` where its call's
// first chunk makes it `want` (at_most: chunk 0's call is larger than the buffer holds). `choice`
// says which: 1 at_most, 2 the first token and the call agree (the valid count or the last flag do
// not), else 0.
template <class Config>
__device__ void record_chunk_out_of_step(const FusedScheduler<Config>& s, uint32_t source, uint32_t chunk,
                                         const FrontSlotMeta& seen, const FrontSlotMeta& want, bool at_most) {
  const uint64_t expected = uint64_t{want.token_base} << 32 | want.call_tokens;
  const uint64_t found = uint64_t{seen.token_base} << 32 | seen.call_tokens;
  record_streamed_error(s, kDeviceStreamedChunks, source, chunk, expected, found,
                        at_most ? 1u : (expected == found ? 2u : 0u));
}

// A streamed call's route unit `index` (part index / num_ranks of source rank index % num_ranks). The
// source's first chunk of this call (at this rank's consumer cursor) says how many tokens the call
// has; the part's routes to this rank's experts are then indexed here (dispatch::index_ring_routes),
// chunk by chunk, each once it is published (both halves: the pulls read its rows from the slot). The
// source's last part to finish publishes its counts and counts the source done.
template <class Config>
__device__ void run_route(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  const FrontRingLayout& ring = a.ring;
  const uint32_t num_ranks = static_cast<uint32_t>(a.view.num_ranks);
  const uint32_t source = index % num_ranks, part = index / num_ranks;
  void* source_ring = device::front_ring_of(a.view, a.layout, static_cast<int32_t>(source));
  const uint64_t first_seq = *ring.consumer_cursor(a.view.local() + a.layout.front_ring.offset, source);
  const auto wait_chunk = [&](uint32_t chunk, FrontSlotMeta& meta) {
    if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{},
                    [&] { return wait_call_chunk(s, source_ring, source, first_seq, chunk); }))
      return false;
    meta = *ring.slot_meta(source_ring, front_slot(first_seq + chunk, ring.num_slots));
    return true;
  };
  FrontSlotMeta first;
  if (!wait_chunk(0, first)) return;
  // Past the buffer's tokens the call would index past its tables and the ring.
  const bool fits = first.call_tokens <= static_cast<uint32_t>(a.problem.max_tokens_per_rank);
  const FrontSlotMeta want = front_chunk_meta(
      fits ? first.call_tokens : static_cast<uint32_t>(a.problem.max_tokens_per_rank), ring.tokens_per_slot, 0);
  const bool own_count =
      source != static_cast<uint32_t>(a.view.rank) || first.call_tokens == static_cast<uint32_t>(a.num_tokens);
  if (!fits || !same_meta(first, want) || !own_count) {
    if (thread == 0 && part == 0 && own_count) record_chunk_out_of_step(s, source, 0, first, want, !fits);
    if (thread == 0 && part == 0 && !own_count)
      record_streamed_error(s, kDeviceStreamedTokens, source, 0, static_cast<uint64_t>(a.num_tokens),
                            first.call_tokens, 0);
    return;
  }
  const StreamedRouteCounters counters = s.streamed_routes();
  if (thread == 0 && part == 0) counters.chunks[source] = front_chunk_count(first.call_tokens, ring.tokens_per_slot);
  const uint32_t routes = first.call_tokens * ring.top_k;
  // Never more parts than the launch has units: route_parts grows with the routes, and a call holds
  // at most the buffer's (checked above).
  const RouteParts plan = route_parts(routes);
  const uint32_t parts = plan.parts;
  if (part >= parts) return;  // none of this call's routes
  const UnitRange mine = unit_range(part, plan.routes_per_part, routes);
  const uint32_t chunk_routes = ring.tokens_per_slot * ring.top_k;
  const UnitRange chunks = chunks_holding(mine, chunk_routes);
  for (uint32_t chunk = chunks.begin; chunk < chunks.end; ++chunk) {
    FrontSlotMeta meta = first;
    if (chunk > 0) {
      if (!wait_chunk(chunk, meta)) return;
      const FrontSlotMeta in_step = front_chunk_meta(first.call_tokens, ring.tokens_per_slot, chunk);
      if (!same_meta(meta, in_step)) {
        if (thread == 0) record_chunk_out_of_step(s, source, chunk, meta, in_step, false);
        return;
      }
    }
    const UnitRange share = routes_in_chunk(mine, chunk, chunk_routes);
    // The slot again rather than kept from the wait: a register more across the loop spilled more.
    const int32_t* ids = ring.slot_topk_idx(source_ring, front_slot(first_seq + chunk, ring.num_slots));
    dispatch::index_ring_routes(a, source, ids, chunk * chunk_routes, share.begin, share.end, counters.cursors,
                                thread, kDispatchThreads);
  }
  __threadfence();  // the tables' entries and slots before the part's count
  DispatchSync{}();
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{}, [&] {
        return device::GpuRef<uint32_t>(counters.parts_done[source]).fetch_add(1u, cuda::memory_order_acq_rel) + 1 ==
               parts;
      }))
    return;
  dispatch::publish_ring_counts(a, source, counters.cursors, thread, kDispatchThreads);
  __threadfence();  // the counts before the source's count: this rank's pulls read them
  DispatchSync{}();
  if (thread == 0) device::GpuRef<uint32_t>(*counters.sources_done).fetch_add(1u, cuda::memory_order_release);
}

// The dispatch warps' start of pull unit `index`: once every rank's counts are in, the pool's segments
// built in their table (published by the unit's builder when `publish`), and the unit's rows. False
// after a timeout.
template <class Config>
__device__ bool start_dispatch_pull(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, bool publish,
                                    dispatch::PoolSegments& segments, UnitRange& rows) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  if (!group_flag(s.words(FusedTables::kDispatchFlag), thread, DispatchSync{}, [&] { return counts_in(s); }))
    return false;
  uint32_t* segment_begin = s.dispatch_table();
  dispatch::build_segments(a, segment_begin, thread, kDispatchThreads, DispatchSync{}, publish);
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  segments = {segment_begin, a.layout.experts_per_rank * num_ranks, num_ranks};
  rows = pull_rows(index, s.plan().pull_units, segment_begin[segments.num_segments]);
  return true;
}

// A pull unit (at decode), by the dispatch warps: its share of the received rows into the pool, each
// row counted for its expert (in the decode configs by the caller's copy_unit_rows, which it returns
// them for). Traced steps (thread 0): 0 every rank's counts in and the segments built, 1 its rows
// pulled and counted.
template <class Config>
__device__ UnitRows run_dispatch_pull(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  UnitRows unit;
  UnitRange rows;
  if (!start_dispatch_pull(s, index, thread, index == 0, unit.segments, rows)) return {};
  const uint32_t traced_unit = first_pull_unit<Config::kStreamed>(s.plan(), s.route_units()) + index;
  trace_step(s, thread == 0, TraceRole::dispatch, traced_unit, UnitKind::pull, 0);
  if constexpr (kLocalRoutesConfig<Config>) {
    unit.count = rows.end - rows.begin;
    unit.pulled = true;
    unit.first = rows.begin;
    return unit;
  }
  uint32_t* rows_pulled = s.counters().rows_pulled;
  constexpr uint32_t kWarps = kDispatchThreads / 32;
  for (uint32_t row = rows.begin + thread / 32; row < rows.end; row += kWarps) {
    dispatch::pull_row<Config::kStreamed, kDispatchPullUnroll>(a, unit.segments, row, lane);
    count_copied_row(rows_pulled, unit.segments.find(row) / unit.segments.num_ranks, lane);
  }
  trace_step(s, thread == 0, TraceRole::dispatch, traced_unit, UnitKind::pull, 1);
  return {};
}

// A pull unit (bulk_pulls), by the dispatch warps: its rows' scales, route weights and sources into
// the pool while the producer copies their bytes (run_pull), each row counted for its expert again.
template <class Config>
__device__ void run_pull_metadata(const FusedScheduler<Config>& s, uint32_t index, uint32_t thread, uint32_t lane) {
  const dispatch::DispatchArgs& a = s.params.dispatch;
  dispatch::PoolSegments segments;
  UnitRange rows;
  if (!start_dispatch_pull(s, index, thread, false, segments, rows)) return;  // run_pull publishes
  uint32_t* rows_pulled = s.counters().rows_pulled;
  dispatch::pull_rows_metadata<Config::kStreamed>(
      a, segments, rows.begin, rows.end, thread / 32, kDispatchThreads / 32, lane,
      [&](uint32_t first, uint32_t count) { count_pulled_rows(rows_pulled, segments, first, count); });
}

// The dispatch warps: run the send, route and pull units the producer hands them, in order.
template <class Config>
__device__ void dispatch_fused(const FusedScheduler<Config>& s, uint32_t thread, uint32_t lane) {
  gemm::RingPosition<kQueueSlots> queue;
  const gemm::PipelineWatch& watch = s.params.l1[0].args.watch;
  for (;;) {
    // Only the hand-over's deadline ends this wait (the same for every dispatch warp): then the slot may
    // be unwritten, and the warps stop.
    if (!gemm::wait_barrier<Config, true>(s.queue_full(queue.stage), queue.phase, watch, queue.stage,
                                          gemm::SharedDeadline{s.queue_deadline()}))
      return;
    const uint32_t unit = *s.queue_slot(queue.stage);
    if (unit == gemm::kNoUnit) return;
    const UnitRef ref = s.classify(unit);
    UnitRows rows;  // the decode configs' rows to copy (copy_unit_rows)
    if (ref.kind == UnitKind::send) {
      if constexpr (kLocalRoutesConfig<Config>) {
        if (s.plan().local_routes) rows = place_local_routes(s, ref.index, thread);
      }
    } else if (Config::kStreamed && ref.kind == UnitKind::route) {
      run_route(s, ref.index, thread);
    } else if (kBulkPullConfig<Config> && s.plan().bulk_pulls) {
      run_pull_metadata(s, ref.index, thread, lane);
    } else {
      rows = run_dispatch_pull(s, ref.index, thread, lane);
    }
    if constexpr (kLocalRoutesConfig<Config>) {
      copy_unit_rows(s, rows, thread, lane);
      // Traced: a pull unit's rows (its step 1) or a one-rank send unit's routes (its step 3) copied.
      if (rows.count > 0)
        trace_step(s, thread == 0, TraceRole::dispatch, unit, ref.kind, ref.kind == UnitKind::pull ? 1 : 3);
    }
    // A send unit's inputs staged (one call site: each inlined copy of the staging adds its loops).
    if (ref.kind == UnitKind::send) run_send(s, ref.index, thread, rows.local_send);
    DispatchSync{}();  // the table and the slot are free again
    if (thread == 0) trace_event(s, TraceRole::dispatch, unit, ref.kind, TraceWhat::done);
    if (thread == 0) cuda::ptx::mbarrier_arrive(s.queue_empty(queue.stage));
    queue.advance();
  }
}

}  // namespace megamoe::fused
