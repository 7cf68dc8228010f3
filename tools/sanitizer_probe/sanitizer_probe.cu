// Twelve hand-overs of shared memory, each as the layer's kernels do it, each checking what it read:
//   named_barrier: a writer warp stages words and arrives (bar.arrive), a reader warp syncs on the
//                  same named barrier and reads them; a second barrier hands the buffer back
//                  (the L2 epilogue's store warps, epilogue.cuh);
//   mbarrier_slot: a producer thread writes a slot and arrives on an mbarrier, a consumer waits for
//                  the phase, reads the slot and arrives on a second one before the slot is written
//                  again (the unit slot of the stage ring, mainloop.cuh: next_unit);
//   mbarrier_warp: as mbarrier_slot, but every lane of the consumer warp reads the slot and lane 0
//                  arrives after __syncwarp (how the math warps release a stage: release_stage_at);
//   group_flag:    thread 0 writes a word between two bar.sync of the threads that read it (the
//                  fused kernel's combine loop, scheduler.cuh: group_flag), with a third warp of
//                  the block outside the named barrier, as the fused kernel's other roles are;
//   claim_loop:    group_flag's word also holding the next claimed unit, three barriers per
//                  unit (the fused kernel's combine loop, math.cuh: math_fused); at
//                  9b65a85 racecheck reported the kernel's loop but not this one;
//   claim_polled:  the same with the flag computed as the kernel does, by a polling loop of thread
//                  0 alone (rank_wait), the rest of its warp at the barrier (not reported either);
//   claim_staggered: claim_loop after the prefill GEMMs' stagger, one warp arriving (bar.arrive) on
//                  another named barrier that the other warp syncs on (pipeline.cuh: stagger_arrive):
//                  racecheck reports the kernel's loop only in the prefill configs, which stagger
//                  (not reported at 3783791: the stagger alone does not explain it);
//   bulk_copy:     one thread's cp.async.bulk fills shared memory and completes an mbarrier's
//                  transaction count; two warps wait for the phase and read it (the converters'
//                  read of TMA-loaded weights, mainloop.cuh: expand_weight_tile);
//   bulk_copy_hint: as bulk_copy, the readers waiting with a suspend-time hint as fp8_fp4's
//                  converters do (GemmConfig::kWaitSuspendNs): racecheck reported their reads of
//                  the bulk-copied shifts at a162dea, and not the decode math warps' (no hint);
//   bulk_copy_ring: fp8_fp4's prefill stage ring, round after round in one buffer: thread 0
//                  bulk-copies it (raw_full), every lane of a converter warp reads it and lane 0
//                  arrives on full after __syncwarp, a math warp waits for full and releases empty
//                  the same way, and only then does thread 0 copy into the buffer again. Every
//                  other round copies half the buffer, and the converter also reads the half an
//                  earlier round wrote (a partial last tile's rows read an earlier stage's shifts).
//                  So the converter's reads are ordered before the next copy only through the
//                  math warp's barrier: the two-hop chain of the unexplained report.
//   bulk_then_write: thread 0 bulk-copies into a buffer and waits for it, then arrives on an
//                  mbarrier; a second warp waits for that and writes the buffer with generic stores
//                  (the fused kernel's bulk pulls bounce rows through the ring's stages, where the
//                  fp8_fp4 converters later write expanded weights: producer.cuh run_pull,
//                  mainloop.cuh expand_weight_tile); the writes must not be overwritten by the copy;
//   handed_ring:   one thread hands entries to another through a shared-memory ring, volatile
//                  counts and __threadfence_block, no barrier (the fused kernel's handed tile-done
//                  counts, tile_done.cuh: hand_over_tile_done, make_handed_counts, finish_counts):
//                  the taker claims the ring with atomicCAS on a mode word, the giver counts an entry
//                  itself when the mode is not handed or the ring is full, then says it has finished;
//                  each entry must be counted exactly once.
// Each runs in one block of three warps (the third idle, as the layer's kernels have roles outside
// each barrier, except in bulk_copy_ring). Usage: compute-sanitizer --tool racecheck megamoe_sanitizer_probe
#include <cuda/atomic>
#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr uint32_t kRounds = 8;

