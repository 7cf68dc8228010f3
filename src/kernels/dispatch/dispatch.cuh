// Inline dispatch as a counting sort on the GPU (seed 001): the device functions both schedules
// compose (dispatch_kernels.cuh has the staged schedule's two kernels):
//   send_routes  every block copies its share of the caller's inputs into this rank's buffer (peers
//                pull from there), counts its routes per global expert in shared memory, takes its
//                offsets from per-expert atomics, then scatters `token * top_k + k` into the owner
//                rank's src_index table [local expert][source rank][slot] over NVLink; the last
//                block to finish sends each owner the number of routes this rank sent to each of
//                its experts, then crosses the rank barrier;
//   pull         each owner turns the received counts into expert row offsets (prefix sums) and
//                pulls every routed token row, its scales and route weight from its source rank
//                into the expert-major pool, recording where it came from.
// The host never reads a count.
#pragma once

#include <cstdint>

#include "kernels/comm/bounce_plan.h"
#include "kernels/comm/pull.cuh"
#include "kernels/comm/sync.cuh"
#include "kernels/warp_scan.cuh"
#include "megamoe/comm.h"
#include "megamoe/layout.h"
#include "megamoe/problem.h"
#include "megamoe/streaming.h"

namespace megamoe::dispatch {

struct DispatchArgs {
  SymmView view;
  BufferLayout layout;
  Problem problem;
  int32_t num_tokens;
  const int32_t* topk_idx;  // this rank's [num_tokens][top_k]
  int64_t* recv_stats;      // nullable: [experts_per_rank], accumulated
  uint32_t first_token;     // the call's index of this wave's token 0, for error records
  // A streamed call (the fused schedule's streamed kernels only): every rank's inputs are its front
  // ring's chunk of this call (one per source rank), read at this rank's consumer cursor for that source.
  bool streamed;
  FrontRingLayout ring;
};

__device__ __forceinline__ void record_input_error(const DispatchArgs& a, uint32_t code, uint32_t route,
                                                   int64_t seen) {
  DeviceError error{};
  error.code = code;
  error.rank = static_cast<uint32_t>(a.view.rank);
  error.block = blockIdx.x;
  error.thread = threadIdx.x;
  error.detail = a.first_token + route / static_cast<uint32_t>(a.problem.top_k);
  error.choice = route % static_cast<uint32_t>(a.problem.top_k);
  error.seen = static_cast<uint64_t>(seen);
  error.expected = static_cast<uint64_t>(code == kDeviceBadExpertId ? a.problem.num_experts : a.layout.wave_tokens);
  device::record_input_error(a.layout.control_block(a.view.local()), error);
}

// Copies of the caller's inputs into this rank's buffer (peers pull from there). A kernel rather than
// cudaMemcpyAsync: a same-device copy may serialize with other streams, and emulated ranks on one
// GPU must never wait for another rank's spinning kernel.
struct StagedCopy {
  const uint32_t* source;  // nullptr: nothing to copy
  uint32_t* destination;
  uint64_t words;
  uint32_t words_per_token;
};
struct StagedInputs {
  StagedCopy copies[3];  // x, its scales, the route weights
};

// Copies tokens [token_begin, token_end) of the staged inputs from copies[first_copy] on, thread
// `thread` of `threads`.
__device__ inline void stage_inputs(const StagedInputs& inputs, uint32_t first_copy, uint32_t token_begin,
                                    uint32_t token_end, uint64_t thread, uint64_t threads) {
  constexpr uint32_t kUnroll = 4;  // 16-byte vectors in flight per thread
#pragma unroll  // constant indices: a variable one would copy the parameters to local memory
  for (uint32_t c = 0; c < 3; ++c) {
    const StagedCopy& whole = inputs.copies[c];
    if (c < first_copy || whole.source == nullptr) continue;
    const uint64_t first_word = uint64_t{token_begin} * whole.words_per_token;
    const StagedCopy copy{whole.source + first_word, whole.destination + first_word,
                          uint64_t{token_end - token_begin} * whole.words_per_token, whole.words_per_token};
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(copy.source) | reinterpret_cast<uintptr_t>(copy.destination)) & 15) == 0;
    const uint64_t vectors = aligned ? copy.words / 4 : 0;
    const uint4* source = reinterpret_cast<const uint4*>(copy.source);
    uint4* destination = reinterpret_cast<uint4*>(copy.destination);
    for (uint64_t first = thread; first < vectors; first += kUnroll * threads) {
      uint4 parts[kUnroll];
#pragma unroll
      for (uint32_t j = 0; j < kUnroll; ++j)
        if (first + j * threads < vectors) parts[j] = source[first + j * threads];
#pragma unroll
      for (uint32_t j = 0; j < kUnroll; ++j)
        if (first + j * threads < vectors) destination[first + j * threads] = parts[j];
    }
    for (uint64_t i = vectors * 4 + thread; i < copy.words; i += threads) copy.destination[i] = copy.source[i];
  }
}

