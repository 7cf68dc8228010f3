// Streaming chunk-ready front ring (docs/streaming.md): where the ring lives in a rank's symmetric
// buffer, and the protocol steps that producers and the MoE layer share.
//
// Each rank's buffer holds the ring of the tokens that rank sources: num_slots slots of
// tokens_per_slot tokens. Producers on the rank write a slot and publish it; every rank's MoE layer
// (the consumers) waits for the slot, reads it through the peer mapping, and acknowledges it in the
// source's buffer. The protocol steps are written once, over an atomic-access policy:
//
//   struct Atomics {
//     static uint64_t load_acquire(uint64_t* word);               // system scope on the GPU
//     static void store_release(uint64_t* word, uint64_t value);  // system scope on the GPU
//     static uint64_t now_ns();                                    // monotonic clock for timeouts
//     static void backoff();                                       // between two polls
//   };
//
// The GPU policy is in src/kernels/streaming/ring_device.cuh; tests/streaming runs the same steps
// over std::atomic_ref on host threads.
#pragma once

#include <cstdint>

#include "megamoe/config.h"
#include "megamoe/problem.h"
#include "megamoe/types.h"

namespace megamoe {

// Sub-regions of the ring start on this boundary (a TMA-friendly base for payload rows).
inline constexpr uint64_t kFrontAlign = 128;

// The two halves of a chunk, published independently: routing (top-k ids, weights and the slot's
// metadata) and layout (activations and their scales).
enum class FrontHalf : uint32_t { route = 0, layout = 1 };

// A slot's metadata: part of the route half.
struct FrontSlotMeta {
  uint32_t token_base;  // the slot's first token: its row in the source rank's tokens of the call
  uint32_t valid;       // tokens in the slot: tokens_per_slot, fewer in a call's final chunk, 0 when empty
  uint32_t last;        // 1 on the source rank's final chunk of the call
  uint32_t call_tokens; // the source rank's tokens in the call: any one chunk tells how many follow it
};

struct FrontSpan {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  MEGAMOE_HD uint64_t end() const { return offset + bytes; }
};

// Sequence number seq (0, 1, 2, ... per source rank over the buffer's life) goes to slot
// seq % num_slots with generation seq / num_slots + 1; generation 0 means never published.
MEGAMOE_HD uint32_t front_slot(uint64_t seq, uint32_t num_slots) {
  return static_cast<uint32_t>(seq % num_slots);
}
MEGAMOE_HD uint64_t front_generation(uint64_t seq, uint32_t num_slots) { return seq / num_slots + 1; }

// Chunks a source rank publishes in a call with `tokens` tokens: a rank with none publishes one
// empty chunk, so consumers learn it is done.
MEGAMOE_HD uint32_t front_chunk_count(uint32_t tokens, uint32_t tokens_per_slot) {
  return tokens == 0 ? 1u : (tokens + tokens_per_slot - 1) / tokens_per_slot;
}

// The front ring of a buffer for streamed calls (Problem::front_num_slots and front_tokens_per_slot):
// chunks of `chunk_tokens` (0, or more than a call holds: one chunk per call), and slots for two calls,
// so that a call's producers need not wait for the previous call's last readers on other ranks.
struct FrontRingShape {
  int32_t num_slots;
  int32_t tokens_per_slot;
};
MEGAMOE_HD FrontRingShape front_ring_shape(int32_t max_tokens_per_rank, int32_t chunk_tokens) {
  const int32_t max_tokens = max_tokens_per_rank > 0 ? max_tokens_per_rank : 1;
  const int32_t per_slot = chunk_tokens > 0 && chunk_tokens < max_tokens ? chunk_tokens : max_tokens;
  return {2 * ((max_tokens + per_slot - 1) / per_slot), per_slot};
}

// Metadata of chunk `chunk` (< front_chunk_count) of such a call.
MEGAMOE_HD FrontSlotMeta front_chunk_meta(uint32_t tokens, uint32_t tokens_per_slot, uint32_t chunk) {
  FrontSlotMeta meta{};
  meta.token_base = chunk * tokens_per_slot;
  const uint32_t left = tokens - meta.token_base;
  meta.valid = left < tokens_per_slot ? left : tokens_per_slot;
  meta.last = chunk + 1 == front_chunk_count(tokens, tokens_per_slot) ? 1u : 0u;
  meta.call_tokens = tokens;
  return meta;
}

// A producer launch's work over one call of `tokens` tokens (kernels/streaming/ring_producer.cuh):
// each chunk cut into parts of `tokens_per_part` tokens, chunk-major, so that the first chunks are
// published first. Only parts that hold tokens are items (a chunk with none, a call without tokens,
// is one empty part, which publishes it): a call far smaller than the slot would otherwise launch a
// block per empty part of the slot, each with its system-scope atomics.
struct FrontProducerParts {
  uint32_t tokens;
  uint32_t tokens_per_slot;
  uint32_t tokens_per_part;
  MEGAMOE_HD uint32_t chunks() const { return front_chunk_count(tokens, tokens_per_slot); }
  MEGAMOE_HD uint32_t full_chunk_parts() const { return (tokens_per_slot + tokens_per_part - 1) / tokens_per_part; }
  MEGAMOE_HD uint32_t parts_in_chunk(uint32_t chunk) const {
    const uint32_t valid = front_chunk_meta(tokens, tokens_per_slot, chunk).valid;
    return valid == 0 ? 1u : (valid + tokens_per_part - 1) / tokens_per_part;
  }
  // Every chunk but the last is full, so item i is part i % full_chunk_parts() of chunk i / full_chunk_parts().
  MEGAMOE_HD uint32_t items() const { return (chunks() - 1) * full_chunk_parts() + parts_in_chunk(chunks() - 1); }
  MEGAMOE_HD uint32_t chunk_of(uint32_t item) const { return item / full_chunk_parts(); }
  // Tokens [begin, end) of the item's chunk.
  MEGAMOE_HD uint32_t part_begin(uint32_t item) const { return item % full_chunk_parts() * tokens_per_part; }
  MEGAMOE_HD uint32_t part_end(uint32_t item) const {
    const uint32_t valid = front_chunk_meta(tokens, tokens_per_slot, chunk_of(item)).valid;
    const uint32_t end = part_begin(item) + tokens_per_part;
    return end < valid ? end : valid;
  }
};

// The tokens of a producer's part for a call of `tokens` tokens in chunks of `tokens_per_slot`, when a
// launch places `blocks` blocks at once: the fewest (a multiple of `step`: a block's warps taking one
// token each) whose parts of the call all fit those blocks, else `most` (the kernel's largest share,
// which amortizes a part's slot claim and count; the launch then takes the parts in turns). Parts of a
// fixed size left a small call's tokens on a few blocks: 128 tokens in parts of four are 32 blocks,
// each warp quantizing 28 of DeepSeek-V3's 1x128 blocks one after the other.
MEGAMOE_HD uint32_t front_tokens_per_part(uint32_t tokens, uint32_t tokens_per_slot, uint32_t blocks, uint32_t step,
                                          uint32_t most) {
  for (uint32_t per_part = step; per_part < most; per_part += step)
    if (FrontProducerParts{tokens, tokens_per_slot, per_part}.items() <= blocks) return per_part;
  return most;
}

// Layout of one rank's front ring. Offsets are relative to the front_ring region of BufferLayout;
// sizes depend on the Problem but never on its rank.
//
//   cursors       u64 [2 + num_ranks]   the route and layout producers' next sequence numbers, then
//                                       this rank's consumer's next sequence number per source rank
//   ready         u64 [2][num_slots]    published generation per half (FrontHalf) and slot
//   consumed      u64 [num_slots][num_ranks]   generation each destination rank has acknowledged
//   publish_counts u32 [2][num_slots + 1]   per producer half: the blocks done with each slot's chunk
//                                       (its last one publishes), then the blocks retired from the
//                                       launch (its last one advances the cursor); zero between launches
//   meta          FrontSlotMeta [num_slots]
//   x             [num_slots][tokens_per_slot][hidden] activation
//   x_scales      f32 [num_slots][tokens_per_slot][hidden / 128]   fp8 recipes only
//   topk_idx      i32 [num_slots][tokens_per_slot][top_k]
//   topk_weights  f32 [num_slots][tokens_per_slot][top_k]
struct FrontRingLayout {
  uint32_t num_ranks = 0;
  uint32_t num_slots = 0;  // 0: streaming disabled, nothing allocated
  uint32_t tokens_per_slot = 0;
  uint32_t top_k = 0;
  uint32_t row_bytes = 0;     // one token's activations: hidden * activation bytes
  uint32_t scale_blocks = 0;  // one token's activation scales: hidden / 128, 0 for bf16

