// How busy a K loop's shape alone can keep the tensor pipe: each variant runs one CTA per SM whose
// math warpgroups loop over K blocks of operands that stay in shared memory (no TMA, no stage barriers,
// no epilogue), so what it measures is the wgmma groups, their waits and the promotion FFMAs between
// them. It bounds the fp8 prefill mainloop by its structure (issue 30, docs/gemm.md): our tile's two
// drained n128 halves per K block, the public kernel's one n192 group, and two partial sums per
// warpgroup, against the same tile without the promotion and the plain (unscaled) loop; and the
// warpgroups staggered, in step, or taking turns at the tensor cores.
//   megamoe_mainloop_probe [--k-blocks N] [--rounds R] [--json FILE]
// A CTA's cycles are its slowest warp's (clock64). Each loop's rate, in multiply-adds per cycle and
// SM, is given against the plain loop's in the same round three ways: for the median CTA, for the
// slowest CTA, and per unit of time (which also feels the clock the board ran at). Hopper's dense
// FP8 rate is 4096 per cycle per SM. "slow CTAs" counts those over 1.1x the fastest CTA's cycles.
#include <cuda/ptx>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace {

using megamoe::ptx::SmemDescSw128;
using Mma128 = megamoe::ptx::WgmmaFp8<128>;
using Mma64 = megamoe::ptx::WgmmaFp8<64>;
using Mma192 = megamoe::ptx::WgmmaFp8<192>;

enum class Loop {
  plain,             // 128 x 256 tile, no promotion: each K block's eight wgmmas one group, one group in flight
  halves,            // 128 x 256, ours: two n128 groups per K block, each waited for and promoted (64 FFMAs)
  halves_unscaled,   // the same groups and waits without the FFMAs
  halves_32_ffmas,   // the same with half the FFMAs (a diagnostic: only half of each partial sum promoted)
  halves_in_step,    // halves with both warpgroups starting together (no stagger)
  halves_turns_at_issue,       // halves_in_step, each group issued on the warpgroup's turn, passed once issued
  halves_turns_at_half,        // ... passed once the group's first two wgmmas have completed
  halves_turns_at_completion,  // ... passed once the group has completed
  single_n192,       // 128 x 192, one n192 group per K block, waited for, 96 FFMAs
  single_n192_staggered,  // the same, warpgroup 1 starting once warpgroup 0's first group has completed
  single_n192_turns_at_issue,       // single_n192 with turns as the halves_turns loops
  single_n192_turns_at_half,
  single_n192_turns_at_completion,
  two_partials,      // 64 x 256, warpgroup w on weight half w: K block kb's group issued before kb - 1's promotion
  quarters,          // 128 x 256 in n64 groups, two 32-register partial sums: group q + 1 issued before q's promotion
};

constexpr const char* loop_name(Loop loop) {
  switch (loop) {
    case Loop::plain: return "plain";
    case Loop::halves: return "halves";
    case Loop::halves_unscaled: return "halves_unscaled";
    case Loop::halves_32_ffmas: return "halves_32_ffmas";
    case Loop::halves_in_step: return "halves_in_step";
    case Loop::halves_turns_at_issue: return "halves_turns_at_issue";
    case Loop::halves_turns_at_half: return "halves_turns_at_half";
    case Loop::halves_turns_at_completion: return "halves_turns_at_completion";
    case Loop::single_n192: return "single_n192";
    case Loop::single_n192_staggered: return "single_n192_staggered";
    case Loop::single_n192_turns_at_issue: return "single_n192_turns_at_issue";
    case Loop::single_n192_turns_at_half: return "single_n192_turns_at_half";
    case Loop::single_n192_turns_at_completion: return "single_n192_turns_at_completion";
    case Loop::two_partials: return "two_partials";
    case Loop::quarters: return "quarters";
  }
  return "?";
}

// Where a warpgroup passes the tensor cores to the other (turn_wait/turn_pass): the in-step loops'
// CTAs settle either with one warpgroup's drain and promotion beside the other's group or with both
// at once (their median and slowest CTAs, stop 94); turns are a way to hold every CTA in the first.
// (Measured at stop 95: one phase on every CTA, but slower than the in-step fast one; not in the GEMM.)
enum class Turns { none, at_issue, at_half, at_completion };