// The shared experts read this rank's own tokens: their scales, K-block-major, for tokens
// [token_begin, token_end), thread `thread` of `threads`.
__device__ inline void stage_shared_scales(const DispatchArgs& a, uint32_t token_begin, uint32_t token_end,
                                           uint64_t thread, uint64_t threads) {
  if (a.problem.recipe == Recipe::bf16 || a.problem.num_shared_experts == 0) return;
  const uint32_t hidden_blocks = a.layout.hidden_blocks;
  const float* x_scales = BufferLayout::at<float>(a.view.local(), a.layout.x_scales);
  float* shared_scales = BufferLayout::at<float>(a.view.local(), a.layout.shared_x_scales);
  const uint64_t first = uint64_t{token_begin} * hidden_blocks, end = uint64_t{token_end} * hidden_blocks;
  for (uint64_t i = first + thread; i < end; i += threads) {
    const uint64_t token = i / hidden_blocks, kb = i % hidden_blocks;
    shared_scales[kb * a.layout.wave_tokens + token] = x_scales[i];
  }
}

// Counts routes [begin, end) per global expert, takes their first slots from the per-expert send
// counters, and scatters each route into its owner's src_index table. expert_cursor: num_experts u32
// in shared memory; thread `thread` of the `threads` that call it together, `sync` their barrier.
template <class Sync>
__device__ inline void count_and_scatter(const DispatchArgs& a, uint32_t begin, uint32_t end, uint32_t* expert_cursor,
                                  uint32_t thread, uint32_t threads, const Sync& sync) {
  const uint32_t num_experts = static_cast<uint32_t>(a.problem.num_experts);
  const uint32_t experts_per_rank = a.layout.experts_per_rank;

  for (uint32_t e = thread; e < num_experts; e += threads) expert_cursor[e] = 0;
  sync();
  for (uint32_t route = begin + thread; route < end; route += threads) {
    const int32_t expert = a.topk_idx[route];
    if (expert == -1) continue;
    if (expert < -1 || expert >= static_cast<int32_t>(num_experts)) {
      record_input_error(a, kDeviceBadExpertId, route, expert);
      continue;
    }
    atomicAdd(&expert_cursor[expert], 1u);
  }
  sync();
  // These routes' first slot in each (expert, this rank) table.
  uint64_t* send_count = a.layout.send_count(a.view.local());
  for (uint32_t e = thread; e < num_experts; e += threads) {
    if (expert_cursor[e] == 0) continue;
    expert_cursor[e] = static_cast<uint32_t>(
        atomicAdd(reinterpret_cast<unsigned long long*>(send_count + e), static_cast<unsigned long long>(expert_cursor[e])));
  }
  sync();
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  for (uint32_t route = begin + thread; route < end; route += threads) {
    const int32_t expert = a.topk_idx[route];
    if (expert < 0 || expert >= static_cast<int32_t>(num_experts)) continue;
    const uint32_t slot = atomicAdd(&expert_cursor[expert], 1u);
    if (slot >= a.layout.wave_tokens) {  // only repeated experts within tokens can get here
      record_input_error(a, kDeviceSlotOverflow, route, slot);
      continue;
    }
    const uint32_t owner = static_cast<uint32_t>(expert) / experts_per_rank;
    uint32_t* table = a.layout.src_index_ptr(a.view.local(), static_cast<uint32_t>(expert) % experts_per_rank,
                                             static_cast<uint32_t>(a.view.rank), num_ranks);
    *a.view.map(table + slot, static_cast<int32_t>(owner)) = route;
  }
}

// A streamed call, as owner: routes [begin, end) of source rank `source`'s call, all in one of its
// chunks (`ids`: that chunk's top-k ids, token-major, the first of them the call's route
// `first_route`), to this rank's experts, each given the next slot of its (local expert, source)
// table as the source's scatter gives it in a batch call (`cursors`: [experts_per_rank][num_ranks],
// this rank's, zero before the call; device-scope atomics, since a call's routes are indexed in parts
// on several CTAs); this rank's own ids also go to its topk_idx region, which the combine reads.
// Reading the routes here replaces the scatter, the count exchange and its barrier
// (publish_ring_counts then gives the counts). Thread `thread` of the `threads` that call it together.
__device__ inline void index_ring_routes(const DispatchArgs& a, uint32_t source, const int32_t* ids,
                                         uint32_t first_route, uint32_t begin, uint32_t end, uint32_t* cursors,
                                         uint32_t thread, uint32_t threads) {
  const uint32_t experts_per_rank = a.layout.experts_per_rank;
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  const int64_t first_expert = int64_t{a.view.rank} * experts_per_rank;
  const bool own = source == static_cast<uint32_t>(a.view.rank);
  int32_t* own_ids = BufferLayout::at<int32_t>(a.view.local(), a.layout.topk_idx);
  // kIdLoads ids in flight per thread: the ids are often read over NVLink, and one load's round trip
  // per route would bound the part. Four: with eight, the fp8 prefill kernel's 40-register dispatch
  // warps spilled more (local-memory instructions 451 -> 650; 506 with four).
  constexpr uint32_t kIdLoads = 4;
  for (uint32_t base = begin + thread; base < end; base += threads * kIdLoads) {
    int32_t loaded[kIdLoads];
#pragma unroll
    for (uint32_t i = 0; i < kIdLoads; ++i)
      loaded[i] = base + i * threads < end ? ids[base + i * threads - first_route] : -1;
#pragma unroll
    for (uint32_t i = 0; i < kIdLoads; ++i) {
      const uint32_t route = base + i * threads;
      const int32_t expert = loaded[i];
      if (route >= end) break;
      if (own) own_ids[route] = expert;
      if (expert < -1 || expert >= a.problem.num_experts) {
        if (own) record_input_error(a, kDeviceBadExpertId, route, expert);  // its source reports it
        continue;
      }
      const int64_t local = int64_t{expert} - first_expert;
      if (expert < 0 || local < 0 || local >= experts_per_rank) continue;
      const uint32_t slot = atomicAdd(&cursors[static_cast<uint32_t>(local) * num_ranks + source], 1u);
      if (slot >= a.layout.wave_tokens) {  // only repeated experts within tokens can get here
        record_input_error(a, kDeviceSlotOverflow, route, slot);
        continue;
      }
      a.layout.src_index_ptr(a.view.local(), static_cast<uint32_t>(local), source, num_ranks)[slot] = route;
    }
  }
}