__global__ void named_barrier(uint32_t* out) {
  __shared__ uint32_t words[32];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp > 1) return;  // the third warp: not in the named barriers' 64 threads
  if (warp == 0) asm volatile("bar.arrive 2, 64;" ::: "memory");  // the buffer starts free
  for (uint32_t round = 0; round < kRounds; ++round) {
    if (warp == 0) {
      asm volatile("bar.sync 2, 64;" ::: "memory");
      words[lane] = round * 32 + lane;
      asm volatile("bar.arrive 1, 64;" ::: "memory");
    } else {
      asm volatile("bar.sync 1, 64;" ::: "memory");
      out[round * 32 + lane] = words[lane];
      asm volatile("bar.arrive 2, 64;" ::: "memory");
    }
  }
  if (warp == 0) asm volatile("bar.sync 2, 64;" ::: "memory");
}

template <bool kSuspendHint = false>
__device__ void wait_phase(uint64_t* barrier, uint32_t parity) {
  const uint32_t suspend_ns = 20000;
  while (!(kSuspendHint ? cuda::ptx::mbarrier_try_wait_parity(barrier, parity, suspend_ns)
                        : cuda::ptx::mbarrier_try_wait_parity(barrier, parity))) {
  }
}

// kWarpWide: every lane of the consumer warp reads the slot and lane 0 arrives after __syncwarp;
// else one consumer thread does both.
template <bool kWarpWide>
__global__ void mbarrier_slot(uint32_t* out) {
  __shared__ uint64_t ready, empty;
  __shared__ uint32_t slot;
  if (threadIdx.x == 0) {
    cuda::ptx::mbarrier_init(&ready, 1);
    cuda::ptx::mbarrier_init(&empty, 1);
  }
  __syncthreads();
  const bool consumer = kWarpWide ? threadIdx.x / 32 == 1 : threadIdx.x == 32;
  for (uint32_t round = 0; round < kRounds; ++round) {
    const uint32_t parity = round & 1;
    if (threadIdx.x == 0) {
      if (round > 0) wait_phase(&empty, parity ^ 1);
      slot = 100 + round;
      cuda::ptx::mbarrier_arrive(&ready);
    } else if (consumer) {
      wait_phase(&ready, parity);
      const uint32_t value = slot;
      if (threadIdx.x == 32 + 31 * kWarpWide) out[round] = value;
      if (kWarpWide) __syncwarp();
      if (threadIdx.x == 32) cuda::ptx::mbarrier_arrive(&empty);
    }
  }
}

__global__ void group_flag(uint32_t* out) {
  __shared__ uint32_t flag;
  if (threadIdx.x >= 64) return;  // the third warp: not in barrier 1's 64 threads
  for (uint32_t round = 0; round < kRounds; ++round) {
    if (threadIdx.x == 0) flag = 200 + round;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    const uint32_t value = flag;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if (threadIdx.x == 63) out[round] = value;
  }
}

// The fused kernel's combine loop (math.cuh: math_fused): one shared word is both the
// group flag and the next claimed unit. Per unit: thread 0 writes the flag, barrier, all read it,
// barrier, the unit's work, barrier, thread 0 writes the claim, barrier, all read it, barrier.
// kPolledFlag: thread 0 computes the flag as the kernel does (rank_wait): polling a global word with
// system-scope acquire loads and a timer, while the rest of its warp waits at the barrier.
// kStaggered: first the prefill GEMMs' stagger on barrier 4 (one warp arrives, the other syncs).
template <bool kPolledFlag, bool kStaggered = false>
__global__ void claim_loop(uint32_t* out) {
  __shared__ uint32_t word;
  if (threadIdx.x < 32) return;  // the first warp: outside barrier 1's 64 threads
  const uint32_t thread = threadIdx.x - 32;
  if (kStaggered) {
    if (thread < 32) asm volatile("bar.arrive 4, 64;" ::: "memory");
    else asm volatile("bar.sync 4, 64;" ::: "memory");
  }
  uint32_t* claims = out + kRounds;      // zeroed by check()
  uint32_t* arrivals = out + kRounds + 1;  // the polled word: already at its target
  if (thread == 0) *arrivals = kRounds;
  for (uint32_t index = 0; index < kRounds;) {
    if (thread == 0) {
      bool arrived = true;
      if (kPolledFlag) {
        const uint64_t start = cuda::ptx::get_sreg_globaltimer();
        cuda::atomic_ref<uint32_t, cuda::thread_scope_system> polled(*arrivals);
        while (polled.load(cuda::memory_order_acquire) < index + 1)
          if (cuda::ptx::get_sreg_globaltimer() - start > 1000000000ull) {
            arrived = false;
            break;
          }
      }
      word = arrived ? 1 : 0;
    }
    asm volatile("bar.sync 1, 64;" ::: "memory");
    const bool go = word != 0;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if (!go) break;
    if (thread == 63) out[index] = 300 + index;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if (thread == 0) word = atomicAdd(claims, 1u) + 1;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    index = word;
    asm volatile("bar.sync 1, 64;" ::: "memory");
  }
}