// Warpgroup w waits for its turn on named barrier 10 + w, then passes the other its turn; the other's
// wait must consume a pass before w passes again (a named barrier counts arrivals, not passes), which
// strict alternation ensures.
__device__ __forceinline__ void turn_wait(uint32_t warpgroup) {
  asm volatile("bar.sync %0, 256;" ::"r"(10 + warpgroup) : "memory");
}
__device__ __forceinline__ void turn_pass(uint32_t warpgroup) {
  asm volatile("bar.arrive %0, 256;" ::"r"(11 - warpgroup) : "memory");
}
constexpr Turns turns_of(Loop loop) {
  switch (loop) {
    case Loop::halves_turns_at_issue:
    case Loop::single_n192_turns_at_issue: return Turns::at_issue;
    case Loop::halves_turns_at_half:
    case Loop::single_n192_turns_at_half: return Turns::at_half;
    case Loop::halves_turns_at_completion:
    case Loop::single_n192_turns_at_completion: return Turns::at_completion;
    default: return Turns::none;
  }
}
constexpr bool is_halves(Loop loop) {
  return loop == Loop::halves || loop == Loop::halves_unscaled || loop == Loop::halves_32_ffmas ||
         loop == Loop::halves_in_step || loop == Loop::halves_turns_at_issue || loop == Loop::halves_turns_at_half ||
         loop == Loop::halves_turns_at_completion;
}
constexpr bool is_n192(Loop loop) {
  return loop == Loop::single_n192 || loop == Loop::single_n192_staggered || loop == Loop::single_n192_turns_at_issue ||
         loop == Loop::single_n192_turns_at_half || loop == Loop::single_n192_turns_at_completion;
}

struct Shape {
  uint32_t tokens, weight_rows;
};
constexpr Shape tile_shape(Loop loop) {
  if (is_n192(loop)) return {128, 192};
  return loop == Loop::two_partials ? Shape{64, 256} : Shape{128, 256};
}

constexpr uint32_t kRowBytes = 128;             // one K block of E4M3 per row, 128-byte swizzle
constexpr uint32_t kTokenBytes = 128 * kRowBytes;
constexpr uint32_t kWeightBytes = 256 * kRowBytes;
constexpr uint32_t kScaleSlots = 8;              // scales cycle through 8 K blocks: none can be hoisted
constexpr uint32_t kSmemBytes = 1024 + kTokenBytes + kWeightBytes + kScaleSlots * 16 * 4 + kScaleSlots * 128 * 4;
constexpr uint32_t kThreads = 256;               // two math warpgroups

struct Smem {
  uint32_t tokens, weights;        // shared-window addresses, 1024-aligned
  const float4* weight_scales;     // [slot]: the K block's four 64-row weight-block scales
  const float* act_scales;         // [slot][128 tokens]
};

// wgmmas [begin, end) of one K block's four (32 bytes of K each) into d (Mma: its n); with accumulate
// false the first of a block starts d from zero.
template <class Mma, uint32_t kRegs>
__device__ __forceinline__ void issue_wgmmas(uint32_t tokens, uint32_t weights, float (&d)[kRegs], uint32_t begin,
                                             uint32_t end, bool accumulate) {
#pragma unroll
  for (uint32_t kk = begin; kk < end; ++kk)
    Mma::mma(SmemDescSw128::at(tokens).plus(32 * kk).value(), SmemDescSw128::at(weights).plus(32 * kk).value(), d,
             accumulate || kk > 0);
}

// One K block's four wgmmas into d, from zero, committed as one group.
template <class Mma, uint32_t kRegs>
__device__ __forceinline__ void issue_group(uint32_t tokens, uint32_t weights, float (&d)[kRegs]) {
  megamoe::ptx::fence_registers(d);
  megamoe::ptx::wgmma_fence();
  issue_wgmmas<Mma>(tokens, weights, d, 0, 4, false);
  megamoe::ptx::wgmma_commit();
}