// Once every part of source rank `source`'s chunk is indexed (their writes acquired): its count per
// local expert, where the pulls' segments read them (`cursors` as index_ring_routes').
__device__ inline void publish_ring_counts(const DispatchArgs& a, uint32_t source, uint32_t* cursors, uint32_t thread,
                                           uint32_t threads) {
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  for (uint32_t e = thread; e < a.layout.experts_per_rank; e += threads) {
    // Another CTA's atomics made it: read where they are, not from this SM's cache.
    const uint32_t count = device::GpuRef<uint32_t>(cursors[e * num_ranks + source]).load(cuda::memory_order_relaxed);
    *a.layout.recv_count_ptr(a.view.local(), e, source, num_ranks) =
        count < a.layout.wave_tokens ? count : a.layout.wave_tokens;
  }
}

// Once every route's slot is taken: sends each owner the number of routes this rank sent to each of
// its experts, and resets the send counters for the next call (thread `thread` of `threads`).
__device__ inline void send_counts(const DispatchArgs& a, uint32_t thread, uint32_t threads) {
  const uint32_t num_experts = static_cast<uint32_t>(a.problem.num_experts);
  const uint32_t experts_per_rank = a.layout.experts_per_rank;
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  uint64_t* send_count = a.layout.send_count(a.view.local());
  for (uint32_t e = thread; e < num_experts; e += threads) {
    device::GpuRef<uint64_t> sent(send_count[e]);
    // Routes past the table's room were dropped (kDeviceSlotOverflow): the owner pulls only those stored.
    const uint64_t counted = sent.load(cuda::memory_order_relaxed);
    const uint32_t count = static_cast<uint32_t>(counted < a.layout.wave_tokens ? counted : a.layout.wave_tokens);
    sent.store(0, cuda::memory_order_relaxed);
    uint32_t* slot = a.layout.recv_count_ptr(a.view.local(), e % experts_per_rank,
                                             static_cast<uint32_t>(a.view.rank), num_ranks);
    *a.view.map(slot, static_cast<int32_t>(e / experts_per_rank)) = count;
  }
}

// One block, once every block's counts are in send_count: sends the counts, then waits until every
// rank has done the same.
__device__ inline void publish_counts(const DispatchArgs& a) {
  send_counts(a, threadIdx.x, blockDim.x);
  device::fence_ranks(a.view);
  device::rank_barrier(a.view, a.layout);
}

// Where each pool row of this rank comes from: the (local expert, source rank) segment holding it.
struct PoolSegments {
  const uint32_t* segment_begin;  // shared memory, [experts_per_rank * num_ranks + 1] pool rows
  uint32_t num_segments;
  uint32_t num_ranks;

  __device__ uint32_t find(uint32_t row) const {  // the last segment starting at or before `row`
    uint32_t low = 0, high = num_segments - 1;
    while (low < high) {
      const uint32_t mid = (low + high + 1) / 2;
      if (segment_begin[mid] <= row) low = mid;
      else high = mid - 1;
    }
    return low;
  }
};

// A rank that received more routes than its pools hold (BufferLayout::recv_capacity) refuses the
// call: it records the error and tells every rank, itself included, before anything reads the pools;
// each rank's combine then leaves y alone (one thread; the flag is written before this rank's L2-done
// arrival, which orders it for the peers).
__device__ inline void refuse_call(const DispatchArgs& a, uint32_t received) {
  ControlBlock* control = a.layout.control_block(a.view.local());
  DeviceError error{};
  error.code = kDeviceCapacityExceeded;
  error.rank = static_cast<uint32_t>(a.view.rank);
  error.block = blockIdx.x;
  error.thread = threadIdx.x;
  error.peer = static_cast<uint32_t>(a.view.rank);
  error.expected = a.layout.recv_capacity;
  error.seen = received;
  device::record_input_error(control, error);
  for (int32_t peer = 0; peer < a.view.num_ranks; ++peer)
    device::st_release_ranks(a.view, &a.view.map(control, peer)->capacity_exceeded_by,
                             static_cast<uint32_t>(a.view.rank) + 1);
}