template <bool kSuspendHint>
__global__ void bulk_copy(uint32_t* out) {
  __shared__ __align__(128) uint32_t landed[128];
  __shared__ uint64_t full;
  const bool reader = threadIdx.x < 64;
  if (reader)
    for (uint32_t i = threadIdx.x; i < 128; i += 64) out[i] = 400 + i;
  if (threadIdx.x == 0) {
    cuda::ptx::mbarrier_init(&full, 1);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The other threads' generic writes of the source, then the async proxy's read of it.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, &full,
                                         512u);
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, landed, out, 512u, &full);
  }
  if (reader) {
    wait_phase<kSuspendHint>(&full, 0);
    for (uint32_t i = threadIdx.x; i < 128; i += 64) out[128 + i] = landed[i];
  }
}

__global__ void bulk_then_write(uint32_t* out) {
  __shared__ __align__(128) uint32_t area[128];
  __shared__ uint64_t loaded, handed;
  uint32_t* source = out + 128;
  for (uint32_t i = threadIdx.x; i < 128; i += blockDim.x) source[i] = 9000 + i;
  if (threadIdx.x == 0) {
    cuda::ptx::mbarrier_init(&loaded, 1);
    cuda::ptx::mbarrier_init(&handed, 1);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the producer: a pull's bounce copy, then a later stage hand-over
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         &loaded, 512u);
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, area, source, 512u, &loaded);
    wait_phase(&loaded, 0);
    cuda::ptx::mbarrier_arrive(&handed);
  } else if (threadIdx.x / 32 == 1) {  // a converter warp
    const uint32_t lane = threadIdx.x % 32;
    wait_phase(&handed, 0);
    for (uint32_t i = lane; i < 128; i += 32) area[i] = 600 + i;
    __syncwarp();
    for (uint32_t i = lane; i < 128; i += 32) out[i] = area[i];
  }
}

// handed_ring: the entries handed or counted, and the ring's slots (few, so that it wraps and fills).
constexpr uint32_t kHandedEntries = 256, kHandedSlots = 4;
enum : uint32_t { kOwn = 0, kHanded = 1, kFinished = 2 };

__global__ void handed_ring(uint32_t* out) {
  __shared__ uint32_t mode, written, made, ring[kHandedSlots];
  if (threadIdx.x == 0) mode = written = made = 0;
  __syncthreads();
  volatile uint32_t* const v_mode = &mode;
  volatile uint32_t* const v_written = &written;
  volatile uint32_t* const v_made = &made;
  // Spins are bounded: a lost entry shows as a wrong count, never as a hang.
  constexpr uint32_t kMaxPolls = 1u << 24;
  if (threadIdx.x == 0) {  // the giver (a math warpgroup's thread 0)
    for (uint32_t i = 0; i < kHandedEntries; ++i) {
      // Halfway, the giver waits for the taker's claim (bounded), so that both paths run.
      if (i == kHandedEntries / 2) {
        for (uint32_t polls = 0; *v_mode == kOwn && polls < kMaxPolls; ++polls) {
        }
      }
      const uint32_t entry = 500 + i;
      const uint32_t w = written;
      if (*v_mode == kHanded && w - *v_made < kHandedSlots) {
        __threadfence_block();  // the count of entries made before the slot's new entry
        ring[w % kHandedSlots] = entry;
        __threadfence_block();  // the entry before the count of entries written
        *v_written = w + 1;
      } else {
        atomicAdd(&out[i], entry);
      }
    }
    __threadfence_block();  // after the entries written
    *v_mode = kFinished;
  } else if (threadIdx.x == 32) {  // the taker (lane 0 of a dispatch warp)
    if (atomicCAS(&mode, kOwn, kHanded) != kOwn) return;
    uint32_t taken = 0;
    for (uint32_t polls = 0; polls < kMaxPolls; ++polls) {
      const bool finished = *v_mode == kFinished;
      __threadfence_block();
      if (taken != *v_written) {
        __threadfence_block();  // the entry after its count of entries written
        const uint32_t entry = ring[taken % kHandedSlots];
        __threadfence_block();  // the entry read before its slot is freed
        *v_made = ++taken;
        if (entry >= 500 && entry < 500 + kHandedEntries) atomicAdd(&out[entry - 500], entry);
        else atomicAdd(&out[kHandedEntries], 1u);  // a word never written as an entry
        continue;
      }
      if (finished) break;
    }
  }
}