// One K block's group into d, issued on the warpgroup's turn and waited for; the turn passes where
// kTurns says (at_half: the group committed as two, its first two wgmmas and the rest). Warpgroup 0
// takes the first turn; warpgroup 1 skips its last pass, which no wait would consume.
template <class Mma, Turns kTurns, uint32_t kRegs>
__device__ __forceinline__ void group_on_turn(uint32_t tokens, uint32_t weights, float (&d)[kRegs], uint32_t warpgroup,
                                              bool first, bool last) {
  constexpr bool kTakesTurns = kTurns != Turns::none;
  if (kTakesTurns && !(first && warpgroup == 0)) turn_wait(warpgroup);
  const bool passes = kTakesTurns && !(last && warpgroup == 1);
  if constexpr (kTurns == Turns::at_half) {
    megamoe::ptx::fence_registers(d);
    megamoe::ptx::wgmma_fence();
    issue_wgmmas<Mma>(tokens, weights, d, 0, 2, false);
    megamoe::ptx::wgmma_commit();
    issue_wgmmas<Mma>(tokens, weights, d, 2, 4, true);
    megamoe::ptx::wgmma_commit();
  } else {
    issue_group<Mma>(tokens, weights, d);
  }
  if (kTurns == Turns::at_issue && passes) turn_pass(warpgroup);
  if constexpr (kTurns == Turns::at_half) {
    megamoe::ptx::wgmma_wait<1>();
    if (passes) turn_pass(warpgroup);
  }
  megamoe::ptx::wgmma_wait<0>();
  if (kTurns == Turns::at_completion && passes) turn_pass(warpgroup);
}

// acc += partial x (act_scale[row] x weight_scale[64-row block]), registers laid out as wgmma's
// accumulator (register i: column 8 (i / 4) + ..., rows r and r + 8 for i % 4 < 2 and >= 2).
template <uint32_t kRegs>
__device__ __forceinline__ void promote(float* acc, float (&partial)[kRegs], const float (&act)[2], const float* blocks) {
  megamoe::ptx::fence_registers(partial);
#pragma unroll
  for (uint32_t i = 0; i < kRegs; ++i) acc[i] += partial[i] * (act[(i % 4) / 2] * blocks[i / 32]);
}

__device__ __forceinline__ void scales_of(const Smem& smem, uint32_t kb, uint32_t token, float (&act)[2],
                                          float (&blocks)[4]) {
  const uint32_t slot = kb % kScaleSlots;
  act[0] = smem.act_scales[slot * 128 + token];
  act[1] = smem.act_scales[slot * 128 + token + 8];
  const float4 b = smem.weight_scales[slot];
  blocks[0] = b.x, blocks[1] = b.y, blocks[2] = b.z, blocks[3] = b.w;
}