// Publishes each local expert's first pool row (expert_rows in the buffer; all 0 for a refused call)
// and adds its rows to the receive statistics: expert e's first row is begin[e * stride].
__device__ inline void publish_expert_rows(const DispatchArgs& a, const uint32_t* begin, uint32_t stride, bool fits,
                                           uint32_t thread, uint32_t threads) {
  const uint32_t experts = a.layout.experts_per_rank;
  uint32_t* expert_rows = BufferLayout::at<uint32_t>(a.view.local(), a.layout.expert_rows);
  for (uint32_t e = thread; e <= experts; e += threads) {
    expert_rows[e] = fits ? begin[e * stride] : 0;
    if (fits && a.recv_stats != nullptr && e < experts) a.recv_stats[e] += begin[(e + 1) * stride] - begin[e * stride];
  }
}

// Builds segment_begin[] from the received counts (thread `thread` of `threads`, barrier `sync`, warp 0
// among them scans); with `publish`, also expert_rows in the buffer and the receive statistics.
// False (every caller) when the routes exceed the receive capacity: the segments are then all empty,
// and with `publish` expert_rows too, and the call is refused.
template <class Sync>
__device__ inline bool build_segments(const DispatchArgs& a, uint32_t* segment_begin, uint32_t thread, uint32_t threads,
                               const Sync& sync, bool publish) {
  const uint32_t num_ranks = static_cast<uint32_t>(a.problem.num_ranks);
  const uint32_t segments = a.layout.experts_per_rank * num_ranks;
  const uint32_t* recv_count = a.layout.recv_count_ptr(a.view.local(), 0, 0, num_ranks);
  // The counts come to shared memory first, every thread's loads in flight at once; then one warp
  // scans them in place. (Scanning straight from global memory waited one round trip per 32
  // segments: 8 at 256 experts on one GPU, about half of this kernel's time at one token.)
#pragma unroll 4
  for (uint32_t s = thread; s < segments; s += threads) segment_begin[s] = recv_count[s];
  sync();
  if (thread < 32)
    device::warp_exclusive_prefix(segments, thread, segment_begin, [&](uint32_t s) { return segment_begin[s]; });
  sync();
  const uint32_t received = segment_begin[segments];
  const bool fits = received <= a.layout.recv_capacity;
  sync();  // every thread has read the total
  if (!fits) {
    for (uint32_t s = thread; s <= segments; s += threads) segment_begin[s] = 0;
    if (publish && thread == 0) refuse_call(a, received);
    sync();
  }
  if (publish) publish_expert_rows(a, segment_begin, num_ranks, fits, thread, threads);
  return fits;
}

// Where a source rank's token inputs are in its buffer, as offsets from its base: token t's row at
// x + input_row(t) * row bytes, its scales at x_scales + input_row(t) * hidden blocks, route r's weight
// at topk_weights + input_route_of_row(input_row(r / top_k), r) floats. A batch call reads the
// regions the source's send units staged them in (row t is row t); a streamed call (kStreamed: the
// fused schedule's streamed kernels) reads the source's front ring, where its call's chunks take
// consecutive slots from this rank's consumer cursor for it (FrontRingLayout::call_row). Template
// flags, so that the batch kernels' pulls stay as they were.
struct InputOffsets {
  uint64_t x;
  uint64_t x_scales;
  uint64_t topk_weights;
};
template <bool kStreamed>
__device__ __forceinline__ InputOffsets input_offsets(const DispatchArgs& a) {
  if constexpr (!kStreamed) {
    return {a.layout.x.offset, a.layout.x_scales.offset, a.layout.topk_weights.offset};
  } else {
    const uint64_t ring = a.layout.front_ring.offset;
    return {ring + a.ring.x.offset, ring + a.ring.x_scales.offset, ring + a.ring.topk_weights.offset};
  }
}
template <bool kStreamed>
__device__ __forceinline__ auto input_row(const DispatchArgs& a, uint32_t rank, uint32_t token) {
  if constexpr (!kStreamed) {
    return uint64_t{token};
  } else {
    return a.ring.call_row(*a.ring.consumer_cursor(a.view.local() + a.layout.front_ring.offset, rank), token);
  }
}
// The same for route token_topk whose token's input_row is `row` (a streamed row's ring arithmetic,
// a load of the consumer cursor and a 64-bit remainder, done once per pulled row).
template <bool kStreamed>
__device__ __forceinline__ auto input_route_of_row(const DispatchArgs& a, uint64_t row, uint32_t token_topk) {
  if constexpr (!kStreamed) {
    return token_topk;
  } else {
    const uint32_t top_k = a.ring.top_k;
    return row * top_k + token_topk % top_k;
  }
}

