// Expert weights of one rank on its GPU, in the layout the kernels read: transformed from a
// WeightSource (canonical stored weights) and uploaded once.
#pragma once

#include <cstdint>
#include <memory>

#include "megamoe/layer.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"

namespace megamoe {

class DeviceWeights {
 public:
  // Transforms and uploads the experts local to `problem.rank` and, when there are shared experts,
  // their concatenation. The current CUDA device must be the rank's.
  DeviceWeights(const Problem& problem, const WeightSource& source);
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  // The weights SyntheticWeights(problem, seed) describes, generated directly on the GPU in the
  // transformed layout: the same bits as transforming SyntheticWeights' experts, in milliseconds
  // instead of minutes for real model sizes.
  static std::unique_ptr<DeviceWeights> synthetic(const Problem& problem, uint64_t seed);

  const LayerWeights& view() const { return view_; }

  struct Allocations;

 private:
  DeviceWeights();
  char* allocate(uint64_t bytes);
  std::unique_ptr<Allocations> allocations_;
  LayerWeights view_;
};

}  // namespace megamoe