template <Loop kLoop>
__global__ void __launch_bounds__(kThreads, 1) probe_kernel(uint32_t k_blocks, unsigned long long* cycles, float* sink) {
  extern __shared__ uint8_t raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  // Operands: E4M3 bytes without the NaN codes, the same every K block (their values do not matter here).
  for (uint32_t i = threadIdx.x; i < (kTokenBytes + kWeightBytes) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(base)[i] = (i * 2654435761u) & 0x77777777u;
  float* scale_area = reinterpret_cast<float*>(base + kTokenBytes + kWeightBytes);
  for (uint32_t i = threadIdx.x; i < kScaleSlots * (16 + 128); i += blockDim.x) scale_area[i] = 1.0f + 1e-3f * (i % 7);
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // generic writes, read by wgmma
  __syncthreads();

  const Smem smem{static_cast<uint32_t>(__cvta_generic_to_shared(base)),
                  static_cast<uint32_t>(__cvta_generic_to_shared(base + kTokenBytes)),
                  reinterpret_cast<const float4*>(scale_area), scale_area + kScaleSlots * 16};
  const uint32_t warpgroup = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const uint32_t token = 16 * warp + lane / 4;  // this thread's first accumulator row within its m64 block
  constexpr uint32_t kHalfBytes = 128 * kRowBytes;
  float act[2], blocks[4];
  float checksum = 0.0f;

  const unsigned long long start = clock64();
  if constexpr (kLoop == Loop::plain) {
    float acc[2][64] = {};
    const uint32_t tokens = smem.tokens + 64 * warpgroup * kRowBytes;
    for (uint32_t kb = 0; kb < k_blocks; ++kb) {
      megamoe::ptx::fence_registers(acc[0]);
      megamoe::ptx::fence_registers(acc[1]);
      megamoe::ptx::wgmma_fence();
      issue_wgmmas<Mma128>(tokens, smem.weights, acc[0], 0, 4, kb > 0);
      issue_wgmmas<Mma128>(tokens, smem.weights + kHalfBytes, acc[1], 0, 4, kb > 0);
      megamoe::ptx::wgmma_commit();
      megamoe::ptx::wgmma_wait<1>();
    }
    megamoe::ptx::wgmma_wait<0>();
    megamoe::ptx::fence_registers(acc[0]);
    megamoe::ptx::fence_registers(acc[1]);
    for (uint32_t i = 0; i < 64; ++i) checksum += acc[0][i] + acc[1][i];
  } else if constexpr (is_halves(kLoop)) {
    // Warpgroup 1 starts once warpgroup 0's first half has completed, as the kernels' stagger does
    // (not in halves_in_step and the turns loops).
    float acc[2][64] = {};
    float partial[64];
    const uint32_t tokens = smem.tokens + 64 * warpgroup * kRowBytes;
    constexpr bool kStaggered = kLoop == Loop::halves || kLoop == Loop::halves_unscaled || kLoop == Loop::halves_32_ffmas;
    if (kStaggered && warpgroup == 1) megamoe::gemm::stagger_wait();
    for (uint32_t kb = 0; kb < k_blocks; ++kb) {
      scales_of(smem, kb, 64 * warpgroup + token, act, blocks);
#pragma unroll
      for (uint32_t h = 0; h < 2; ++h) {
        group_on_turn<Mma128, turns_of(kLoop)>(tokens, smem.weights + h * kHalfBytes, partial, warpgroup,
                                               kb == 0 && h == 0, kb == k_blocks - 1 && h == 1);
        if (kStaggered && warpgroup == 0 && kb == 0 && h == 0) megamoe::gemm::stagger_arrive();
        if constexpr (kLoop != Loop::halves_unscaled && kLoop != Loop::halves_32_ffmas)
          promote(acc[h], partial, act, blocks + 2 * h);
        else if constexpr (kLoop == Loop::halves_32_ffmas)
          promote(acc[h], reinterpret_cast<float(&)[32]>(partial), act, blocks + 2 * h);
        else
          checksum += partial[0];  // one read keeps ptxas from dropping the group (its result is otherwise dead)
      }
    }
    for (uint32_t i = 0; i < 64; ++i) checksum += acc[0][i] + acc[1][i] + partial[i];
  } else if constexpr (is_n192(kLoop)) {
    // DeepGEMM's structure: one group per K block, one wait, 96 FFMAs; its warpgroups consume each
    // stage together, which leaves them in step only as far as the stages' arrivals hold them.
    constexpr bool kStaggered = kLoop == Loop::single_n192_staggered;
    float acc[96] = {};
    float partial[96];
    const uint32_t tokens = smem.tokens + 64 * warpgroup * kRowBytes;
    if (kStaggered && warpgroup == 1) megamoe::gemm::stagger_wait();
    for (uint32_t kb = 0; kb < k_blocks; ++kb) {
      scales_of(smem, kb, 64 * warpgroup + token, act, blocks);
      group_on_turn<Mma192, turns_of(kLoop)>(tokens, smem.weights, partial, warpgroup, kb == 0, kb == k_blocks - 1);
      if (kStaggered && warpgroup == 0 && kb == 0) megamoe::gemm::stagger_arrive();
      promote(acc, partial, act, blocks);
    }
    for (uint32_t i = 0; i < 96; ++i) checksum += acc[i];
  } else if constexpr (kLoop == Loop::quarters) {
    // The same registers as `halves` (128 results, 64 partial), as two partial sums of n64 groups: each
    // quarter's promotion runs beside the next quarter's wgmmas; the last one's is exposed.
    float acc[4][32] = {};
    float partial[2][32];
    const uint32_t tokens = smem.tokens + 64 * warpgroup * kRowBytes;
    const auto issue = [&](float (&into)[32], uint32_t quarter) {
      issue_group<Mma64>(tokens, smem.weights + quarter * 64 * kRowBytes, into);
    };
    if (warpgroup == 1) megamoe::gemm::stagger_wait();
    for (uint32_t kb = 0; kb < k_blocks; ++kb) {
      scales_of(smem, kb, 64 * warpgroup + token, act, blocks);
      issue(partial[0], 0);
      megamoe::ptx::wgmma_wait<0>();
      if (warpgroup == 0 && kb == 0) megamoe::gemm::stagger_arrive();
#pragma unroll
      for (uint32_t q = 1; q < 4; ++q) {
        issue(partial[q % 2], q);
        promote(acc[q - 1], partial[(q - 1) % 2], act, blocks + q - 1);
        megamoe::ptx::wgmma_wait<0>();
      }
      promote(acc[3], partial[1], act, blocks + 3);
    }
    for (uint32_t i = 0; i < 32; ++i) checksum += acc[0][i] + acc[1][i] + acc[2][i] + acc[3][i];
  } else {
    // Two partial sums: K block kb's group is issued before K block kb - 1's, in the other partial sum,
    // is promoted, so the FFMAs run beside the warpgroup's own wgmmas and a drain is followed at once by
    // the next issue. Each group is waited for before the next pass: ptxas serializes every wgmma
    // (C7514) when a loop's back edge carries a group in flight past reads of another's registers.
    float acc[64] = {};
    float partial[2][64];
    const uint32_t weights = smem.weights + warpgroup * kHalfBytes;
    const auto issue = [&](float (&into)[64]) { issue_group<Mma128>(smem.tokens, weights, into); };
    issue(partial[1]);  // stands for K block -1 (k_blocks is even)
    megamoe::ptx::wgmma_wait<0>();
    for (uint32_t kb = 0; kb < k_blocks; kb += 2) {
      issue(partial[0]);
      scales_of(smem, kb + k_blocks - 1, token, act, blocks);
      promote(acc, partial[1], act, blocks + 2 * warpgroup);
      megamoe::ptx::wgmma_wait<0>();
      issue(partial[1]);
      scales_of(smem, kb, token, act, blocks);
      promote(acc, partial[0], act, blocks + 2 * warpgroup);
      megamoe::ptx::wgmma_wait<0>();
    }
    for (uint32_t i = 0; i < 64; ++i) checksum += acc[i];
  }
  const unsigned long long elapsed = clock64() - start;

  // The CTA's time is its slowest warp's (lane 0 of each records; the host takes the largest).
  if (lane == 0) cycles[blockIdx.x * (kThreads / 32) + threadIdx.x / 32] = elapsed;
  if (checksum == 1.2345f) sink[blockIdx.x] = checksum;  // keeps the loops from being dropped
}

// Per K block: the median CTA's cycles and the slowest CTA's (which ends the kernel). A loop whose
// CTAs settle into different phases shows a median far from the slowest; the SM clock is the
// slowest CTA's cycles over the kernel's time.
struct Result {
  double median_cycles_per_k_block, slowest_cycles_per_k_block, ffma_per_k_block, kernel_us, sm_ghz;
  int slow_ctas;  // CTAs over 1.1x the fastest CTA's cycles: how many settled in a slower phase
};

#define PROBE_CHECK(call)                                                                        \
  do {                                                                                           \
    const cudaError_t status_ = (call);                                                          \
    if (status_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "mainloop_probe: %s: %s\n", #call, cudaGetErrorString(status_));      \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

template <Loop kLoop>
Result run(uint32_t k_blocks, int sms, unsigned long long* cycles, float* sink) {
  PROBE_CHECK(cudaFuncSetAttribute(probe_kernel<kLoop>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  cudaEvent_t begin, end;
  PROBE_CHECK(cudaEventCreate(&begin));
  PROBE_CHECK(cudaEventCreate(&end));
  probe_kernel<kLoop><<<sms, kThreads, kSmemBytes>>>(k_blocks, cycles, sink);  // warm-up
  PROBE_CHECK(cudaEventRecord(begin));
  probe_kernel<kLoop><<<sms, kThreads, kSmemBytes>>>(k_blocks, cycles, sink);
  PROBE_CHECK(cudaEventRecord(end));
  PROBE_CHECK(cudaEventSynchronize(end));
  PROBE_CHECK(cudaGetLastError());
  float ms = 0.0f;
  PROBE_CHECK(cudaEventElapsedTime(&ms, begin, end));
  std::vector<unsigned long long> warp_cycles(static_cast<size_t>(sms) * (kThreads / 32));
  PROBE_CHECK(cudaMemcpy(warp_cycles.data(), cycles, warp_cycles.size() * sizeof(unsigned long long),
                         cudaMemcpyDeviceToHost));
  std::vector<double> cta_cycles(sms);
  for (int cta = 0; cta < sms; ++cta)
    cta_cycles[cta] = static_cast<double>(
        *std::max_element(warp_cycles.begin() + cta * (kThreads / 32), warp_cycles.begin() + (cta + 1) * (kThreads / 32)));
  std::sort(cta_cycles.begin(), cta_cycles.end());
  const double median = cta_cycles[sms / 2], slowest = cta_cycles.back();
  const int slow_ctas = static_cast<int>(
      cta_cycles.end() - std::upper_bound(cta_cycles.begin(), cta_cycles.end(), 1.1 * cta_cycles.front()));
  const Shape shape = tile_shape(kLoop);
  PROBE_CHECK(cudaEventDestroy(begin));
  PROBE_CHECK(cudaEventDestroy(end));
  return {median / k_blocks, slowest / k_blocks, static_cast<double>(shape.tokens) * shape.weight_rows * 128,
          ms * 1e3, slowest / (ms * 1e6), slow_ctas};
}

// Calls f(std::integral_constant<Loop, L>{}) for every loop, in this order.
template <class F>
void for_each_loop(const F& f) {
  const auto each = [&]<Loop... kLoops>() { (f(std::integral_constant<Loop, kLoops>{}), ...); };
  each.template operator()<Loop::plain, Loop::halves, Loop::halves_unscaled, Loop::halves_32_ffmas,
                           Loop::halves_in_step, Loop::halves_turns_at_issue, Loop::halves_turns_at_half,
                           Loop::halves_turns_at_completion, Loop::single_n192, Loop::single_n192_staggered,
                           Loop::single_n192_turns_at_issue, Loop::single_n192_turns_at_half,
                           Loop::single_n192_turns_at_completion, Loop::two_partials, Loop::quarters>();
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t k_blocks = 4096;
  int rounds = 3;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--k-blocks") && has_value) {
      k_blocks = static_cast<uint32_t>(std::strtoul(argv[++i], nullptr, 10));
    } else if (!std::strcmp(argv[i], "--rounds") && has_value) {
      rounds = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--json") && has_value) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: megamoe_mainloop_probe [--k-blocks N] [--rounds R] [--json FILE]\n");
      return 2;
    }
  }
  if (k_blocks < 2 || k_blocks % 2 != 0 || k_blocks > (1u << 24)) {
    std::fprintf(stderr, "mainloop_probe: --k-blocks must be even and in [2, 2^24], got %u\n", k_blocks);
    return 2;
  }
  if (rounds < 1 || rounds > 100) {
    std::fprintf(stderr, "mainloop_probe: --rounds must be in [1, 100], got %d\n", rounds);
    return 2;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) {
    std::fprintf(stderr, "mainloop_probe: no CUDA device\n");
    return 2;
  }
  cudaDeviceProp properties{};
  PROBE_CHECK(cudaGetDeviceProperties(&properties, 0));
  unsigned long long* cycles = nullptr;
  float* sink = nullptr;
  PROBE_CHECK(cudaMalloc(&cycles, static_cast<size_t>(sms) * (kThreads / 32) * sizeof(unsigned long long)));
  PROBE_CHECK(cudaMalloc(&sink, sms * sizeof(float)));

  std::vector<std::string> rows;
  // Of the plain loop: per cycle of the median CTA, per cycle of the slowest, and per unit of time.
  std::printf("%-31s %5s %8s %14s %14s %8s %8s %8s %7s %9s\n", "loop", "round", "tile", "median cyc/K",
              "slowest cyc/K", "median", "slowest", "time", "SM GHz", "slow CTAs");
  for (int round = 0; round < rounds; ++round) {
    // The loops take turns within a round, so that the board's clock and power state fall on all alike.
    double plain_median = 0.0, plain_slowest = 0.0, plain_time = 0.0;  // multiply-adds per cycle or µs
    const auto report = [&](auto loop_constant) {
      constexpr Loop loop = decltype(loop_constant)::value;
      const Result result = run<loop>(k_blocks, sms, cycles, sink);
      const double median_rate = result.ffma_per_k_block / result.median_cycles_per_k_block;
      const double slowest_rate = result.ffma_per_k_block / result.slowest_cycles_per_k_block;
      const double time_rate = result.ffma_per_k_block * k_blocks / result.kernel_us;
      if (loop == Loop::plain) plain_median = median_rate, plain_slowest = slowest_rate, plain_time = time_rate;
      const Shape shape = tile_shape(loop);
      std::printf("%-31s %5d %3ux%-4u %14.1f %14.1f %8.3f %8.3f %8.3f %7.2f %9d\n", loop_name(loop), round,
                  shape.tokens, shape.weight_rows, result.median_cycles_per_k_block, result.slowest_cycles_per_k_block,
                  median_rate / plain_median, slowest_rate / plain_slowest, time_rate / plain_time, result.sm_ghz,
                  result.slow_ctas);
      char row[768];
      std::snprintf(row, sizeof row,
                    "{\"loop\": \"%s\", \"round\": %d, \"tile_tokens\": %u, \"tile_weight_rows\": %u, "
                    "\"k_blocks\": %u, \"cycles_per_k_block\": %.1f, \"slowest_cycles_per_k_block\": %.1f, "
                    "\"ffma_per_cycle_per_sm\": %.1f, \"vs_plain_loop\": %.4f, \"slowest_vs_plain_loop\": %.4f, "
                    "\"time_vs_plain_loop\": %.4f, \"vs_fp8_dense_peak\": %.4f, \"us\": %.1f, \"sm_ghz\": %.3f, "
                    "\"slow_ctas\": %d, \"ctas\": %d}",
                    loop_name(loop), round, shape.tokens, shape.weight_rows, k_blocks,
                    result.median_cycles_per_k_block, result.slowest_cycles_per_k_block, median_rate,
                    median_rate / plain_median, slowest_rate / plain_slowest, time_rate / plain_time,
                    median_rate / 4096.0, result.kernel_us, result.sm_ghz, result.slow_ctas, sms);
      rows.emplace_back(row);
    };
    for_each_loop(report);  // plain first: the others are given against it
  }
  if (!json_path.empty()) {
    FILE* file = std::fopen(json_path.c_str(), "w");
    if (file == nullptr) {
      std::fprintf(stderr, "mainloop_probe: cannot write %s\n", json_path.c_str());
      return 2;
    }
    const char* commit = std::getenv("MEGAMOE_COMMIT");
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::fprintf(file,
                 "{\n  \"benchmark\": \"mainloop_probe\",\n  \"commit\": \"%s\",\n  \"device\": \"%s x 1\",\n"
                 "  \"command\": \"megamoe_mainloop_probe --k-blocks %u --rounds %d\",\n  \"date\": \"%s\",\n"
                 "  \"rows\": [\n",
                 commit ? commit : "unknown", properties.name, k_blocks, rounds, date);
    for (size_t i = 0; i < rows.size(); ++i) std::fprintf(file, "    %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
    std::fprintf(file, "  ]\n}\n");
    std::fclose(file);
  }
  PROBE_CHECK(cudaFree(cycles));
  PROBE_CHECK(cudaFree(sink));
  return 0;
}