// Where pool row `row` comes from.
struct RowSource {
  uint32_t rank;
  uint32_t token_topk;  // token * top_k + k on that rank
  const char* buffer;   // that rank's buffer
};
__device__ inline RowSource row_source(const DispatchArgs& a, const PoolSegments& segments, uint32_t row) {
  const uint32_t num_ranks = segments.num_ranks;
  const uint32_t segment = segments.find(row);
  const uint32_t rank = segment % num_ranks;
  const uint32_t token_topk = a.layout.src_index_ptr(a.view.local(), segment / num_ranks, rank,
                                                     num_ranks)[row - segments.segment_begin[segment]];
  return {rank, token_topk, a.view.peers[rank]};
}

// Where a row's inputs are read: a rank's x, its scales and its route weights, each token-major (row
// input_row of each, route input_route_of_row of the weights). In the source rank's buffer; or, for a
// one-rank call's own routes, the caller's tensors (caller_inputs), whose rows are laid out alike.
struct RowInputs {
  const char* x;
  const float* x_scales;
  const float* topk_weights;
};
template <bool kStreamed>
__device__ __forceinline__ RowInputs buffer_inputs(const DispatchArgs& a, const char* buffer) {
  const InputOffsets offsets = input_offsets<kStreamed>(a);
  return {buffer + offsets.x, reinterpret_cast<const float*>(buffer + offsets.x_scales),
          reinterpret_cast<const float*>(buffer + offsets.topk_weights)};
}
// The caller's tensors where the staging copies them from, this rank's buffer where the caller wrote
// them there itself (nothing to copy). The layer requires every tensor 16-byte aligned (check_tensor).
__device__ __forceinline__ RowInputs caller_inputs(const DispatchArgs& a, const StagedInputs& staged) {
  const RowInputs staged_inputs = buffer_inputs<false>(a, a.view.local());
  const auto* x = reinterpret_cast<const char*>(staged.copies[0].source);
  const auto* x_scales = reinterpret_cast<const float*>(staged.copies[1].source);
  const auto* topk_weights = reinterpret_cast<const float*>(staged.copies[2].source);
  return {x != nullptr ? x : staged_inputs.x, x_scales != nullptr ? x_scales : staged_inputs.x_scales,
          topk_weights != nullptr ? topk_weights : staged_inputs.topk_weights};
}

// Pulls pool row `row` from `source`, its inputs read from `inputs` (warp-wide, `lane`): the row, its
// scales and its route weight loaded together (at decode each row's round trips are the pull's time),
// then all of them stored. kUnroll: 16-byte vectors in flight per lane.
template <bool kStreamed = false, int kUnroll = device::kPullRowUnroll>
__device__ inline void pull_row_from(const DispatchArgs& a, const RowSource& source, const RowInputs& inputs,
                                     uint32_t row, uint32_t lane) {
  const uint32_t row_bytes = static_cast<uint32_t>(a.problem.hidden) * a.layout.activation_bytes;
  const uint32_t hidden_blocks = a.layout.hidden_blocks;
  const bool scaled = a.problem.recipe != Recipe::bf16;
  float* pool_scales = BufferLayout::at<float>(a.view.local(), a.layout.l1_pool_scales);
  float* pool_weight = BufferLayout::at<float>(a.view.local(), a.layout.pool_weight);
  PoolSource* pool_source = BufferLayout::at<PoolSource>(a.view.local(), a.layout.pool_source);
  constexpr uint32_t kEarlyScales = 2;  // per lane: DeepSeek-V3's 56 K blocks
  const uint32_t token_topk = source.token_topk;
  const uint32_t token = token_topk / static_cast<uint32_t>(a.problem.top_k);
  const uint64_t input = input_row<kStreamed>(a, source.rank, token);
  const float* source_scales = inputs.x_scales + input * hidden_blocks;
  float scales[kEarlyScales];
#pragma unroll
  for (uint32_t i = 0; i < kEarlyScales; ++i) {
    const uint32_t kb = lane + 32 * i;
    scales[i] = scaled && kb < hidden_blocks ? source_scales[kb] : 0.0f;
  }
  const float weight = lane == 0 ? inputs.topk_weights[input_route_of_row<kStreamed>(a, input, token_topk)] : 0.0f;
  device::copy_row_vector<kUnroll>(inputs.x + input * row_bytes,
                                   a.view.local() + a.layout.l1_pool.offset + uint64_t{row} * row_bytes, row_bytes,
                                   lane);
  // Scales K-block-major: one TMA box then holds a GEMM tile's scales.
  if (scaled) {
#pragma unroll
    for (uint32_t i = 0; i < kEarlyScales; ++i) {
      const uint32_t kb = lane + 32 * i;
      if (kb < hidden_blocks) pool_scales[uint64_t{kb} * a.layout.pool_rows + row] = scales[i];
    }
    for (uint32_t kb = lane + 32 * kEarlyScales; kb < hidden_blocks; kb += 32)
      pool_scales[uint64_t{kb} * a.layout.pool_rows + row] = source_scales[kb];
  }
  if (lane == 0) {
    pool_weight[row] = weight;
    pool_source[row] = PoolSource{source.rank, token_topk};
  }
}
// The same for pool row `row`, from the source its segment gives.
template <bool kStreamed = false, int kUnroll = device::kPullRowUnroll>
__device__ inline void pull_row(const DispatchArgs& a, const PoolSegments& segments, uint32_t row, uint32_t lane) {
  const RowSource source = row_source(a, segments, row);
  pull_row_from<kStreamed, kUnroll>(a, source, buffer_inputs<kStreamed>(a, source.buffer), row, lane);
}

