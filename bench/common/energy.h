// Energy of a benchmark's launches, from the driver's cumulative energy counter. Long GEMMs run this
// board at its power cap, where time follows energy: joules per launch then say which kernel does
// the same work with less, and watts say whether both ran at the cap.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace megamoe::bench {

// NVML's total-energy counter of the current CUDA device. NVML is loaded at run time
// (libnvidia-ml.so.1 comes with the driver), so the benchmarks build where it is absent;
// available() is false when it cannot be loaded or has no counter for the device.
class EnergyCounter {
 public:
  EnergyCounter();
  ~EnergyCounter();
  EnergyCounter(const EnergyCounter&) = delete;
  EnergyCounter& operator=(const EnergyCounter&) = delete;
  bool available() const { return device_ != nullptr; }
  // Millijoules the device has used since the driver loaded.
  uint64_t millijoules() const;

 private:
  void* library_ = nullptr;
  bool initialized_ = false;  // nvmlInit succeeded: nvmlShutdown is owed
  void* device_ = nullptr;
  int (*total_energy_)(void*, unsigned long long*) = nullptr;
};

struct LaunchEnergy {
  double joules;  // per launch
  double watts;   // average over the launches
};

// Each of `works` launched back to back for `seconds`, `rounds` times, the works taking turns
// (a, b, c, a, b, c, ...) so that a drift of the board's temperature over the run falls on all of
// them. Unlike interleaved_us, each window is long enough for the work to run in its own steady
// power state. Launches go in batches of about 20 ms of work (`expected_us` per launch), with a
// synchronization after each.
std::vector<LaunchEnergy> energy_per_launch(const EnergyCounter& counter, std::span<const std::function<void()>> works,
                                            std::span<const double> expected_us, cudaStream_t stream, double seconds,
                                            int rounds);

}  // namespace megamoe::bench
