#include "bench/common/energy.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>

#include "bench/common/ceilings.h"
#include "megamoe/error.h"

namespace megamoe::bench {
namespace {

constexpr int kNvmlSuccess = 0;

template <class Function>
Function symbol(void* library, const char* name) {
  return reinterpret_cast<Function>(dlsym(library, name));
}

}  // namespace

EnergyCounter::EnergyCounter() {
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) return;
  const auto init = symbol<int (*)()>(library_, "nvmlInit_v2");
  const auto by_bus_id = symbol<int (*)(const char*, void**)>(library_, "nvmlDeviceGetHandleByPciBusId_v2");
  total_energy_ = symbol<int (*)(void*, unsigned long long*)>(library_, "nvmlDeviceGetTotalEnergyConsumption");
  if (init == nullptr || by_bus_id == nullptr || total_energy_ == nullptr) return;
  initialized_ = init() == kNvmlSuccess;
  if (!initialized_) return;
  int cuda_device = 0;
  char bus_id[32] = {};
  cuda_ok(cudaGetDevice(&cuda_device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device), "cudaDeviceGetPCIBusId");
  void* device = nullptr;
  unsigned long long probe = 0;
  if (by_bus_id(bus_id, &device) == kNvmlSuccess && total_energy_(device, &probe) == kNvmlSuccess) device_ = device;
}

EnergyCounter::~EnergyCounter() {
  if (library_ == nullptr) return;
  if (initialized_)
    if (const auto shutdown = symbol<int (*)()>(library_, "nvmlShutdown")) shutdown();
  dlclose(library_);
}

uint64_t EnergyCounter::millijoules() const {
  require(available(), "EnergyCounter", "NVML's energy counter is not available on this machine");
  unsigned long long value = 0;
  require(total_energy_(device_, &value) == kNvmlSuccess, "EnergyCounter", "nvmlDeviceGetTotalEnergyConsumption failed");
  return value;
}

std::vector<LaunchEnergy> energy_per_launch(const EnergyCounter& counter, std::span<const std::function<void()>> works,
                                            std::span<const double> expected_us, cudaStream_t stream, double seconds,
                                            int rounds) {
  require(works.size() == expected_us.size(), "energy_per_launch", "needs one expected time per work");
  std::vector<double> joules(works.size(), 0.0), elapsed(works.size(), 0.0);
  std::vector<uint64_t> launches(works.size(), 0);
  using Clock = std::chrono::steady_clock;
  for (int round = 0; round < rounds; ++round) {
    for (size_t w = 0; w < works.size(); ++w) {
      const uint64_t batch = std::max<uint64_t>(1, static_cast<uint64_t>(20000.0 / std::max(expected_us[w], 1.0)));
      cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      const uint64_t start_mj = counter.millijoules();
      const Clock::time_point start = Clock::now();
      double spent = 0.0;
      while (spent < seconds) {
        for (uint64_t i = 0; i < batch; ++i) works[w]();
        launches[w] += batch;
        cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        spent = std::chrono::duration<double>(Clock::now() - start).count();
      }
      joules[w] += 1e-3 * static_cast<double>(counter.millijoules() - start_mj);
      elapsed[w] += spent;
    }
  }
  std::vector<LaunchEnergy> result;
  for (size_t w = 0; w < works.size(); ++w)
    result.push_back({joules[w] / static_cast<double>(launches[w]), joules[w] / elapsed[w]});
  return result;
}

}  // namespace megamoe::bench