// ---- One rank's calls: routes placed without a scatter, a count exchange or pulls ----
// With a single rank every expert is local, and a call's routes alone say where each goes in the
// pool. A send unit of one token finds its routes' rows (local_route_rows) and copies them there
// itself; every CTA's producer counts the experts' rows from the same routes (FusedScheduler::build).
// Rows are expert-major and, within an expert, in route order (token * top_k + k): both sides derive
// the same offsets. (A pool row's order within its expert is free: the scatter's atomics give none.)
inline constexpr uint32_t kNoPoolRow = 0xFFFFFFFFu;

// A valid local expert of route id `expert`, or -1 (masked, or out of range: the caller records that).
__device__ __forceinline__ int32_t local_route_expert(const DispatchArgs& a, int32_t expert) {
  return expert >= 0 && expert < a.problem.num_experts ? expert : -1;
}

// The pool rows of token `token`'s routes: rows[k] for route k (kNoPoolRow if masked or bad, or when
// the call's routes exceed the receive capacity: its producers then refuse it). expert_begin:
// [num_experts + 1] shared memory, left holding each expert's first pool row. `token_experts`,
// `rows`: [top_k] shared memory. Thread `thread` of the `threads` that call it together, `sync`
// their barrier. Bad expert ids of this token are recorded (as count_and_scatter does).
template <class Sync>
__device__ inline void local_route_rows(const DispatchArgs& a, uint32_t token, uint32_t* expert_begin,
                                        int32_t* token_experts, uint32_t* rows, uint32_t thread, uint32_t threads,
                                        const Sync& sync) {
  const uint32_t num_experts = static_cast<uint32_t>(a.problem.num_experts);
  const uint32_t top_k = static_cast<uint32_t>(a.problem.top_k);
  const uint32_t routes = static_cast<uint32_t>(a.num_tokens) * top_k;
  const uint32_t first = token * top_k;
  for (uint32_t e = thread; e <= num_experts; e += threads) expert_begin[e] = 0;
  if (thread < top_k) {
    const int32_t id = a.topk_idx[first + thread];
    if (id < -1 || id >= static_cast<int32_t>(num_experts)) record_input_error(a, kDeviceBadExpertId, first + thread, id);
    token_experts[thread] = local_route_expert(a, id);
    rows[thread] = 0;  // first the routes before it to the same expert
  }
  sync();
  // Every route counts for its expert; those before route k to k's expert place it after them.
  for (uint32_t route = thread; route < routes; route += threads) {
    const int32_t expert = local_route_expert(a, a.topk_idx[route]);
    if (expert < 0) continue;
    atomicAdd(&expert_begin[expert], 1u);
    if (route >= first + top_k) continue;
    for (uint32_t k = 0; k < top_k; ++k)
      if (route < first + k && token_experts[k] == expert) atomicAdd(&rows[k], 1u);
  }
  sync();
  if (thread < 32)
    device::warp_exclusive_prefix(num_experts, thread, expert_begin, [&](uint32_t e) { return expert_begin[e]; });
  sync();
  const bool fits = expert_begin[num_experts] <= a.layout.recv_capacity;
  if (thread < top_k) {
    const int32_t expert = token_experts[thread];
    rows[thread] = expert >= 0 && fits ? expert_begin[expert] + rows[thread] : kNoPoolRow;
  }
  sync();
}

// Once per call (the first send unit), from local_route_rows' offsets: what build_segments publishes
// (expert_rows, the receive statistics), or the refusal when the routes exceed the receive capacity.
__device__ inline void publish_local_rows(const DispatchArgs& a, const uint32_t* expert_begin, uint32_t thread,
                                          uint32_t threads) {
  const uint32_t received = expert_begin[a.layout.experts_per_rank];
  const bool fits = received <= a.layout.recv_capacity;
  if (!fits && thread == 0) refuse_call(a, received);
  publish_expert_rows(a, expert_begin, 1, fits, thread, threads);
}

// Scale loads in flight per lane while pull_rows_metadata copies 32 rows' scales. (Eight spilled the
// dispatch warps' 40 registers: 446 local-memory instructions in the fp8 prefill kernel against 307.)
inline constexpr uint32_t kBounceScaleLoads = 4;

// A shared-memory area that bulk copies (TMA) pass data through, in two halves: one half's loads
// land while the other's stores drain. `loaded`: one mbarrier per half (arrival count 1);
// `phases`: their parity bits, kept across calls.
struct BounceArea {
  uint8_t* area;  // 16-byte aligned
  uint32_t bytes;
  uint64_t* loaded;
  uint32_t phases;
};

