// Reads %globaltimer in a tight loop on every SM for a while and reports its steps: how often and by
// how much it went back, and its largest step forward. Every spin-wait's timeout is an unsigned
// difference of two readings (sync.cuh: spin_wait, pipeline.cuh: wait_barrier), so a step back would
// read as an elapsed time of about 2^64 ns: a false timeout.
//   megamoe_timer_probe [SECONDS]   (default 10); exit status 1 if a step back was seen
#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct TimerSteps {
  unsigned long long reads;
  unsigned long long backward;          // readings smaller than the one before
  unsigned long long largest_backward;  // ns
  unsigned long long largest_forward;   // ns
};

__global__ void read_timer(uint64_t duration_ns, TimerSteps* steps) {
  if (threadIdx.x != 0) return;
  TimerSteps mine{};
  const uint64_t start = cuda::ptx::get_sreg_globaltimer();
  uint64_t before = start;
  // The loop ends on a count of reads as well as on the timer, so that a timer that stalls or steps
  // back cannot keep it running.
  for (uint64_t reads = 0; reads < duration_ns; ++reads) {
    const uint64_t now = cuda::ptx::get_sreg_globaltimer();
    ++mine.reads;
    if (now < before) {
      ++mine.backward;
      if (before - now > mine.largest_backward) mine.largest_backward = before - now;
    } else if (now - before > mine.largest_forward) {
      mine.largest_forward = now - before;
    }
    before = now;
    if (now > start && now - start > duration_ns) break;
  }
  steps[blockIdx.x] = mine;
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 10.0;
  if (!(seconds > 0.0 && seconds <= 3600.0)) {
    std::fprintf(stderr, "timer_probe: SECONDS must be in (0, 3600], got %s\n", argv[1]);
    return 2;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) {
    std::fprintf(stderr, "timer_probe: no CUDA device\n");
    return 2;
  }
  TimerSteps* steps = nullptr;
  if (cudaMalloc(&steps, sms * sizeof(TimerSteps)) != cudaSuccess) return 2;
  read_timer<<<sms, 32>>>(static_cast<uint64_t>(seconds * 1e9), steps);
  const cudaError_t status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    std::fprintf(stderr, "timer_probe: %s\n", cudaGetErrorString(status));
    return 2;
  }
  std::vector<TimerSteps> host(sms);
  cudaMemcpy(host.data(), steps, sms * sizeof(TimerSteps), cudaMemcpyDeviceToHost);
  TimerSteps all{};
  for (const TimerSteps& sm : host) {
    all.reads += sm.reads;
    all.backward += sm.backward;
    if (sm.largest_backward > all.largest_backward) all.largest_backward = sm.largest_backward;
    if (sm.largest_forward > all.largest_forward) all.largest_forward = sm.largest_forward;
  }
  std::printf("timer_probe: %llu reads on %d SMs over %.1f s: %llu steps back (largest %llu ns), largest step "
              "forward %llu ns\n",
              all.reads, sms, seconds, all.backward, all.largest_backward, all.largest_forward);
  cudaFree(steps);
  return all.backward == 0 ? 0 : 1;
}
