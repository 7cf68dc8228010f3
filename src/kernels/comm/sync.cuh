// Device primitives for ranks that share memory: system-scope flags and counters, the error record,
// timeout-protected spin-waits, the cross-rank barrier and the grid barrier.
//
// Memory model: peers' buffers are reached over NVLink (or, for emulated ranks, are other allocations
// on this GPU), so every flag another rank reads is accessed at system scope. A release store or
// release RMW publishes every write this thread has made or has observed (including its block's
// writes ordered by a __syncthreads before it); an acquire load that sees the value makes them visible
// to the loading thread and, after a __syncthreads, to its block. Writes made with TMA (the async
// proxy) are covered only once complete (cp.async.bulk.wait_group 0) and fenced with
// fence.proxy.async before the release; data acquired here and then read with TMA needs a
// fence.proxy.async after the acquire.
//
// Timeouts: no spin-wait here waits forever. After SymmView::timeout_ns it records a kDeviceTimeout
// (site, peer, expected and seen value, timeout in ms as `detail`) in this rank's ControlBlock and
// returns false; the caller then leaves the kernel (never traps), and the host's
// SymmBuffer::check_device_error turns the record into an exception.
#pragma once

#include <cuda/atomic>
#include <cuda/ptx>
#include <cuda/std/type_traits>

#include <cstdint>

#include "megamoe/comm.h"
#include "megamoe/config.h"
#include "megamoe/layout.h"