  FrontSpan cursors, ready, consumed, publish_counts, meta, x, x_scales, topk_idx, topk_weights;
  uint64_t total_bytes = 0;

  MEGAMOE_HD static FrontRingLayout make(const Problem& p) {
    FrontRingLayout l;
    if (p.front_num_slots <= 0) return l;
    l.num_ranks = static_cast<uint32_t>(p.num_ranks);
    l.num_slots = static_cast<uint32_t>(p.front_num_slots);
    l.tokens_per_slot = static_cast<uint32_t>(p.front_tokens_per_slot);
    l.top_k = static_cast<uint32_t>(p.top_k);
    l.row_bytes = static_cast<uint32_t>(p.hidden) * (p.recipe == Recipe::bf16 ? 2u : 1u);
    l.scale_blocks = p.recipe == Recipe::bf16 ? 0u : static_cast<uint32_t>(p.hidden / kScaleBlock);

    const uint64_t slots = l.num_slots;
    const uint64_t rows = slots * l.tokens_per_slot;
    uint64_t cursor = 0;
    auto place = [&cursor](FrontSpan& span, uint64_t bytes) {
      span.offset = cursor;
      span.bytes = bytes;
      cursor = (cursor + bytes + kFrontAlign - 1) / kFrontAlign * kFrontAlign;
    };
    place(l.cursors, sizeof(uint64_t) * (2ull + l.num_ranks));
    place(l.ready, sizeof(uint64_t) * 2ull * slots);
    place(l.consumed, sizeof(uint64_t) * slots * l.num_ranks);
    place(l.publish_counts, sizeof(uint32_t) * 2ull * (slots + 1));
    place(l.meta, sizeof(FrontSlotMeta) * slots);
    place(l.x, rows * l.row_bytes);
    place(l.x_scales, sizeof(float) * rows * l.scale_blocks);
    place(l.topk_idx, sizeof(int32_t) * rows * l.top_k);
    place(l.topk_weights, sizeof(float) * rows * l.top_k);
    l.total_bytes = cursor;
    return l;
  }