// Whether stage_rows_bulk can copy `copy`: whole 16-byte vectors, aligned.
__device__ inline bool bulk_stageable(const StagedCopy& copy) {
  return copy.source != nullptr && copy.words_per_token % 4 == 0 &&
         ((reinterpret_cast<uintptr_t>(copy.source) | reinterpret_cast<uintptr_t>(copy.destination)) & 15) == 0;
}

// Copies tokens [token_begin, token_end) of `copy` (bulk_stageable), one contiguous range, by one
// thread through `bounce`, in chunks of half its bytes: a few bulk copies instead of a warp's 16-byte
// vectors, so that up to the whole area is in flight. Complete, and fenced for the generic proxy,
// when it returns.
__device__ inline void stage_rows_bulk(const StagedCopy& copy, uint32_t token_begin, uint32_t token_end,
                                       BounceArea& bounce) {
  const uint64_t first = uint64_t{token_begin} * copy.words_per_token * 4;
  const uint64_t bytes = uint64_t{token_end - token_begin} * copy.words_per_token * 4;
  const char* source = reinterpret_cast<const char*>(copy.source) + first;
  char* destination = reinterpret_cast<char*>(copy.destination) + first;
  const uint32_t half = bounce.bytes / 2 / 16 * 16;
  const uint64_t chunks = (bytes + half - 1) / half;
  const auto chunk_bytes = [&](uint64_t c) { return static_cast<uint32_t>(min(uint64_t{half}, bytes - c * half)); };
  const auto load = [&](uint64_t c) {
    uint64_t* loaded = &bounce.loaded[c % 2];
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, loaded,
                                         chunk_bytes(c));
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, bounce.area + c % 2 * half,
                             source + c * half, chunk_bytes(c), loaded);
  };
  // The caller's inputs were written by generic stores before the call.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  if (chunks > 0) load(0);
  for (uint64_t c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) {
      // Chunk c + 1's half held chunk c - 1, whose store (the only one issued) must have read it.
      cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
      load(c + 1);
    }
    const uint32_t slot = c % 2;
    // TMA completes the transfer it was given, so this wait needs no timeout.
    while (!cuda::ptx::mbarrier_try_wait_parity(&bounce.loaded[slot], (bounce.phases >> slot) & 1u)) {
    }
    bounce.phases ^= 1u << slot;
    cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, destination + c * half,
                             bounce.area + slot * half, chunk_bytes(c));
    cuda::ptx::cp_async_bulk_commit_group();
  }
  cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  // Peers may read the rows with generic loads (the register pulls) after this thread's release.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
}

// Copies pool rows [begin, end)'s scales (K-block-major), route weights and sources, by `warps`
// warps (this one `warp`), 32 rows a warp at a time: each lane finds its row's source, then the rows'
// scales go through every lane, kBounceScaleLoads loads in flight per lane. Lane 0 calls
// rows_done(first, count) once a warp's rows are written (and fenced for the async proxy: the GEMM
// reads the scales with TMA). The row bytes are pull_rows_bulk's.
template <bool kStreamed = false, class RowsDone>
__device__ inline void pull_rows_metadata(const DispatchArgs& a, const PoolSegments& segments, uint32_t begin,
                                          uint32_t end, uint32_t warp, uint32_t warps, uint32_t lane,
                                          const RowsDone& rows_done) {
  const uint32_t hidden_blocks = a.layout.hidden_blocks;
  const bool scaled = a.problem.recipe != Recipe::bf16;
  float* pool_scales = BufferLayout::at<float>(a.view.local(), a.layout.l1_pool_scales);
  float* pool_weight = BufferLayout::at<float>(a.view.local(), a.layout.pool_weight);
  PoolSource* pool_source = BufferLayout::at<PoolSource>(a.view.local(), a.layout.pool_source);
  for (uint32_t first = begin + 32 * warp; first < end; first += 32 * warps) {
    const uint32_t rows = min(32u, end - first);
    const uint32_t row = first + lane;
    RowSource source{};
    if (lane < rows) source = row_source(a, segments, row);
    const uint32_t token = source.token_topk / static_cast<uint32_t>(a.problem.top_k);
    const uint64_t input = input_row<kStreamed>(a, source.rank, token);
    if (lane < rows) {
      pool_weight[row] = reinterpret_cast<const float*>(source.buffer + input_offsets<kStreamed>(a).topk_weights)
          [input_route_of_row<kStreamed>(a, input, source.token_topk)];
      pool_source[row] = PoolSource{source.rank, source.token_topk};
    }
    if (scaled) {
      // K-block-major, as pull_row writes them. Each lane's loads of a round are in flight before
      // its stores: one round trip per round of the rows' scales, not one per row.
      const uintptr_t row_scales =
          reinterpret_cast<uintptr_t>(source.buffer + input_offsets<kStreamed>(a).x_scales) +
          input * hidden_blocks * sizeof(float);
      const uint32_t total = rows * hidden_blocks;
      for (uint32_t base = 0; base < total; base += 32 * kBounceScaleLoads) {
        float values[kBounceScaleLoads];
#pragma unroll
        for (uint32_t u = 0; u < kBounceScaleLoads; ++u) {
          const uint32_t i = base + 32 * u + lane;
          const uint32_t r = min(i / hidden_blocks, rows - 1);
          const auto from = reinterpret_cast<const float*>(__shfl_sync(0xFFFFFFFFu, row_scales, r));
          values[u] = i < total ? from[i - r * hidden_blocks] : 0.0f;
        }
#pragma unroll
        for (uint32_t u = 0; u < kBounceScaleLoads; ++u) {
          const uint32_t i = base + 32 * u + lane;
          const uint32_t r = i / hidden_blocks;
          const uint64_t kb = i - r * hidden_blocks;
          if (i < total) pool_scales[kb * a.layout.pool_rows + first + r] = values[u];
        }
      }
    }
    // The warp barrier orders every lane's stores before lane 0's fence and count.
    __syncwarp();
    if (lane == 0) {
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      rows_done(first, rows);
    }
    __syncwarp();
  }
}