namespace megamoe::device {

template <typename T>
using SystemRef = cuda::atomic_ref<T, cuda::thread_scope_system>;
template <typename T>
using GpuRef = cuda::atomic_ref<T, cuda::thread_scope_device>;
template <typename T>
using Same = cuda::std::type_identity_t<T>;

// ---- System-scope loads, stores and counters ----

template <typename T>
MEGAMOE_DEVICE T ld_acquire_sys(const T* address) {
  return SystemRef<T>(*const_cast<T*>(address)).load(cuda::memory_order_acquire);
}
template <typename T>
MEGAMOE_DEVICE T ld_relaxed_sys(const T* address) {
  return SystemRef<T>(*const_cast<T*>(address)).load(cuda::memory_order_relaxed);
}
template <typename T>
MEGAMOE_DEVICE void st_release_sys(T* address, Same<T> value) {
  SystemRef<T>(*address).store(value, cuda::memory_order_release);
}
template <typename T>
MEGAMOE_DEVICE void st_relaxed_sys(T* address, Same<T> value) {
  SystemRef<T>(*address).store(value, cuda::memory_order_relaxed);
}
// The atomic adds return the value before the addition.
template <typename T>
MEGAMOE_DEVICE T atomic_add_release_sys(T* address, Same<T> value) {
  return SystemRef<T>(*address).fetch_add(value, cuda::memory_order_release);
}
template <typename T>
MEGAMOE_DEVICE T atomic_add_acq_rel_sys(T* address, Same<T> value) {
  return SystemRef<T>(*address).fetch_add(value, cuda::memory_order_acq_rel);
}
template <typename T>
MEGAMOE_DEVICE T atomic_add_relaxed_sys(T* address, Same<T> value) {
  return SystemRef<T>(*address).fetch_add(value, cuda::memory_order_relaxed);
}

// ---- What ranks share, at the scope their GPUs need ----
// Ranks on other GPUs read these words over NVLink: system scope. With every rank on this GPU
// (SymmView::one_device) device scope orders them, without the system fences' round trips.

MEGAMOE_DEVICE void fence_ranks(const SymmView& view) {
  if (view.one_device) __threadfence();
  else __threadfence_system();
}
template <typename T>
MEGAMOE_DEVICE T ld_acquire_ranks(const SymmView& view, const T* address) {
  return view.one_device ? GpuRef<T>(*const_cast<T*>(address)).load(cuda::memory_order_acquire)
                         : ld_acquire_sys(address);
}
template <typename T>
MEGAMOE_DEVICE void st_release_ranks(const SymmView& view, T* address, Same<T> value) {
  if (view.one_device) GpuRef<T>(*address).store(value, cuda::memory_order_release);
  else st_release_sys(address, value);
}
// (By the flag alone: the fused L2 count reads it from shared memory, not from the view.)
template <typename T>
MEGAMOE_DEVICE T atomic_add_acq_rel_ranks(bool one_device, T* address, Same<T> value) {
  return one_device ? GpuRef<T>(*address).fetch_add(value, cuda::memory_order_acq_rel)
                    : atomic_add_acq_rel_sys(address, value);
}
template <typename T>
MEGAMOE_DEVICE T atomic_add_acq_rel_ranks(const SymmView& view, T* address, Same<T> value) {
  return atomic_add_acq_rel_ranks(view.one_device, address, value);
}

// ---- The error record ----

MEGAMOE_DEVICE uint32_t linear_block() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
MEGAMOE_DEVICE uint32_t linear_thread() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Records `error` in `record` unless an earlier error was recorded there (the first one is usually
// the cause). The host reads the record only after the kernel has finished, so the fields need no
// ordering among themselves.
MEGAMOE_DEVICE void record_first(DeviceError& record, const DeviceError& error) {
  if (atomicCAS(&record.code, uint32_t{kDeviceOk}, error.code) != kDeviceOk) return;
  record.site = error.site;
  record.rank = error.rank;
  record.block = error.block;
  record.thread = error.thread;
  record.peer = error.peer;
  record.detail = error.detail;
  record.choice = error.choice;
  record.expected = error.expected;
  record.seen = error.seen;
}
// An error that breaks the call (a timeout, a streamed chunk out of step): the record the rank's waits
// and check_device_error's resets go by.
MEGAMOE_DEVICE void record_error(ControlBlock* control, const DeviceError& error) { record_first(control->error, error); }
// An input error: the call runs to its end on every rank.
MEGAMOE_DEVICE void record_input_error(ControlBlock* control, const DeviceError& error) {
  record_first(control->input_error, error);
}

// True once this rank has recorded an error that breaks the call (breaks_call: a wait that timed out,
// a streamed chunk out of step): later waits and kernels of the call stop instead of waiting for what
// will not come or working on data the stuck step left incomplete (and writing it into peers'
// buffers). Input errors (a bad expert id) do not: the bad route is skipped, so peers are not left
// waiting.
MEGAMOE_DEVICE bool rank_call_failed(const ControlBlock* control) {
  return breaks_call(*static_cast<const volatile uint32_t*>(&control->error.code));
}
// rank_call_failed read once for the whole CTA (every thread calls it: a barrier). Read by each thread
// on its own, two threads could disagree when another CTA records an error between their reads, and a
// CTA split that way would wait at its next barrier forever.
MEGAMOE_DEVICE bool cta_call_failed(const ControlBlock* control) {
  return __syncthreads_or(rank_call_failed(control)) != 0;
}
// Whether some rank refused the call, its routes past its receive capacity (dispatch's refuse_call):
// read after the L2-done barrier, which orders the refusing rank's flag before it. With `record` (one
// thread), also records it on this rank, for its host, unless an input error is recorded already.
MEGAMOE_DEVICE bool call_refused(ControlBlock* control, int32_t rank, bool record) {
  const uint32_t refused_by = *static_cast<const volatile uint32_t*>(&control->capacity_exceeded_by);
  if (refused_by != 0 && record) {
    DeviceError error{};
    error.code = kDeviceCapacityExceeded;
    error.rank = static_cast<uint32_t>(rank);
    error.block = linear_block();
    error.thread = linear_thread();
    error.peer = refused_by - 1;
    record_input_error(control, error);
  }
  return refused_by != 0;
}

// ---- Spin-waits ----

// What a spin-wait reports if it gives up.
struct WaitSiteInfo {
  WaitSite site;
  uint32_t peer;       // the rank waited for (for sites about one peer)
  uint64_t expected;   // the value waited for
  uint32_t choice = 0; // what the value counts for (the fused schedule's expert or token tile)
  // How many view.timeout_ns to wait: a wait on what another wait's owner makes waits longer, so that
  // the owner's own wait fires first and its record names the cause.
  uint32_t timeouts = 1;
};

// Calls poll(seen) until it returns true (it sets `seen` to the value it read each time). Returns
// false after view.timeout_ns, having recorded a kDeviceTimeout in `control`, or as soon as another
// wait of this rank has timed out (what it waits for may then never come).
template <typename Poll>
MEGAMOE_DEVICE bool spin_wait(const SymmView& view, ControlBlock* control, const WaitSiteInfo& info, Poll&& poll) {
  uint64_t seen = 0;
  if (poll(seen)) return true;
  const uint64_t start = cuda::ptx::get_sreg_globaltimer();
  for (uint32_t polls = 1; !poll(seen); ++polls) {
    // A short sleep between polls: a waiting warp (the fused schedule's producer) then leaves its
    // scheduler's issue slots to the math warps beside it.
    __nanosleep(100);
    if (polls % 256 == 0 && rank_call_failed(control)) return false;
    if (cuda::ptx::get_sreg_globaltimer() - start > info.timeouts * view.timeout_ns) {
      DeviceError error{};
      error.code = kDeviceTimeout;
      error.site = info.site;
      error.rank = static_cast<uint32_t>(view.rank);
      error.block = linear_block();
      error.thread = linear_thread();
      error.peer = info.peer;
      error.detail = static_cast<uint32_t>(info.timeouts * view.timeout_ns / 1000000);
      error.expected = info.expected;
      error.seen = seen;
      error.choice = info.choice;
      record_error(control, error);
      return false;
    }
  }
  return true;
}

// Waits until load() >= expected (one thread): spin_wait's timeout and record, the value seen in it.
template <typename T, class Load>
MEGAMOE_DEVICE bool wait_until_at_least(const SymmView& view, ControlBlock* control, Same<T> expected, WaitSite site,
                                        uint32_t peer, const Load& load) {
  return spin_wait(view, control, WaitSiteInfo{site, peer, static_cast<uint64_t>(expected)}, [&](uint64_t& seen) {
    const T value = load();
    seen = static_cast<uint64_t>(value);
    return value >= expected;
  });
}
// Waits until *counter >= expected, reading with system-scope acquire.
template <typename T>
MEGAMOE_DEVICE bool wait_at_least_sys(const SymmView& view, ControlBlock* control, const T* counter, Same<T> expected,
                                      WaitSite site, uint32_t peer) {
  return wait_until_at_least<T>(view, control, expected, site, peer, [&] { return ld_acquire_sys(counter); });
}
// The same for a word ranks share (ld_acquire_ranks).
template <typename T>
MEGAMOE_DEVICE bool wait_at_least_ranks(const SymmView& view, ControlBlock* control, const T* counter,
                                        Same<T> expected, WaitSite site, uint32_t peer) {
  return wait_until_at_least<T>(view, control, expected, site, peer,
                                [&] { return ld_acquire_ranks(view, counter); });
}

// Waits until *counter >= expected, reading with device-scope acquire (counters of this rank's own
// kernels). `choice` goes into the record's `choice` field (what the counter counts for).
MEGAMOE_DEVICE bool wait_at_least_gpu(const SymmView& view, ControlBlock* control, const uint32_t* counter,
                                      uint32_t expected, WaitSite site, uint32_t choice, uint32_t timeouts = 1) {
  const auto poll = [&](uint64_t& seen) {
    const uint32_t value = GpuRef<uint32_t>(*const_cast<uint32_t*>(counter)).load(cuda::memory_order_acquire);
    seen = value;
    return value >= expected;
  };
  return spin_wait(view, control, WaitSiteInfo{site, static_cast<uint32_t>(view.rank), expected, choice, timeouts},
                   poll);
}

// ---- Barriers ----

// The cross-rank barrier in two halves, for a kernel that arrives in one place and waits in others
// (the fused schedule). rank_arrive writes `epoch` into every rank's barrier_arrivals[rank], this
// rank's own last: a thread that sees its own arrival (rank_wait acquires it) then also orders its
// later writes to the peers' words after these, so a later epoch never lands before an earlier one.
MEGAMOE_DEVICE void rank_arrive(const SymmView& view, ControlBlock* control, uint64_t epoch) {
  for (int32_t i = 1; i <= view.num_ranks; ++i) {
    const int32_t peer = (view.rank + i) % view.num_ranks;
    st_release_ranks(view, &view.map(control, peer)->barrier_arrivals[view.rank], epoch);
  }
}
// Waits until every rank (with others_only, every other rank) has arrived at `epoch` or later (one
// thread). False, with a timeout recorded, if one did not in time.
MEGAMOE_DEVICE bool rank_wait(const SymmView& view, ControlBlock* control, uint64_t epoch, bool others_only = false) {
  for (int32_t peer = 0; peer < view.num_ranks; ++peer)
    if (!(others_only && peer == view.rank) &&
        !wait_at_least_ranks(view, control, &control->barrier_arrivals[peer], epoch, kWaitRankBarrier,
                           static_cast<uint32_t>(peer)))
      return false;
  return true;
}

// Whether every other rank's previous call on this buffer has ended (one thread; false, with a timeout
// recorded, if one's has not in time). A fused call's last CTA arrives at its end, and a staged call's
// ranks at its last barrier, both where barrier_epoch then stands (a rank whose call broke does not:
// make a new buffer). A batch call waits for it before writing into the peers' route tables and
// counts, which a peer may still read (or, in a streamed call, write) after its L2 tiles. This rank's
// own previous call ended before its kernel started.
MEGAMOE_DEVICE bool peers_previous_call_ended(const SymmView& view, ControlBlock* control) {
  return rank_wait(view, control, GpuRef<uint64_t>(control->barrier_epoch).load(cuda::memory_order_relaxed), true);
}

// Cross-rank barrier. Every thread of exactly one block per rank calls it (the same number of times on
// every rank). Each rank writes its new epoch into every peer's barrier_arrivals[rank] and polls only
// its own buffer, so the waiting is local and each crossing costs one NVLink store per peer. Writes the
// block made (locally or to peers) before the call are visible to every rank's calling block after it.
// Returns false, with a kDeviceTimeout recorded, if some rank did not arrive in time.
MEGAMOE_DEVICE bool rank_barrier(const SymmView& view, const BufferLayout& layout) {
  __syncthreads();
  bool arrived = true;
  if (linear_thread() == 0) {
    ControlBlock* control = layout.control_block(view.local());
    // Only this thread touches barrier_epoch; relaxed device-scope access keeps it out of stale caches.
    const uint64_t epoch = GpuRef<uint64_t>(control->barrier_epoch).load(cuda::memory_order_relaxed) + 1;
    GpuRef<uint64_t>(control->barrier_epoch).store(epoch, cuda::memory_order_relaxed);
    for (int32_t peer = 0; peer < view.num_ranks; ++peer) {
      st_release_ranks(view, &view.map(control, peer)->barrier_arrivals[view.rank], epoch);
    }
    for (int32_t peer = 0; peer < view.num_ranks && arrived; ++peer) {
      arrived = wait_at_least_ranks(view, control, &control->barrier_arrivals[peer], epoch, kWaitRankBarrier,
                                  static_cast<uint32_t>(peer));
    }
  }
  return __syncthreads_and(arrived) != 0;
}

// Every thread of every block of a grid calls it once, at the block's end: true in the block that
// finishes last, whose later reads then see every other block's earlier writes (device scope; a
// caller whose writes go further fences them first). The count returns to zero for the next grid.
MEGAMOE_DEVICE bool last_block_to_finish(ControlBlock* control) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (linear_thread() == 0) {
    GpuRef<uint32_t> finished(control->finished_blocks);
    last = finished.fetch_add(1, cuda::memory_order_acq_rel) == gridDim.x * gridDim.y * gridDim.z - 1;
    if (last) finished.store(0, cuda::memory_order_relaxed);
  }
  __syncthreads();
  return last;
}

// Barrier across all blocks of this rank's grid, which must all be resident at once (launch at most
// one block per multiprocessor of the rank's sm_budget, or fewer). Every thread of every block calls
// it. Writes made before it by any block are visible to every block after it. Returns false, with a
// kDeviceTimeout recorded, if some block did not arrive in time.
MEGAMOE_DEVICE bool grid_barrier(const SymmView& view, const BufferLayout& layout) {
  __syncthreads();
  bool passed = true;
  if (linear_thread() == 0) {
    ControlBlock* control = layout.control_block(view.local());
    GpuRef<uint32_t> count(control->grid_barrier_count);
    GpuRef<uint32_t> generation(control->grid_barrier_generation);
    const uint32_t blocks = gridDim.x * gridDim.y * gridDim.z;
    // The generation cannot move before this block arrives, so reading it first is safe.
    const uint32_t current = generation.load(cuda::memory_order_acquire);
    if (count.fetch_add(1, cuda::memory_order_acq_rel) + 1 == blocks) {
      count.store(0, cuda::memory_order_relaxed);
      generation.store(current + 1, cuda::memory_order_release);
    } else {
      const WaitSiteInfo info{kWaitGridBarrier, static_cast<uint32_t>(view.rank), uint64_t{current} + 1};
      passed = spin_wait(view, control, info, [&](uint64_t& seen) {
        const uint32_t value = generation.load(cuda::memory_order_acquire);
        seen = value;
        return value != current;
      });
    }
  }
  return __syncthreads_and(passed) != 0;
}

}  // namespace megamoe::device
