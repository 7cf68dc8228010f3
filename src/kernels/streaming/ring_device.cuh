// GPU side of the streaming front ring (docs/streaming.md): the atomic-access policy that the
// protocol steps of megamoe/streaming.h run over on the device, and the report of a wait that gave up.
//
// Ordering around the steps (sync.cuh's memory-model notes apply): a producer block finishes its
// payload writes (__syncthreads; for TMA stores cp.async.bulk.wait_group 0 and fence.proxy.async)
// before one thread calls front_publish; a consumer calls front_wait_ready from one thread, then
// __syncthreads (and fence.proxy.async before TMA loads) before the block reads; it calls
// front_acknowledge only after its last read of the slot has completed (for TMA loads: after the
// mbarrier wait that completes them).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/sync.cuh"
#include "megamoe/comm.h"
#include "megamoe/layout.h"
#include "megamoe/streaming.h"

namespace megamoe::device {

// Ring words are written and polled by other GPUs over NVLink: system scope.
struct FrontRingAtomics {
  MEGAMOE_DEVICE static uint64_t load_acquire(uint64_t* word) { return ld_acquire_sys(word); }
  MEGAMOE_DEVICE static void store_release(uint64_t* word, uint64_t value) { st_release_sys(word, value); }
  MEGAMOE_DEVICE static uint64_t now_ns() { return cuda::ptx::get_sreg_globaltimer(); }
  // Polling a peer's word crosses NVLink; a short sleep keeps many waiting blocks off the link.
  MEGAMOE_DEVICE static void backoff() { __nanosleep(128); }
};

MEGAMOE_DEVICE WaitSite front_wait_site(FrontWaitFor what) {
  switch (what) {
    case FrontWaitFor::route_ready: return kWaitFrontRouteReady;
    case FrontWaitFor::layout_ready: return kWaitFrontLayoutReady;
    case FrontWaitFor::consumed: return kWaitFrontConsumed;
    case FrontWaitFor::nothing: break;
  }
  return kWaitNone;
}

// Base of `rank`'s front ring, as this rank addresses it.
MEGAMOE_DEVICE void* front_ring_of(const SymmView& view, const BufferLayout& layout, int32_t rank) {
  return view.peers[rank] + layout.front_ring.offset;
}

// A front-ring wait's stop(): this rank's call has failed already (another wait gave up).
struct StopOnFailure {
  const ControlBlock* control;
  MEGAMOE_DEVICE bool operator()() const { return rank_call_failed(control); }
};

// Returns result.ok(); a wait that timed out is recorded as this rank's kDeviceTimeout (first error
// wins), with the wait site, the peer rank, and the generation expected and seen. One abandoned after
// an earlier failure records nothing: that failure is the cause.
MEGAMOE_DEVICE bool front_wait_ok(const SymmView& view, ControlBlock* control, const FrontWaitResult& result) {
  if (result.ok()) return true;
  if (result.abandoned) return false;
  DeviceError error{};
  error.code = kDeviceTimeout;
  error.site = front_wait_site(result.what);
  error.rank = static_cast<uint32_t>(view.rank);
  error.block = linear_block();
  error.thread = linear_thread();
  error.peer = result.peer;
  error.detail = static_cast<uint32_t>(view.timeout_ns / 1000000);
  error.expected = result.expected;
  error.seen = result.seen;
  record_error(control, error);
  return false;
}

}  // namespace megamoe::device
