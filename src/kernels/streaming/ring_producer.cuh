// A producer's side of the front ring in a multi-block kernel (docs/streaming.md, "Protocol"): one
// half (route or layout) of every chunk of this rank's call, each chunk cut into parts of a block's
// work, taken chunk-major so that the first chunks are published first (FrontProducerParts: only
// parts that hold tokens).
//
// A producer kernel's blocks call front_produce with the writes of one part; per part it runs, in
// order:
//   front_claim_slot   thread 0 waits until every destination acknowledged the slot's previous
//                      generation; false (recorded as kWaitFrontConsumed) if that timed out
//   ... the part's writes into the slot ...
//   front_finish_part  the block whose part completes the chunk publishes the half (the route half's
//                      metadata first)
// and, after the block's last part, front_retire: the last block to retire advances the producer's
// cursor, so that every block has read the call's first sequence number (front_first_seq) before it
// moves. Every block first lets the stream's next kernel start (the layer launched to synchronize
// through the ring, not by the producers' end; it never waits for this kernel otherwise).
#pragma once

#include <cstdint>

#include "kernels/comm/sync.cuh"
#include "kernels/overlapped_launch.cuh"
#include "kernels/streaming/ring_device.cuh"
#include "megamoe/comm.h"
#include "megamoe/error.h"
#include "megamoe/streaming.h"

namespace megamoe::device {

struct FrontProducer {
  SymmView view;  // this rank and the wait timeout (waits are on this rank's own ring)
  ControlBlock* control;
  FrontRingLayout ring;
  char* own_ring;  // this rank's front_ring region
  FrontHalf half;
  uint32_t tokens;           // this rank's tokens in the call
  uint32_t tokens_per_part;  // a block's share of a chunk

  MEGAMOE_HD FrontProducerParts parts() const { return {tokens, ring.tokens_per_slot, tokens_per_part}; }
  MEGAMOE_HD uint32_t chunks() const { return parts().chunks(); }
  MEGAMOE_HD uint32_t items() const { return parts().items(); }
};

// The call's first sequence number: written only by this half's previous launch (stream order).
MEGAMOE_DEVICE uint64_t front_first_seq(const FrontProducer& p) {
  return *p.ring.producer_cursor(p.own_ring, p.half);
}

MEGAMOE_DEVICE bool front_claim_slot(const FrontProducer& p, uint64_t seq) {
  int free = 1;
  if (threadIdx.x == 0) {
    free = front_wait_ok(p.view, p.control,
                         front_wait_slot_free<FrontRingAtomics>(p.ring, p.own_ring, seq, p.view.timeout_ns,
                                                                StopOnFailure{p.control}));
  }
  return __syncthreads_and(free) != 0;  // also orders the block's writes after thread 0's acquire
}

MEGAMOE_DEVICE void front_finish_part(const FrontProducer& p, uint64_t seq, uint32_t chunk) {
  __syncthreads();  // the block's writes of its part, before thread 0's release
  if (threadIdx.x != 0) return;
  const uint32_t slot = front_slot(seq, p.ring.num_slots);
  uint32_t* parts_done = p.ring.slot_parts_done(p.own_ring, p.half, slot);
  if (atomic_add_acq_rel_sys(parts_done, 1u) + 1 != p.parts().parts_in_chunk(chunk)) return;
  // Every part of the chunk has arrived, and no other chunk of the call takes this slot (a call
  // never wraps the ring): the count restarts for the slot's next generation.
  *parts_done = 0;
  if (p.half == FrontHalf::route) {
    *p.ring.slot_meta(p.own_ring, slot) = front_chunk_meta(p.tokens, p.ring.tokens_per_slot, chunk);
  }
  front_publish<FrontRingAtomics>(p.ring, p.own_ring, p.half, seq);
}

MEGAMOE_DEVICE void front_retire(const FrontProducer& p, uint64_t first_seq) {
  if (threadIdx.x != 0) return;
  uint32_t* retired = p.ring.producer_blocks_retired(p.own_ring, p.half);
  if (atomic_add_acq_rel_sys(retired, 1u) + 1 != gridDim.x) return;
  *retired = 0;
  *p.ring.producer_cursor(p.own_ring, p.half) = first_seq + p.chunks();
}

// Every part of the call that falls to this block: write_part(slot, meta, begin, end) writes the
// chunk's rows [begin, end) (end <= meta.valid; empty only in an empty chunk) into `slot`.
template <typename WritePart>
MEGAMOE_DEVICE void front_produce(const FrontProducer& p, const WritePart& write_part) {
  allow_next_kernel();
  const uint64_t first_seq = front_first_seq(p);
  const FrontProducerParts parts = p.parts();
  for (uint32_t item = blockIdx.x; item < parts.items(); item += gridDim.x) {
    const uint32_t chunk = parts.chunk_of(item);
    const uint64_t seq = first_seq + chunk;
    if (!front_claim_slot(p, seq)) return;  // the error is recorded; the host resets the ring
    const FrontSlotMeta meta = front_chunk_meta(p.tokens, p.ring.tokens_per_slot, chunk);
    write_part(front_slot(seq, p.ring.num_slots), meta, parts.part_begin(item), parts.part_end(item));
    front_finish_part(p, seq, chunk);
  }
  front_retire(p, first_seq);
}

// Blocks a producer launch places at once: eight per SM of the rank's budget.
inline uint32_t front_producer_blocks(const SymmBuffer& buffer) {
  return static_cast<uint32_t>(buffer.comm().sm_budget()) * 8;
}

// The host's description of one half's launch for `tokens` tokens of this rank's next call, in parts
// of front_tokens_per_part (at least part_step tokens, at most part_most); checks that the buffer has
// a ring that holds the call. `what` names the caller's argument in errors.
inline FrontProducer make_front_producer(const SymmBuffer& buffer, FrontHalf half, int64_t tokens, uint32_t part_step,
                                         uint32_t part_most, const char* what) {
  const Problem& p = buffer.problem();
  const FrontRingLayout ring = FrontRingLayout::make(p);
  require(ring.num_slots > 0, "buffer", "has no front ring: its Problem's front_num_slots is 0");
  require(tokens >= 0 && tokens <= p.max_tokens_per_rank, what, "holds ", tokens,
          " tokens; a streamed call takes at most the buffer's max_tokens_per_rank, ", p.max_tokens_per_rank);
  require(ring.holds_call(static_cast<uint64_t>(tokens)), what, "holds ", tokens, " tokens; the front ring holds ",
          ring.call_capacity(), " a call (front_num_slots x front_tokens_per_slot)");
  FrontProducer producer{};
  producer.view = buffer.view();
  producer.control = buffer.layout().control_block(buffer.local());
  producer.ring = ring;
  producer.own_ring = buffer.local() + buffer.layout().front_ring.offset;
  producer.half = half;
  producer.tokens = static_cast<uint32_t>(tokens);
  producer.tokens_per_part = front_tokens_per_part(producer.tokens, ring.tokens_per_slot, front_producer_blocks(buffer),
                                                   part_step, part_most);
  return producer;
}

// Blocks of a producer launch: every part of the call, at most front_producer_blocks (the parts
// beyond them, when the part's size is capped, are taken in turn).
inline uint32_t front_producer_grid(const FrontProducer& p, const SymmBuffer& buffer) {
  const uint32_t items = p.items(), blocks = front_producer_blocks(buffer);
  return items < blocks ? items : blocks;
}

}  // namespace megamoe::device