  // Most tokens one source rank may stream in one call: a call never wraps the ring, so its
  // producers finish without its consumers (docs/streaming.md, "Progress").
  MEGAMOE_HD uint64_t call_capacity() const { return static_cast<uint64_t>(num_slots) * tokens_per_slot; }
  MEGAMOE_HD bool holds_call(uint64_t tokens) const { return num_slots > 0 && tokens <= call_capacity(); }

  // The ring row (slot * tokens_per_slot + row in the slot) of token `token` of a source's call whose
  // first chunk is sequence `first_seq`: a call's chunks take consecutive slots, so its rows are
  // consecutive ring rows, continued from the last slot's end at the first slot's start. token <
  // call_capacity() (holds_call: a call never takes more than the ring's slots).
  MEGAMOE_HD uint64_t call_row(uint64_t first_seq, uint32_t token) const {
    const uint64_t row = uint64_t{front_slot(first_seq, num_slots)} * tokens_per_slot + token;
    return row >= call_capacity() ? row - call_capacity() : row;
  }

  // ---- Typed accessors, given the base of the front_ring region on some rank ----
  template <typename T>
  MEGAMOE_HD static T* at(void* ring, const FrontSpan& span, uint64_t element) {
    return reinterpret_cast<T*>(static_cast<char*>(ring) + span.offset) + element;
  }
  MEGAMOE_HD uint64_t* producer_cursor(void* ring, FrontHalf half) const {
    return at<uint64_t>(ring, cursors, static_cast<uint32_t>(half));
  }
  MEGAMOE_HD uint64_t* consumer_cursor(void* ring, uint32_t src_rank) const {
    return at<uint64_t>(ring, cursors, 2ull + src_rank);
  }
  MEGAMOE_HD uint64_t* ready_word(void* ring, FrontHalf half, uint32_t slot) const {
    return at<uint64_t>(ring, ready, static_cast<uint64_t>(half) * num_slots + slot);
  }
  MEGAMOE_HD uint64_t* consumed_word(void* ring, uint32_t slot, uint32_t dst_rank) const {
    return at<uint64_t>(ring, consumed, static_cast<uint64_t>(slot) * num_ranks + dst_rank);
  }
  MEGAMOE_HD uint32_t* slot_parts_done(void* ring, FrontHalf half, uint32_t slot) const {
    return at<uint32_t>(ring, publish_counts, static_cast<uint64_t>(half) * (num_slots + 1ull) + slot);
  }
  MEGAMOE_HD uint32_t* producer_blocks_retired(void* ring, FrontHalf half) const {
    return at<uint32_t>(ring, publish_counts, static_cast<uint64_t>(half) * (num_slots + 1ull) + num_slots);
  }
  MEGAMOE_HD FrontSlotMeta* slot_meta(void* ring, uint32_t slot) const { return at<FrontSlotMeta>(ring, meta, slot); }
  // Row t of a slot's payload views starts at t * row_bytes, t * scale_blocks and t * top_k.
  MEGAMOE_HD uint8_t* slot_x(void* ring, uint32_t slot) const {
    return at<uint8_t>(ring, x, static_cast<uint64_t>(slot) * tokens_per_slot * row_bytes);
  }
  MEGAMOE_HD float* slot_x_scales(void* ring, uint32_t slot) const {
    return at<float>(ring, x_scales, static_cast<uint64_t>(slot) * tokens_per_slot * scale_blocks);
  }
  MEGAMOE_HD int32_t* slot_topk_idx(void* ring, uint32_t slot) const {
    return at<int32_t>(ring, topk_idx, static_cast<uint64_t>(slot) * tokens_per_slot * top_k);
  }
  MEGAMOE_HD float* slot_topk_weights(void* ring, uint32_t slot) const {
    return at<float>(ring, topk_weights, static_cast<uint64_t>(slot) * tokens_per_slot * top_k);
  }
};

// ---- Protocol steps (docs/streaming.md, "Protocol") ----

// What a front-ring wait was waiting for; the GPU reports these as WaitSite kWaitFrontRouteReady,
// kWaitFrontLayoutReady and kWaitFrontConsumed.
enum class FrontWaitFor : uint32_t { nothing = 0, route_ready, layout_ready, consumed };

// The outcome of a wait: ok(), or what it gave up on.
struct FrontWaitResult {
  FrontWaitFor what = FrontWaitFor::nothing;
  uint32_t peer = 0;  // the source rank of a ready wait, the destination rank of a consumed wait
  uint32_t slot = 0;
  uint64_t expected = 0;
  uint64_t seen = 0;  // the word's value when the wait gave up
  bool abandoned = false;  // gave up because the caller's stop() said so, not on its timeout
  MEGAMOE_HD bool ok() const { return what == FrontWaitFor::nothing; }
};

// A wait's early way out: never, by default. On the GPU the layer and the producers stop once their
// rank has recorded a failure (device::rank_call_failed), instead of waiting a whole timeout for a
// word that will not come.
struct FrontNeverStop {
  MEGAMOE_HD bool operator()() const { return false; }
};

// Polls `word` (acquire) until it holds `expected`, or until timeout_ns have passed since `start`,
// or until stop() (asked every 64 polls) returns true.
template <typename Atomics, typename Stop = FrontNeverStop>
MEGAMOE_HD FrontWaitResult front_wait_word(uint64_t* word, uint64_t expected, FrontWaitFor what, uint32_t peer,
                                           uint32_t slot, uint64_t start, uint64_t timeout_ns, const Stop& stop = {}) {
  for (uint32_t polls = 1;; ++polls) {
    const uint64_t seen = Atomics::load_acquire(word);
    if (seen == expected) return FrontWaitResult{};
    if (Atomics::now_ns() - start >= timeout_ns) return FrontWaitResult{what, peer, slot, expected, seen};
    if (polls % 64 == 0 && stop()) return FrontWaitResult{what, peer, slot, expected, seen, true};
    Atomics::backoff();
  }
}

// Producer, before writing its half of chunk `seq` into its own ring: waits until every destination
// rank has acknowledged the slot's previous generation (all of them read every chunk's routing).
template <typename Atomics, typename Stop = FrontNeverStop>
MEGAMOE_HD FrontWaitResult front_wait_slot_free(const FrontRingLayout& l, void* own_ring, uint64_t seq,
                                                uint64_t timeout_ns, const Stop& stop = {}) {
  const uint32_t slot = front_slot(seq, l.num_slots);
  const uint64_t previous = front_generation(seq, l.num_slots) - 1;
  const uint64_t start = Atomics::now_ns();
  for (uint32_t dst = 0; dst < l.num_ranks; ++dst) {
    const FrontWaitResult result = front_wait_word<Atomics>(l.consumed_word(own_ring, slot, dst), previous,
                                                            FrontWaitFor::consumed, dst, slot, start, timeout_ns, stop);
    if (!result.ok()) return result;
  }
  return FrontWaitResult{};
}

// Producer, after every write of its half of chunk `seq` is complete: publishes it (release).
template <typename Atomics>
MEGAMOE_HD void front_publish(const FrontRingLayout& l, void* own_ring, FrontHalf half, uint64_t seq) {
  Atomics::store_release(l.ready_word(own_ring, half, front_slot(seq, l.num_slots)),
                         front_generation(seq, l.num_slots));
}

// Consumer, before any read of chunk `seq` of source rank src_rank (whose ring is src_ring): waits
// until both halves are published with the chunk's generation (acquire).
template <typename Atomics, typename Stop = FrontNeverStop>
MEGAMOE_HD FrontWaitResult front_wait_ready(const FrontRingLayout& l, void* src_ring, uint32_t src_rank, uint64_t seq,
                                            uint64_t timeout_ns, const Stop& stop = {}) {
  const uint32_t slot = front_slot(seq, l.num_slots);
  const uint64_t generation = front_generation(seq, l.num_slots);
  const uint64_t start = Atomics::now_ns();
  const FrontWaitResult route =
      front_wait_word<Atomics>(l.ready_word(src_ring, FrontHalf::route, slot), generation, FrontWaitFor::route_ready,
                               src_rank, slot, start, timeout_ns, stop);
  if (!route.ok()) return route;
  return front_wait_word<Atomics>(l.ready_word(src_ring, FrontHalf::layout, slot), generation,
                                  FrontWaitFor::layout_ready, src_rank, slot, start, timeout_ns, stop);
}

// Consumer dst_rank, after its last read of chunk `seq` from src_ring: hands the slot back (release).
template <typename Atomics>
MEGAMOE_HD void front_acknowledge(const FrontRingLayout& l, void* src_ring, uint32_t dst_rank, uint64_t seq) {
  Atomics::store_release(l.consumed_word(src_ring, front_slot(seq, l.num_slots), dst_rank),
                         front_generation(seq, l.num_slots));
}

// ---- Streamed dispatch: chunk-local expert pools (docs/streaming.md, "Chunk-aware dispatch") ----

// Step s of a call on a destination takes chunk s of every source rank that still has chunks. The
// step's routes to the destination's experts form one segment of its pool, from the call's row
// cursor, laid out by local expert, then source rank, then token and choice: so the layout depends
// on the routes alone, not on the order in which chunks arrived, and local expert e's group in the
// segment is rows [first_row(e, 0), first_row(e + 1, 0)). A dispatch fills it in three passes:
// count each (local expert, source rank) pair's routes, place the segment (the counts become each
// pair's first row), then give each route the next row of its pair in token and choice order.
struct StreamSegment {
  uint32_t row_begin = 0;
  uint32_t row_end = 0;  // the next step's row_begin
};

// pair_rows[e * num_ranks + src]: in, the routes of source src to local expert e in this step; out,
// the pair's first row (an exclusive prefix in (expert, source) order from row_begin).
MEGAMOE_HD StreamSegment stream_segment_place(uint32_t* pair_rows, uint32_t experts_per_rank,
                                              uint32_t num_ranks, uint32_t row_begin) {
  uint32_t row = row_begin;
  for (uint32_t pair = 0; pair < experts_per_rank * num_ranks; ++pair) {
    const uint32_t routes = pair_rows[pair];
    pair_rows[pair] = row;
    row += routes;
  }
  return {row_begin, row};
}

}  // namespace megamoe