// Pulls the bytes of pool rows [begin, end) by one warp through `bounce` in batches
// (comm::BouncePlan): through shared memory, so that the warp keeps the area's bytes in flight
// however few registers it has. Lane 0 calls rows_pulled(first, count) once a batch's rows are
// complete in the pool (their stores done and fenced for the async proxy), in order. Their scales,
// route weights and sources are pull_rows_metadata's, run by other warps meanwhile: in this warp's
// loop they took about five round trips per batch, most of a bulk pull's time (DeepSeek-V3 at 2048
// tokens: about 130 µs per CTA for 124 rows).
template <bool kStreamed = false, class RowsPulled>
__device__ inline void pull_rows_bulk(const DispatchArgs& a, const PoolSegments& segments, uint32_t begin,
                                      uint32_t end, BounceArea& bounce, uint32_t lane,
                                      const RowsPulled& rows_pulled) {
  if (begin >= end) return;
  const uint32_t row_bytes = static_cast<uint32_t>(a.problem.hidden) * a.layout.activation_bytes;
  char* pool = a.view.local() + a.layout.l1_pool.offset;
  const comm::BouncePlan plan = comm::BouncePlan::make(bounce.bytes, row_bytes, end - begin);
  const uint32_t batches = plan.batches();
  const auto batch_of = [&](uint32_t b) {
    comm::BounceBatch batch = plan.batch(b);
    batch.first += begin;
    return batch;
  };
  // The source rows were written by generic stores (the source rank's send); bulk copies read them
  // through the async proxy.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  // Batch b's loads go to half b % 2 once batch b - 2's store has read it; batch b - 1's store is
  // issued once its loads have landed; rows are reported once their store has completed.
  for (uint32_t b = 0; b <= batches; ++b) {
    if (b < batches) {
      const comm::BounceBatch batch = batch_of(b);
      uint8_t* slot = bounce.area + (b % 2) * plan.half;
      if (b >= 2 && lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
      const uint32_t row = batch.first + lane;
      RowSource source{};
      if (lane < batch.rows) source = row_source(a, segments, row);
      const uint32_t token = source.token_topk / static_cast<uint32_t>(a.problem.top_k);
      const char* source_row =
          source.buffer + input_offsets<kStreamed>(a).x + input_row<kStreamed>(a, source.rank, token) * row_bytes +
          batch.offset;
      // Lane 0 issues the loads: the half is free for it (its wait above).
      if (lane == 0) {
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &bounce.loaded[b % 2], batch.rows * batch.bytes);
      }
      for (uint32_t r = 0; r < batch.rows; ++r) {
        const auto from = reinterpret_cast<const char*>(
            __shfl_sync(0xFFFFFFFFu, reinterpret_cast<uintptr_t>(source_row), r));
        if (lane == 0) {
          cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, slot + r * batch.bytes, from,
                                   batch.bytes, &bounce.loaded[b % 2]);
        }
      }
    }
    if (b >= 1) {
      const comm::BounceBatch done = batch_of(b - 1);
      if (lane == 0) {
        const uint32_t slot = (b - 1) % 2;
        // TMA completes the transfer it was given, so this wait needs no timeout.
        while (!cuda::ptx::mbarrier_try_wait_parity(&bounce.loaded[slot], (bounce.phases >> slot) & 1u)) {
        }
        bounce.phases ^= 1u << slot;
        cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared,
                                 pool + uint64_t{done.first} * row_bytes + done.offset,
                                 bounce.area + slot * plan.half, done.rows * done.bytes);
        cuda::ptx::cp_async_bulk_commit_group();
        // The store of batch b - 2 complete (b - 1's may still run): its rows, when that was their last piece.
        if (b >= 2) {
          cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<1>{});
          const comm::BounceBatch stored = batch_of(b - 2);
          if (stored.completes_rows) {
            cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
            rows_pulled(stored.first, stored.rows);
          }
        }
      }
      __syncwarp();
    }
  }
  if (lane == 0) {
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    const comm::BounceBatch stored = batch_of(batches - 1);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    rows_pulled(stored.first, stored.rows);
  }
  __syncwarp();
}

}  // namespace megamoe::dispatch