// bulk_copy_ring's buffer, in words.
constexpr uint32_t kRingWords = 128;

__global__ void bulk_copy_ring(uint32_t* out) {
  constexpr uint32_t kWords = kRingWords;
  __shared__ __align__(128) uint32_t landed[kWords];
  __shared__ uint64_t raw_full, full, empty;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Source words: round r's copy reads words [r * kWords, (r + 1) * kWords) of the global staging area.
  uint32_t* source = out + kRounds * kWords;
  for (uint32_t i = threadIdx.x; i < kRounds * kWords; i += blockDim.x) source[i] = 1000 * (i / kWords) + i % kWords;
  if (threadIdx.x == 0) {
    cuda::ptx::mbarrier_init(&raw_full, 1);
    cuda::ptx::mbarrier_init(&full, 1);
    cuda::ptx::mbarrier_init(&empty, 1);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  for (uint32_t round = 0; round < kRounds; ++round) {
    const uint32_t parity = round & 1;
    // Odd rounds copy the first half only; the second half keeps the round before's words.
    const uint32_t bytes = (round % 2 == 1 ? kWords / 2 : kWords) * 4;
    if (threadIdx.x == 0) {
      if (round > 0) wait_phase(&empty, parity ^ 1);
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &raw_full, bytes);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, landed, source + round * kWords,
                               bytes, &raw_full);
    } else if (warp == 1) {  // the converter warp
      wait_phase<true>(&raw_full, parity);
      for (uint32_t i = lane; i < kWords; i += 32) out[round * kWords + i] = landed[i];
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(&full);
    } else if (warp == 2) {  // the math warp
      wait_phase(&full, parity);
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(&empty);
    }
  }
}

// Word i of bulk_copy_ring's output: round i / kRingWords's read of word i % kRingWords.
uint32_t ring_word(uint32_t i) {
  const uint32_t round = i / kRingWords, word = i % kRingWords;
  const uint32_t written_in = round % 2 == 1 && word >= kRingWords / 2 ? round - 1 : round;
  return 1000 * written_in + word;
}

bool check(const char* name, void (*kernel)(uint32_t*), uint32_t words, uint32_t (*expected)(uint32_t)) {
  uint32_t* out = nullptr;
  uint32_t host[2 * kRounds * kRingWords] = {};  // bulk_copy_ring's output and its source
  bool ok = cudaMalloc(&out, sizeof(host)) == cudaSuccess && cudaMemset(out, 0, sizeof(host)) == cudaSuccess;
  if (ok) {
    kernel<<<1, 96>>>(out);
    ok = cudaDeviceSynchronize() == cudaSuccess && cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  for (uint32_t i = 0; ok && i < words; ++i) ok = host[i] == expected(i);
  cudaFree(out);
  std::printf("%-14s %s\n", name, ok ? "ok" : "WRONG");
  return ok;
}

}  // namespace

int main() {
  bool ok = check("named_barrier", named_barrier, kRounds * 32, [](uint32_t i) { return i; });
  ok = check("mbarrier_slot", mbarrier_slot<false>, kRounds, [](uint32_t i) { return 100 + i; }) && ok;
  ok = check("mbarrier_warp", mbarrier_slot<true>, kRounds, [](uint32_t i) { return 100 + i; }) && ok;
  ok = check("group_flag", group_flag, kRounds, [](uint32_t i) { return 200 + i; }) && ok;
  ok = check("claim_loop", claim_loop<false>, kRounds, [](uint32_t i) { return 300 + i; }) && ok;
  ok = check("claim_polled", claim_loop<true>, kRounds, [](uint32_t i) { return 300 + i; }) && ok;
  ok = check("claim_staggered", claim_loop<false, true>, kRounds, [](uint32_t i) { return 300 + i; }) && ok;
  ok = check("bulk_copy", bulk_copy<false>, 256, [](uint32_t i) { return 400 + i % 128; }) && ok;
  ok = check("bulk_copy_hint", bulk_copy<true>, 256, [](uint32_t i) { return 400 + i % 128; }) && ok;
  ok = check("bulk_copy_ring", bulk_copy_ring, kRounds * kRingWords, ring_word) && ok;
  ok = check("bulk_then_write", bulk_then_write, 128, [](uint32_t i) { return 600 + i; }) && ok;
  // Word kHandedEntries counts entries read that were never written: 0.
  ok = check("handed_ring", handed_ring, kHandedEntries + 1,
             [](uint32_t i) { return i < kHandedEntries ? 500 + i : 0u; }) && ok;
  return ok ? 0 : 1;
}
